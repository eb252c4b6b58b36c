"""`python -m bench.stack_overhead` end to end on a tiny GGUF file: the engine, the lone worker
and the full stack (two of each, at two stream intervals) run every round, and the report
carries them all. Only the shape is checked; timings on a shared CI machine mean nothing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_every_side_runs_each_round(tmp_path):
    from tests.gguf_files import GGUFSpec, T, write_gguf

    model = tmp_path / "tiny.gguf"
    write_gguf(model, GGUFSpec("llama", default_type=T.Q4_0))
    out = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.stack_overhead", "--model", str(model), "--streams", "1,2",
         "--rounds", "2", "--new-tokens", "8", "--stream-interval-ms", "default,5", "--json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert [(row["streams"], row["stream_interval_ms"]) for row in report["rows"]] == \
        [(1, None), (1, 5), (2, None), (2, 5)]
    for row in report["rows"]:
        for side in ("engine", "worker", "stack"):
            assert row[side]["min"] > 0
        assert row["worker_ratio"]["median"] > 0 and row["ratio"]["median"] > 0
    assert "worker over gRPC / engine" in proc.stdout
    assert proc.stdout.count("round ") == 4  # 2 rounds x 2 stream counts, each with 5 sides
    assert "stack@default" in proc.stdout
