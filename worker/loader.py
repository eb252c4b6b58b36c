"""The one interface the model loads its weights through, and the choice of reader.

Two readers implement `CheckpointReader`: `SafetensorsReader` (a Hugging Face folder) and
`GGUFCheckpointReader` (a llama.cpp GGUF file). Both serve tensors under ShardLM's names (the
Hugging Face ones) and layout, a tensor-parallel rank's slice at a time, so the model never sees
which format it came from. A block-quantized tensor can also be taken as its packed blocks
(`read_packed`), for a layer that keeps weights quantized.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from shardlm_server.worker.config import ModelConfig, load_config


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


def _gguf_path(path: str | Path) -> Path | None:
    from shardlm_server.worker.gguf.file import find_gguf

    return find_gguf(path)


def checkpoint_format(path: str | Path) -> str:
    """"gguf" for a .gguf file or a folder holding one (and no config.json), else "safetensors"."""
    return "gguf" if _gguf_path(path) is not None else "safetensors"


def load_checkpoint_config(path: str | Path) -> ModelConfig:
    """The model configuration of the checkpoint at `path`, whichever its format."""
    gguf_path = _gguf_path(path)
    if gguf_path is None:
        return load_config(path)
    from shardlm_server.worker.gguf.config import gguf_config
    from shardlm_server.worker.gguf.file import open_gguf

    return gguf_config(open_gguf(gguf_path))


def open_checkpoint(path: str | Path, device: torch.device, dtype: torch.dtype,
                    quantize: str = "") -> CheckpointReader:
    """The reader for the checkpoint at `path` (a Hugging Face folder or a GGUF file); `quantize`
    is how the layers keep linear weights (worker.quant.read_linear)."""
    gguf_path = _gguf_path(path)
    if gguf_path is None:
        from shardlm_server.worker.safetensors_reader import SafetensorsReader

        reader: CheckpointReader = SafetensorsReader(path, device, dtype)
    else:
        from shardlm_server.worker.gguf.reader import GGUFCheckpointReader

        reader = GGUFCheckpointReader(gguf_path, device, dtype)
    reader.quantize = quantize
    return reader
