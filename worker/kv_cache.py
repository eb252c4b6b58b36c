"""The paged KV cache of one rank.

Per layer, K and V are `[num_blocks, block_size, kv_heads_per_rank, head_dim]`. Token t of a
sequence lives at slot `block_table[t // block_size] * block_size + t % block_size`. The gateway
allocates blocks; this class only sizes and holds the memory.

Two modes: PAGED sizes the block pool from a memory budget; STATIC reserves a fixed number of
sequence slots, each a fixed run of blocks (predictable memory, no allocator churn).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import torch
from shardlm.constants import DEFAULT_BLOCK_SIZE

from shardlm_server.worker.errors import (
    CacheCapacityError,
    DeviceOutOfMemoryError,
    InvalidRequestError,
)

DEFAULT_CPU_BUDGET_BYTES = 1 << 30
DEFAULT_GPU_MEMORY_FRACTION = 0.9


class CacheMode(StrEnum):
    PAGED = "paged"
    STATIC = "static"


@dataclass(frozen=True)
class CacheConfig:
    mode: CacheMode = CacheMode.PAGED
    block_size: int = DEFAULT_BLOCK_SIZE
    memory_bytes: int = 0  # budget for K+V of all layers; 0 = default for the device
    gpu_memory_fraction: float = 0.0  # share of free GPU memory; 0 = default
    num_blocks: int = 0  # explicit pool size; 0 = derive from the budget
    static_max_sequences: int = 0
    static_max_sequence_length: int = 0

    def validate(self) -> None:
        if not 1 <= self.block_size <= 1024:
            raise InvalidRequestError(f"block_size must be in [1, 1024], got {self.block_size}",
                                      field="kv_cache.block_size")
        if not 0.0 <= self.gpu_memory_fraction < 1.0:
            raise InvalidRequestError("gpu_memory_fraction must be in [0, 1)",
                                      field="kv_cache.gpu_memory_fraction")
        if self.mode is CacheMode.STATIC and (
            self.static_max_sequences <= 0 or self.static_max_sequence_length <= 0
        ):
            raise InvalidRequestError(
                "static cache mode needs static_max_sequences and static_max_sequence_length > 0",
                field="kv_cache.static_max_sequences")


@dataclass(frozen=True)
class CacheCapacity:
    mode: CacheMode
    num_blocks: int
    block_size: int
    bytes_per_block: int  # all layers, K and V, this rank
    max_sequences: int  # STATIC: sequence slots; PAGED: 0 (bounded by blocks only)
    max_sequence_length: int  # STATIC: tokens per slot; PAGED: the model's context


def bytes_per_block(
    num_layers: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * kv_heads * head_dim * element


def _budget_bytes(config: CacheConfig, device: torch.device) -> int:
    if config.memory_bytes:
        return config.memory_bytes
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        fraction = config.gpu_memory_fraction or DEFAULT_GPU_MEMORY_FRACTION
        return int(free * fraction)
    return DEFAULT_CPU_BUDGET_BYTES


def _available_bytes(device: torch.device) -> int | None:
    """Memory a new cache may take: free device memory, or the host's available memory (so an
    absurd request fails cleanly instead of inviting the kernel's OOM killer)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class KVCache:
    def __init__(
        self,
        config: CacheConfig,
        *,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        max_model_len: int,
    ) -> None:
        config.validate()
        per_block = bytes_per_block(num_layers, config.block_size, kv_heads, head_dim, dtype)
        if config.mode is CacheMode.STATIC:
            length = min(config.static_max_sequence_length, max_model_len)
            blocks_per_seq = -(-length // config.block_size)
            num_blocks = config.static_max_sequences * blocks_per_seq
            max_sequences, max_len = config.static_max_sequences, length
        else:
            num_blocks = config.num_blocks or _budget_bytes(config, device) // per_block
            max_sequences, max_len = 0, max_model_len
        if num_blocks <= 0:
            raise CacheCapacityError(
                f"the KV cache budget holds no block of {per_block} bytes; raise memory_bytes",
                bytes_per_block=per_block,
            )
        available = _available_bytes(device)
        if available is not None and num_blocks * per_block > available:
            raise DeviceOutOfMemoryError(
                f"{num_blocks} KV blocks need {num_blocks * per_block} bytes; only {available} "
                "are available", requested_bytes=num_blocks * per_block, device=str(device))
        shape = (num_blocks, config.block_size, kv_heads, head_dim)
        try:
            self.layers = [
                (
                    torch.zeros(shape, dtype=dtype, device=device),
                    torch.zeros(shape, dtype=dtype, device=device),
                )
                for _ in range(num_layers)
            ]
        except (torch.OutOfMemoryError, RuntimeError) as exc:  # CPU allocation failures are
            # RuntimeErrors
            raise DeviceOutOfMemoryError(
                f"could not allocate {num_blocks} KV blocks ({num_blocks * per_block} bytes)"
            ) from exc
        self.config = config
        self.capacity = CacheCapacity(
            mode=config.mode,
            num_blocks=num_blocks,
            block_size=config.block_size,
            bytes_per_block=per_block,
            max_sequences=max_sequences,
            max_sequence_length=max_len,
        )

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def num_blocks(self) -> int:
        return self.capacity.num_blocks
