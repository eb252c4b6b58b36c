"""Opening a GGUF file: its header read by the shared reader (shardlm.gguf_header, which the
gateway's tokenizer reads too), its errors turned into `CheckpointError`s, the tensor types
checked once, and each tensor's data as a numpy view of the memory-mapped file (never copied here).

The `gguf` package supplies the GGML type names and block sizes, and the dequantizing kernels
(gguf/reader.py). A load opens the file twice (the tensor-parallel check, then the weights), so
the last file opened is kept.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from shardlm.gguf_header import GGUFFormatError, SeveralGGUFFiles, read_gguf_header
from shardlm.gguf_header import find_gguf as _find_gguf

from shardlm_server.worker.errors import CheckpointError

T = gguf.GGMLQuantizationType
# The tensor types ShardLM reads (worker.quant says which stay packed), in the order the docs
# list them.
SUPPORTED_TYPES = (T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1,
                   T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_NL, T.IQ4_XS,
                   T.IQ3_S, T.IQ3_XXS, T.IQ2_S, T.IQ2_XS, T.IQ2_XXS, T.IQ1_S, T.IQ1_M)
SUPPORTED_TYPE_NAMES = ", ".join(t.name for t in SUPPORTED_TYPES)
# Types whose data is typed numbers; every other one is [rows, bytes per row] uint8 (BF16, blocks).
_ELEMENT_DTYPES: dict[gguf.GGMLQuantizationType, np.dtype] = {T.F32: np.dtype(np.float32),
                                                         T.F16: np.dtype(np.float16)}


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of the file: its llama.cpp name, type, logical shape (rows first, as torch
    orders it) and its data (typed for float types; [rows, bytes per row] uint8 for blocks)."""

    name: str
    qtype: gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray

    @property
    def block_size(self) -> int:
        return gguf.GGML_QUANT_SIZES[self.qtype][0]

    @property
    def is_quantized(self) -> bool:
        return self.qtype not in (T.F32, T.F16, T.BF16)


def _unreadable(path: Path, reason: object) -> CheckpointError:
    return CheckpointError(f"'{path.name}' is not a readable GGUF file (corrupt or truncated): "
                           f"{reason}")


def _qtype(name: str, raw_type: int) -> gguf.GGMLQuantizationType:
    try:
        qtype = T(raw_type)
    except ValueError:  # a type the gguf package does not know either
        kind = f"#{raw_type}"
    else:
        if qtype in SUPPORTED_TYPES:
            return qtype
        kind = qtype.name
    raise CheckpointError(f"tensor '{name}' has GGUF type {kind}, which ShardLM does not support "
                          f"(supported: {SUPPORTED_TYPE_NAMES})", tensor=name)


class GGUFFile:
    """A parsed GGUF file: `metadata` (key -> Python value) and `tensors` (name -> GGUFTensor)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            header = read_gguf_header(path)
        except FileNotFoundError as exc:
            raise CheckpointError(f"GGUF file '{path.name}' does not exist") from exc
        except GGUFFormatError as exc:
            raise _unreadable(path, exc) from exc
        self.metadata: dict[str, Any] = header.metadata
        # A plain ndarray view of the map: slicing numpy's memmap subclass is several times slower.
        mapped = np.memmap(path, mode="r").view(np.ndarray)
        self.tensors: dict[str, GGUFTensor] = {}
        for entry in header.tensors:
            qtype = _qtype(entry.name, entry.ggml_type)
            block_size, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
            shape = entry.shape
            if not shape or any(d <= 0 for d in shape) or shape[-1] % block_size:
                raise _unreadable(path, f"tensor '{entry.name}' has shape {list(shape)}")
            row_bytes = shape[-1] // block_size * block_bytes
            size = row_bytes * int(np.prod(shape[:-1], dtype=np.int64))
            if entry.offset + size > header.file_size:
                raise _unreadable(path, f"tensor '{entry.name}' runs past the end of the file")
            raw = mapped[entry.offset:entry.offset + size]
            element = _ELEMENT_DTYPES.get(qtype)
            if element is None:
                data = raw.reshape(*shape[:-1], row_bytes)
            else:
                data = raw.view(element.newbyteorder(header.byte_order)).reshape(shape)
            self.tensors[entry.name] = GGUFTensor(entry.name, qtype, shape, data)

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def tensor_type_names(self) -> list[str]:
        """The distinct tensor types in the file, most frequent first."""
        counts: dict[str, int] = {}
        for t in self.tensors.values():
            counts[t.qtype.name] = counts.get(t.qtype.name, 0) + 1
        return sorted(counts, key=lambda n: (-counts[n], n))


_cache_lock = threading.Lock()
_cache: tuple[tuple, GGUFFile] | None = None


def open_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """The parsed file at `path`; the last one opened is reused while it is unchanged on disk."""
    global _cache
    path = Path(path)
    try:
        stat = path.stat()
    except FileNotFoundError as exc:
        raise CheckpointError(f"GGUF file '{path.name}' does not exist") from exc
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    with _cache_lock:
        if _cache is not None and _cache[0] == key:
            return _cache[1]
        parsed = GGUFFile(path)
        _cache = (key, parsed)
        return parsed


def drop_cache() -> None:
    """Forget the last parsed file once a load has copied its weights out: its memory map then
    closes, and the file's pages the copy read no longer count in the worker's RSS."""
    global _cache
    with _cache_lock:
        _cache = None


def find_gguf(path: str | os.PathLike[str]) -> Path | None:
    """The GGUF file `path` names: the file itself, or the one `.gguf` inside a folder. None when
    the folder is a Hugging Face folder (it has a config.json) or holds no GGUF; an error when it
    holds several."""
    try:
        return _find_gguf(path)
    except SeveralGGUFFiles as exc:
        raise CheckpointError(str(exc)) from exc
