"""The replica's load as routers and autoscalers read it: one snapshot of the scheduler's queues,
its generation rate and prefix-cache hit rate, and the KV cache's blocks, served by
GatewayService.GetLoad, by the SMG engine service's GetLoads (gateway/api/smg_service.py) and in
the load record of every KV event batch (gateway/kv/events.py)."""

from __future__ import annotations

from dataclasses import dataclass

from shardlm.gateway.v1 import gateway_pb2
from smg_grpc_proto.generated import common_pb2 as smg_common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as engine_pb2

from shardlm_server.gateway.api.runtime import Runtime


def load_report(runtime: Runtime) -> gateway_pb2.GetLoadResponse:
    """The current load; all zeros (and `loaded` false) with no model loaded."""
    model = runtime.model
    if model is None:
        return gateway_pb2.GetLoadResponse(loaded=False)
    allocator, load = model.allocator, router_load(runtime)
    return gateway_pb2.GetLoadResponse(
        loaded=True,
        running_sequences=load.running,
        waiting_sequences=load.waiting,
        kv_blocks_used=allocator.used_blocks,
        kv_blocks_free=allocator.free_blocks,
        kv_blocks_total=allocator.num_blocks,
        block_size=allocator.block_size,
        prefix_cache_blocks=allocator.cached_blocks,
        sessions=len(model.sessions),
        generated_tokens_per_second=load.gen_throughput,
        prefix_cache_hit_rate=load.cache_hit_rate,
        waiting_uncached_prompt_tokens=load.waiting_uncached_tokens,
        max_running_sequences=load.max_running)


@dataclass
class RouterLoad:
    """What a router weighs (SMG's SchedulerLoad and EngineLoad carry the same numbers)."""

    running: int = 0
    waiting: int = 0
    waiting_uncached_tokens: int = 0
    used_tokens: int = 0  # in blocks sequences hold (cached blocks nobody holds are free)
    total_tokens: int = 0
    gen_throughput: float = 0.0  # tokens generated per second, last seconds
    cache_hit_rate: float = 0.0  # prompt tokens served from the prefix cache, since the load
    max_running: int = 0

    @property
    def token_usage(self) -> float:
        return self.used_tokens / self.total_tokens if self.total_tokens else 0.0


def router_load(runtime: Runtime) -> RouterLoad:
    model = runtime.model
    if model is None:
        return RouterLoad(max_running=runtime.limits.max_running)
    scheduler, allocator = model.scheduler, model.allocator
    return RouterLoad(
        running=scheduler.running, waiting=scheduler.waiting,
        waiting_uncached_tokens=scheduler.waiting_uncached_tokens(),
        used_tokens=allocator.used_blocks * allocator.block_size,
        total_tokens=allocator.num_blocks * allocator.block_size,
        gen_throughput=scheduler.stats.tokens_per_second(),
        cache_hit_rate=scheduler.stats.cache_hit_rate,
        max_running=scheduler.max_running)


def scheduler_load(runtime: Runtime) -> engine_pb2.SchedulerLoad:
    """GetLoads' record of the one data-parallel rank."""
    load = router_load(runtime)
    return engine_pb2.SchedulerLoad(
        dp_rank=0, num_running_reqs=load.running, num_waiting_reqs=load.waiting,
        num_total_reqs=load.running + load.waiting, num_used_tokens=load.used_tokens,
        max_total_num_tokens=load.total_tokens, token_usage=load.token_usage,
        gen_throughput=load.gen_throughput, cache_hit_rate=load.cache_hit_rate,
        utilization=load.token_usage, max_running_requests=load.max_running,
        num_waiting_uncached_tokens=load.waiting_uncached_tokens)


def engine_load(runtime: Runtime) -> smg_common_pb2.EngineLoad:
    """The load record a KV event batch carries (the same numbers as GetLoads)."""
    load = router_load(runtime)
    return smg_common_pb2.EngineLoad(
        running_requests=load.running, waiting_requests=load.waiting,
        waiting_uncached_tokens=load.waiting_uncached_tokens, token_usage=load.token_usage,
        active_token_usage=load.token_usage, gen_throughput=load.gen_throughput,
        max_running_requests=load.max_running, age_ms=0, cache_hit_rate=load.cache_hit_rate,
        num_used_tokens=load.used_tokens, max_total_num_tokens=load.total_tokens)
