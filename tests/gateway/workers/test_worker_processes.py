"""How the gateway starts local workers (without starting any)."""

from __future__ import annotations

import pytest

from shardlm_server.gateway.workers import processes as worker_processes
from shardlm_server.gateway.workers.processes import WorkerGroup


def spawned_env(monkeypatch) -> dict[str, str]:
    seen: list[dict[str, str]] = []

    def fake_spawn(self, rank, env, host, timeout_s):
        seen.append(env)
        raise RuntimeError("not starting anything")

    monkeypatch.setattr(WorkerGroup, "_spawn", fake_spawn)
    with pytest.raises(RuntimeError):
        WorkerGroup.spawn(2, device="cpu")
    return seen[0]


def test_cpu_workers_split_the_cores_and_spin_before_sleeping(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.setattr(worker_processes.os, "cpu_count", lambda: 8)
    env = spawned_env(monkeypatch)
    assert env == {"OMP_NUM_THREADS": "4",
                   "GOMP_SPINCOUNT": str(worker_processes.CPU_SPIN_COUNT)}


@pytest.mark.parametrize("name,value", [("OMP_WAIT_POLICY", "ACTIVE"),
                                        ("GOMP_SPINCOUNT", "100")])
def test_an_operators_wait_setting_wins(monkeypatch, name, value):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.setenv(name, value)
    env = spawned_env(monkeypatch)
    assert "OMP_WAIT_POLICY" not in env and "GOMP_SPINCOUNT" not in env
