"""The one thread that runs the engine's steps.

gRPC's server runs each call, and each message of a streaming call, on whichever of its pool
threads is free. On a CPU host every thread that runs torch ops owns its own OpenMP team, so steps
run from changing threads wake changing teams, and two teams spinning at once on two cores halve
the step rate (measured through `shardlm serve`: one stream at 70-77 tok/s in the rounds where it
happened, 143 in the others, with four busy compute threads instead of two). Here every step, cache
reset and prefill runs on one thread, in the order submitted, so one team does all the work.

A Decode's steps run ahead of its gRPC stream: the thread computes step after step and hands the
outputs over through a queue, so the compute never waits for a message to be sent, and the caller
turns outputs into messages while the next steps run. Outputs are handed over in groups, a group
once `gather_s` have passed since the previous one (a step's output waits for the steps after it
until then; the last goes with the end): the reader, which makes a message of each group, then
wakes once a message, not once a step. On a CPU host each wake-up takes a core from a compute
thread, and its partner waits for it at the next barrier (README, *The stack's overhead*).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import TypeVar

T = TypeVar("T")
_END = object()


class EngineThread:
    """A daemon thread running submitted work in order (a daemon: a step stuck in a collective
    must not keep the process from exiting)."""

    def __init__(self, name: str = "shardlm-engine") -> None:
        self._work: queue.SimpleQueue[tuple[Callable[[], object], Future]] = queue.SimpleQueue()
        self._pending = 0  # submitted and not yet finished
        self._count = threading.Lock()
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def _run(self) -> None:
        while True:
            fn, future = self._work.get()
            result, error = None, None
            if future.set_running_or_notify_cancel():
                try:
                    result = fn()
                except BaseException as exc:  # noqa: BLE001 - handed to the caller
                    error = exc
            with self._count:  # not busy before the caller sees the outcome
                self._pending -= 1
            if error is not None:
                future.set_exception(error)
            elif future.running():
                future.set_result(result)

    @property
    def busy(self) -> bool:
        """Whether work is running or waiting (a step may be stuck in a collective)."""
        return self._pending > 0

    def submit(self, fn: Callable[[], T]) -> Future:
        future: Future = Future()
        with self._count:
            self._pending += 1
        self._work.put((fn, future))
        return future

    def call(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the engine thread and return its result (or raise its exception)."""
        return self.submit(fn).result()

    def stream(self, make: Callable[[], Iterator[T]], *, gather_s: float = 0.0,
               clock: Callable[[], float] = time.monotonic) -> Iterator[list[T]]:
        """The items of the iterator `make()` returns, in groups: a group ends at the first item
        `gather_s` or more after the previous group's end (or the call's start), and at the last
        item; 0 makes every item a group. `make()` runs on the engine thread to its end even when
        the caller stops reading (a rank's steps must all run, since its peers run them too); its
        exception, if any, is raised here after the groups before it, the items it had gathered
        included."""
        groups: queue.SimpleQueue = queue.SimpleQueue()

        def produce() -> None:
            group: list = []
            last = clock()
            error = None
            try:
                for item in make():
                    group.append(item)
                    now = clock()
                    if now - last >= gather_s:
                        groups.put((group, None))
                        group, last = [], now
            except BaseException as exc:  # noqa: BLE001 - handed to the reader
                error = exc
            if group:  # the last group, or what was gathered before the error
                groups.put((group, None))
            groups.put((_END, error))

        self.submit(produce)
        while True:
            group, error = groups.get()
            if group is _END:
                if error is not None:
                    raise error
                return
            yield group
