"""Supervisor recovery of workers started elsewhere (`--workers`): they cannot be restarted from
the gateway, so it waits for them, past the attempt limit that bounds local restarts, and then
reloads the model on them."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from shardlm.errors import UnavailableError

from shardlm_server.gateway.serve.supervisor import Supervisor
from shardlm_server.gateway.workers.processes import WorkerGroup

ADDRESSES = ["10.0.0.1:50061", "10.0.0.2:50061"]


class UnreachableForAWhile:
    """The Runtime and WorkerPool surface the supervisor uses; the workers answer only from the
    `answers_from`-th health wait on."""

    def __init__(self, answers_from: int) -> None:
        self.group = WorkerGroup.connect(ADDRESSES)
        self.pool = self
        self.model = SimpleNamespace(sessions=None)
        self.last_load = ("/models/m", 0, 0, None)
        self.stopping = self.draining = self.recovering = False
        self.metrics = SimpleNamespace(worker_restarts=SimpleNamespace(inc=lambda: None))
        self.answers_from = answers_from
        self.waits = 0
        self.loaded: list[str] = []
        self.groups: list[WorkerGroup] = []

    async def unload(self, error) -> None:
        self.model = None

    async def replace_group(self, group: WorkerGroup) -> None:
        self.group = group
        self.groups.append(group)

    async def wait_healthy(self, timeout_s: float, alive) -> None:
        self.waits += 1
        if self.waits < self.answers_from:
            raise UnavailableError("worker rank 1 is not answering", reason="WORKER_UNAVAILABLE")

    async def load(self, path, dtype, tp, kv, progress, sessions=None) -> None:
        self.loaded.append(path)


async def _recover(runtime: UnreachableForAWhile) -> Supervisor:
    supervisor = Supervisor(runtime, lambda: WorkerGroup.connect(ADDRESSES), max_attempts=2,
                            backoff_s=0.001, max_backoff_s=0.002)
    supervisor.trigger(UnavailableError("worker rank 1 stopped answering",
                                        reason="WORKER_UNAVAILABLE"))
    await asyncio.wait_for(supervisor._recovery, 10)
    return supervisor


def test_remote_workers_are_waited_for_past_the_attempt_limit_then_reloaded():
    runtime = UnreachableForAWhile(answers_from=6)
    asyncio.run(_recover(runtime))
    assert runtime.waits == 6  # well past max_attempts=2
    assert runtime.loaded == ["/models/m"]
    assert all(g.addresses == ADDRESSES for g in runtime.groups)  # the same workers, fresh channels
    assert not runtime.recovering
