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
    def __init__(self, addresses: list[str], *, step_timeout_s: float,
                 credentials: grpc.ChannelCredentials | None = None) -> None:
        """`step_timeout_s` (the --step-timeout setting) bounds every worker call: a wedged
        rank turns into UNAVAILABLE instead of a wait forever."""
        options = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
        self.addresses = addresses
        self.channels = [grpc.aio.secure_channel(a, credentials, options) if credentials
                         else grpc.aio.insecure_channel(a, options=options) for a in addresses]
        self.stubs = [worker_pb2_grpc.WorkerServiceStub(c) for c in self.channels]
        self.timeout = step_timeout_s

    @property
    def world_size(self) -> int:
        return len(self.stubs)

    async def _all_unary(self, method: str, request) -> list:
        """Call every rank; the first failure cancels the rest (a rank whose peer died would
        otherwise sit in a collective until its timeout)."""
        tasks = [asyncio.ensure_future(getattr(stub, method)(request, timeout=self.timeout))
                 for stub in self.stubs]
        try:
            done, _pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for rank, task in enumerate(tasks):
                if task in done and task.exception() is not None:
                    exc = task.exception()
                    if isinstance(exc, grpc.aio.AioRpcError):
                        raise worker_error(exc, rank)
                    raise exc
            return [task.result() for task in tasks]
        finally:
            for task in tasks:
                task.cancel()

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
        """Rank 0's step messages as they arrive; the other ranks are drained alongside, and a
        failure of any rank ends the stream at once."""
        calls = [stub.Decode(request, timeout=self.timeout) for stub in self.stubs]
        messages: asyncio.Queue = asyncio.Queue()
        end = object()

        async def pump(rank: int) -> None:
            try:
                async for message in calls[rank]:
                    if rank == 0:
                        messages.put_nowait(message)
            except grpc.aio.AioRpcError as exc:
                raise worker_error(exc, rank) from None
            if rank == 0:
                messages.put_nowait(end)

        tasks = [asyncio.ensure_future(pump(r)) for r in range(len(calls))]
        getter: asyncio.Future | None = None
        try:
            while True:
                if getter is None:
                    getter = asyncio.ensure_future(messages.get())
                failed = [t for t in tasks if t.done() and t.exception() is not None]
                if not failed and not getter.done():
                    await asyncio.wait([getter, *[t for t in tasks if not t.done()]],
                                       return_when=asyncio.FIRST_COMPLETED)
                    failed = [t for t in tasks if t.done() and t.exception() is not None]
                if failed:
                    raise failed[0].exception()
                if not getter.done():
                    continue  # another rank finished its stream; rank 0 still sends
                message, getter = getter.result(), None
                if message is end:
                    break
                yield message
            for task in tasks:
                await task
        finally:
            if getter is not None:
                getter.cancel()
            for task in tasks:
                task.cancel()
            for call in calls:
                call.cancel()

    async def close(self) -> None:
        for channel in self.channels:
            await channel.close()
