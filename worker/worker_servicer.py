"""The worker's gRPC servicer: a thin layer over the engine.

Every rank of a group gets the same requests in the same order (the gateway sends one step at a
time), so each call runs under one lock and to completion: a Decode whose client went away still
runs its remaining steps, because the other ranks are running them too and the collectives must
pair up. Rank 0 returns tokens; the other ranks return empty acknowledgements. The one exception
is Load: the gateway sends it only after giving up on every step in flight, so a step still
waiting in a collective then is ended (Communicator.abort) instead of being waited for.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterator

import grpc
import torch
from shardlm.constants import DEFAULT_COMM_TIMEOUT_S
from shardlm.errors import FieldViolation, InvalidArgumentError, ShardLMError
from shardlm.worker.v1 import worker_pb2, worker_pb2_grpc

from shardlm_server.worker import convert
from shardlm_server.worker.comm import (
    Communicator,
    create_communicator,
    new_nccl_unique_id,
    open_store,
)
from shardlm_server.worker.comm.gloo import format_address, parse_address
from shardlm_server.worker.engine import Engine
from shardlm_server.worker.engine_thread import EngineThread

log = logging.getLogger("shardlm.worker")

BACKENDS = {worker_pb2.COMM_BACKEND_GLOO: "gloo", worker_pb2.COMM_BACKEND_NCCL: "nccl"}


def _not_loaded() -> ShardLMError:
    return ShardLMError("no model is loaded on this worker; call Load first",
                        reason="MODEL_NOT_LOADED", code=grpc.StatusCode.FAILED_PRECONDITION)


def _validate_load(request: worker_pb2.LoadRequest) -> torch.device:
    violations = []
    if not request.model_path:
        violations.append(FieldViolation("model_path", "must name a checkpoint folder"))
    if request.world_size < 1:
        violations.append(FieldViolation("world_size", "must be at least 1"))
    elif request.rank >= request.world_size:
        violations.append(FieldViolation("rank", f"must be below world_size ({request.world_size})"))
    device = None
    try:
        device = torch.device(request.device or "cpu")
        if device.type not in ("cpu", "cuda"):
            raise ValueError
        if device.type == "cuda" and not torch.cuda.is_available():
            violations.append(FieldViolation("device", "CUDA is not available on this worker"))
    except (RuntimeError, ValueError):
        violations.append(FieldViolation("device", "must be 'cpu', 'cuda' or 'cuda:N'"))
    _raise_if_any(violations)
    assert device is not None
    return device


def _validate_comm(request: worker_pb2.LoadRequest) -> None:
    """How a multi-rank load joins its peers; checked after the model is known to split
    world_size ways (a model that cannot is the more useful error)."""
    if request.world_size <= 1:
        return
    if request.comm.backend not in BACKENDS:
        _raise_if_any([FieldViolation("comm.backend", "must be GLOO or NCCL when world_size > 1")])
    if request.comm.backend == worker_pb2.COMM_BACKEND_GLOO and not request.comm.init_address:
        _raise_if_any([FieldViolation("comm.init_address", "gloo needs rank 0's host:port")])


def _raise_if_any(violations: list[FieldViolation]) -> None:
    if violations:
        raise InvalidArgumentError(violations[0].description, reason="INVALID_FIELD",
                                   field_violations=violations,
                                   metadata={"field": violations[0].field})


class WorkerServicer(worker_pb2_grpc.WorkerServiceServicer):
    def __init__(self, advertise_host: str = "", comm_port: int = 0) -> None:
        """`advertise_host` / `comm_port`: as rank 0 of a gloo group, the host the other ranks
        dial for the rendezvous (instead of the one the gateway names) and the port the store
        listens on (instead of the one the gateway names, 0 = a free one)."""
        self._advertise_host = advertise_host
        self._comm_port = comm_port
        self._lock = threading.Lock()
        self._engine_thread = EngineThread()  # every step runs here (worker/engine_thread.py)
        self._engine: Engine | None = None
        self._comm: Communicator | None = None
        self._device = torch.device("cpu")

    def _loaded(self) -> Engine:
        if self._engine is None:
            raise _not_loaded()
        return self._engine

    def _unload(self) -> None:
        self._engine = None
        if self._comm is not None:
            self._comm.close()
            self._comm = None

    # ----------------------------------------------------------------- Load
    def Load(self, request, context) -> Iterator[worker_pb2.LoadResponse]:
        device = _validate_load(request)
        Engine.check_parallel(request.model_path, request.world_size)
        _validate_comm(request)
        comm = self._comm
        if comm is not None and (self._lock.locked() or self._engine_thread.busy):
            # The gateway loads only after giving up on every step in flight: a step still
            # running here waits in a collective for a peer that never got it (its request was
            # lost with the network), so end it now rather than at the communicator timeout.
            comm.abort("a new Load replaces this communicator")
        with self._lock:
            self._unload()
            if device.type == "cuda":  # the current device is per thread
                torch.cuda.set_device(device)
                self._engine_thread.submit(lambda: torch.cuda.set_device(device))
            self._device = device
            # world_size 1 runs without a communicator whatever the backend says.
            backend = BACKENDS.get(request.comm.backend, "single")
            unique_id = request.comm.nccl_unique_id
            timeout_s = request.comm.timeout_seconds or DEFAULT_COMM_TIMEOUT_S
            init_address, store = request.comm.init_address, None
            leads = request.world_size > 1 and request.rank == 0
            if leads and backend == "nccl" and not unique_id:
                unique_id = new_nccl_unique_id()
                yield worker_pb2.LoadResponse(nccl_unique_id=unique_id)
            if leads and backend == "gloo":
                store, init_address = open_store(self._rendezvous_address(init_address),
                                                 request.world_size, timeout_s=timeout_s)
                log.info("rank 0/%d: rendezvous store at %s", request.world_size, init_address)
                yield worker_pb2.LoadResponse(comm_init_address=init_address)
            yield from self._load_with_progress(request, device, backend, unique_id,
                                                init_address, store, timeout_s)

    def _rendezvous_address(self, requested: str) -> str:
        """Where rank 0 opens the gloo store: the gateway's host:port with this worker's own
        --advertise-host / --comm-port in their place when it was started with them."""
        try:
            host, port = parse_address(requested, allow_port_zero=True)
        except ValueError as exc:
            raise InvalidArgumentError(str(exc), reason="INVALID_FIELD", field_violations=[
                FieldViolation("comm.init_address", str(exc))]) from None
        return format_address(self._advertise_host or host, self._comm_port or port)

    def _load_with_progress(self, request, device, backend, unique_id, init_address, store,
                            timeout_s):
        events: queue.Queue = queue.Queue()

        def work() -> None:
            try:
                comm = create_communicator(
                    backend, request.rank, request.world_size, device=device,
                    init_address=init_address, nccl_unique_id=unique_id, timeout_s=timeout_s,
                    store=store,
                )
                self._comm = comm
                engine = Engine.load(
                    request.model_path,
                    dtype=convert.DTYPE_BY_ENUM.get(request.dtype),
                    device=device,
                    comm=comm,
                    cache_config=convert.cache_config_from_proto(request.kv_cache),
                    options=convert.engine_options_from_proto(request.engine),
                    quantize=request.quantize,
                    tokenizer_json=request.tokenizer_json,
                    progress=lambda f, m: events.put(("progress", f, m)),
                )
                events.put(("done", engine, None))
            except BaseException as exc:  # noqa: BLE001 - re-raised in the serving thread
                events.put(("error", exc, None))

        thread = threading.Thread(target=work, name="shardlm-load", daemon=True)
        thread.start()
        while True:
            kind, a, b = events.get()
            if kind == "progress":
                yield worker_pb2.LoadResponse(
                    progress={"stage": "weights", "fraction": a, "message": b})
            elif kind == "error":
                self._unload()
                raise a
            else:
                self._engine = a
                log.info("rank %d/%d loaded %s: weights %.1f MiB, KV cache %.1f MiB (%d "
                         "blocks, %s)", request.rank, request.world_size, request.model_path,
                         a.weight_bytes / 2**20, a.cache.nbytes / 2**20, a.capacity.num_blocks,
                         str(a.cache.dtype).removeprefix("torch."))
                yield worker_pb2.LoadResponse(complete=worker_pb2.LoadComplete(
                    model=convert.model_info_to_proto(a),
                    capacity=convert.capacity_to_proto(a.capacity)))
                return

    # ----------------------------------------------------------------- steps
    def Prefill(self, request, context) -> worker_pb2.PrefillResponse:
        with self._lock:
            engine = self._loaded()
            items, taps = convert.prefill_items(request), tuple(request.debug_taps)
            output = self._engine_thread.call(lambda: engine.prefill(items, taps))
            if engine.comm.rank != 0:
                return worker_pb2.PrefillResponse()
            return worker_pb2.PrefillResponse(tokens=convert.tokens_to_proto(output),
                                              taps=convert.taps_to_proto(output.taps),
                                              constraint_mask_seconds=output.mask_seconds)

    def Decode(self, request, context) -> Iterator[worker_pb2.DecodeResponse]:
        with self._lock:
            engine = self._loaded()
            items, taps = convert.decode_items(request), tuple(request.debug_taps)
            # The steps run on the engine thread to their end even if the caller goes away: the
            # other ranks run them too, and the collectives must pair up.
            groups = self._engine_thread.stream(
                lambda: engine.decode(items, request.num_steps, taps),
                gather_s=convert.stream_gather_s(request, self._device))
            yield from convert.decode_responses(groups, samples=engine.comm.rank == 0)

    def ResetCache(self, request, context) -> worker_pb2.ResetCacheResponse:
        with self._lock:
            engine = self._loaded()
            if request.HasField("kv_cache"):
                config = convert.cache_config_from_proto(request.kv_cache)
                capacity = self._engine_thread.call(lambda: engine.reconfigure(config))
            else:
                ids = None if request.all else list(request.sequence_ids)
                self._engine_thread.call(lambda: engine.reset(ids))
                capacity = engine.capacity
            return worker_pb2.ResetCacheResponse(capacity=convert.capacity_to_proto(capacity))

    def GetInfo(self, request, context) -> worker_pb2.GetInfoResponse:
        # No lock: a health probe must answer while a long Decode runs.
        engine = self._engine
        reply = worker_pb2.GetInfoResponse(loaded=engine is not None, device=str(self._device))
        if self._device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self._device)
            reply.memory_allocated_bytes = total - free
            reply.memory_total_bytes = total
        if engine is not None:
            reply.model.CopyFrom(convert.model_info_to_proto(engine))
            reply.capacity.CopyFrom(convert.capacity_to_proto(engine.capacity))
            reply.used_blocks = engine.used_blocks()
            reply.live_sequences = len(engine.sequences)
            reply.rank = engine.comm.rank
            reply.world_size = engine.comm.world_size
        return reply
