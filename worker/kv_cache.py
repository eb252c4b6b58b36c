"""The paged KV cache of one rank.

Per layer, K and V are `[num_blocks, block_size, kv_heads_per_rank, head_dim]`. Token t of a
sequence lives at slot `block_table[t // block_size] * block_size + t % block_size`. The gateway
allocates blocks; this class only sizes and holds the memory.

Two modes: PAGED sizes the block pool from a memory budget; STATIC reserves a fixed number of
sequence slots, each a fixed run of blocks (predictable memory, no allocator churn).

The default PAGED pool is what the gateway asked for: `sequences` (its --max-running) sequences
of the model's full context, plus one spare block each, and no more; at most a share of free
GPU memory, or of the host's available memory on CPU, so an over-large request still starts. On
CPU the pool is mapped zero pages, so blocks no sequence has written yet cost no resident memory.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass
from enum import StrEnum

import torch
from shardlm.constants import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_CPU_MEMORY_FRACTION,
    DEFAULT_GPU_MEMORY_FRACTION,
    DEFAULT_MAX_RUNNING,
    DTYPE_NAMES,
)

from shardlm_server.worker.errors import (
    CacheCapacityError,
    DeviceOutOfMemoryError,
    InvalidRequestError,
)

KV_DTYPES = tuple(getattr(torch, name) for name in DTYPE_NAMES)


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
    dtype: torch.dtype | None = None  # of the cached K and V; None ("auto"): the serving dtype
    sequences: int = 0  # sequences run at once, what the default pool holds; 0 = the default

    def validate(self) -> None:
        if self.dtype is not None and self.dtype not in KV_DTYPES:
            raise InvalidRequestError(
                f"the KV cache dtype must be one of {', '.join(DTYPE_NAMES)}, got {self.dtype}",
                field="kv_cache.dtype")
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


def cache_dtype(config: CacheConfig, serving: torch.dtype) -> torch.dtype:
    """The dtype of the cached K and V: the configured one, else the serving dtype. The kernels
    convert on write and read the cache in its own dtype (csrc/, worker/attention.py)."""
    return config.dtype or serving


def needed_blocks(config: CacheConfig, max_model_len: int) -> int:
    """Blocks for `sequences` sequences of `max_model_len` tokens, plus one spare each: a
    sequence rewound off a block the prefix cache shares (gateway/kv/manager.py) recomputes into
    a fresh block while the shared one is still held."""
    sequences = config.sequences or DEFAULT_MAX_RUNNING
    return sequences * (-(-max_model_len // config.block_size) + 1)


def _default_blocks(config: CacheConfig, device: torch.device, per_block: int,
                    max_model_len: int) -> int:
    """The default PAGED pool (module notes): the need, capped by the device's memory."""
    need = needed_blocks(config, max_model_len)
    if device.type == "cuda" and config.gpu_memory_fraction:  # an explicit share is taken whole
        return int(torch.cuda.mem_get_info(device)[0] * config.gpu_memory_fraction) // per_block
    available = _available_bytes(device)
    if available is None:
        return need
    fraction = DEFAULT_GPU_MEMORY_FRACTION if device.type == "cuda" else DEFAULT_CPU_MEMORY_FRACTION
    return min(need, int(available * fraction) // per_block)


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
        elif config.num_blocks or config.memory_bytes:
            num_blocks = config.num_blocks or config.memory_bytes // per_block
            max_sequences, max_len = 0, max_model_len
        else:
            num_blocks = _default_blocks(config, device, per_block, max_model_len)
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
            self.layers = [(_zeros(shape, dtype, device), _zeros(shape, dtype, device))
                           for _ in range(num_layers)]
        except (torch.OutOfMemoryError, RuntimeError, OSError, MemoryError) as exc:
            # CPU allocation failures are RuntimeErrors (torch) or OSErrors (mmap)
            raise DeviceOutOfMemoryError(
                f"could not allocate {num_blocks} KV blocks ({num_blocks * per_block} bytes)"
            ) from exc
        self.config = config
        self.dtype = dtype
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

    @property
    def nbytes(self) -> int:
        """Bytes of the pool on this rank: K and V of every layer."""
        return self.capacity.num_blocks * self.capacity.bytes_per_block


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed tensor; on CPU over an anonymous mapping, whose pages the kernel hands out (zero)
    on first write, so a pool sized for many long sequences is resident only where written."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    count = 1
    for size in shape:
        count *= size
    element = torch.empty((), dtype=dtype).element_size()
    return torch.frombuffer(mmap.mmap(-1, count * element), dtype=dtype).view(shape)
