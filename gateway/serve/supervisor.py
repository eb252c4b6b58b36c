"""Keeps the worker group alive: notices a dead worker, restarts the group, reloads the model.

A worker that dies mid-step makes that step's calls fail at once (UNAVAILABLE); the scheduler
reports it here. A worker that stops answering is noticed by a watch loop, also mid-step (a local
process that exited, or a remote one whose health ping times out: a host cut off the network
sends no reset, so its calls would otherwise wait). Recovery: health NOT_SERVING, every in-flight
call ends with UNAVAILABLE, then the last model is reloaded. Local workers are restarted first,
with bounded attempts and exponential backoff. Workers on other hosts cannot be restarted from
here: the supervisor waits, without an attempt limit and with capped backoff, until every one
answers again, then reloads the model on them (each worker's Load replaces its communicator).
Sessions survive: their token histories stay here, their caches are gone, and each is rebuilt by
re-prefilling on its next call.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from shardlm.errors import ShardLMError, UnavailableError

from shardlm_server.gateway.api.runtime import Runtime
from shardlm_server.gateway.workers.processes import WorkerGroup

log = logging.getLogger("shardlm.supervisor")


def backoff_delay(attempt: int, base_s: float, max_s: float) -> float:
    """Seconds to wait after failed attempt `attempt` (1, 2, ...): `base_s`, doubling with each
    attempt, at most `max_s`. Shared by the worker supervisor and the SMG router's
    (gateway/serve/openai_router.py)."""
    return min(base_s * 2 ** (attempt - 1), max_s)


class Supervisor:
    def __init__(self, runtime: Runtime, respawn: Callable[[], WorkerGroup], *,
                 max_attempts: int = 5, backoff_s: float = 1.0, check_interval_s: float = 0.5,
                 ping_timeout_s: float = 2.0, start_timeout_s: float = 60.0,
                 max_backoff_s: float = 30.0) -> None:
        self.rt = runtime
        self.respawn = respawn
        self.max_attempts = max_attempts
        self.backoff_s = backoff_s
        self.check_interval_s = check_interval_s
        self.ping_timeout_s = ping_timeout_s
        self.start_timeout_s = start_timeout_s
        self.max_backoff_s = max_backoff_s
        self._watch: asyncio.Task | None = None
        self._recovery: asyncio.Task | None = None
        runtime.on_failure = self.trigger

    def start(self) -> None:
        self._watch = asyncio.ensure_future(self._watch_loop())

    async def stop(self) -> None:
        for task in (self._watch, self._recovery):
            if task is not None:
                task.cancel()

    def trigger(self, error: ShardLMError) -> None:
        if self._recovery is None or self._recovery.done():
            action = ("waiting for the workers to answer" if self._remote()
                      else "restarting the worker group")
            log.error("worker failure: %s; %s", error.message, action)
            self._recovery = asyncio.ensure_future(self._recover(error))

    def _remote(self) -> bool:
        """Workers started elsewhere (`--workers`): none of them is a process of ours."""
        return all(h.process is None for h in self.rt.group.handles)

    async def _dead_worker(self) -> str | None:
        for h in self.rt.group.handles:
            if h.process is not None:
                if h.process.poll() is not None:
                    return f"worker rank {h.rank} exited with code {h.process.returncode}"
            else:
                try:
                    await self.rt.pool.info(h.rank, timeout=self.ping_timeout_s)
                except ShardLMError:
                    return f"worker rank {h.rank} at {h.address} stopped answering"
        return None

    async def _watch_loop(self) -> None:
        while True:
            await asyncio.sleep(self.check_interval_s)
            if self.rt.model is None or self.rt.recovering or self.rt.stopping:
                continue
            why = await self._dead_worker()
            if why:
                self.trigger(UnavailableError(why, reason="WORKER_UNAVAILABLE",
                                              retry_after_s=2.0))

    async def _recover(self, error: ShardLMError) -> None:
        rt = self.rt
        if rt.last_load is None or rt.stopping:
            return
        rt.recovering = True
        try:
            sessions = rt.model.sessions if rt.model is not None else None
            await rt.unload(error)
            remote = self._remote()
            log.info("in-flight calls failed; %s", "waiting for the workers to answer" if remote
                     else "stopping the old workers")
            attempt = 0
            while remote or attempt < self.max_attempts:
                attempt += 1
                await asyncio.to_thread(rt.group.close, 2.0)  # remote workers are left running
                try:
                    # Remote: the same addresses on fresh channels (the old connections may be
                    # dead ones that no packet will ever close).
                    group = await asyncio.to_thread(self.respawn)
                    await rt.replace_group(group)
                    await rt.pool.wait_healthy(self.start_timeout_s, group.is_alive)
                    log.info("the workers answer; reloading the model")
                    path, dtype, tp, kv = rt.last_load
                    await rt.load(path, dtype, tp, kv, lambda _p: None, sessions=sessions)
                    rt.metrics.worker_restarts.inc()
                    log.info("worker group %s and %s reloaded (attempt %d)",
                             "reconnected" if remote else "restarted", path, attempt)
                    return
                except (ShardLMError, OSError) as exc:
                    delay = backoff_delay(attempt, self.backoff_s, self.max_backoff_s)
                    limit = "" if remote else f"/{self.max_attempts}"
                    log.warning("recovery attempt %d%s failed: %s; next in %.1fs", attempt, limit,
                                exc, delay)
                    await asyncio.sleep(delay)
            log.error("giving up after %d restart attempts; health stays NOT_SERVING",
                      self.max_attempts)
        except Exception:  # noqa: BLE001 - a bug here must be seen, not lost in a task
            log.exception("worker recovery failed")
        finally:
            rt.recovering = False
