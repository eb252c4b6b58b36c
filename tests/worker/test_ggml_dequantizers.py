"""The 8-row layouts against GGML's own C dequantizers (`to_float` of libggml-base, which the
llama-cpp-python of `pip install .[bench]` ships): every type ShardLM keeps packed on CPU holds
the very floats llama.cpp computes, bit for bit. test_kquant.py checks the same against the `gguf`
package's Python dequantizers; this one checks those too. Skipped without llama-cpp-python."""

from __future__ import annotations

import ctypes
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from shardlm_server.worker.quant import QuantizedWeight, regrouped
from tests.worker.ops.test_kquant import LAYOUTS, ggml_dequantize, k_blocks

llama_cpp = pytest.importorskip("llama_cpp", reason="needs llama-cpp-python (pip install .[bench])")


class _Traits(ctypes.Structure):  # ggml.h's struct ggml_type_traits, its leading fields
    _fields_ = [("type_name", ctypes.c_char_p), ("blck_size", ctypes.c_int64),
                ("blck_size_interleave", ctypes.c_int64), ("type_size", ctypes.c_size_t),
                ("is_quantized", ctypes.c_bool), ("to_float", ctypes.c_void_p)]


_TO_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)


@pytest.fixture(scope="module")
def ggml():
    path = Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"
    if not path.is_file():
        pytest.skip(f"no {path.name} beside llama_cpp")
    lib = ctypes.CDLL(str(path))
    lib.ggml_get_type_traits.restype = ctypes.POINTER(_Traits)
    lib.ggml_get_type_traits.argtypes = [ctypes.c_int]
    return lib


def _ggml_to_float(lib, blocks: np.ndarray, qtype: str, count: int) -> np.ndarray:
    kind = gguf.GGMLQuantizationType[qtype]
    traits = lib.ggml_get_type_traits(int(kind)).contents
    # The struct's layout is that of the library's version: its name and sizes must be the type's.
    block, size = gguf.GGML_QUANT_SIZES[kind]
    assert traits.type_name.decode().upper() == qtype
    assert (traits.blck_size, traits.type_size) == (block, size)
    out = np.zeros(count, dtype=np.float32)
    _TO_FLOAT(traits.to_float)(blocks.ctypes.data, out.ctypes.data, count)
    return out


@pytest.mark.parametrize("qtype", list(LAYOUTS))
def test_layouts_hold_ggml_s_own_floats(ggml, qtype):
    n, k = 32, 1024
    blocks = k_blocks(n, k, qtype, seed=5)
    expected = _ggml_to_float(ggml, np.ascontiguousarray(blocks.numpy()), qtype, n * k)
    expected = torch.from_numpy(expected).reshape(n, k)
    held = regrouped(QuantizedWeight(qtype, blocks, (n, k)))
    assert held.qtype == LAYOUTS[qtype][0]
    torch.testing.assert_close(held.dequantize(), expected, atol=0, rtol=0)
    torch.testing.assert_close(ggml_dequantize(blocks, qtype), expected, atol=0, rtol=0)
