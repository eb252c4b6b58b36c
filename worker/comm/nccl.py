"""GPU tensor parallelism over NCCL, through CuPy's NCCL bindings.

Collectives run on torch CUDA tensors (by ``data_ptr``) on torch's *current*
CUDA stream, so they are ordered with the surrounding model kernels and need no
extra synchronisation.

Timeout model
-------------
NCCL collectives are asynchronous: ``all_reduce``/``all_gather``/``broadcast``
only enqueue work on the stream and return at once, with no per-op host cost.
A dead or hung peer therefore cannot be seen at the call; it shows up as a
stream that never drains.  Detection happens in :meth:`NcclCommunicator.synchronize`
(and in :meth:`barrier`, which is an all_reduce of one element followed by
``synchronize``): it records a CUDA event on the current stream and polls
``event.query()`` (sleeping 20 us, growing to 1 ms) while also polling NCCL's
asynchronous error state, until the event completes or the deadline passes.
On the deadline or an NCCL async error it calls ``ncclCommAbort`` (which makes
the stuck NCCL kernels exit) and raises :class:`CommunicatorError`.

The engine must therefore call ``comm.synchronize()`` once per step, *before*
anything that blocks the host on the stream (``.item()``, ``.cpu()``,
``torch.cuda.synchronize()``): those would otherwise wait forever on a
collective whose peer is gone.

Set-up is bounded too: ``ncclCommInitRank`` blocks until every rank joined, so
it runs on a helper thread and the constructor gives up after ``timeout_s``
(the helper, if it ever finishes, aborts the communicator it created).

Across hosts: the unique id that rank 0 creates carries the address of rank
0's bootstrap socket, which NCCL picks on rank 0's host (``NCCL_SOCKET_IFNAME``
names the interface, as it does for every rank's own sockets; NCCL's ports are
ephemeral).  The gateway only relays the id, so nothing host-specific is chosen
anywhere else.

cupy is imported lazily: importing this module never needs it.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

from .base import (
    Communicator,
    CommunicatorError,
    check_gather_input,
    check_rank,
)

NCCL_UNIQUE_ID_BYTES = 128
_NCCL_SUM = 0  # ncclSum
_NCCL_BFLOAT16 = 9  # ncclBfloat16, for cupy builds that lack the constant
_INSTALL_HINT = "install shardlm[cuda13] or shardlm[cuda12] (CuPy with NCCL)"


def _import_nccl() -> Any:
    try:
        from cupy.cuda import nccl  # type: ignore[import-not-found]
    except Exception as e:  # ImportError, or a CUDA/NCCL library load error
        raise CommunicatorError(f"NCCL backend unavailable: {_INSTALL_HINT}: {e}") from None
    if not getattr(nccl, "available", True):
        raise CommunicatorError(
            f"NCCL backend unavailable: CuPy was built without NCCL; {_INSTALL_HINT}"
        )
    return nccl


def new_nccl_unique_id() -> bytes:
    """A fresh NCCL unique id (128 bytes) for rank 0 to hand to the other ranks."""
    nccl = _import_nccl()
    try:
        uid = nccl.get_unique_id()
    except Exception as e:
        raise CommunicatorError(f"nccl get_unique_id failed: {e}") from None
    if len(uid) != NCCL_UNIQUE_ID_BYTES:
        raise CommunicatorError(
            f"nccl unique id has {len(uid)} bytes, expected {NCCL_UNIQUE_ID_BYTES}"
        )
    # cupy returns the C `char`s as Python ints: -128..127 where char is signed
    # (x86-64), 0..255 where it is unsigned (aarch64).  Bytes are unsigned.
    return bytes(v & 0xFF for v in uid)


def unique_id_to_tuple(data: bytes, *, signed: bool = True) -> tuple[int, ...]:
    """Inverse of :func:`new_nccl_unique_id`'s encoding, as cupy wants it."""
    if len(data) != NCCL_UNIQUE_ID_BYTES:
        raise ValueError(f"nccl unique id must be {NCCL_UNIQUE_ID_BYTES} bytes, got {len(data)}")
    if signed:
        return tuple(b - 256 if b >= 128 else b for b in data)
    return tuple(data)


def unique_id_forms(data: bytes) -> list[Any]:
    """The forms CuPy's ``NcclCommunicator`` has taken a unique id in, the newest first: bytes
    (CuPy 14), then a tuple of C chars, signed where char is (x86-64) or unsigned (aarch64).
    A form CuPy does not take fails its argument parsing (TypeError, OverflowError) before NCCL
    is called, so the next one can be tried."""
    return [bytes(data), unique_id_to_tuple(data), unique_id_to_tuple(data, signed=False)]


def _nccl_dtypes(nccl: Any) -> dict[torch.dtype, int]:
    return {
        torch.float32: nccl.NCCL_FLOAT32,
        torch.float16: nccl.NCCL_FLOAT16,
        torch.bfloat16: getattr(nccl, "NCCL_BFLOAT16", _NCCL_BFLOAT16),
        torch.int32: nccl.NCCL_INT32,
        torch.int64: nccl.NCCL_INT64,
        torch.float64: nccl.NCCL_FLOAT64,
        torch.int8: nccl.NCCL_INT8,
        torch.uint8: nccl.NCCL_UINT8,
    }


class NcclCommunicator(Communicator):
    """Collectives over NCCL for CUDA tensors on ``device``.

    Ops are asynchronous on the current stream; see the module docstring for
    the ``synchronize()`` contract that bounds them in time.
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        *,
        device: torch.device | str | int,
        unique_id: bytes,
        timeout_s: float = 30.0,
    ) -> None:
        check_rank(rank, world_size)
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = float(timeout_s)
        self._comm: Any = None
        self._failure: str | None = None
        self._abort_reason: str | None = None
        self._closed = False

        nccl = _import_nccl()
        self._nccl = nccl
        dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        if dev.type != "cuda":
            raise ValueError(f"NCCL communicator needs a CUDA device, got {dev}")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        self.device = dev
        torch.cuda.set_device(dev)
        self._dtypes = _nccl_dtypes(nccl)
        self._barrier_buf: torch.Tensor | None = None  # allocated by the first barrier()
        self._comm = self._init_comm(unique_id_forms(unique_id))

    # -- set-up -----------------------------------------------------------------

    def _init_comm(self, uid_forms: list[Any]) -> Any:
        nccl = self._nccl
        index = self.device.index
        state: dict[str, Any] = {"comm": None, "error": None, "abandoned": False}
        lock = threading.Lock()

        def init() -> None:
            comm = None
            error = None
            try:
                torch.cuda.set_device(index)  # the current device is per thread
                for i, uid in enumerate(uid_forms):
                    try:
                        comm = nccl.NcclCommunicator(self.world_size, uid, self.rank)
                        break
                    except (TypeError, OverflowError):
                        if i == len(uid_forms) - 1:
                            raise
            except Exception as e:  # reported to the caller below
                error = f"{type(e).__name__}: {e}"
            with lock:
                if state["abandoned"] and comm is not None:
                    _quiet(comm.abort)  # the caller gave up on us; free it
                    return
                state["comm"], state["error"] = comm, error

        thread = threading.Thread(target=init, name=f"nccl-init-rank{self.rank}", daemon=True)
        thread.start()
        thread.join(self.timeout_s)
        with lock:
            if thread.is_alive():
                state["abandoned"] = True
                raise CommunicatorError(
                    f"nccl init: rank {self.rank}/{self.world_size} on {self.device} timed out "
                    f"after {self.timeout_s:g}s waiting for the other ranks "
                    "(a peer did not start, or the unique ids differ)"
                )
            if state["error"] is not None:
                raise CommunicatorError(
                    f"nccl init failed on rank {self.rank}/{self.world_size} ({self.device}): "
                    f"{state['error']}"
                )
            return state["comm"]

    # -- plumbing ---------------------------------------------------------------

    def _comm_or_raise(self, op: str) -> Any:
        if self._failure is not None:
            raise CommunicatorError(
                f"nccl {op} on rank {self.rank}: communicator is broken by an earlier "
                f"failure ({self._failure}); close it and create a new one"
            )
        if self._closed or self._comm is None:
            raise CommunicatorError(f"nccl {op} on rank {self.rank}: communicator is closed")
        return self._comm

    def _fail(self, op: str, why: str) -> CommunicatorError:
        """Abort the communicator (unblocks stuck kernels) and build the error."""
        self._failure = f"{op}: {why}"
        comm, self._comm = self._comm, None
        if comm is not None:
            _quiet(comm.abort)
        return CommunicatorError(
            f"nccl {op} failed on rank {self.rank}/{self.world_size} ({self.device}, "
            f"timeout {self.timeout_s:g}s): {why}; communicator aborted"
        )

    def _dtype(self, op: str, tensor: torch.Tensor) -> int:
        if tensor.device != self.device:
            raise ValueError(
                f"nccl {op}: tensor is on {tensor.device}, communicator on {self.device}"
            )
        try:
            return self._dtypes[tensor.dtype]
        except KeyError:
            raise ValueError(f"nccl {op}: unsupported dtype {tensor.dtype}") from None

    def _launch(self, op: str, fn: Any, *args: Any) -> None:
        err = ""
        try:
            fn(*args)
        except Exception as e:
            err = _describe(e)
        if err:
            raise self._fail(op, err)

    def _stream(self) -> int:
        return torch.cuda.current_stream(self.device).cuda_stream

    # -- collectives (asynchronous: see synchronize) ---------------------------

    def all_reduce(self, tensor: torch.Tensor) -> None:
        comm = self._comm_or_raise("all_reduce")
        dtype = self._dtype("all_reduce", tensor)
        if tensor.numel() == 0:
            return
        buf = tensor if tensor.is_contiguous() else tensor.contiguous()
        ptr = buf.data_ptr()
        self._launch(
            "all_reduce", comm.allReduce, ptr, ptr, buf.numel(), dtype, _NCCL_SUM, self._stream()
        )
        if buf is not tensor:
            tensor.copy_(buf)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        check_gather_input(tensor)
        comm = self._comm_or_raise("all_gather")
        dtype = self._dtype("all_gather", tensor)
        shape = tuple(tensor.shape)
        # NCCL writes rank blocks one after another: out[r] is rank r's tensor.
        out = torch.empty((self.world_size, *shape), dtype=tensor.dtype, device=tensor.device)
        if tensor.numel() > 0:
            buf = tensor if tensor.is_contiguous() else tensor.contiguous()
            self._launch(
                "all_gather",
                comm.allGather,
                buf.data_ptr(),
                out.data_ptr(),
                buf.numel(),
                dtype,
                self._stream(),
            )
        return _blocks_to_last_dim(out, shape, self.world_size)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        self._check_src(src)
        comm = self._comm_or_raise("broadcast")
        dtype = self._dtype("broadcast", tensor)
        if tensor.numel() == 0:
            return
        buf = tensor if tensor.is_contiguous() else tensor.contiguous()
        self._launch(
            "broadcast", comm.bcast, buf.data_ptr(), buf.numel(), dtype, src, self._stream()
        )
        if buf is not tensor:
            tensor.copy_(buf)

    def barrier(self) -> None:
        """All-reduce one element, then :meth:`synchronize` (bounded by timeout_s)."""
        comm = self._comm_or_raise("barrier")
        if self._barrier_buf is None:
            self._barrier_buf = torch.zeros(1, dtype=torch.float32, device=self.device)
        buf = self._barrier_buf
        ptr = buf.data_ptr()
        self._launch(
            "barrier",
            comm.allReduce,
            ptr,
            ptr,
            1,
            self._dtypes[torch.float32],
            _NCCL_SUM,
            self._stream(),
        )
        self.synchronize(op="barrier")

    def synchronize(self, timeout_s: float | None = None, *, op: str = "synchronize") -> None:
        """Wait (bounded) until the collectives enqueued on the current stream finished.

        Raises CommunicatorError, after aborting the NCCL communicator, when they
        do not finish within ``timeout_s`` (default: the communicator's) or NCCL
        reports an asynchronous error (e.g. a peer's connection dropped).
        """
        comm = self._comm_or_raise(op)
        timeout = self.timeout_s if timeout_s is None else float(timeout_s)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        if event.query():  # common case when the step already waited on the GPU
            return
        deadline = time.monotonic() + timeout
        pause = 20e-6
        while not event.query():
            err = ""
            try:
                comm.check_async_error()
            except Exception as e:
                err = f"NCCL asynchronous error: {_describe(e)}"
            if self._abort_reason is not None:
                err = f"aborted: {self._abort_reason}"
            if err:
                raise self._fail(op, err)
            if time.monotonic() >= deadline:
                raise self._fail(
                    op,
                    f"collectives did not complete within {timeout:g}s (peer dead or hung?)",
                )
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)

    def abort(self, reason: str) -> None:
        """Seen by a waiting :meth:`synchronize` at its next poll, which aborts the NCCL
        communicator there (on the thread that owns the stream)."""
        self._abort_reason = reason

    def close(self) -> None:
        if self._closed:
            return
        if self._comm is not None and self._failure is None:
            # Let in-flight collectives drain (bounded): ncclCommDestroy would
            # wait for them without a timeout.  On failure synchronize aborts.
            try:
                self.synchronize(op="close")
            except CommunicatorError:
                pass
        self._closed = True
        comm, self._comm = self._comm, None
        if comm is not None:
            _quiet(comm.destroy if self._failure is None else comm.abort)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


def _blocks_to_last_dim(
    blocks: torch.Tensor, shape: tuple[int, ...], world_size: int
) -> torch.Tensor:
    """NCCL's all_gather output ``(W, *shape)`` -> ranks concatenated along the last dim.

    (W, ..., D) -> (..., W, D) -> (..., W*D).  A view, no copy, when the leading
    dims are all 1 (e.g. a single decode token).
    """
    return blocks.movedim(0, -2).reshape(*shape[:-1], world_size * shape[-1])


def _describe(e: Exception) -> str:
    # Older cupy builds NcclError's message from a table that lacks the newer
    # result codes (ncclRemoteError = 6, ...), so the error comes out as KeyError.
    if isinstance(e, KeyError) and e.args and isinstance(e.args[0], int):
        return f"NCCL error code {e.args[0]}"
    return f"{type(e).__name__}: {e}"


def _quiet(fn: Any) -> None:
    try:
        fn()
    except Exception:
        pass
