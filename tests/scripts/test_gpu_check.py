"""scripts/gpu_check.sh without a GPU: its dry run (argument parsing, the environment probe, the
commands it would run, the output folder and the summary), its early failures, and the Python
helpers it calls (scripts/gpu_probe.py, scripts/gpu_summary.py) on synthetic inputs."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
NO_GPU_HERE = shutil.which("nvidia-smi") is None
EXPECTED_FILES = {"env.txt", "gpu_check.log", "build-tail.log", "junit-cuda.xml",
                  "junit-stack.xml", "bench.json", "summary.md"}


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


probe, summary = load("gpu_probe"), load("gpu_summary")


def run(tmp_path: Path, *args: str, path_prefix: str | None = None,
        timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHON=sys.executable, OUT=str(tmp_path / "out"),
               GPU_CHECK_SCRATCH=str(tmp_path / "scratch"))
    if path_prefix:
        env["PATH"] = f"{path_prefix}:{env['PATH']}"
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_dry_run_prints_every_command_and_writes_the_whole_layout(tmp_path):
    done = run(tmp_path, "--dry-run", "--bench-shapes", "qwen2.5-0.5b,llama-3-8b")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "setup.py build_ext --inplace" in out and "MAX_JOBS=" in out
    assert "-m pytest" in out and "-m cuda tests/worker" in out
    assert "SHARDLM_TEST_DEVICE=cuda" in out and "tests/gateway/test_serve_cuda.py" in out
    for shape in ("qwen2.5-0.5b", "llama-3-8b"):
        assert f"bench.run --device cuda --dtype bfloat16 --shapes {shape}" in out
    if NO_GPU_HERE:
        assert "a real run would stop here: no NVIDIA GPU visible" in done.stderr
    folder = tmp_path / "out"
    assert {p.name for p in folder.iterdir()} == EXPECTED_FILES
    assert summary.layout_problems(folder) == []
    page = (folder / "summary.md").read_text()
    assert "| junit-cuda.xml | 1 | 1 | 0 | 1 |" in page  # the synthetic failure is counted
    assert "test_dry_run_failure" in page and "| build | planned | 0 |" in page
    assert page.count("| 100.0 | 10.00 | 50.0 |") == 2  # one bench row per shape
    assert [r["results"][0]["shape"] for r in json.loads((folder / "bench.json").read_text())
            ["runs"]] == ["qwen2.5-0.5b", "llama-3-8b"]
    assert not (tmp_path / "scratch" / "tree").exists()  # a dry run copies and builds nothing


@pytest.mark.parametrize("args,message", [
    (["--part", "nope"], "--part must be tests, bench or all"),
    (["--budget", "soon"], "--budget must be a number of seconds"),
    (["--bench-shapes", "a b"], "--bench-shapes"),
    (["--frobnicate"], "unknown argument '--frobnicate'"),
])
def test_bad_arguments_exit_2_with_usage(tmp_path, args, message):
    done = run(tmp_path, *args, "--dry-run", timeout=30)
    assert done.returncode == 2
    assert message in done.stderr and "--part tests" in done.stderr  # the usage follows


@pytest.mark.skipif(not NO_GPU_HERE, reason="this machine has nvidia-smi")
def test_without_a_gpu_a_real_run_stops_at_once_with_a_clear_message(tmp_path):
    done = run(tmp_path, "--part", "tests", timeout=60)
    assert done.returncode == 3
    assert "GPU check stopped: no NVIDIA GPU visible" in done.stderr
    assert "problem: no NVIDIA GPU visible" in (tmp_path / "out" / "env.txt").read_text()
    assert not (tmp_path / "scratch" / "tree").exists()  # nothing was copied or built


def test_a_gpu_that_torch_cannot_use_stops_the_run(tmp_path):
    fake = tmp_path / "bin"
    fake.mkdir()
    smi = fake / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'NVIDIA H100 80GB HBM3, 580.159.04, 81559 MiB'\n")
    smi.chmod(0o755)
    done = run(tmp_path, "--part", "tests", path_prefix=str(fake), timeout=120)
    assert done.returncode == 3
    assert "GPU check stopped: torch" in done.stderr
    assert "has no CUDA support" in done.stderr or "sees no GPU" in done.stderr
    assert "gpu: NVIDIA H100 80GB HBM3" in (tmp_path / "out" / "env.txt").read_text()


# ----------------------------------------------------------------------------- gpu_probe.py


def test_the_wheel_list_parses_and_names_the_grpc_add_ons():
    names = {name for name, _version, _module in probe.wheel_list()}
    assert {"grpcio-status", "grpcio-health-checking", "grpcio-reflection",
            "googleapis-common-protos"} <= names


def test_wheels_are_chosen_only_for_missing_modules(tmp_path, monkeypatch):
    listing = tmp_path / "wheels.txt"
    listing.write_text("# comment\nMarkup-Safe==3.0.2  gone_a\nthere==1.0  json\n"
                       "absent==2.0  gone_b\n")
    monkeypatch.setattr(probe, "WHEEL_LIST", listing)
    monkeypatch.setattr(probe.wheel_list, "__defaults__", (listing,))
    for name in ("markup_safe-3.0.2-cp312-cp312-manylinux_2_17_x86_64.whl",
                 "markup_safe-3.0.1-py3-none-any.whl", "there-1.0-py3-none-any.whl"):
        (tmp_path / name).write_text("")
    chosen, lacking = probe.wheels_to_install(tmp_path)
    assert [p.name for p in chosen] == ["markup_safe-3.0.2-cp312-cp312-manylinux_2_17_x86_64.whl"]
    assert lacking == ["absent==2.0"]


def test_a_malformed_wheel_list_line_is_named(tmp_path):
    listing = tmp_path / "wheels.txt"
    listing.write_text("grpcio-status>=1.62\n")
    with pytest.raises(SystemExit, match="wheels.txt:1: expected `name==version module`"):
        probe.wheel_list(listing)


# ----------------------------------------------------------------------------- gpu_summary.py


def test_junit_counts_and_failures(tmp_path):
    xml = tmp_path / "j.xml"
    xml.write_text(summary.SYNTHETIC_JUNIT.replace(
        '<testcase classname="tests.worker.test_comm"',
        '<testcase classname="x" name="broken"><error message="boom\nmore"/></testcase>'
        '<testcase classname="tests.worker.test_comm"'))
    result = summary.read_junit(xml)
    assert (result["passed"], result["failed"], result["errors"], result["skipped"]) == (1, 1, 1, 1)
    assert ("j.xml: x::broken", "boom more") in result["failures"]
    (tmp_path / "cut.xml").write_text("<testsuites><testsuite>")
    assert "unreadable" in summary.read_junit(tmp_path / "cut.xml")["note"]


def test_bench_rows_show_figures_errors_and_targets():
    bench = {"runs": [summary.synthetic_bench("tiny"),
                      {"results": [{"shape": "big", "engine": {"error": "OutOfMemoryError"}}],
                       "targets": [{"target": "t", "shape": "big", "value": None, "goal": 1,
                                    "pass": None}]}]}
    lines, targets = summary.bench_rows(bench)
    assert lines[0].startswith("| tiny | 100.0 | 10.00 | 50.0 | 700.0 (batch 8) | 5000 (512) |")
    assert "| 90.0 / 12.5 ms |" in lines[0]
    assert lines[1].startswith("| big | - |") and "engine: OutOfMemoryError" in lines[1]
    assert targets[-1] == "- not measured: t (big): -"


def test_layout_problems_name_what_would_not_come_back(tmp_path):
    for i in range(9):
        (tmp_path / f"f{i}.txt").write_text("x")
    deep = tmp_path / "a" / "b" / "c"
    deep.mkdir(parents=True)
    (deep / "x").write_text("x")
    (tmp_path / "bad name.txt").write_text("x")
    problems = summary.layout_problems(tmp_path)
    assert any("11 files, at most 8" in p for p in problems)
    assert any("more than 2 folders down" in p for p in problems)
    assert any("bad name.txt: names may hold only" in p for p in problems)
    ok = tmp_path / "ok"
    (ok / "prebuilt-0123abcd").mkdir(parents=True)
    (ok / "prebuilt-0123abcd" / "_C.cpython-312-x86_64-linux-gnu.so").write_text("x")
    assert summary.layout_problems(ok) == []
