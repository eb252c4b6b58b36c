"""CPU tensor parallelism over torch.distributed's gloo backend.

Each communicator owns a private ``ProcessGroupGloo`` built on a private
``TCPStore`` (rank 0 serves it at ``init_address``; the other ranks connect), so
it never touches torch.distributed's global default group: several
communicators can live in one process, across hosts, and a closed one can be
replaced by a new one in the same process.

Rendezvous across hosts: rank 0 opens the store itself (:func:`open_store`,
listening on every interface, port 0 = a free one, which only rank 0's host can
pick) and reports the address the other ranks dial; nothing is bound on one
host on behalf of another.  Each rank's gloo connections use the interface
named by ``GLOO_SOCKET_IFNAME``, else the one on its route to the store host.

Timeouts: ``timeout_s`` bounds the store connection, the process-group
rendezvous and every collective.  A peer that died closes its sockets, so the
survivor's collective fails at once; a peer that hangs makes it fail after
``timeout_s``; :meth:`GlooCommunicator.abort` (another thread) makes it fail
within ``ABORT_POLL_S``.  Either way the caller gets :class:`CommunicatorError`.
A gloo group cannot be destroyed while a collective of it is still pending in
gloo (the destructor waits for it to time out), so a failed group is let go on
a helper thread; rank 0's store is a separate object, closed at once, so its
port is free for the next group.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from .base import (
    Communicator,
    CommunicatorError,
    check_gather_input,
    check_rank,
)

# Dtypes that gloo reduces natively on every torch version we support.  bf16 is
# missing on older torch (pytorch#111131: "Invalid scalar type"), so all_reduce
# upcasts bf16 to float32, sums, and copies the result back (which is also the
# more accurate sum).  all_gather/broadcast only move bytes, so bf16 travels
# bit-for-bit viewed as float16 there.
_REDUCE_NATIVE = frozenset(
    {torch.float32, torch.float64, torch.float16, torch.int32, torch.int64, torch.int8, torch.uint8}
)
_MOVE_AS = {torch.bfloat16: torch.float16, torch.bool: torch.uint8}
# How often a waiting collective checks whether the group was aborted.
ABORT_POLL_S = 0.25


def parse_address(address: str, *, allow_port_zero: bool = False) -> tuple[str, int]:
    """``"host:port"`` (or ``"[v6addr]:port"``) -> (host, port); port 0 only where
    ``allow_port_zero`` (a store about to be opened on a free port)."""
    host, sep, port_s = address.rpartition(":")
    if not sep or not host or not port_s.isdigit():
        raise ValueError(f"gloo init_address must be 'host:port', got {address!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    port = int(port_s)
    if not (0 if allow_port_zero else 1) <= port < 65536:
        raise ValueError(f"gloo init_address port out of range: {address!r}")
    return host, port


def _local_address_towards(host: str, port: int) -> str:
    """The local IP address this host uses to reach ``host`` ('' if unknown).

    Gloo's default device resolves this machine's hostname, which inside
    containers often maps to nothing routable; binding to the address on the
    route to the store host works on one machine and across machines alike.
    A UDP connect sends no packet, it only picks the route.
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    except OSError:
        return ""
    for family, type_, proto, _, sockaddr in infos:
        try:
            with socket.socket(family, type_, proto) as s:
                s.connect(sockaddr)
                return str(s.getsockname()[0])
        except OSError:
            continue
    return ""


def format_address(host: str, port: int) -> str:
    """(host, port) -> ``"host:port"``, with an IPv6 address in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def open_store(
    init_address: str, world_size: int, *, timeout_s: float = 30.0
) -> tuple[dist.TCPStore, str]:
    """Rank 0: serve the rendezvous store and return it with the address to dial.

    ``init_address`` is ``"host:port"``: the store listens on every interface
    at ``port`` (0 picks a free one) and the returned address is ``host`` with
    the port actually bound, so the other ranks can be told where to go before
    rank 0 blocks in the rendezvous.  Pass the store to
    :class:`GlooCommunicator` (``store=``).
    """
    host, port = parse_address(init_address, allow_port_zero=True)
    try:
        store = dist.TCPStore(
            host,
            port,
            world_size,
            is_master=True,
            timeout=timedelta(seconds=timeout_s),
            wait_for_workers=False,
        )
    except Exception as e:  # RuntimeError / DistStoreError / DistNetworkError
        raise CommunicatorError(
            f"gloo init (rank 0/{world_size}): could not serve the store on port {port}: "
            f"{type(e).__name__}: {e}"
        ) from None
    return store, format_address(host, store.port)


def _release(holder: list[dist.ProcessGroupGloo]) -> None:
    """Shut down and drop the last reference to a group (closes its gloo sockets)."""
    pg = holder.pop()
    try:
        pg.shutdown()
    except Exception:  # older torch without shutdown(), or already broken
        pass
    del pg


class GlooCommunicator(Communicator):
    """Collectives over gloo for CPU tensors (other devices are staged via CPU)."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        *,
        init_address: str,
        timeout_s: float = 30.0,
        device: torch.device | str = "cpu",
        store: dist.TCPStore | None = None,
    ) -> None:
        """``store``: on rank 0, the store :func:`open_store` opened at
        ``init_address``; without it rank 0 opens one itself."""
        check_rank(rank, world_size)
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.rank = rank
        self.world_size = world_size
        self.device = torch.device(device)
        self.timeout_s = float(timeout_s)
        self._timeout = timedelta(seconds=self.timeout_s)
        self._failure: str | None = None
        self._abort_reason: str | None = None
        self._closed = False
        self._store: dist.Store | None = None
        self._server_store: dist.TCPStore | None = None  # rank 0: the listening store
        self._pg: dist.ProcessGroupGloo | None = None

        host, port = parse_address(init_address)
        who = f"gloo init (rank {rank}/{world_size}, store {init_address}, timeout {self.timeout_s:g}s)"
        err = ""
        if store is not None and rank != 0:
            raise ValueError("only rank 0 serves the store; the other ranks dial init_address")
        try:
            if rank == 0:
                # The group talks to the store through a client of its own, so that closing
                # the listening store frees the port even while a failed group lingers.
                self._server_store = store or dist.TCPStore(
                    host,
                    port,
                    world_size,
                    is_master=True,
                    timeout=self._timeout,
                    wait_for_workers=False,
                )
            # Rank 0 dials its own store on loopback (it listens on every interface): the
            # advertised host may be an address only the other hosts can reach.
            store_host, store_port = (
                ("127.0.0.1", self._server_store.port) if rank == 0 else (host, port)
            )
            self._store = dist.TCPStore(
                store_host, store_port, world_size, is_master=False, timeout=self._timeout
            )
        except Exception as e:  # RuntimeError / DistStoreError / DistNetworkError
            action = "could not serve the store" if rank == 0 else "could not reach the store"
            err = f"{who}: {action}: {type(e).__name__}: {e}"
        if err:
            self._server_store = None
            raise CommunicatorError(err)
        try:
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = self._timeout
            opts._devices = [self._make_device(host, port)]
            # Prefixed keys never collide with anything else put into the store.
            self._pg = dist.ProcessGroupGloo(
                dist.PrefixStore("shardlm/tp/", self._store), rank, world_size, opts
            )
        except Exception as e:
            err = (
                f"{who}: process-group rendezvous failed (a peer did not join in time?): "
                f"{type(e).__name__}: {e}"
            )
        if err:
            self._store = self._server_store = None  # releases the port on rank 0
            raise CommunicatorError(err)

    @staticmethod
    def _make_device(host: str, port: int) -> object:
        ifname = os.environ.get("GLOO_SOCKET_IFNAME", "")
        if ifname:
            return dist.ProcessGroupGloo.create_device(interface=ifname.split(",")[0])
        local = _local_address_towards(host, port)
        if local:
            return dist.ProcessGroupGloo.create_device(hostname=local)
        return dist.ProcessGroupGloo.create_default_device()

    # -- plumbing ---------------------------------------------------------------

    def _pg_or_raise(self, op: str) -> dist.ProcessGroupGloo:
        if self._closed or self._pg is None:
            raise CommunicatorError(f"gloo {op} on rank {self.rank}: communicator is closed")
        if self._failure is not None or self._abort_reason is not None:
            why = self._failure or f"aborted: {self._abort_reason}"
            raise CommunicatorError(
                f"gloo {op} on rank {self.rank}: communicator is broken by an earlier "
                f"failure ({why}); close it and create a new one"
            )
        return self._pg

    def _wait(self, op: str, start: Callable[[dist.ProcessGroupGloo], dist.Work]) -> None:
        pg: dist.ProcessGroupGloo | None = self._pg_or_raise(op)
        work = None
        err = ""
        try:
            work = start(pg)
            err = self._wait_for(work)
        except Exception as e:  # gloo raises RuntimeError / DistBackendError
            err = f"{type(e).__name__}: {e}"
        finally:
            # Drop Work and group references before raising: a traceback that
            # keeps them alive would pin the group's sockets (and the store's
            # port) for as long as the caller holds on to the exception.
            work = pg = None
        if err:
            self._failure = f"{op}: {err}"
            why = "" if self._abort_reason else f" (timeout {self.timeout_s:g}s; peer dead or hung?)"
            raise CommunicatorError(
                f"gloo {op} failed on rank {self.rank}/{self.world_size}{why}: {err}"
            )

    def _wait_for(self, work: dist.Work) -> str:
        """Wait for ``work`` in slices (a slice that ends first raises, and the collective goes
        on), so that an abort is seen; '' when it completed, else why not."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            left = deadline - time.monotonic()
            try:
                if work.wait(timedelta(seconds=max(min(ABORT_POLL_S, left), 0.001))) is False:
                    return "wait() reported a timeout"
                return ""
            except Exception as e:  # a failed collective, or only this slice ended
                if work.is_completed() or left <= ABORT_POLL_S:
                    return f"{type(e).__name__}: {e}"
            if self._abort_reason is not None:
                return f"aborted: {self._abort_reason}"

    def abort(self, reason: str) -> None:
        self._abort_reason = reason

    def _stage(self, tensor: torch.Tensor, wire_dtype: torch.dtype) -> torch.Tensor:
        """A contiguous CPU tensor of ``wire_dtype`` holding ``tensor``'s data.

        Returns ``tensor`` itself when it already qualifies (the common case).
        """
        if tensor.device.type == "cpu" and tensor.is_contiguous():
            if tensor.dtype == wire_dtype:
                return tensor
            if _MOVE_AS.get(tensor.dtype) == wire_dtype:
                return tensor.view(wire_dtype)
        if _MOVE_AS.get(tensor.dtype) == wire_dtype:
            return tensor.to("cpu").contiguous().view(wire_dtype)
        return tensor.to(device="cpu", dtype=wire_dtype).contiguous()

    @staticmethod
    def _unstage(buf: torch.Tensor, tensor: torch.Tensor) -> None:
        """Copy ``buf`` back into ``tensor`` unless they share storage already."""
        if buf.data_ptr() == tensor.data_ptr() and buf.device == tensor.device:
            return
        if buf.dtype != tensor.dtype and _MOVE_AS.get(tensor.dtype) == buf.dtype:
            buf = buf.view(tensor.dtype)
        tensor.copy_(buf)

    # -- collectives --------------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor) -> None:
        wire = tensor.dtype if tensor.dtype in _REDUCE_NATIVE else torch.float32
        buf = self._stage(tensor, wire)
        self._wait("all_reduce", lambda pg: pg.allreduce([buf]))
        self._unstage(buf, tensor)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        check_gather_input(tensor)
        wire = _MOVE_AS.get(tensor.dtype, tensor.dtype)
        buf = self._stage(tensor, wire)
        outs = [torch.empty_like(buf) for _ in range(self.world_size)]
        self._wait("all_gather", lambda pg: pg.allgather([outs], [buf]))
        out = torch.cat(outs, dim=-1)
        if out.dtype != tensor.dtype:
            out = out.view(tensor.dtype)
        return out if out.device == tensor.device else out.to(tensor.device)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        self._check_src(src)
        wire = _MOVE_AS.get(tensor.dtype, tensor.dtype)
        buf = self._stage(tensor, wire)
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        self._wait("broadcast", lambda pg: pg.broadcast([buf], opts))
        if self.rank != src:
            self._unstage(buf, tensor)

    def barrier(self) -> None:
        self._wait("barrier", lambda pg: pg.barrier())

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        pg, self._pg = self._pg, None
        self._store = self._server_store = None  # the store's port is free from here on
        if pg is None:
            return
        holder = [pg]
        del pg  # the holder keeps the last reference
        if self._failure is not None:
            # A collective may still be pending in gloo: destroying the group waits for it.
            threading.Thread(
                target=_release, args=(holder,), name="gloo-release", daemon=True
            ).start()
        else:
            _release(holder)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
