"""Real worker processes for the worker tests: started by the gateway's process code, loaded
through the gateway's worker client, and then driven rank by rank with sync stubs."""

from __future__ import annotations

import asyncio
import subprocess
from dataclasses import dataclass

import grpc
from shardlm.worker.v1 import worker_pb2, worker_pb2_grpc

from shardlm_server.gateway.config import Limits
from shardlm_server.gateway.workers.client import CHANNEL_OPTIONS, WorkerPool
from shardlm_server.gateway.workers.processes import WorkerGroup


@dataclass
class LiveWorker:
    rank: int
    stub: worker_pb2_grpc.WorkerServiceStub
    process: subprocess.Popen | None


class LiveWorkers:
    def __init__(self, world_size: int) -> None:
        self.group = WorkerGroup.spawn(world_size)
        self.quantize = ""  # what every load sends as LoadRequest.quantize
        self.channels = [grpc.insecure_channel(a, options=CHANNEL_OPTIONS)
                         for a in self.group.addresses]
        self.handles = [LiveWorker(h.rank, worker_pb2_grpc.WorkerServiceStub(channel), h.process)
                        for h, channel in zip(self.group.handles, self.channels, strict=True)]

    def load(self, model_path: str, **options) -> worker_pb2.LoadComplete:
        """Load on every rank (WorkerPool.load's keywords); rank 0's LoadComplete."""
        options.setdefault("quantize", self.quantize)

        async def load() -> worker_pb2.LoadComplete:
            pool = WorkerPool(self.group.addresses, devices=self.group.devices,
                              step_timeout_s=Limits().step_timeout_s)
            try:
                return await pool.load(model_path, **options)
            finally:
                await pool.close()

        return asyncio.run(load())

    def close(self) -> None:
        for channel in self.channels:
            channel.close()
        self.group.close()
