"""Async client for a tensor-parallel group of workers.

Every step request goes to every rank at once (the ranks meet in collectives); rank 0's reply is
the answer, the others' acknowledgements are awaited so a failing rank is noticed. Worker
failures become statuses the gateway can pass on: UNAVAILABLE when a rank is unreachable or a
peer died, RESOURCE_EXHAUSTED when a device ran out of memory.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc
from shardlm.errors import ShardLMError, UnavailableError
from shardlm.worker.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger("shardlm.gateway")

# Worker calls never wait forever: a wedged rank turns into UNAVAILABLE.
DEFAULT_STEP_TIMEOUT_S = 120.0
MAX_MESSAGE_BYTES = 256 << 20
PASS_THROUGH = {grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE}


def worker_error(exc: grpc.aio.AioRpcError, rank: int) -> ShardLMError:
    error = ShardLMError.from_rpc_error(exc)
    if error.code in PASS_THROUGH and error.reason in ("OUT_OF_MEMORY", "PEER_FAILED",
                                                       "KV_CACHE_FULL"):
        return error
    if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                      grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN):
        return UnavailableError(f"worker rank {rank} is unavailable", reason="WORKER_UNAVAILABLE",
                                metadata={"rank": rank}, retry_after_s=2.0)
    return error  # a worker-side validation error: the gateway maps it (a contract bug)


class WorkerPool:
    def __init__(self, addresses: list[str], step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S) -> None:
        options = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
        self.addresses = addresses
        self.channels = [grpc.aio.insecure_channel(a, options=options) for a in addresses]
        self.stubs = [worker_pb2_grpc.WorkerServiceStub(c) for c in self.channels]
        self.timeout = step_timeout_s

    @property
    def world_size(self) -> int:
        return len(self.stubs)

    async def _all_unary(self, method: str, request) -> list:
        calls = [getattr(stub, method)(request, timeout=self.timeout) for stub in self.stubs]
        results = await asyncio.gather(*calls, return_exceptions=True)
        for rank, result in enumerate(results):
            if isinstance(result, grpc.aio.AioRpcError):
                raise worker_error(result, rank)
            if isinstance(result, BaseException):
                raise result
        return results

    async def prefill(self, request: worker_pb2.PrefillRequest) -> worker_pb2.PrefillResponse:
        return (await self._all_unary("Prefill", request))[0]

    async def reset(self, request: worker_pb2.ResetCacheRequest) -> worker_pb2.ResetCacheResponse:
        return (await self._all_unary("ResetCache", request))[0]

    async def info(self, rank: int = 0, timeout: float = 2.0) -> worker_pb2.GetInfoResponse:
        try:
            return await self.stubs[rank].GetInfo(worker_pb2.GetInfoRequest(), timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            raise worker_error(exc, rank) from None

    async def decode(self, request: worker_pb2.DecodeRequest) -> AsyncIterator[worker_pb2.DecodeResponse]:
        """Rank 0's step messages as they arrive; the other ranks are drained alongside."""
        calls = [stub.Decode(request, timeout=self.timeout) for stub in self.stubs]

        async def drain(rank: int) -> None:
            try:
                async for _ in calls[rank]:
                    pass
            except grpc.aio.AioRpcError as exc:
                raise worker_error(exc, rank) from None

        others = [asyncio.ensure_future(drain(r)) for r in range(1, len(calls))]
        try:
            try:
                async for message in calls[0]:
                    yield message
            except grpc.aio.AioRpcError as exc:
                raise worker_error(exc, 0) from None
            for task in others:
                await task
        finally:
            for task in others:
                task.cancel()

    async def close(self) -> None:
        for channel in self.channels:
            await channel.close()
