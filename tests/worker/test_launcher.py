"""How the launcher starts local workers (without starting any)."""

from __future__ import annotations

import pytest

from worker import launcher
from worker.launcher import WorkerGroup


def spawned_env(monkeypatch) -> dict[str, str]:
    seen: list[dict[str, str]] = []

    def fake_spawn(rank, env, host, timeout_s, tls):
        seen.append(env)
        raise RuntimeError("not starting anything")

    monkeypatch.setattr(launcher, "_spawn", fake_spawn)
    with pytest.raises(RuntimeError):
        WorkerGroup.spawn(2, device="cpu")
    return seen[0]


def test_cpu_workers_split_the_cores_and_wait_passively(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setattr(launcher.os, "cpu_count", lambda: 8)
    env = spawned_env(monkeypatch)
    assert env == {"OMP_NUM_THREADS": "4", "OMP_WAIT_POLICY": "PASSIVE"}


def test_an_operators_wait_policy_wins(monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert "OMP_WAIT_POLICY" not in spawned_env(monkeypatch)
