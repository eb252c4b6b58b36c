"""The gateway's model-dependent state: the worker group, and the loaded model's tokenizer, KV
manager, scheduler and sessions (a LoadedModel), created by Load and replaced as a whole by the
next Load."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2
from grpc_health.v1.health import aio as health_aio
from shardlm.common.v1 import common_pb2
from shardlm.errors import (
    FailedPreconditionError,
    FieldViolation,
    InvalidArgumentError,
    ShardLMError,
    UnavailableError,
)
from shardlm.worker.v1 import worker_pb2

from shardlm_server.gateway.api.paths import check_model_path
from shardlm_server.gateway.batching.scheduler import Scheduler
from shardlm_server.gateway.batching.sessions import SessionStore
from shardlm_server.gateway.config import Limits, LoadOptions
from shardlm_server.gateway.constraints.compiler import ConstraintCompiler
from shardlm_server.gateway.kv.allocator import BlockAllocator
from shardlm_server.gateway.kv.events import KvEventLog
from shardlm_server.gateway.kv.manager import KvManager
from shardlm_server.gateway.metrics import Metrics
from shardlm_server.gateway.text.tokenizer import Tokenizer, TokenizerError
from shardlm_server.gateway.workers.client import WorkerPool
from shardlm_server.gateway.workers.processes import WorkerGroup

log = logging.getLogger("shardlm.gateway")
SERVICE_NAME = "shardlm.gateway.v1.GatewayService"


@dataclass
class LoadedModel:
    """Everything that lives as long as one loaded model (and its KV cache configuration)."""

    info: common_pb2.ModelInfo
    capacity: common_pb2.KvCacheCapacity
    tokenizer: Tokenizer
    scheduler: Scheduler
    sessions: SessionStore
    kv: KvManager
    constraints: ConstraintCompiler

    @property
    def allocator(self) -> BlockAllocator:
        """The KV blocks, for limits and load reports (the scheduler asks the KV manager)."""
        return self.kv.allocator

    @property
    def max_context(self) -> int:
        static = self.capacity.max_sequence_length
        return min(self.info.max_position_embeddings, static or self.info.max_position_embeddings)

    @property
    def eos_ids(self) -> frozenset[int]:
        """The model's end-of-sequence ids: the set the workers gathered from the checkpoint
        once and reported in ModelInfo (the only EOS list the finish policy uses)."""
        return frozenset(self.info.eos_token_ids)


def not_loaded() -> FailedPreconditionError:
    return FailedPreconditionError("no model is loaded; call Load first",
                                   reason="MODEL_NOT_LOADED")


class Runtime:
    def __init__(self, group: WorkerGroup, metrics: Metrics, limits: Limits,
                 health: health_aio.HealthServicer, model_root: str | None = None,
                 load_options: LoadOptions | None = None) -> None:
        self.model_root = model_root
        self.group = group
        self.metrics = metrics
        self.limits = limits
        self.load_options = load_options or LoadOptions()
        self.health = health
        self.model: LoadedModel | None = None
        self.pool = self._pool_for(group)
        # Shutdown: `stopping` from the moment it is announced (health says so, routers are
        # told), `draining` from when new calls are refused (gateway/api/server.py: drain).
        self.stopping = False
        self.draining = False
        self.refused_while_draining = 0
        self.recovering = False
        # Parts served beside the API that are down, and why (`serve --openai-port`'s SMG
        # router): the server's overall health ("") is NOT_SERVING while any is.
        self.parts_down: dict[str, str] = {}
        self._serving = False
        self.last_load: tuple | None = None  # what to reload after a worker restart
        self._load_lock = asyncio.Lock()
        # One log for the process: its sequence numbers go on across loads and restarts of
        # the workers (each starts with a clear).
        self.kv_events = KvEventLog(enabled=limits.kv_events)
        self.on_failure: Callable[[ShardLMError], None] = lambda _e: None

    def _pool_for(self, group: WorkerGroup) -> WorkerPool:
        credentials = group.tls.channel_credentials() if group.tls else None
        return WorkerPool(group.addresses, credentials=credentials, devices=group.devices,
                          step_timeout_s=self.limits.step_timeout_s)

    def require(self) -> LoadedModel:
        if self.draining:
            self.refused_while_draining += 1
            raise UnavailableError("the server is shutting down", reason="DRAINING",
                                   retry_after_s=1.0)
        if self.recovering:
            raise UnavailableError("workers are restarting; retry shortly",
                                   reason="WORKER_UNAVAILABLE", retry_after_s=2.0)
        if self.model is None:
            raise not_loaded()
        return self.model

    async def set_serving(self, serving: bool) -> None:
        self._serving = serving
        status = (health_pb2.HealthCheckResponse.SERVING if serving and not self.stopping
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.health.set(SERVICE_NAME, status)
        await self.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING
                              if self.parts_down else status)

    async def set_part_down(self, part: str, why: str | None) -> None:
        """Mark a part served beside the API down (`why`) or up again (None)."""
        if why is None:
            self.parts_down.pop(part, None)
        else:
            self.parts_down[part] = why
        await self.set_serving(self._serving)

    async def load(self, model_path: str, dtype: int, tp_size: int,
                   kv_cache: common_pb2.KvCacheConfig | None,
                   progress: Callable[[common_pb2.LoadProgress], None],
                   sessions: SessionStore | None = None) -> LoadedModel:
        if not model_path:
            raise InvalidArgumentError("model_path must name a checkpoint folder",
                                       reason="INVALID_FIELD",
                                       field_violations=[FieldViolation("model_path", "empty")])
        world = self.group.world_size
        if tp_size not in (0, world):
            raise InvalidArgumentError(
                f"tensor_parallel_size {tp_size} does not match the {world} running workers",
                reason="TENSOR_PARALLEL_MISMATCH",
                field_violations=[FieldViolation("tensor_parallel_size", f"must be 0 or {world}")],
                metadata={"tensor_parallel_size": tp_size, "workers": world})
        model_path = check_model_path(model_path, self.model_root)
        kv_cache = self._sized(kv_cache)
        if self._load_lock.locked():
            raise FailedPreconditionError("another Load is in progress; retry when it has finished",
                                          reason="LOAD_IN_PROGRESS")
        async with self._load_lock:
            # The tokenizer first: a checkpoint whose tokenizer cannot be built (or a GGUF file
            # whose header is corrupt) is refused before the running model is let go.
            try:
                tokenizer = await asyncio.to_thread(Tokenizer.from_pretrained, Path(model_path))
            except TokenizerError as exc:
                raise FailedPreconditionError(str(exc), reason="CHECKPOINT_INVALID",
                                              metadata={"model_path": model_path}) from None
            previous = self.model
            await self.unload(UnavailableError("the model is being replaced",
                                               reason="WORKER_UNAVAILABLE", retry_after_s=5.0))
            try:
                complete = await self.pool.load(
                    model_path, dtype=dtype, kv_cache=kv_cache, progress=progress,
                    engine_options=self.load_options.engine,
                    comm_timeout_s=self.load_options.comm_timeout_s,
                    quantize=self.load_options.quantize, tokenizer_json=tokenizer.backend_json())
            except ShardLMError:
                await self._restore(previous)
                raise
            complete.model.has_chat_template = tokenizer.has_chat_template  # a gateway-side fact
            constraints = await asyncio.to_thread(
                ConstraintCompiler.for_vocabulary, tokenizer.backend_json(),
                complete.model.vocab_size, list(complete.model.eos_token_ids), self.metrics,
                timeout_s=self.limits.constraint_compile_timeout_s,
                max_bytes=self.limits.max_constraint_bytes)
            self.model = self._build(complete, tokenizer, constraints, sessions)
            self.last_load = (model_path, dtype, tp_size, kv_cache)
            await self.set_serving(True)
            log.info("loaded %s (%s, tp=%d, %d KV blocks)", model_path,
                     complete.model.architecture, world, complete.capacity.num_blocks)
            return self.model

    async def _restore(self, previous: LoadedModel | None) -> None:
        """After a failed Load: when every worker still holds the previous model (the checkpoint
        was rejected before they let it go), serve it again, on an emptied cache."""
        if previous is None:
            return
        try:
            for rank in range(self.pool.world_size):
                info = await self.pool.info(rank)
                if not info.loaded or info.model.model_path != previous.info.model_path:
                    return
            reply = await self.pool.reset(worker_pb2.ResetCacheRequest(all=True))
        except ShardLMError:
            return
        self.model = self._build(worker_pb2.LoadComplete(model=previous.info,
                                                         capacity=reply.capacity),
                                 previous.tokenizer, previous.constraints)
        await self.set_serving(True)
        log.warning("the new checkpoint was rejected; still serving %s", previous.info.model_path)

    def _build(self, complete: worker_pb2.LoadComplete, tokenizer: Tokenizer,
               constraints: ConstraintCompiler,
               sessions: SessionStore | None = None) -> LoadedModel:
        capacity = complete.capacity
        kv = KvManager.for_capacity(capacity, complete.model, self.metrics,
                                    prefix_cache=self.limits.prefix_cache,
                                    events=self.kv_events)
        sessions = sessions or SessionStore(self.limits.session_idle_timeout_s,
                                            self.limits.max_sessions)
        max_running = self.limits.max_running
        if capacity.mode == common_pb2.KV_CACHE_MODE_STATIC:
            max_running = min(max_running, capacity.max_sequences)
        scheduler = Scheduler(
            self.pool, kv, sessions, self.metrics,
            prefill_token_budget=self.limits.prefill_token_budget,
            max_decode_steps=self.limits.max_decode_steps,
            decode_call_s=self.limits.decode_call_s,
            stream_interval_ms=self.limits.stream_interval_ms, max_waiting=self.limits.max_waiting,
            max_running=max_running, on_worker_failure=self._worker_failed)
        scheduler.start()
        kv.update_gauges()
        return LoadedModel(complete.model, capacity, tokenizer, scheduler, sessions, kv,
                           constraints)

    def _worker_failed(self, error: ShardLMError) -> None:
        if error.code != grpc.StatusCode.UNAVAILABLE:
            return  # e.g. out of memory: only that step's requests failed
        model = self.model
        if model is not None:
            model.scheduler.fail_all(error)
        self.on_failure(error)

    async def unload(self, error: ShardLMError) -> None:
        model, self.model = self.model, None
        await self.set_serving(False)
        if model is not None:
            await model.scheduler.stop()
            model.scheduler.fail_all(error)
        self.metrics.observe_kv_cache(0, 0)

    async def replace_group(self, group: WorkerGroup) -> None:
        """Talk to a new worker group (after a restart) from now on."""
        old = self.pool
        self.group, self.pool = group, self._pool_for(group)
        await old.close()

    def _sized(self, config: common_pb2.KvCacheConfig | None) -> common_pb2.KvCacheConfig:
        """`config` with max_running_sequences filled in from --max-running where it is 0: the
        workers size their default cache for the sequences this gateway runs at once."""
        sized = common_pb2.KvCacheConfig()
        if config is not None:
            sized.CopyFrom(config)
        if not sized.max_running_sequences:
            sized.max_running_sequences = self.limits.max_running
        return sized

    async def reset_cache(self, config: common_pb2.KvCacheConfig) -> common_pb2.KvCacheCapacity:
        """Reallocate the workers' caches with a new configuration; every session is released."""
        config = self._sized(config)
        model = self.require()
        await model.scheduler.stop()
        model.scheduler.fail_all(UnavailableError("the KV cache was reconfigured",
                                                  reason="WORKER_UNAVAILABLE", retry_after_s=1.0))
        try:
            reply = await self.pool.reset(worker_pb2.ResetCacheRequest(all=True, kv_cache=config))
        except ShardLMError:
            # The workers kept (restored) the cache they had: serve on with it.
            self.model = self._build(worker_pb2.LoadComplete(model=model.info,
                                                             capacity=model.capacity),
                                     model.tokenizer, model.constraints, model.sessions)
            raise
        complete = worker_pb2.LoadComplete(model=model.info, capacity=reply.capacity)
        # The new pool's size and dtype (auto: the serving dtype, as the workers resolve it).
        complete.model.kv_cache_bytes = reply.capacity.num_blocks * reply.capacity.bytes_per_block
        complete.model.kv_cache_dtype = config.dtype or model.info.dtype
        self.model = self._build(complete, model.tokenizer, model.constraints, model.sessions)
        return reply.capacity

    async def close(self) -> None:
        await self.unload(UnavailableError("the server stopped", reason="DRAINING"))
        await self.pool.close()
