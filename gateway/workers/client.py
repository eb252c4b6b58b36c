"""The gateway's one client for a tensor-parallel group of workers: health, Load and the steps.

Every request goes to every rank at once (the ranks meet in collectives); rank 0's reply is the
answer, the others' acknowledgements are awaited so a failing rank is noticed, and the first
failure cancels the other ranks' calls. Load works the same way, because ranks block in the
communicator's rendezvous until all have joined; rank 0's Load stream first yields where the
others meet it (with gloo the address of the rendezvous store rank 0 opened on its own host, with
NCCL the unique id), which is then passed to the other ranks. The connections to the workers are
kept alive by pings, so a worker host that drops off the network fails its calls within seconds
instead of when TCP gives up. Worker failures become statuses the
gateway can pass on: UNAVAILABLE when a rank is unreachable or a peer died, RESOURCE_EXHAUSTED
when a device ran out of memory.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

import grpc
from shardlm.common.v1 import common_pb2
from shardlm.constants import (
    DEFAULT_HOST,
    DEFAULT_WORKER_START_TIMEOUT_S,
    MAX_WORKER_MESSAGE_BYTES,
    WORKER_KEEPALIVE_MS,
    WORKER_KEEPALIVE_TIMEOUT_MS,
)
from shardlm.errors import ShardLMError, UnavailableError
from shardlm.worker.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger("shardlm.gateway")

CHANNEL_OPTIONS = [("grpc.max_send_message_length", MAX_WORKER_MESSAGE_BYTES),
                   ("grpc.max_receive_message_length", MAX_WORKER_MESSAGE_BYTES),
                   ("grpc.keepalive_time_ms", WORKER_KEEPALIVE_MS),
                   ("grpc.keepalive_timeout_ms", WORKER_KEEPALIVE_TIMEOUT_MS),
                   ("grpc.keepalive_permit_without_calls", 1),
                   ("grpc.http2.max_pings_without_data", 0),
                   # A worker that comes back is found within seconds, not minutes of backoff.
                   ("grpc.max_reconnect_backoff_ms", 2000)]
PASS_THROUGH = {grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE}


def rendezvous_host(worker_address: str) -> str:
    """The host part of a worker's gRPC address ("host:port", "[v6]:port"), which the other
    ranks can reach it at too; a unix-socket worker is on this host."""
    if worker_address.startswith("unix:"):
        return DEFAULT_HOST
    return worker_address.rsplit(":", 1)[0]


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
                 credentials: grpc.ChannelCredentials | None = None,
                 devices: list[str] | None = None) -> None:
        """`devices`: each rank's device as the worker names it ("cpu", "cuda:0"); all "cpu"
        when not given. `step_timeout_s` (the --step-timeout setting) bounds every worker call:
        a wedged rank turns into UNAVAILABLE instead of a wait forever."""
        self.addresses = addresses
        self.devices = devices or ["cpu"] * len(addresses)
        self.channels = [grpc.aio.secure_channel(a, credentials, CHANNEL_OPTIONS) if credentials
                         else grpc.aio.insecure_channel(a, options=CHANNEL_OPTIONS)
                         for a in addresses]
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

    async def wait_healthy(self, timeout_s: float = DEFAULT_WORKER_START_TIMEOUT_S,
                           alive: Callable[[int], bool] = lambda _rank: True) -> None:
        """Return once every rank answers GetInfo; UNAVAILABLE when one does not within
        `timeout_s` or `alive(rank)` says its process is gone."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        for rank, stub in enumerate(self.stubs):
            while True:
                try:
                    await stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=2.0)
                    break
                except grpc.aio.AioRpcError:
                    if loop.time() > deadline or not alive(rank):
                        raise UnavailableError(
                            f"worker rank {rank} at {self.addresses[rank]} is not answering",
                            reason="WORKER_UNAVAILABLE",
                            metadata={"rank": rank, "address": self.addresses[rank]}) from None
                    await asyncio.sleep(0.2)

    async def load(
        self,
        model_path: str,
        *,
        dtype: int = common_pb2.DTYPE_UNSPECIFIED,
        kv_cache: common_pb2.KvCacheConfig | None = None,
        engine_options: worker_pb2.EngineOptions | None = None,
        comm_timeout_s: float = 0.0,
        quantize: str = "",
        tokenizer_json: str = "",
        progress: Callable[[common_pb2.LoadProgress], None] = lambda _p: None,
    ) -> worker_pb2.LoadComplete:
        """Load on every rank at once; rank 0's LoadComplete, or the first rank's error (which
        cancels the others: they would wait for a peer that is not coming). Progress comes
        from rank 0. Unset engine options and a 0 communicator timeout take the workers'
        defaults. `tokenizer_json` goes to rank 0, the one that samples (and so masks)."""
        world = self.world_size
        cuda = self.devices[0].startswith("cuda")
        backend = worker_pb2.COMM_BACKEND_NCCL if cuda else worker_pb2.COMM_BACKEND_GLOO
        # gloo: rank 0 opens the store on a port of its own host and reports it; the host named
        # here is the one the other ranks dial unless rank 0 has an --advertise-host.
        rank0_address = f"{rendezvous_host(self.addresses[0])}:0" if world > 1 and not cuda else ""

        def request(rank: int, init_address: str = rank0_address,
                    unique_id: bytes = b"") -> worker_pb2.LoadRequest:
            return worker_pb2.LoadRequest(
                model_path=model_path, dtype=dtype, device=self.devices[rank], rank=rank,
                world_size=world, kv_cache=kv_cache, engine=engine_options, quantize=quantize,
                tokenizer_json=tokenizer_json if rank == 0 else "",
                comm=worker_pb2.CommunicatorConfig(backend=backend, init_address=init_address,
                                                   nccl_unique_id=unique_id,
                                                   timeout_seconds=comm_timeout_s))

        calls = [self.stubs[0].Load(request(0))]
        results: list[worker_pb2.LoadComplete | None] = [None] * world

        async def consume(rank: int) -> None:
            try:
                # read(), not `async for`: rank 0's first message may already have been read
                # (the NCCL id), and a call may not mix the two styles.
                while (event := await calls[rank].read()) is not grpc.aio.EOF:
                    if event.HasField("complete"):
                        results[rank] = event.complete
                    elif event.HasField("progress") and rank == 0:
                        progress(event.progress)
            except grpc.aio.AioRpcError as exc:
                raise worker_error(exc, rank) from None

        tasks: list[asyncio.Future] = []
        try:
            meeting = worker_pb2.LoadResponse()
            if world > 1:
                try:
                    meeting = await calls[0].read()
                except grpc.aio.AioRpcError as exc:
                    raise worker_error(exc, 0) from None
                if meeting is grpc.aio.EOF:
                    raise UnavailableError("worker rank 0 ended Load before its peers could join",
                                           reason="WORKER_UNAVAILABLE", metadata={"rank": 0})
            calls += [self.stubs[rank].Load(request(rank, meeting.comm_init_address,
                                                    meeting.nccl_unique_id))
                      for rank in range(1, world)]
            tasks = [asyncio.ensure_future(consume(rank)) for rank in range(world)]
            done, _pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for task in tasks:
                if task in done and task.exception() is not None:
                    raise task.exception()
        finally:
            for task in tasks:
                task.cancel()
            for call in calls:
                call.cancel()
        complete = results[0]
        if complete is None:
            raise UnavailableError("worker rank 0 ended Load without a result",
                                   reason="WORKER_UNAVAILABLE", metadata={"rank": 0})
        return complete

    async def decode(self, request: worker_pb2.DecodeRequest) -> AsyncIterator[worker_pb2.DecodeResponse]:
        """Rank 0's step messages as they arrive; the other ranks are drained alongside, and a
        failure of any rank ends the stream at once."""
        calls = [stub.Decode(request, timeout=self.timeout) for stub in self.stubs]
        if len(calls) == 1:
            # One rank: its messages are read directly. The pump, queue and wait below cost a
            # few tasks and futures per step, which a one-token step on a CPU host cannot spare.
            try:
                async for message in calls[0]:
                    yield message
            except grpc.aio.AioRpcError as exc:
                raise worker_error(exc, 0) from None
            finally:
                calls[0].cancel()
            return
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
