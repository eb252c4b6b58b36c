"""The load test in CI form: `shardlm serve` in a subprocess under 48 concurrent streams for
about 15 s, 30% of them cancelled or given a deadline that expires mid-stream (the full run is
`python -m bench.load_test`, 200 streams for 60 s). No call may end INTERNAL or UNKNOWN, every
stream must carry exactly the greedy tokens its prompt gives alone, the KV cache must be empty
afterwards and the gateway's RSS must not grow after warm-up."""

from __future__ import annotations

from bench.load_test import RSS_GROWTH_LIMIT, run, table


def test_concurrent_streams_with_cancellations_and_deadlines(llama_dir):
    report = run(llama_dir, streams=48, seconds=15, cancel_fraction=0.3, log=lambda *_a: None)
    print("\n" + table(report))
    assert not report.mismatches, report.mismatches[:3]
    assert "INTERNAL" not in report.other_codes and "UNKNOWN" not in report.other_codes
    assert not report.server_codes.get("INTERNAL") and not report.server_codes.get("UNKNOWN")
    assert report.completed > 0 and report.cancelled > 0 and report.deadline > 0
    assert report.kv_blocks_used_end == 0
    assert report.rss_growth <= RSS_GROWTH_LIMIT, (report.rss_warm_bytes, report.rss_end_bytes)
    assert report.ok, report.failures
