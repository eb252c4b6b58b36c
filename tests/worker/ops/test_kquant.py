"""Q4_K kept packed (regrouped into Q4Kx8) and Q5_0 stored as Q8_0 (worker/kquant.py): the
formats against the `gguf` package's GGML dequantizers, and quant_linear on Q4Kx8 against its
reference on every path (decode rows, panel, tiles); the SIMD paths are compared in
test_quant_ops.py.

The `gguf` package cannot quantize to Q4_K, so Q4_K blocks are random bytes with float16 scales
of a realistic size: every field takes every value, which is what the layout must carry.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from shardlm_server.worker import kquant, ops
from shardlm_server.worker.ops import reference
from shardlm_server.worker.quant import (
    QuantizedWeight,
    dequantize_blocks,
    dequantize_rows,
    regrouped,
)

TOL = {"atol": 1e-4, "rtol": 1e-4}  # float32: summation order only


def q4_k_blocks(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """Random Q4_K blocks [n, K / 256 * 144] with scales like a quantizer's."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n, k // 256, 144), dtype=np.uint8)
    scales = (rng.uniform(0.5, 2.0, size=(n, k // 256, 2)) / 64 / np.sqrt(k)).astype(np.float16)
    raw[..., 0:4] = scales.view(np.uint8).reshape(n, k // 256, 4)
    return torch.from_numpy(raw.reshape(n, -1))


def q4_k_weight(n: int, k: int, seed: int = 0) -> QuantizedWeight:
    return regrouped(QuantizedWeight("Q4_K", q4_k_blocks(n, k, seed), (n, k)))


def ggml_dequantize(blocks: torch.Tensor, qtype: str) -> torch.Tensor:
    values = gguf.quants.dequantize(blocks.numpy(), gguf.GGMLQuantizationType[qtype])
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))


def test_q4_k_dequantizes_as_ggml():
    blocks = q4_k_blocks(5, 768)
    torch.testing.assert_close(kquant.dequantize_q4_k(blocks), ggml_dequantize(blocks, "Q4_K"),
                               atol=0, rtol=0)


def test_q4kx8_holds_the_same_weights():
    blocks = q4_k_blocks(24, 512, seed=1)
    w = regrouped(QuantizedWeight("Q4_K", blocks, (24, 512)))
    assert w.qtype == "Q4Kx8" and w.shape == (24, 512)
    assert w.blocks.shape == (3, 2 * kquant.Q4KX8_SUPER_BYTES)  # 1184 bytes per 8 x 256 weights
    torch.testing.assert_close(w.dequantize(), ggml_dequantize(blocks, "Q4_K"), atol=0, rtol=0)


def test_q4kx8_rows_equal_the_table():
    w = q4_k_weight(32, 256, seed=2)
    rows = torch.tensor([0, 31, 9, 9, 16, 7])
    torch.testing.assert_close(dequantize_rows(w, rows), w.dequantize()[rows], atol=0, rtol=0)


def test_q5_0_as_q8_0_holds_the_same_weights():
    rng = np.random.default_rng(3)
    values = rng.standard_normal((6, 320)).astype(np.float32)
    q5 = torch.from_numpy(gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q5_0))
    q8 = kquant.q5_0_to_q8_0(q5)
    assert q8.shape == (6, 10 * 34)
    torch.testing.assert_close(dequantize_blocks(q8, "Q8_0"), ggml_dequantize(q5, "Q5_0"),
                               atol=0, rtol=0)


# m: decode rows (1-4 a pass, 5 and 9 leave remainders), the panel path (16-256 rows), tiles.
# n: 5 groups of 8 (AVX-512 pairs plus one), 4 groups; k: one and three super-blocks.
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 9, 16, 23, 64, 300])
@pytest.mark.parametrize("n,k", [(40, 256), (32, 768)])
def test_quant_linear_on_q4kx8_matches_reference(m, n, k):
    w = q4_k_weight(n, k, seed=m)
    gen = torch.Generator().manual_seed(m + n)
    x = torch.randn(m, k, generator=gen) * 2
    bias = torch.randn(n, generator=gen)
    torch.testing.assert_close(ops.quant_linear(x, w, bias),
                               reference.quant_linear(x, w.blocks, "Q4Kx8", bias), **TOL)
    expected = x.double() @ ggml_dequantize(q4_k_blocks(n, k, seed=m), "Q4_K").double().T
    torch.testing.assert_close(ops.quant_linear(x, w).double(), expected, **TOL)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_quant_linear_on_q4kx8_in_half_precision(dtype):
    w = q4_k_weight(16, 512, seed=7)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(7)).to(dtype)
    torch.testing.assert_close(ops.quant_linear(x, w), reference.quant_linear(x, w.blocks, "Q4Kx8"),
                               atol=3e-2, rtol=1.6e-2)
