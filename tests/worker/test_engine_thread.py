"""The engine thread runs all submitted work on one thread, in order; a stream's iterator runs to
its end even when its reader stops, its items reach the reader in groups under the gather time
(nothing lost, reordered or held past the end), and errors reach the caller after the items
before them."""

from __future__ import annotations

import threading
import time

import pytest

from shardlm_server.worker.engine_thread import EngineThread


def test_calls_run_on_one_thread_in_order_and_raise_their_errors():
    engine = EngineThread(name="test-engine")
    seen: list[tuple[int, str]] = []
    futures = [engine.submit(lambda i=i: seen.append((i, threading.current_thread().name)))
               for i in range(20)]
    for f in futures:
        f.result(timeout=5)
    assert seen == [(i, "test-engine") for i in range(20)]
    assert engine.call(lambda: 6 * 7) == 42
    with pytest.raises(ZeroDivisionError):
        engine.call(lambda: 1 / 0)
    assert engine.call(lambda: "still serving") == "still serving"


def test_a_stream_yields_in_order_then_raises_the_iterators_error():
    engine = EngineThread()

    def steps():
        yield from range(3)
        raise ValueError("step 3 failed")

    got = []
    with pytest.raises(ValueError, match="step 3 failed"):
        for group in engine.stream(steps):
            got.append(group)
    assert got == [[0], [1], [2]]
    got = []
    with pytest.raises(ValueError, match="step 3 failed"):
        for group in engine.stream(steps, gather_s=60):
            got.append(group)
    assert got == [[0, 1, 2]]  # what was gathered before the error is not lost


def test_a_stream_runs_to_its_end_when_the_reader_stops_and_later_work_waits_for_it():
    engine = EngineThread()
    ran = []

    def steps():
        for i in range(5):
            time.sleep(0.01)
            ran.append(i)
            yield i

    stream = engine.stream(steps)
    assert next(stream) == [0]
    stream.close()  # the caller went away after one step
    assert engine.call(lambda: list(ran)) == [0, 1, 2, 3, 4]
    assert not engine.busy


def test_busy_while_work_runs_or_waits():
    engine = EngineThread()
    release = threading.Event()
    first = engine.submit(release.wait)
    second = engine.submit(lambda: None)
    assert engine.busy
    release.set()
    first.result(timeout=5)
    second.result(timeout=5)
    assert not engine.busy


class Clock:
    """Each reading is `tick` seconds after the one before (an item of that length)."""

    def __init__(self, tick: float) -> None:
        self.now, self.tick = 0.0, tick

    def __call__(self) -> float:
        self.now += self.tick
        return self.now


def test_fast_items_go_together_and_the_last_is_never_held():
    engine = EngineThread()
    # 3 ms an item, 7 ms to gather: a group ends at the third item after the previous one.
    assert list(engine.stream(lambda: iter(range(5)), gather_s=0.007, clock=Clock(0.003))) == [
        [0, 1, 2], [3, 4]]
    assert list(engine.stream(lambda: iter(range(2)), gather_s=10, clock=Clock(0.003))) == [[0, 1]]


def test_slow_items_each_go_at_once():
    engine = EngineThread()
    assert list(engine.stream(lambda: iter(range(3)), gather_s=0.007, clock=Clock(0.05))) == [
        [0], [1], [2]]
