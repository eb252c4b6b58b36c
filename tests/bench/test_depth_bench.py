"""bench.depth_bench and bench.model_bench (both through roofline.round_shares) set each round's
step against the read bandwidth measured in that round (a shared host's moves between rounds)."""

from __future__ import annotations

import pytest

from bench.depth_bench import _row
from bench.roofline import round_shares


def test_each_round_is_set_against_its_own_bandwidth():
    # Round 1: 10 bytes at 10 B/s, a 1 s floor, stepped in 1 s; round 2: the host halved the
    # bandwidth and the step took 2 s. Both rounds ran at their floor.
    row = _row([1.0, 2.0], weight_bytes=6, kv_bytes=4, bandwidths=[10.0, 5.0])
    assert row["pct_of_floor"] == pytest.approx(100.0)
    assert row["pct_of_floor_spread"] == pytest.approx([100.0, 100.0])
    assert row["decode_tokens_per_s"] == pytest.approx(1 / 1.5)
    assert round_shares(10, [10.0, 5.0], [1.0, 2.0]) == pytest.approx([100.0, 100.0])


def test_the_share_is_the_median_of_the_rounds():
    row = _row([2.0, 1.0, 4.0], weight_bytes=10, kv_bytes=0, bandwidths=[10.0, 10.0, 10.0])
    assert row["pct_of_floor"] == pytest.approx(50.0)  # shares 50%, 100%, 25%
    assert row["pct_of_floor_spread"] == pytest.approx([25.0, 100.0])
    assert row["floor_ms_per_token"] == pytest.approx(1000.0)


def test_each_opt_in_mode_gets_its_own_row_and_targets():
    from bench.depth_bench import print_rows, targets

    row = _row([1.0], weight_bytes=6, kv_bytes=4, bandwidths=[10.0])
    fast = _row([0.5], weight_bytes=6, kv_bytes=4, bandwidths=[10.0])
    result = {"depth": 4096, "steps": 1, "modes": ["int8"], "bandwidth_gb_s": [1e-8],
              "shardlm_kv_float32": row, "shardlm_kv_float16": row,
              "shardlm_kv_float16_int8": fast, "llama_cpp": row}
    names = {name: value for name, value, _goal in targets(result)}
    assert names["decode at depth 4096 (float16 KV, int8 mode) vs llama.cpp >= 1.3x"] == \
        pytest.approx(2.0)
    assert names["decode at depth 4096 (int8 mode): weights + KV at >= 60% of the read floor"] \
        == pytest.approx(2.0)
    print_rows(result)  # the mode's row prints beside the exact ones
