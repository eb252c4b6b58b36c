"""`python -m bench.run --smoke` end to end: every section runs and lands in the JSON.

Only the shape of the result is checked; timings on a shared CI machine mean nothing.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_smoke_run_writes_every_section(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "bench.run", "--device", "cpu", "--smoke", "--out", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=170,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    files = list(tmp_path.glob("run-cpu-*.json"))
    assert len(files) == 1, files
    report = json.loads(files[0].read_text())
    assert report["device_type"] == "cpu"
    for key in ("device", "versions", "date", "config"):
        assert report[key], key
    assert report["config"]["smoke"] is True
    (shape,) = report["results"]
    assert shape["shape"] == "tiny"
    for section in ("engine", "baselines", "stack"):
        assert section in shape and "error" not in shape[section], (section, shape.get(section))

    engine = shape["engine"]
    assert [r["batch"] for r in engine["decode"]] == report["config"]["batches"]
    assert all(r["tokens_per_s"] > 0 for r in engine["decode"])
    assert engine["prefill"] and engine["prefill"][0]["tokens_per_s"] > 0

    base = shape["baselines"]
    assert {r["batch"] for r in base["transformers"]["decode"]} == {1, max(report["config"]["batches"])}
    assert "n/a" in base["transformers_compiled"]  # GPU only
    roof = base["roofline"]
    assert roof["weight_bytes"] > 0 and roof["bandwidth_gb_s"] > 0
    assert {"shardlm", "transformers"} <= set(roof["achieved"])

    stack = shape["stack"]
    assert [r["streams"] for r in stack["rows"]] == report["config"]["streams"]
    for row in stack["rows"]:
        assert row["tokens"] == row["streams"] * report["config"]["new_tokens"]
        for key in ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "tokens_per_s"):
            assert row[key] >= 0, key

    names = {t["target"] for t in report["targets"]}
    assert any("transformers" in n for n in names) and any("streams" in n for n in names)
    assert any("in-process" in n for n in names)
    assert all(t["pass"] is not None for t in report["targets"])
    for marker in ("== 1. engine", "== 2. baselines", "== 3. full stack", "== 4. targets"):
        assert marker in proc.stdout


def test_smoke_run_on_a_model_file(tmp_path):
    """`--model FILE.gguf`: ShardLM's figures (exact, int8 and int16 activations), the breakdown,
    the roofline, the agreement, decode at depth, the full stack and the targets land in the JSON;
    llama.cpp's columns are there or say why not."""
    from tests.gguf_files import GGUFSpec, T, write_gguf

    model = tmp_path / "tiny.gguf"
    write_gguf(model, GGUFSpec("llama", default_type=T.Q4_0))  # 4-bit: the int8 mode applies
    proc = subprocess.run(
        [sys.executable, "-m", "bench.run", "--model", str(model), "--smoke",
         "--agreement-tokens", "32", "--depth", "48", "--activation-precision", "int8,int16",
         "--out", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=240,
        # No llama-server even where one is built: the run must say so and go on.
        env=dict(os.environ, PYTHONUNBUFFERED="1", LLAMA_SERVER=str(tmp_path / "none")),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (file,) = tmp_path.glob("run-cpu-tiny-*.json")
    report = json.loads(file.read_text())
    assert report["config"]["model"] == str(model)
    (result,) = report["results"]
    assert result["format"] == "gguf"
    ours = result["shardlm"]
    assert ours["decode_tokens_per_s"] > 0 and ours["prefill_tokens_per_s"] > 0
    assert set(ours["breakdown"]) >= {"weights_ms", "attention_ms", "other_ms"}
    assert [r["batch"] for r in ours["decode_batches"]] == [
        b for b in report["config"]["batches"] if b > 1]
    assert result["roofline"]["weight_bytes"] > 0 and result["roofline"]["achieved_gb_s"] > 0
    assert result["agreement"]["tokens"] == 32
    assert 0.0 <= result["agreement"]["shardlm"] <= 1.0
    for mode in ("int8", "int16"):
        fast = result[f"shardlm_{mode}"]
        assert fast["decode_tokens_per_s"] > 0 and fast["prefill_tokens_per_s"] > 0
        assert fast["pct_of_floor"] > 0 and 0.0 <= result["agreement"][f"shardlm_{mode}"] <= 1.0
    assert result["compute"]["fma_peak_gflops"] > 0 and result["compute"]["prefill_gflops"]["shardlm"] > 0
    assert any("int8 activations" in t["target"] for t in report["targets"])
    assert any("int16 activations: top-1" in t["target"] for t in report["targets"])
    llama = result["llama_cpp"]
    assert llama.startswith("not run") if isinstance(llama, str) else llama["decode_tokens_per_s"] > 0
    assert any("agreement" in t["target"] for t in report["targets"])
    depth = result["depth"]  # decode after a 48-token context, both KV dtypes
    assert depth["depth"] == 48
    for kv in ("float32", "float16"):
        row = depth[f"shardlm_kv_{kv}"]
        assert row["decode_tokens_per_s"] > 0 and row["kv_bytes"] > 0 and row["pct_of_floor"] > 0
    assert depth["shardlm_kv_float32"]["kv_bytes"] == 2 * depth["shardlm_kv_float16"]["kv_bytes"]
    assert any("depth 48" in t["target"] for t in report["targets"])
    stack = result["stack"]  # `shardlm serve` on the file; llama-server beside it when built
    assert [r["streams"] for r in stack["rows"]] == report["config"]["streams"]
    assert all(r["shardlm"]["tokens_per_s"] > 0 for r in stack["rows"])
    assert stack["llama_server"].startswith("not run: no llama-server")
    assert "top-1 agreement" in proc.stdout and "== full stack" in proc.stdout
    assert "== targets" in proc.stdout


def test_model_must_exist(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "bench.run", "--model", str(tmp_path / "missing.gguf")],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2 and "no such file" in proc.stderr


def test_an_interrupted_run_writes_the_sections_it_finished(tmp_path):
    """SIGINT (how scripts/gpu_check.sh stops a bench step at its time limit) after the engine
    section: the JSON holds that section and says the run was interrupted; the exit status is
    130."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.run", "--device", "cpu", "--smoke", "--out", str(tmp_path)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    seen = []
    try:
        for line in proc.stdout:
            seen.append(line)
            if line.startswith("-- baselines"):
                proc.send_signal(signal.SIGINT)
                break
        rest, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    output = "".join(seen) + rest
    assert proc.returncode == 130, output[-3000:]
    (file,) = tmp_path.glob("run-cpu-*.json")
    report = json.loads(file.read_text())
    assert report["interrupted"] is True
    (shape,) = report["results"]
    assert shape["shape"] == "tiny" and shape["engine"]["decode"]
    assert "stack" not in shape
