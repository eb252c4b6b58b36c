"""Tensor-parallel communicators: real processes for the collectives, a fake clock for timeouts.

The gloo tests start 2-3 processes per group from a forkserver (never forked
from the pytest process, so none of its thread state leaks into them).  Every
wait on a child is bounded (the bound only stops a hung test), and leftover
children are killed.  How long a communicator waits is checked against a fake
clock that moves only when the code under test waits, never against the wall
clock.  The NCCL code path also runs here against a fake CuPy; the real NCCL
tests need CUDA and CuPy and are skipped otherwise.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import multiprocessing as mp
import os
import queue
import signal
import socket
import sys
import threading
import time
import traceback
import types
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch

from shardlm_server.worker.comm import (
    Communicator,
    CommunicatorError,
    GlooCommunicator,
    SingleRankCommunicator,
    create_communicator,
    new_nccl_unique_id,
)
from shardlm_server.worker.comm import gloo as gloo_module
from shardlm_server.worker.comm import nccl as nccl_module
from shardlm_server.worker.comm.gloo import ABORT_POLL_S
from shardlm_server.worker.comm.nccl import (
    NcclCommunicator,
    _blocks_to_last_dim,
    unique_id_to_tuple,
)

CPU = torch.device("cpu")
HAVE_CUPY = importlib.util.find_spec("cupy") is not None
HAVE_NCCL = HAVE_CUPY and torch.cuda.is_available()


# -- process harness ----------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _address() -> str:
    return f"127.0.0.1:{_free_port()}"


def _port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _child_main(
    target: Callable[..., Any], rank: int, world_size: int, q: Any, args: tuple
) -> None:
    torch.set_num_threads(1)

    def send(kind: str, payload: Any = None) -> None:
        q.put((rank, kind, payload))

    try:
        send("result", target(rank, world_size, send, *args))
    except BaseException:
        send("error", traceback.format_exc())


def _mp_context(method: str) -> Any:
    """``forkserver`` preloads this module (and so torch): children fork from a
    clean server process (no pytest threads, no gloo state) that already
    imported torch, so a group starts in milliseconds instead of a torch import
    per child.  CUDA children use ``spawn``: CUDA does not survive a fork.
    """
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload([__name__])
    return ctx


class Group:
    """``world_size`` processes running ``target(rank, world_size, send, *args)``."""

    def __init__(
        self, target: Callable[..., Any], world_size: int, *args: Any, method: str = "forkserver"
    ) -> None:
        ctx = _mp_context(method)
        self.queue = ctx.Queue()
        self.inbox: list[tuple[int, str, Any]] = []
        self.procs = [
            ctx.Process(
                target=_child_main, args=(target, r, world_size, self.queue, args), daemon=True
            )
            for r in range(world_size)
        ]
        for p in self.procs:
            p.start()

    def get(self, rank: int, kind: str = "result", timeout: float = 30.0) -> Any:
        """The next message ``kind`` from ``rank``; a child's exception fails the test."""
        deadline = time.monotonic() + timeout
        while True:
            for i, (r, k, payload) in enumerate(self.inbox):
                if r == rank and (k == kind or k == "error"):
                    del self.inbox[i]
                    if k == "error":
                        pytest.fail(f"rank {rank} raised:\n{payload}")
                    return payload
            left = deadline - time.monotonic()
            if left <= 0:
                pytest.fail(f"no {kind!r} from rank {rank} within {timeout}s")
            try:
                self.inbox.append(self.queue.get(timeout=min(left, 0.5)))
            except queue.Empty:
                pass

    def results(self, timeout: float = 30.0) -> list[Any]:
        return [self.get(r, timeout=timeout) for r in range(len(self.procs))]

    def kill(self, rank: int) -> None:
        p = self.procs[rank]
        if p.pid is not None and p.is_alive():
            os.kill(p.pid, signal.SIGKILL)
        p.join(5)

    def close(self) -> None:
        for p in self.procs:
            p.join(timeout=5)
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        self.queue.close()

    def __enter__(self) -> Group:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- child bodies (module level: the children import them by name) ---------------------


def _values(t: torch.Tensor) -> list:
    return t.float().tolist()


def _exercise(comm: Communicator, rank: int, ws: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3) * (rank + 1)
    comm.all_reduce(t)
    out["ar_f32"] = _values(t)

    # bf16 / fp16: small integers are exact in both, so the sums are exact too.
    for name, dtype in (("ar_bf16", torch.bfloat16), ("ar_f16", torch.float16)):
        t = torch.tensor([1.0, 2.0, -3.0, 0.5], dtype=dtype) * (rank + 1)
        comm.all_reduce(t)
        assert t.dtype == dtype
        out[name] = _values(t)

    t = torch.tensor([rank + 1, 10 * (rank + 1)], dtype=torch.int64)
    comm.all_reduce(t)
    out["ar_i64"] = t.tolist()

    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    t = (base * (rank + 1)).t()  # non-contiguous: reduced in place all the same
    comm.all_reduce(t)
    out["ar_noncontig"] = _values(t.t())

    t = torch.arange(6, dtype=torch.float32).reshape(2, 3) + 100 * rank
    g = comm.all_gather(t)
    out["ag_f32"] = (list(g.shape), _values(g))

    t = (torch.arange(4, dtype=torch.float32) + 10 * rank).to(torch.bfloat16).reshape(1, 2, 2)
    g = comm.all_gather(t)
    assert g.dtype == torch.bfloat16
    out["ag_bf16"] = (list(g.shape), _values(g))

    src = ws - 1
    t = torch.full((2, 2), float(rank))
    comm.broadcast(t, src=src)
    out["bc_f32"] = _values(t)
    t = torch.tensor([0.1, 0.2, 0.3], dtype=torch.bfloat16) * (rank + 1)
    comm.broadcast(t, src=0)
    out["bc_bf16"] = _values(t)

    comm.barrier()
    comm.synchronize()  # no-op for gloo, part of the interface
    return out


def _gloo_ops_child(rank: int, ws: int, send: Callable, address: str) -> dict[str, Any]:
    comm = create_communicator("gloo", rank, ws, device=CPU, init_address=address, timeout_s=20)
    assert isinstance(comm, GlooCommunicator)
    assert (comm.rank, comm.world_size) == (rank, ws)
    try:
        return _exercise(comm, rank, ws)
    finally:
        comm.close()


def _gloo_reopen_child(rank: int, ws: int, send: Callable, first: str, second: str) -> dict:
    out: dict[str, Any] = {}
    comm = create_communicator("gloo", rank, ws, device=CPU, init_address=first, timeout_s=20)
    t = torch.ones(3)
    comm.all_reduce(t)
    out["first"] = t.tolist()
    comm.close()
    comm.close()  # idempotent
    with pytest.raises(CommunicatorError, match="closed"):
        comm.all_reduce(torch.ones(1))
    if rank == 0:
        out["port_released"] = _port_is_free(int(first.rsplit(":", 1)[1]))
    # A worker restart reloads the model: a new group in the same process.
    with create_communicator(
        "gloo", rank, ws, device=CPU, init_address=second, timeout_s=20
    ) as comm2:
        t = torch.full((2,), float(rank))
        comm2.all_reduce(t)
        out["second"] = t.tolist()
        comm2.barrier()
    return out


def _gloo_dead_peer_child(rank: int, ws: int, send: Callable, address: str, mode: str) -> Any:
    timeout_s = 3.0
    comm = create_communicator(
        "gloo", rank, ws, device=CPU, init_address=address, timeout_s=timeout_s
    )
    comm.barrier()  # everyone connected
    if rank == 1:
        if mode == "exit":
            os._exit(0)  # dies before the next collective, without closing anything
        send("ready")
        time.sleep(60)  # "hang": never joins; "sigkill": killed by the test meanwhile
        os._exit(0)
    if mode == "exit":
        time.sleep(0.3)  # let the peer die first
    try:
        comm.all_reduce(torch.ones(4))
    except CommunicatorError as e:
        message = str(e)
    else:
        raise AssertionError("all_reduce with a dead peer returned")
    # The communicator is broken from now on, and says so.
    with pytest.raises(CommunicatorError, match="broken") as broken:
        comm.barrier()
    comm.close()
    return {"message": message, "broken": str(broken.value)}


# -- gloo ---------------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [2, 3])
def test_gloo_collectives(world_size: int) -> None:
    with Group(_gloo_ops_child, world_size, _address()) as group:
        results = group.results(timeout=40)
    ws = world_size
    total = sum(range(1, ws + 1))  # sum of (rank + 1)
    for rank, r in enumerate(results):
        ctx = f"rank {rank}"
        assert r["ar_f32"] == (torch.arange(6.0).reshape(2, 3) * total).tolist(), ctx
        expect_small = [v * total for v in (1.0, 2.0, -3.0, 0.5)]
        assert r["ar_bf16"] == expect_small, ctx
        assert r["ar_f16"] == expect_small, ctx
        assert r["ar_i64"] == [total, 10 * total], ctx
        assert r["ar_noncontig"] == (torch.arange(12.0).reshape(3, 4) * total).tolist(), ctx

        shape, values = r["ag_f32"]
        assert shape == [2, 3 * ws], ctx
        expect = torch.cat([torch.arange(6.0).reshape(2, 3) + 100 * k for k in range(ws)], dim=-1)
        assert values == expect.tolist(), ctx
        shape, values = r["ag_bf16"]
        assert shape == [1, 2, 2 * ws], ctx
        expect = torch.cat(
            [(torch.arange(4.0) + 10 * k).reshape(1, 2, 2) for k in range(ws)], dim=-1
        )
        assert values == expect.tolist(), ctx

        assert r["bc_f32"] == [[float(ws - 1)] * 2] * 2, ctx
        bc = torch.tensor([0.1, 0.2, 0.3], dtype=torch.bfloat16).float().tolist()
        assert r["bc_bf16"] == bc, ctx


def test_gloo_close_then_recreate_in_same_process() -> None:
    with Group(_gloo_reopen_child, 2, _address(), _address()) as group:
        results = group.results(timeout=40)
    for r in results:
        assert r["first"] == [2.0, 2.0, 2.0]
        assert r["second"] == [1.0, 1.0]
    assert results[0]["port_released"] is True


@pytest.mark.parametrize("mode", ["exit", "sigkill", "hang"])
def test_gloo_dead_or_hung_peer_raises(mode: str) -> None:
    """exit: peer gone before the collective; sigkill: peer killed while the
    survivor is blocked in it; hang: peer alive but never joins (pure timeout).
    When the error comes is checked on a fake clock below: a failed collective
    at once, a hung one at its timeout."""
    with Group(_gloo_dead_peer_child, 2, _address(), mode) as group:
        if mode != "exit":
            group.get(1, "ready", timeout=30)
        if mode == "sigkill":
            time.sleep(0.5)  # rank 0 is now blocked inside all_reduce
            group.kill(1)
        r = group.get(0, timeout=30)
        group.kill(1)
    assert "all_reduce" in r["message"] and "rank 0" in r["message"], r
    assert "3s" in r["message"], r
    assert "earlier failure" in r["broken"], r  # refused before starting a collective


# -- gloo waits, on a fake clock ----------------------------------------------------------


class _Clock:
    """A monotonic clock that moves only when the code under test waits or sleeps."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


class _FakeWork:
    """A collective that never completes (its peer hangs: each wait() runs out its slice on
    the clock) or, with ``fails_in_wait`` n, fails during the n-th wait (its peer died)."""

    def __init__(self, clock: _Clock, fails_in_wait: int = 0) -> None:
        self.clock, self.fails_in_wait, self.waits = clock, fails_in_wait, 0
        self.on_wait: Callable[[int], None] = lambda waits: None
        self.failed = False

    def wait(self, timeout: timedelta) -> bool:
        self.waits += 1
        self.on_wait(self.waits)
        if self.waits == self.fails_in_wait:
            self.failed = True
            raise RuntimeError("Connection closed by peer")
        self.clock.now += timeout.total_seconds()
        raise RuntimeError("Operation timed out!")

    def is_completed(self) -> bool:
        return self.failed


class _FakeGlooGroup:
    """Stands in for a ProcessGroupGloo: counts the collectives started on it."""

    def __init__(self, work: _FakeWork) -> None:
        self.work, self.started = work, 0

    def allreduce(self, tensors: list) -> _FakeWork:
        self.started += 1
        return self.work

    def barrier(self) -> _FakeWork:
        self.started += 1
        return self.work

    def shutdown(self) -> None:
        pass


def _gloo_over(group: _FakeGlooGroup, timeout_s: float) -> GlooCommunicator:
    """A GlooCommunicator whose process group is ``group`` (no store, no peers)."""
    comm = GlooCommunicator.__new__(GlooCommunicator)
    comm.rank, comm.world_size, comm.device = 0, 2, CPU
    comm.timeout_s = timeout_s
    comm._failure = comm._abort_reason = None
    comm._closed = False
    comm._store = comm._server_store = None
    comm._pg = group
    return comm


def test_gloo_hung_collective_fails_at_its_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = _Clock()
    monkeypatch.setattr(gloo_module, "time", clock)
    work = _FakeWork(clock)
    group = _FakeGlooGroup(work)
    comm = _gloo_over(group, timeout_s=3.0)
    with pytest.raises(CommunicatorError, match=r"all_reduce failed on rank 0/2 \(timeout 3s"):
        comm.all_reduce(torch.ones(4))
    # It waited the whole timeout, in slices short enough to see an abort, and not a slice more.
    assert clock.now == 3.0
    assert work.waits == 3.0 / ABORT_POLL_S
    with pytest.raises(CommunicatorError, match="earlier failure"):
        comm.barrier()
    assert group.started == 1  # the broken communicator refused without starting a collective
    comm.close()


def test_gloo_failed_collective_is_reported_when_it_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = _Clock()
    monkeypatch.setattr(gloo_module, "time", clock)
    comm = _gloo_over(_FakeGlooGroup(_FakeWork(clock, fails_in_wait=3)), timeout_s=30.0)
    with pytest.raises(CommunicatorError, match="Connection closed by peer"):
        comm.all_reduce(torch.ones(4))
    assert clock.now == 2 * ABORT_POLL_S  # the two slices before the failure: not the timeout
    comm.close()


def test_gloo_abort_ends_a_waiting_collective_at_the_next_poll(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = _Clock()
    monkeypatch.setattr(gloo_module, "time", clock)
    work = _FakeWork(clock)
    comm = _gloo_over(_FakeGlooGroup(work), timeout_s=30.0)

    def abort_during_the_second_slice(waits: int) -> None:  # as another thread would
        if waits == 2:
            comm.abort("the gateway gave up")

    work.on_wait = abort_during_the_second_slice
    with pytest.raises(CommunicatorError, match="aborted: the gateway gave up") as info:
        comm.all_reduce(torch.ones(4))
    assert clock.now == 2 * ABORT_POLL_S  # seen right after the slice it arrived in
    assert "timeout" not in str(info.value)  # an abort is not reported as a timeout
    comm.close()


# The timeout marks only stop a hung test: the calls give up after their 1 s timeout_s.
@pytest.mark.timeout(60)
def test_gloo_init_no_store_times_out() -> None:
    address = _address()  # nobody serves it
    with pytest.raises(CommunicatorError, match="could not reach the store") as info:
        create_communicator("gloo", 1, 2, device=CPU, init_address=address, timeout_s=1.0)
    assert address in str(info.value) and "rank 1" in str(info.value)
    assert "timeout 1s" in str(info.value)


@pytest.mark.timeout(60)
def test_gloo_init_missing_peer_times_out_and_frees_port() -> None:
    address = _address()
    with pytest.raises(CommunicatorError, match="rendezvous") as info:
        create_communicator("gloo", 0, 2, device=CPU, init_address=address, timeout_s=1.0)
    assert "rank 0" in str(info.value) and "timeout 1s" in str(info.value)
    assert _port_is_free(int(address.rsplit(":", 1)[1]))


def test_gloo_bad_arguments() -> None:
    with pytest.raises(ValueError, match="init_address"):
        create_communicator("gloo", 0, 2, device=CPU)
    with pytest.raises(ValueError, match="host:port"):
        create_communicator("gloo", 0, 2, device=CPU, init_address="localhost")
    with pytest.raises(ValueError, match="rank"):
        create_communicator("gloo", 2, 2, device=CPU, init_address="127.0.0.1:1")
    with pytest.raises(ValueError, match="backend"):
        create_communicator("mpi", 0, 2, device=CPU, init_address="127.0.0.1:1")


# -- single rank --------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["gloo", "nccl", "single"])
def test_single_rank_ops_are_no_ops(backend: str) -> None:
    comm = create_communicator(backend, 0, 1, device=CPU)
    assert isinstance(comm, SingleRankCommunicator)
    assert (comm.rank, comm.world_size) == (0, 1)
    t = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    before = t.clone()
    comm.all_reduce(t)
    assert torch.equal(t, before)
    assert comm.all_gather(t) is t
    comm.broadcast(t, src=0)
    assert torch.equal(t, before)
    with pytest.raises(ValueError, match="src"):
        comm.broadcast(t, src=1)
    comm.barrier()
    comm.synchronize()
    comm.close()
    comm.close()


# -- NCCL helpers that need no GPU ----------------------------------------------------------


def test_nccl_unique_id_round_trip() -> None:
    signed = tuple(range(-128, 0))  # 128 values, all with the sign bit set
    mixed = tuple((i * 37) % 256 - 128 for i in range(128))
    for uid in (signed, mixed):
        encoded = bytes(v & 0xFF for v in uid)  # what new_nccl_unique_id sends
        assert len(encoded) == 128
        assert unique_id_to_tuple(encoded) == uid
        assert unique_id_to_tuple(encoded, signed=False) == tuple(v & 0xFF for v in uid)
    with pytest.raises(ValueError, match="128"):
        unique_id_to_tuple(b"\0" * 12)


def test_nccl_gather_layout_is_last_dim_concat() -> None:
    ws, shape = 3, (2, 4, 5)
    blocks = torch.stack([torch.randn(shape) for _ in range(ws)])  # NCCL's (W, *shape) output
    out = _blocks_to_last_dim(blocks, shape, ws)
    assert torch.equal(out, torch.cat(list(blocks), dim=-1))
    flat = torch.stack([torch.randn(7) for _ in range(ws)])
    assert torch.equal(_blocks_to_last_dim(flat, (7,), ws), flat.reshape(-1))


@pytest.mark.skipif(HAVE_CUPY, reason="checks the message shown when CuPy is missing")
def test_nccl_without_cupy_says_what_to_install() -> None:
    with pytest.raises(CommunicatorError, match=r"shardlm\[cuda13\]"):
        new_nccl_unique_id()
    with pytest.raises(CommunicatorError, match=r"shardlm\[cuda12\]"):
        create_communicator(
            "nccl", 0, 2, device=torch.device("cuda", 0), nccl_unique_id=b"\0" * 128
        )


# -- NCCL code path against a fake CuPy (runs anywhere) ------------------------------------
#
# CuPy's NcclCommunicator is replaced by a fake that works on CPU memory through
# the same raw pointers, and torch.cuda's stream/event/set_device by fakes, so the
# pointer plumbing, dtype mapping, gather layout, timeout/abort and init-timeout
# logic of NcclCommunicator run on this CPU-only machine.  The fake simulates
# a world of identical peers: all_reduce multiplies by world_size, peer r
# contributes ``x + 1000 * r`` to all_gather, and a broadcast from root writes
# ``root + 42``.


def _cpu_view(ptr: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    nbytes = count * torch.empty((), dtype=dtype).element_size()
    raw = (ctypes.c_uint8 * nbytes).from_address(ptr)
    return torch.frombuffer(raw, dtype=torch.uint8).view(dtype)


class _FakeComm:
    def __init__(self, nccl: _FakeNccl, ndev: int, rank: int) -> None:
        self.nccl, self.ndev, self.rank = nccl, ndev, rank
        self.calls: list[str] = []
        self.aborted = self.destroyed = False
        self.async_error: Exception | None = None

    def _dtype(self, code: int) -> torch.dtype:
        return {
            7: torch.float32,
            6: torch.float16,
            9: torch.bfloat16,
            2: torch.int32,
            4: torch.int64,
        }[code]

    def allReduce(self, send: int, recv: int, count: int, dt: int, op: int, stream: int) -> None:
        assert send == recv and op == 0 and stream == 1234
        self.calls.append("allReduce")
        _cpu_view(recv, count, self._dtype(dt)).mul_(self.ndev)

    def allGather(self, send: int, recv: int, count: int, dt: int, stream: int) -> None:
        self.calls.append("allGather")
        src = _cpu_view(send, count, self._dtype(dt))
        dst = _cpu_view(recv, count * self.ndev, self._dtype(dt))
        for r in range(self.ndev):
            dst[r * count : (r + 1) * count] = src + 1000 * r

    def bcast(self, buf: int, count: int, dt: int, root: int, stream: int) -> None:
        self.calls.append("bcast")
        _cpu_view(buf, count, self._dtype(dt)).fill_(root + 42)

    def check_async_error(self) -> None:
        if self.async_error is not None:
            raise self.async_error

    def abort(self) -> None:
        self.aborted = True

    def destroy(self) -> None:
        self.destroyed = True


class _FakeNccl:
    available = True
    NCCL_INT8, NCCL_UINT8, NCCL_INT32, NCCL_INT64 = 0, 1, 2, 4
    NCCL_FLOAT16, NCCL_FLOAT32, NCCL_FLOAT64 = 6, 7, 8  # no NCCL_BFLOAT16: like old cupy

    def __init__(self, hold_init: bool = False, signed_char: bool = True,
                 bytes_ids: bool = False) -> None:
        """``hold_init``: ncclCommInitRank blocks (a peer that never starts) until
        ``release_init`` is set. ``bytes_ids``: unique ids are bytes, as CuPy 14 has them, not
        tuples of C chars."""
        self.signed_char = signed_char
        self.bytes_ids = bytes_ids
        self.release_init = threading.Event()
        if not hold_init:
            self.release_init.set()
        self.comms: list[_FakeComm] = []
        self.uids: list[tuple[int, ...] | bytes] = []

    def get_unique_id(self) -> tuple[int, ...] | bytes:
        if self.bytes_ids:
            return bytes(range(64, 192))
        return tuple(range(-64, 64))

    def NcclCommunicator(self, ndev: int, uid: tuple | bytes, rank: int) -> _FakeComm:
        # What CuPy's argument parsing does with the other form: a TypeError, before NCCL runs.
        if isinstance(uid, bytes) != self.bytes_ids:
            raise TypeError("Argument 'commId' has incorrect type")
        lo, hi = (-128, 127) if self.signed_char else (0, 255)
        if not self.bytes_ids and not all(lo <= v <= hi for v in uid):
            raise OverflowError("value too large to convert to char")
        self.release_init.wait(timeout=60)  # the bound only stops a hung test
        self.uids.append(uid)
        comm = _FakeComm(self, ndev, rank)
        self.comms.append(comm)
        return comm


class _FakeEvent:
    done = True

    def record(self, stream: Any) -> None:
        pass

    def query(self) -> bool:
        return _FakeEvent.done


@pytest.fixture
def fake_cupy(monkeypatch: pytest.MonkeyPatch) -> Callable[..., _FakeNccl]:
    def install(**kwargs: Any) -> _FakeNccl:
        nccl = _FakeNccl(**kwargs)
        cupy, cuda = types.ModuleType("cupy"), types.ModuleType("cupy.cuda")
        cupy.cuda, cuda.nccl = cuda, nccl  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, "cupy", cupy)
        monkeypatch.setitem(sys.modules, "cupy.cuda", cuda)
        monkeypatch.setitem(sys.modules, "cupy.cuda.nccl", nccl)
        return nccl

    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(
        torch.cuda, "current_stream", lambda device=None: types.SimpleNamespace(cuda_stream=1234)
    )
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(_FakeEvent, "done", True)
    return install


def _fake_comm(world_size: int = 2, timeout_s: float = 5.0, uid: bytes = b"") -> NcclCommunicator:
    comm = create_communicator(
        "nccl",
        0,
        world_size,
        device=torch.device("cuda", 0),
        nccl_unique_id=uid or new_nccl_unique_id(),
        timeout_s=timeout_s,
    )
    assert isinstance(comm, NcclCommunicator)
    comm.device = CPU  # the fake moves CPU memory; tensors must sit on comm.device
    return comm


def test_nccl_fake_ops(fake_cupy: Callable[..., _FakeNccl]) -> None:
    nccl = fake_cupy()
    uid = new_nccl_unique_id()
    assert uid == bytes(v & 0xFF for v in range(-64, 64))
    comm = _fake_comm(uid=uid)
    assert nccl.uids == [tuple(range(-64, 64))]
    fake = nccl.comms[0]

    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64):
        t = torch.arange(6).reshape(2, 3).to(dtype)
        comm.all_reduce(t)
        assert torch.equal(t, (torch.arange(6).reshape(2, 3) * 2).to(dtype)), dtype
    t = torch.arange(12.0).reshape(3, 4).t()  # non-contiguous
    comm.all_reduce(t)
    assert torch.equal(t, torch.arange(12.0).reshape(3, 4).t() * 2)

    x = torch.arange(6.0).reshape(1, 2, 3).to(torch.bfloat16)
    g = comm.all_gather(x)
    assert g.shape == (1, 2, 6) and g.dtype == torch.bfloat16
    assert torch.equal(g, torch.cat([x, x + 1000], dim=-1))
    g = comm.all_gather(torch.arange(4.0).reshape(2, 2).t())  # non-contiguous input
    assert torch.equal(
        g,
        torch.cat([torch.arange(4.0).reshape(2, 2).t()] * 2, -1)
        + torch.tensor([0, 0, 1000, 1000.0]),
    )

    t = torch.zeros(5)
    comm.broadcast(t, src=1)
    assert torch.equal(t, torch.full((5,), 43.0))
    with pytest.raises(ValueError, match="src"):
        comm.broadcast(t, src=2)
    with pytest.raises(ValueError, match="dtype"):
        comm.all_reduce(torch.zeros(2, dtype=torch.complex64))

    comm.barrier()
    comm.synchronize()
    comm.close()
    assert fake.destroyed and not fake.aborted
    assert fake.calls.count("allReduce") == 7 and fake.calls.count("allGather") == 2
    with pytest.raises(CommunicatorError, match="closed"):
        comm.all_reduce(torch.zeros(1))


@pytest.fixture
def nccl_clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    """NcclCommunicator's clock: it moves only when synchronize() sleeps between polls."""
    clock = _Clock()
    monkeypatch.setattr(nccl_module, "time", clock)
    return clock


def test_nccl_fake_synchronize_timeout_aborts(
    fake_cupy: Callable[..., _FakeNccl], nccl_clock: _Clock
) -> None:
    nccl = fake_cupy()
    comm = _fake_comm(timeout_s=0.3)
    comm.all_reduce(torch.ones(3))  # enqueued; the "stream" never drains from here on
    _FakeEvent.done = False
    with pytest.raises(CommunicatorError, match=r"nccl barrier failed on rank 0/2 .*0\.3s") as info:
        comm.barrier()
    # It gave up at the first poll past the deadline (polls are at most 1 ms apart).
    assert 0.3 <= nccl_clock.now < 0.3 + 1e-3
    assert "aborted" in str(info.value)
    assert nccl.comms[0].aborted
    with pytest.raises(CommunicatorError, match="broken"):
        comm.all_reduce(torch.ones(1))
    comm.close()
    assert not nccl.comms[0].destroyed


def test_nccl_fake_async_error_aborts_fast(
    fake_cupy: Callable[..., _FakeNccl], nccl_clock: _Clock
) -> None:
    nccl = fake_cupy()
    comm = _fake_comm(timeout_s=30)
    _FakeEvent.done = False
    nccl.comms[0].async_error = KeyError(6)  # how old cupy reports ncclRemoteError
    with pytest.raises(CommunicatorError, match="NCCL error code 6"):
        comm.synchronize()
    assert nccl_clock.now == 0.0  # seen at the first poll, before any wait
    assert nccl.comms[0].aborted


def test_nccl_fake_init_timeout(fake_cupy: Callable[..., _FakeNccl]) -> None:
    nccl = fake_cupy(hold_init=True)
    with pytest.raises(CommunicatorError, match=r"nccl init: rank 0/2 .*timed out after 0\.2s"):
        _fake_comm(timeout_s=0.2)
    assert not nccl.comms  # it gave up while ncclCommInitRank was still blocked
    nccl.release_init.set()  # the peer finally shows up
    deadline = time.monotonic() + 30  # the bound only stops a hung test
    while not nccl.comms and time.monotonic() < deadline:
        time.sleep(0.01)
    assert nccl.comms and nccl.comms[0].aborted  # the late communicator was freed


def test_nccl_fake_unsigned_char_platform(fake_cupy: Callable[..., _FakeNccl]) -> None:
    nccl = fake_cupy(signed_char=False)
    uid = bytes(range(128, 256))
    comm = _fake_comm(uid=uid)
    assert nccl.uids == [tuple(range(128, 256))]
    comm.close()


def test_nccl_fake_cupy_14_takes_bytes(fake_cupy: Callable[..., _FakeNccl]) -> None:
    nccl = fake_cupy(bytes_ids=True)
    uid = new_nccl_unique_id()
    assert uid == bytes(range(64, 192))
    comm = _fake_comm(uid=uid)
    assert nccl.uids == [uid]
    comm.close()


# -- NCCL on a GPU (skipped without CUDA + CuPy) --------------------------------------------

needs_nccl = pytest.mark.skipif(not HAVE_NCCL, reason="needs CUDA and CuPy with NCCL")


@pytest.mark.cuda
@needs_nccl
def test_nccl_single_rank_through_cupy() -> None:
    dev = torch.device("cuda", 0)
    comm = NcclCommunicator(0, 1, device=dev, unique_id=new_nccl_unique_id(), timeout_s=10)
    try:
        for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int64):
            t = torch.arange(6, device=dev).reshape(2, 3).to(dtype)
            before = t.clone()
            comm.all_reduce(t)
            g = comm.all_gather(t)
            comm.broadcast(t, src=0)
            comm.synchronize()
            assert torch.equal(t, before) and torch.equal(g, before), dtype
        comm.barrier()
    finally:
        comm.close()


def _nccl_ops_child(rank: int, ws: int, send: Callable, uid: bytes) -> dict[str, Any]:
    dev = torch.device("cuda", rank)
    comm = create_communicator("nccl", rank, ws, device=dev, nccl_unique_id=uid, timeout_s=30)
    try:
        out: dict[str, Any] = {}
        for name, dtype in (
            ("f32", torch.float32),
            ("bf16", torch.bfloat16),
            ("f16", torch.float16),
        ):
            t = torch.tensor([1.0, 2.0, -3.0, 0.5], dtype=dtype, device=dev) * (rank + 1)
            comm.all_reduce(t)
            g = comm.all_gather(torch.arange(6.0, device=dev).reshape(2, 3).to(dtype) + 100 * rank)
            b = torch.full((3,), float(rank), dtype=dtype, device=dev)
            comm.broadcast(b, src=ws - 1)
            comm.synchronize()
            out[name] = (_values(t.cpu()), list(g.shape), _values(g.cpu()), _values(b.cpu()))
        comm.barrier()
        return out
    finally:
        comm.close()


def _nccl_dead_peer_child(rank: int, ws: int, send: Callable, uid: bytes) -> Any:
    dev = torch.device("cuda", rank)
    comm = create_communicator("nccl", rank, ws, device=dev, nccl_unique_id=uid, timeout_s=3)
    comm.barrier()
    if rank == 1:
        os._exit(0)
    time.sleep(0.5)
    with pytest.raises(CommunicatorError) as info:
        comm.all_reduce(torch.ones(1024, device=dev))
        comm.synchronize()
    comm.close()
    return {"message": str(info.value)}


# NCCL refuses two ranks of one communicator on the same GPU ("Duplicate GPU
# detected"), so the multi-rank tests need one GPU per rank.
needs_two_gpus = pytest.mark.skipif(
    not HAVE_NCCL or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs and CuPy"
)


@pytest.mark.cuda
@needs_two_gpus
def test_nccl_two_ranks() -> None:
    with Group(_nccl_ops_child, 2, new_nccl_unique_id(), method="spawn") as group:
        results = group.results(timeout=120)
    for r in results:
        for name in ("f32", "bf16", "f16"):
            reduced, shape, gathered, bcast = r[name]
            assert reduced == [3.0, 6.0, -9.0, 1.5], name
            assert shape == [2, 6], name
            expect = torch.cat([torch.arange(6.0).reshape(2, 3) + 100 * k for k in range(2)], -1)
            assert gathered == expect.tolist(), name
            assert bcast == [1.0, 1.0, 1.0], name


@pytest.mark.cuda
@needs_two_gpus
def test_nccl_dead_peer_raises() -> None:
    with Group(_nccl_dead_peer_child, 2, new_nccl_unique_id(), method="spawn") as group:
        r = group.get(0, timeout=120)
        with contextlib.suppress(Exception):
            group.kill(1)
    assert "rank 0" in r["message"] and "timeout 3s" in r["message"], r
