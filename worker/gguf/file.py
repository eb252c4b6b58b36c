"""Opening a GGUF file: the `gguf` package's reader, its errors turned into `CheckpointError`s, the
tensor types checked once, and metadata values as plain Python.

Parsing a file's metadata (a vocabulary of tens of thousands of strings) takes seconds, and a load
reads it twice (the tensor-parallel check, then the weights), so the last file opened is kept.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from shardlm_server.worker.errors import CheckpointError

T = gguf.GGMLQuantizationType
# The tensor types ShardLM dequantizes at load, in the order the docs list them.
SUPPORTED_TYPES = (T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1,
                   T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K)
SUPPORTED_TYPE_NAMES = ", ".join(t.name for t in SUPPORTED_TYPES)


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


class _PlainViewReader(gguf.GGUFReader):
    """The package's reader, slicing a plain ndarray view of its memory map: the reader takes
    hundreds of thousands of small slices, and numpy's memmap subclass makes each several times
    slower (same bytes, same results; tensor data stays mapped, not copied)."""

    def _get(self, offset: int, dtype: Any, count: int = 1,
             override_order: Any = None) -> np.ndarray:
        plain = self.__dict__.get("_plain")
        if plain is None:
            plain = self.__dict__["_plain"] = self.data.view(np.ndarray)
        dtype = np.dtype(dtype)
        count = int(count)
        arr = plain[offset:offset + dtype.itemsize * count].view(dtype)[:count]
        order = self.byte_order if override_order is None else override_order
        return arr.view(arr.dtype.newbyteorder(order))


class GGUFFile:
    """A parsed GGUF file: `metadata` (key -> Python value) and `tensors` (name -> GGUFTensor)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            reader = _PlainViewReader(str(path), "r")
        except FileNotFoundError as exc:
            raise CheckpointError(f"GGUF file '{path.name}' does not exist") from exc
        except Exception as exc:  # the reader raises ValueError, struct/numpy errors, ...
            raise CheckpointError(
                f"'{path.name}' is not a readable GGUF file (corrupt or truncated): {exc}"
            ) from exc
        self.metadata: dict[str, Any] = {}
        for key, field in reader.fields.items():
            if key.startswith("GGUF."):
                continue
            try:
                self.metadata[key] = field.contents()
            except Exception as exc:
                raise CheckpointError(f"GGUF metadata '{key}' is unreadable: {exc}") from exc
        self.tensors: dict[str, GGUFTensor] = {}
        for t in reader.tensors:
            qtype = gguf.GGMLQuantizationType(int(t.tensor_type))
            if qtype not in SUPPORTED_TYPES:
                raise CheckpointError(
                    f"tensor '{t.name}' has GGUF type {qtype.name}, which ShardLM does not "
                    f"support (supported: {SUPPORTED_TYPE_NAMES})", tensor=t.name)
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            self.tensors[t.name] = GGUFTensor(t.name, qtype, shape, t.data)

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


def find_gguf(path: str | os.PathLike[str]) -> Path | None:
    """The GGUF file `path` names: the file itself, or the one `.gguf` inside a folder. None when
    the folder is a Hugging Face folder (it has a config.json) or holds no GGUF; an error when it
    holds several."""
    path = Path(path)
    if path.is_file():
        return path if path.suffix.lower() == ".gguf" else None
    if not path.is_dir() or (path / "config.json").exists():
        return None
    found = sorted(p for p in path.iterdir() if p.suffix.lower() == ".gguf" and p.is_file())
    if len(found) > 1:
        names = ", ".join(p.name for p in found[:4])
        raise CheckpointError(f"folder '{path.name}' holds several GGUF files ({names}); "
                              "name the one to load")
    return found[0] if found else None
