"""The one interface the model loads its weights through (`CheckpointReader`), and what a reader
hands over besides dense tensors. Both readers (`worker.safetensors_reader`, `worker.gguf.reader`)
implement it and the model's layers consume it; `worker.loader` picks the reader for a path.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class PackedTensor:
    """A block-quantized tensor (slice): `blocks` is [rows, bytes per row] uint8 in the GGML
    layout of `qtype` (its GGML type name, e.g. "Q4_K"); `shape` is the logical [rows, cols]."""

    qtype: str
    blocks: torch.Tensor
    shape: tuple[int, int]


@dataclass(frozen=True)
class CheckpointSource:
    """Where the served weights came from, as model information reports it."""

    format: str
    tensor_types: tuple[str, ...]


class CheckpointReader(Protocol):
    """Reads named tensors (slices of them) in ShardLM's naming and layout."""

    format: str  # "safetensors" or "gguf"
    device: torch.device
    dtype: torch.dtype  # the serving dtype dense tensors are read in
    quantize: str  # how linear weights are kept in memory: worker.quant.QUANTIZE_MODES

    @property
    def tensor_types(self) -> list[str]:
        """The stored tensor types, most frequent first (e.g. ["Q4_1", "F32"] or ["BF16"])."""
        ...

    def has(self, name: str) -> bool: ...

    def read(self, name: str, expected_shape: tuple[int, ...], *, shard_dim: int | None = None,
             rank: int = 0, world_size: int = 1) -> torch.Tensor:
        """`name`'s `rank`-th of `world_size` slices along `shard_dim`, in the serving dtype.
        `expected_shape` is the full shape the config implies; a mismatch is a CheckpointError."""
        ...

    def read_packed(self, name: str, expected_shape: tuple[int, ...], *,
                    shard_dim: int | None = None, rank: int = 0,
                    world_size: int = 1) -> PackedTensor | None:
        """The same slice as packed blocks, or None when the tensor is not block-quantized."""
        ...

    def check_all_consumed(self, optional: Callable[[str], bool] = ...) -> None: ...

    def close(self) -> None: ...

    def __enter__(self) -> CheckpointReader: ...

    def __exit__(self, *exc: object) -> None: ...
