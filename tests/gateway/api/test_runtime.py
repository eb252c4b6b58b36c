"""Runtime.load without worker processes: a stand-in worker group answers Load, so what the
runtime does around it (the reason a concurrent Load gets, the KV gauges it publishes) is seen
directly."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
from grpc_health.v1.health import aio as health_aio
from shardlm.common.v1 import common_pb2
from shardlm.errors import FailedPreconditionError
from shardlm.worker.v1 import worker_pb2

from shardlm_server.gateway.api.runtime import Limits, Runtime
from shardlm_server.gateway.metrics import Metrics

TINY_MODEL = Path(__file__).resolve().parents[3] / "models" / "shakespeare-tiny"
NUM_BLOCKS = 96


class StandInGroup:
    """The part of WorkerGroup that Runtime reads: one local rank (nothing listens there)."""

    world_size = 1
    tls = None
    handles: list = []
    addresses = ["127.0.0.1:1"]
    devices = ["cpu"]


class StandInPool:
    """The part of the worker client that Runtime.load uses; `load` waits for `release` when set."""

    world_size = 1

    def __init__(self, release: threading.Event | None = None) -> None:
        self.release = release
        self.started = threading.Event()

    async def load(self, model_path, *, dtype, kv_cache, progress,
                   **_options) -> worker_pb2.LoadComplete:
        self.started.set()
        if self.release is not None:
            await asyncio.to_thread(self.release.wait, 30)
        return worker_pb2.LoadComplete(
            model=common_pb2.ModelInfo(model_path=model_path, vocab_size=1000,
                                       max_position_embeddings=512),
            capacity=common_pb2.KvCacheCapacity(num_blocks=NUM_BLOCKS, block_size=16,
                                                mode=common_pb2.KV_CACHE_MODE_PAGED))

    async def close(self) -> None:
        pass


def stand_in_runtime(metrics: Metrics, pool: StandInPool) -> Runtime:
    runtime = Runtime(StandInGroup(), metrics, Limits(), health_aio.HealthServicer())
    runtime.pool = pool
    return runtime


async def _load(runtime: Runtime) -> None:
    await runtime.load(str(TINY_MODEL), common_pb2.DTYPE_UNSPECIFIED, 0, None, lambda _p: None)


def test_kv_blocks_total_is_published_when_the_model_loads():
    async def scenario() -> tuple[float, float, float]:
        metrics = Metrics()
        runtime = stand_in_runtime(metrics, StandInPool())
        await _load(runtime)
        loaded = metrics.value("shardlm_kv_blocks_total")
        used = metrics.value("shardlm_kv_blocks_used")
        await runtime.close()
        return loaded, used, metrics.value("shardlm_kv_blocks_total")

    loaded, used, after_close = asyncio.run(scenario())
    assert (loaded, used) == (NUM_BLOCKS, 0)  # before any request has run a step
    assert after_close == 0


def test_a_concurrent_load_is_refused_with_load_in_progress():
    async def scenario() -> FailedPreconditionError:
        release = threading.Event()
        pool = StandInPool(release)
        runtime = stand_in_runtime(Metrics(), pool)
        first = asyncio.create_task(_load(runtime))
        await asyncio.to_thread(pool.started.wait, 30)
        try:
            with pytest.raises(FailedPreconditionError) as err:
                await _load(runtime)
        finally:
            release.set()
            await first
            await runtime.close()
        return err.value

    error = asyncio.run(scenario())
    assert error.reason == "LOAD_IN_PROGRESS"
