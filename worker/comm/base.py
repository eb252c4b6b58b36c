"""Communicator interface shared by the tensor-parallel backends.

The model layers only ever see :class:`Communicator`.  Semantics common to every
backend:

* ``all_reduce(t)``: in-place elementwise sum over all ranks.
* ``all_gather(t)``: returns a new tensor, the ranks' tensors concatenated along
  the LAST dimension in rank order (every rank must pass the same shape).
* ``broadcast(t, src)``: in place; afterwards every rank holds ``src``'s values.
* ``barrier()``: returns once every rank has reached it (bounded by the timeout).
* ``synchronize(timeout_s=None)``: returns once every collective issued so far by
  this rank has completed.  For the synchronous backends (single rank, gloo) it
  is a no-op; for NCCL the collectives are only *enqueued* on the current CUDA
  stream and this is where a dead or hung peer is detected (see ``nccl.py``).
  The engine calls it once per step, before it reads results back to the host.
* ``close()``: releases everything (sockets, ports, NCCL communicator).
  Idempotent; a new communicator can be created in the same process afterwards.

Failures at run time (timeout, dead peer, init failure, use after failure) raise
:class:`CommunicatorError`.  A communicator that raised from a collective is
broken: every later collective raises too; close it and create a new one.
Programming errors (bad rank, bad ``src``, mismatched arguments) raise
``ValueError``.
"""

from __future__ import annotations

import abc

import torch


class CommunicatorError(RuntimeError):
    """A collective or the communicator set-up failed (timeout, dead peer, init)."""


class Communicator(abc.ABC):
    """Collective operations over the ranks of one tensor-parallel group."""

    rank: int
    world_size: int

    @abc.abstractmethod
    def all_reduce(self, tensor: torch.Tensor) -> None:
        """In-place sum of ``tensor`` over all ranks."""

    @abc.abstractmethod
    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenation of every rank's ``tensor`` along the last dim, rank order."""

    @abc.abstractmethod
    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """In place: copy ``src``'s ``tensor`` into every rank's ``tensor``."""

    @abc.abstractmethod
    def barrier(self) -> None:
        """Block until every rank reached the barrier (bounded by the timeout)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the group's resources.  Safe to call more than once."""

    def synchronize(self, timeout_s: float | None = None) -> None:  # noqa: B027
        """Wait until this rank's issued collectives are complete.

        No-op for synchronous backends; overridden by asynchronous ones (NCCL).
        """

    def abort(self, reason: str) -> None:  # noqa: B027
        """Give up on this group, from any thread: a collective waiting for a peer (one whose
        request never came, on a host cut off the network) fails with CommunicatorError within
        a fraction of a second instead of at the timeout, and so does every later one. The
        caller then closes the communicator and makes a new one. No-op without peers.
        """

    # -- helpers shared by the implementations ---------------------------------

    def _check_src(self, src: int) -> None:
        if not 0 <= src < self.world_size:
            raise ValueError(f"broadcast src={src} out of range for world_size={self.world_size}")

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.rank}, world_size={self.world_size})"


def check_rank(rank: int, world_size: int) -> None:
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} out of range for world_size {world_size}")


def check_gather_input(tensor: torch.Tensor) -> None:
    if tensor.dim() == 0:
        raise ValueError("all_gather needs a tensor with at least one dimension")


class SingleRankCommunicator(Communicator):
    """world_size == 1: every collective is the identity, with no overhead."""

    def __init__(self) -> None:
        self.rank = 0
        self.world_size = 1

    def all_reduce(self, tensor: torch.Tensor) -> None:
        return None

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        if src != 0:
            self._check_src(src)

    def barrier(self) -> None:
        return None

    def close(self) -> None:
        return None
