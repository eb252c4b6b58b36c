"""Prometheus metrics of the gateway, on a registry of its own (several gateways may share a
process in tests). Names carry the `shardlm_` prefix and their unit; no colons."""

from __future__ import annotations

from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class LoadReading(Protocol):
    """What a scrape reads from the batch loop's load statistics (from the exporter's thread,
    so both must be safe to read while the loop writes)."""

    def tokens_per_second(self) -> float: ...

    @property
    def cache_hit_rate(self) -> float: ...


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self._load_source: LoadReading | None = None
        self.time_to_first_token = Histogram(
            "shardlm_time_to_first_token_seconds", "From request arrival to its first token.",
            buckets=LATENCY_BUCKETS, registry=r)
        self.inter_token = Histogram(
            "shardlm_inter_token_latency_seconds", "Between consecutive streamed tokens.",
            buckets=LATENCY_BUCKETS, registry=r)
        self.request_duration = Histogram(
            "shardlm_request_duration_seconds", "Whole calls, arrival to last message.",
            ["method"], buckets=LATENCY_BUCKETS, registry=r)
        self.queue_seconds = Histogram(
            "shardlm_queue_time_seconds", "From submission to the first prefill step.",
            buckets=LATENCY_BUCKETS, registry=r)
        self.queue_length = Gauge("shardlm_queue_length_requests",
                                  "Sequences waiting for prefill.", registry=r)
        self.running_sequences = Gauge("shardlm_running_sequences",
                                       "Sequences in the decode batch.", registry=r)
        self.max_running_sequences = Gauge(
            "shardlm_max_running_sequences", "The most sequences the decode batch runs at once.",
            registry=r)
        self.waiting_uncached_prompt_tokens = Gauge(
            "shardlm_waiting_uncached_prompt_tokens",
            "Prompt tokens of the waiting sequences that no KV cache holds (prefill queued).",
            registry=r)
        self.generation_rate = Gauge(
            "shardlm_generation_tokens_per_second",
            "Tokens generated per second over the last 10 seconds.", registry=r)
        self.prefix_cache_hit_ratio = Gauge(
            "shardlm_prefix_cache_hit_ratio",
            "Prompt tokens served from the prefix cache over all prompt tokens admitted since "
            "the model was loaded.", registry=r)
        self.kv_blocks_used = Gauge("shardlm_kv_blocks_used", "KV cache blocks held.", registry=r)
        self.kv_blocks_total = Gauge("shardlm_kv_blocks_total", "KV cache blocks in the pool.",
                                     registry=r)
        self.prompt_tokens = Counter("shardlm_prompt_tokens_total",
                                     "Prompt tokens received.", registry=r)
        self.cached_prompt_tokens = Counter("shardlm_cached_prompt_tokens_total",
                                            "Prompt tokens served from the KV cache.", registry=r)
        self.generated_tokens = Counter("shardlm_generated_tokens_total",
                                        "Tokens generated and streamed.", registry=r)
        self.draft_tokens = Counter(
            "shardlm_speculative_draft_tokens_total",
            "Draft tokens the workers verified (speculative decoding).", registry=r)
        self.accepted_draft_tokens = Counter(
            "shardlm_speculative_accepted_tokens_total",
            "Draft tokens accepted: tokens produced without a decode step of their own.",
            registry=r)
        self.requests = Counter("shardlm_requests_total", "Finished calls by final status.",
                                ["method", "code"], registry=r)
        self.decode_batch_size = Histogram(
            "shardlm_decode_batch_size_sequences", "Sequences per worker decode call.",
            buckets=BATCH_BUCKETS, registry=r)
        self.prefill_batch_tokens = Histogram(
            "shardlm_prefill_batch_tokens", "Tokens per worker prefill call.",
            buckets=(16, 64, 256, 1024, 2048, 4096, 8192), registry=r)
        self.preemptions = Counter("shardlm_preemptions_total",
                                   "Running sequences preempted for KV blocks.", registry=r)
        self.prefix_cache_lookups = Counter(
            "shardlm_prefix_cache_lookups_total",
            "Prefills that looked up a cached prefix (sequences holding no blocks).", registry=r)
        self.prefix_cache_hit_tokens = Counter(
            "shardlm_prefix_cache_hit_tokens_total",
            "Prompt tokens found in the prefix cache by those lookups.", registry=r)
        self.prefix_cache_evictions = Counter(
            "shardlm_prefix_cache_evictions_total",
            "Cached prefix blocks reclaimed for new tokens.", registry=r)
        self.prefix_cache_blocks = Gauge(
            "shardlm_prefix_cache_blocks", "KV blocks holding a cached prefix, in use or not.",
            registry=r)
        self.prefix_cache_idle_blocks = Gauge(
            "shardlm_prefix_cache_idle_blocks",
            "Cached prefix blocks no sequence holds (reclaimed first).", registry=r)
        self.constraint_compile_seconds = Histogram(
            "shardlm_constraint_compile_seconds",
            "Compiling a request's constraint to a grammar (cache hits excluded).", ["kind"],
            buckets=(0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0), registry=r)
        self.constraint_mask_seconds = Histogram(
            "shardlm_constraint_mask_seconds",
            "Per worker step with constrained sequences: making and applying their token masks "
            "on the sampling rank.", buckets=(0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025,
                                              0.005, 0.01, 0.025, 0.1), registry=r)
        self.constrained_requests = Counter(
            "shardlm_constrained_requests_total", "Calls that carried a constraint, by kind.",
            ["kind"], registry=r)
        self.constraint_failures = Counter(
            "shardlm_constraint_failures_total",
            "Constraints refused, by reason (INVALID_CONSTRAINT, CONSTRAINT_TOO_LARGE, "
            "CONSTRAINT_COMPILE_TIMEOUT).", ["reason"], registry=r)
        self.worker_restarts = Counter("shardlm_worker_restarts_total",
                                       "Worker group restarts by the supervisor.", registry=r)
        self.openai_router_up = Gauge(
            "shardlm_openai_router_up", "1 while the SMG router of serve --openai-port answers, "
            "0 while it is down or restarting.", registry=r)
        self.openai_router_restarts = Counter(
            "shardlm_openai_router_restarts_total",
            "Restarts of the SMG router of serve --openai-port: after it exited, or to serve a "
            "newly loaded model.", registry=r)

    def observe_kv_cache(self, used_blocks: int, total_blocks: int, cached_blocks: int = 0,
                         idle_cached_blocks: int = 0) -> None:
        """Publish the KV block gauges: when a cache is built or dropped, and after each step."""
        self.kv_blocks_used.set(used_blocks)
        self.kv_blocks_total.set(total_blocks)
        self.prefix_cache_blocks.set(cached_blocks)
        self.prefix_cache_idle_blocks.set(idle_cached_blocks)

    def follow_load(self, stats: LoadReading, max_running: int) -> None:
        """Read the generation rate and prefix-cache hit rate from a batch loop's `stats` at
        each scrape (a rate falls while idle, when no step updates a gauge)."""
        self._load_source = stats
        self.max_running_sequences.set(max_running)
        self.generation_rate.set_function(stats.tokens_per_second)
        self.prefix_cache_hit_ratio.set_function(lambda: stats.cache_hit_rate)

    def unfollow_load(self, stats: LoadReading) -> None:
        """The batch loop that owns `stats` stopped: zeros, unless a newer loop is followed."""
        if self._load_source is not stats:
            return
        self._load_source = None
        self.max_running_sequences.set(0)
        self.waiting_uncached_prompt_tokens.set(0)
        self.generation_rate.set_function(float)
        self.prefix_cache_hit_ratio.set_function(float)

    def serve_http(self, port: int, host: str = "127.0.0.1") -> None:
        start_http_server(port, addr=host, registry=self.registry)

    def value(self, name: str, labels: dict[str, str] | None = None) -> float:
        """A sample's current value (tests and the CLI read metrics without scraping)."""
        return self.registry.get_sample_value(name, labels or {}) or 0.0
