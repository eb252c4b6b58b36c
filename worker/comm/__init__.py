"""Tensor-parallel communicators: the collectives the model layers call.

``create_communicator`` picks the implementation:

* world_size == 1 (any backend)  -> :class:`SingleRankCommunicator` (no-ops)
* ``"gloo"``                     -> :class:`GlooCommunicator` (CPU, TCPStore at init_address)
* ``"nccl"``                     -> :class:`NcclCommunicator` (CUDA, CuPy NCCL, nccl_unique_id)

See ``base.py`` for the semantics shared by all of them and ``nccl.py`` for the
NCCL timeout contract (``synchronize()`` once per step).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from shardlm.constants import DEFAULT_COMM_TIMEOUT_S

from .base import Communicator, CommunicatorError, SingleRankCommunicator, check_rank
from .gloo import GlooCommunicator, open_store
from .nccl import NcclCommunicator, new_nccl_unique_id

__all__ = [
    "BACKENDS",
    "Communicator",
    "CommunicatorError",
    "GlooCommunicator",
    "NcclCommunicator",
    "SingleRankCommunicator",
    "create_communicator",
    "new_nccl_unique_id",
    "open_store",
]

BACKENDS = ("gloo", "nccl", "single")


def create_communicator(
    backend: str,
    rank: int,
    world_size: int,
    *,
    device: torch.device,
    init_address: str = "",
    nccl_unique_id: bytes = b"",
    timeout_s: float = DEFAULT_COMM_TIMEOUT_S,
    store: dist.Store | None = None,
) -> Communicator:
    """Build the communicator for one rank of a tensor-parallel group.

    ``init_address`` ("host:port", rank 0 serves it) is required for gloo; rank 0
    may pass the ``store`` it opened there with :func:`open_store`;
    ``nccl_unique_id`` (from :func:`new_nccl_unique_id` on rank 0) for nccl.
    Raises ValueError for bad arguments, CommunicatorError when set-up fails or
    the other ranks do not join within ``timeout_s``.
    """
    backend = backend.lower()
    if backend not in BACKENDS:
        raise ValueError(f"unknown communicator backend {backend!r}; expected one of {BACKENDS}")
    check_rank(rank, world_size)
    if world_size == 1:
        return SingleRankCommunicator()
    if backend == "single":
        raise ValueError(f"backend 'single' needs world_size 1, got {world_size}")
    if backend == "gloo":
        if not init_address:
            raise ValueError("gloo communicator needs init_address 'host:port'")
        return GlooCommunicator(
            rank, world_size, init_address=init_address, timeout_s=timeout_s, device=device,
            store=store,
        )
    if not nccl_unique_id:
        raise ValueError(
            "nccl communicator needs nccl_unique_id (from new_nccl_unique_id on rank 0)"
        )
    return NcclCommunicator(
        rank, world_size, device=device, unique_id=nccl_unique_id, timeout_s=timeout_s
    )
