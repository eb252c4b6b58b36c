"""A real gateway on loopback over real worker processes, driven with sync gRPC stubs."""

from __future__ import annotations

import asyncio
import os
import threading

import grpc
import pytest
from shardlm.gateway.v1 import gateway_pb2_grpc

from shardlm_server.gateway.api.runtime import Limits
from shardlm_server.gateway.api.server import start_gateway
from shardlm_server.gateway.workers.processes import WorkerGroup

# Where the live gateway's workers run: "cpu" unless SHARDLM_TEST_DEVICE says "cuda"
# (scripts/gpu_check.sh runs tests/gateway/test_e2e.py that way on a GPU machine).
TEST_DEVICE = os.environ.get("SHARDLM_TEST_DEVICE", "cpu")


class LiveGateway:
    def __init__(self, workers: int, limits: Limits, channel_credentials=None, worker_tls=None,
                 **kwargs) -> None:
        group = WorkerGroup.spawn(workers, device=TEST_DEVICE, tls=worker_tls)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = self.call(start_gateway(group, limits=limits, **kwargs))
        self.address = f"127.0.0.1:{self.server.port}"
        self.channel = (grpc.secure_channel(self.address, channel_credentials)
                        if channel_credentials else grpc.insecure_channel(self.address))
        self.stub = gateway_pb2_grpc.GatewayServiceStub(self.channel)

    def call(self, coro, timeout: float = 120):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    @property
    def runtime(self):
        return self.server.runtime

    @property
    def metrics(self):
        return self.server.metrics

    def kv_used(self) -> int:
        async def used():
            return self.runtime.model.allocator.used_blocks
        return self.call(used())

    @property
    def group(self) -> WorkerGroup:
        return self.server.runtime.group  # replaced when a supervisor restarts the workers

    def close(self) -> None:
        self.channel.close()
        self.call(self.server.drain(grace_s=2))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.group.close()


@pytest.fixture(scope="module")
def live():
    gateway = LiveGateway(1, Limits(session_idle_timeout_s=600))
    yield gateway
    gateway.close()
