"""The replica's load as routers and autoscalers read it: one snapshot of the scheduler's queues
and the KV cache's blocks, served by GatewayService.GetLoad and by the SMG engine service's
GetLoads (gateway/api/smg_service.py)."""

from __future__ import annotations

from shardlm.gateway.v1 import gateway_pb2

from shardlm_server.gateway.api.runtime import Runtime


def load_report(runtime: Runtime) -> gateway_pb2.GetLoadResponse:
    """The current load; all zeros (and `loaded` false) with no model loaded."""
    model = runtime.model
    if model is None:
        return gateway_pb2.GetLoadResponse(loaded=False)
    allocator = model.allocator
    return gateway_pb2.GetLoadResponse(
        loaded=True,
        running_sequences=model.scheduler.running,
        waiting_sequences=model.scheduler.waiting,
        kv_blocks_used=allocator.used_blocks,
        kv_blocks_free=allocator.free_blocks,
        kv_blocks_total=allocator.num_blocks,
        block_size=allocator.block_size,
        prefix_cache_blocks=allocator.cached_blocks,
        sessions=len(model.sessions))
