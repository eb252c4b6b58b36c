"""The batch loop's load statistics (gateway/batching/load_stats.py): the generation rate over a
sliding window and the prefix cache's share of prompt tokens."""

from __future__ import annotations

from shardlm_server.gateway.batching.load_stats import LoadStats


def test_the_generation_rate_covers_the_window_and_falls_to_zero_when_idle():
    stats = LoadStats(window_s=10.0)
    assert stats.tokens_per_second(now=100.0) == 0.0
    for second in range(5):
        stats.generated(20, now=100.0 + second)
    assert stats.tokens_per_second(now=104.0) == 100 / 4  # 100 tokens over 4 s
    assert stats.tokens_per_second(now=112.0) == 60 / 10  # the first two steps left the window
    assert stats.tokens_per_second(now=200.0) == 0.0  # idle: nothing is left to read


def test_a_lone_step_is_not_read_as_a_huge_rate():
    stats = LoadStats()
    stats.generated(8, now=50.0)
    assert stats.tokens_per_second(now=50.001) == 8.0  # divided by at least a second


def test_the_hit_rate_is_the_cached_share_of_admitted_prompt_tokens():
    stats = LoadStats()
    assert stats.cache_hit_rate == 0.0
    stats.admitted(100, 0)
    stats.admitted(100, 60)
    assert stats.cache_hit_rate == 0.3
