"""The one thread that runs the engine's steps.

gRPC's server runs each call, and each message of a streaming call, on whichever of its pool
threads is free. On a CPU host every thread that runs torch ops owns its own OpenMP team, so steps
run from changing threads wake changing teams, and two teams spinning at once on two cores halve
the step rate (measured through `shardlm serve`: one stream at 70-77 tok/s in the rounds where it
happened, 143 in the others, with four busy compute threads instead of two). Here every step, cache
reset and prefill runs on one thread, in the order submitted, so one team does all the work.

A Decode's steps run ahead of its gRPC stream: the thread computes step after step and hands each
output over through a queue, so the compute never waits for a message to be sent, and the caller
turns outputs into messages while the next step runs.
"""

from __future__ import annotations

import queue
import threading
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

    def stream(self, make: Callable[[], Iterator[T]]) -> Iterator[T]:
        """The items of the iterator `make()` returns, which runs on the engine thread to its
        end even when the caller stops reading (a rank's steps must all run, since its peers run
        them too); its exception, if any, is raised here after the items before it."""
        items: queue.SimpleQueue = queue.SimpleQueue()

        def produce() -> None:
            try:
                for item in make():
                    items.put((item, None))
            except BaseException as exc:  # noqa: BLE001 - handed to the reader
                items.put((_END, exc))
                return
            items.put((_END, None))

        self.submit(produce)
        while True:
            item, error = items.get()
            if item is _END:
                if error is not None:
                    raise error
                return
            yield item
