"""Reading a GGUF file's header: its metadata (key -> plain Python value) and its table of tensors
(name, dimensions, GGML type, where the data lies), with the standard library alone.

Both server halves read GGUF metadata, the gateway for the tokenizer and the workers for the model
configuration and the tensors, and neither may import the other; so the one reader lives here,
beside the shared constants. It needs neither the `gguf` package nor numpy, so the SDK installs
and imports without them. It maps the file and reads only the header, never the tensor data.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import Any

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32  # bytes; a file may set general.alignment


class GGUFFormatError(ValueError):
    """The file is not a readable GGUF file: wrong magic, a version this reader does not know, or
    a header that is corrupt or cut short."""


class SeveralGGUFFiles(ValueError):
    """A folder named as a checkpoint holds more than one GGUF file."""


class ValueType(IntEnum):
    """The GGUF metadata value types (the file's type codes)."""

    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


# struct codes of the fixed-size value types.
_SCALAR_CODES = {ValueType.UINT8: "B", ValueType.INT8: "b", ValueType.UINT16: "H",
                 ValueType.INT16: "h", ValueType.UINT32: "I", ValueType.INT32: "i",
                 ValueType.FLOAT32: "f", ValueType.BOOL: "?", ValueType.UINT64: "Q",
                 ValueType.INT64: "q", ValueType.FLOAT64: "d"}


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of the file's table. `dims` are as stored, fastest-varying first (GGML's
    order); `shape` is rows first, as torch orders them. `offset` is the absolute byte offset of
    its data in the file."""

    name: str
    dims: tuple[int, ...]
    ggml_type: int
    offset: int

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.dims))


@dataclass(frozen=True)
class GGUFHeader:
    """A GGUF file's header. `byte_order` is the struct prefix of its numbers ("<" or ">")."""

    version: int
    byte_order: str
    metadata: dict[str, Any]
    tensors: tuple[TensorEntry, ...]
    data_offset: int  # where the tensor data section starts
    file_size: int


class _Cursor:
    """Reads the header's values in order, each checked against the end of the file."""

    def __init__(self, buffer: mmap.mmap, byte_order: str) -> None:
        self.buffer, self.order, self.offset = buffer, byte_order, 0

    def take(self, size: int) -> int:
        """The offset of the next `size` bytes, which the cursor then moves past."""
        start = self.offset
        if size < 0 or start + size > len(self.buffer):
            raise GGUFFormatError(f"the header is cut short at byte {start} (corrupt or truncated)")
        self.offset = start + size
        return start

    def scalars(self, code: str, count: int) -> tuple:
        fmt = f"{self.order}{count}{code}"
        return struct.unpack_from(fmt, self.buffer, self.take(struct.calcsize(fmt)))

    def scalar(self, code: str) -> Any:
        return self.scalars(code, 1)[0]

    def string(self) -> str:
        size = self.scalar("Q")
        start = self.take(size)
        try:
            return self.buffer[start:start + size].decode("utf-8")
        except UnicodeDecodeError as exc:
            raise GGUFFormatError(f"a string at byte {start} is not UTF-8: {exc}") from exc

    def value(self, raw_type: int) -> Any:
        try:
            kind = ValueType(raw_type)
        except ValueError:
            raise GGUFFormatError(f"unknown metadata value type {raw_type}") from None
        if kind == ValueType.STRING:
            return self.string()
        if kind != ValueType.ARRAY:
            return self.scalar(_SCALAR_CODES[kind])
        item_type, count = self.scalar("I"), self.scalar("Q")
        code = _SCALAR_CODES.get(item_type)
        if code is not None:  # fixed-size items: one unpack for the whole array
            return list(self.scalars(code, count))
        return [self.value(item_type) for _ in range(count)]


def _read(buffer: mmap.mmap) -> GGUFHeader:
    if buffer[:4] != GGUF_MAGIC:
        raise GGUFFormatError("the file does not start with the GGUF magic")
    version = struct.unpack_from("<I", buffer, 4)[0]
    # A file written on a machine of the other byte order reads as a version with its low half 0.
    order = ">" if version & 0xFFFF == 0 else "<"
    cursor = _Cursor(buffer, order)
    cursor.take(4)
    version = cursor.scalar("I")
    if version not in SUPPORTED_VERSIONS:
        raise GGUFFormatError(f"GGUF version {version} is not supported "
                              f"(supported: {', '.join(map(str, SUPPORTED_VERSIONS))})")
    tensor_count, kv_count = cursor.scalar("Q"), cursor.scalar("Q")
    metadata: dict[str, Any] = {}
    for _ in range(kv_count):
        key = cursor.string()
        if key in metadata:
            raise GGUFFormatError(f"metadata key '{key}' appears twice")
        metadata[key] = cursor.value(cursor.scalar("I"))
    table = []
    for _ in range(tensor_count):
        name = cursor.string()
        dims = cursor.scalars("Q", cursor.scalar("I"))
        table.append((name, dims, cursor.scalar("I"), cursor.scalar("Q")))
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise GGUFFormatError(f"general.alignment {alignment!r} is not a power of two")
    data_offset = -(-cursor.offset // alignment) * alignment
    tensors, names = [], set()
    for name, dims, ggml_type, offset in table:
        if name in names:
            raise GGUFFormatError(f"tensor '{name}' appears twice")
        names.add(name)
        tensors.append(TensorEntry(name, tuple(dims), ggml_type, data_offset + offset))
    return GGUFHeader(version, order, metadata, tuple(tensors), data_offset, len(buffer))


def read_gguf_header(path: str | os.PathLike[str]) -> GGUFHeader:
    """The header of the GGUF file at `path`. Raises FileNotFoundError for a missing file and
    GGUFFormatError for one that is not a readable GGUF file."""
    with open(path, "rb") as file:
        if os.fstat(file.fileno()).st_size < 8:
            raise GGUFFormatError("the file is too short to be a GGUF file")
        with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as buffer:
            try:
                return _read(buffer)
            except struct.error as exc:  # a count too large for any file
                raise GGUFFormatError(f"the header is corrupt or truncated: {exc}") from exc


def find_gguf(path: str | os.PathLike[str]) -> Path | None:
    """The GGUF file `path` names: the file itself, or the one `.gguf` inside a folder. None when
    the folder is a Hugging Face folder (it has a config.json) or holds no GGUF file; raises
    SeveralGGUFFiles when it holds more than one."""
    path = Path(path)
    if path.is_file():
        return path if path.suffix.lower() == ".gguf" else None
    if not path.is_dir() or (path / "config.json").exists():
        return None
    found = sorted(p for p in path.iterdir() if p.suffix.lower() == ".gguf" and p.is_file())
    if len(found) > 1:
        names = ", ".join(p.name for p in found[:4])
        raise SeveralGGUFFiles(f"folder '{path.name}' holds several GGUF files ({names}); "
                               "name the one to load")
    return found[0] if found else None
