"""bench.verify_steps on a small checkpoint: every row count is timed and the per-row slope and
the FMA bound land in the result (timings on a shared CI machine mean nothing, so only the
shape of the result and the slope's arithmetic are checked)."""

from __future__ import annotations

import pytest

from bench.verify_steps import measure, print_result, slope
from tests.checkpoints import LLAMA, build_checkpoint


def test_slope_leaves_out_one_row_and_fits_the_rest():
    # 1 row is cheap (its arithmetic hides under the reads); from 2 rows on, 2 ms a row.
    assert slope([1, 2, 3, 5], [5.0, 6.0, 8.0, 12.0]) == pytest.approx(2.0)
    assert slope([1, 2], [5.0, 6.0]) == 0.0  # one count past the first: no slope


def test_measure_times_every_row_count(tmp_path, capsys):
    folder = build_checkpoint(tmp_path / "llama", LLAMA, seed=1)
    result = measure(folder, [1, 2, 4], context=40, rounds=2, repeats=2)
    assert set(result["verify_ms"]) == {"1", "2", "4"}
    assert all(ms > 0 for ms in result["verify_ms"].values())
    assert result["plain_step_ms"] > 0
    assert result["fma_peak_gflop_s"] > 0 and result["linear_flops_per_row"] > 0
    for r, ms in result["verify_ms"].items():  # the split adds up to the pass
        assert sum(result["split_ms"][kind][r] for kind in ("weights", "attention", "other")) \
            == pytest.approx(ms)
    assert result["split_ms"]["weights"]["1"] > 0
    assert result["fma_bound_per_row_ms"] == pytest.approx(
        result["linear_flops_per_row"] / (result["fma_peak_gflop_s"] * 1e9) * 1000)
    print_result(result)
    assert "each row past the first" in capsys.readouterr().out
