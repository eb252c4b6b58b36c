"""The shared GGUF header reader (shardlm.gguf_header) against the `gguf` package's own reader:
the same metadata values, the same tensor table and, through the worker's GGUFFile, the same
tensor bytes, for files the package writes in either byte order. Also what it refuses, and that
it runs without the `gguf` package and numpy (the SDK installs without them)."""

from __future__ import annotations

import subprocess
import sys

import gguf
import numpy as np
import pytest
from shardlm.gguf_header import (
    GGUFFormatError,
    SeveralGGUFFiles,
    TensorEntry,
    ValueType,
    find_gguf,
    read_gguf_header,
)

from shardlm_server.worker.gguf.file import SUPPORTED_TYPES, GGUFFile
from tests.gguf_files import GGUFSpec, every_type_once, write_gguf

V = gguf.GGUFValueType
# One key per value type, arrays of each kind included; stored values, as a reader returns them.
VALUES = {
    "t.u8": (255, V.UINT8, None), "t.i8": (-7, V.INT8, None), "t.u16": (65535, V.UINT16, None),
    "t.i16": (-300, V.INT16, None), "t.u32": (4_000_000_000, V.UINT32, None),
    "t.i32": (-70_000, V.INT32, None), "t.f32": (0.5, V.FLOAT32, None),
    "t.bool": (True, V.BOOL, None), "t.str": ("héllo ▁wörld", V.STRING, None),
    "t.u64": (2**63 + 5, V.UINT64, None), "t.i64": (-(2**40), V.INT64, None),
    "t.f64": (1e-300, V.FLOAT64, None),
    "t.ints": ([1, -2, 3], V.ARRAY, V.INT32), "t.floats": ([0.25, -1.5], V.ARRAY, V.FLOAT32),
    "t.strs": (["a", "", "ß c"], V.ARRAY, V.STRING), "t.bools": ([True, False], V.ARRAY, V.BOOL),
}


def test_the_value_types_are_the_packages():
    assert {t.name: t.value for t in ValueType} == {t.name: t.value for t in V}


def _write(path, endianess=gguf.GGUFEndian.LITTLE, alignment: int | None = None) -> None:
    writer = gguf.GGUFWriter(str(path), "llama", endianess=endianess)
    if alignment is not None:
        writer.data_alignment = alignment
        writer.add_uint32("general.alignment", alignment)
    for key, (value, kind, sub) in VALUES.items():
        writer.add_key_value(key, value, kind, sub)
    rng = np.random.default_rng(0)
    writer.add_tensor("a.weight", rng.standard_normal((3, 5)).astype(np.float32))
    writer.add_tensor("b.weight", rng.standard_normal((7,)).astype(np.float16))
    writer.add_tensor("c.weight", gguf.quants.quantize(rng.standard_normal((2, 64)).astype(
        np.float32), gguf.GGMLQuantizationType.Q8_0), raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _the_packages(path) -> tuple[dict, list[TensorEntry]]:
    reader = gguf.GGUFReader(str(path))
    metadata = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    table = [TensorEntry(t.name, tuple(int(d) for d in t.shape), int(t.tensor_type),
                         int(t.data_offset)) for t in reader.tensors]
    return metadata, table


@pytest.mark.parametrize("endianess", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG])
def test_metadata_and_table_equal_the_packages_reader(tmp_path, endianess):
    path = tmp_path / "m.gguf"
    _write(path, endianess)
    header = read_gguf_header(path)
    metadata, table = _the_packages(path)
    assert header.byte_order == (">" if endianess == gguf.GGUFEndian.BIG else "<")
    assert header.metadata == metadata
    assert {k: type(v) for k, v in header.metadata.items()} == {
        k: type(v) for k, v in metadata.items()}
    for key, (value, kind, _sub) in VALUES.items():
        assert header.metadata[key] == (pytest.approx(value) if kind == V.FLOAT32 else value)
    assert list(header.tensors) == table
    assert header.tensors[0].shape == (3, 5)


def test_a_set_alignment_moves_the_data(tmp_path):
    path = tmp_path / "m.gguf"
    _write(path, alignment=256)
    header = read_gguf_header(path)
    assert header.data_offset % 256 == 0
    assert list(header.tensors) == _the_packages(path)[1]


def test_a_model_files_table_and_bytes_equal_the_packages(tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(path, every_type_once(GGUFSpec("llama", layers=2), list(SUPPORTED_TYPES)))
    header = read_gguf_header(path)
    metadata, table = _the_packages(path)
    assert header.metadata == metadata and list(header.tensors) == table
    ours = GGUFFile(path).tensors
    for tensor in gguf.GGUFReader(str(path)).tensors:
        mine = ours[tensor.name]
        assert mine.qtype == tensor.tensor_type
        assert mine.data.dtype == tensor.data.dtype and mine.data.shape == tensor.data.shape
        assert np.array_equal(mine.data, tensor.data), tensor.name


def test_a_big_endian_files_floats_read_as_written(tmp_path):
    path = tmp_path / "m.gguf"
    _write(path, gguf.GGUFEndian.BIG)
    big = GGUFFile(path).tensors
    _write(tmp_path / "little.gguf")
    little = GGUFFile(tmp_path / "little.gguf").tensors
    for name in ("a.weight", "b.weight", "c.weight"):
        assert np.array_equal(big[name].data, little[name].data), name


@pytest.mark.parametrize("damage, message", [
    (lambda data: b"GGUX" + data[4:], "magic"),
    (lambda data: data[:4] + (9).to_bytes(4, "little") + data[8:], "version 9"),
    (lambda data: data[:200], "cut short"),
    (lambda data: data[:5], "too short"),
    (lambda data: data[:16] + (2**62).to_bytes(8, "little") + data[24:], "corrupt or truncated"),
])
def test_damaged_headers_are_format_errors(tmp_path, damage, message):
    path = tmp_path / "m.gguf"
    _write(path)
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(GGUFFormatError, match=message):
        read_gguf_header(path)


def test_find_gguf(tmp_path):
    assert find_gguf(tmp_path) is None
    _write(tmp_path / "a.gguf")
    assert find_gguf(tmp_path) == tmp_path / "a.gguf"
    assert find_gguf(tmp_path / "a.gguf") == tmp_path / "a.gguf"
    (tmp_path / "config.json").write_text("{}")
    assert find_gguf(tmp_path) is None  # a Hugging Face folder
    (tmp_path / "config.json").unlink()
    _write(tmp_path / "b.gguf")
    with pytest.raises(SeveralGGUFFiles, match=r"several GGUF files \(a.gguf, b.gguf\)"):
        find_gguf(tmp_path)


def test_it_needs_neither_gguf_nor_numpy(tmp_path):
    path = tmp_path / "m.gguf"
    _write(path)
    script = ("import sys\n"
              "sys.modules.update(gguf=None, numpy=None)  # importing either now fails\n"
              "from shardlm.gguf_header import read_gguf_header\n"
              f"header = read_gguf_header({str(path)!r})\n"
              "print(header.metadata['t.str'], len(header.tensors))\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["héllo", "▁wörld", "3"]
