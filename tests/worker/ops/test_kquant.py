"""Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q5_0, Q5_1, IQ4_XS, IQ4_NL and the grid i-quants (IQ3_XXS,
IQ3_S, IQ2_XXS, IQ2_XS, IQ2_S, IQ1_S, IQ1_M) kept packed (regrouped into Q2Kx8, Q3Kx8, Q4Kx8,
Q5Kx8, Q6Kx8, Q5x8, Q51x8, IQ4x8, IQ4NLx8 and the grid types' table layouts, gridquant.py) and
Q5_0 stored as Q8_0 (worker/kquant.py): the formats against the `gguf` package's GGML
dequantizers, and quant_linear on the regrouped layouts against its reference on every path
(decode rows, panel, tiles); the SIMD paths are compared in test_quant_ops.py.

The `gguf` package cannot quantize to the K-quants or the i-quants, so their blocks are random bytes with
float16 scales of a realistic size: every field takes every value, which is what a layout must
carry. Q5_0 and Q5_1 blocks are quantized from random values.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from shardlm_server.worker import gridquant, iquant, kquant, lowbit, ops
from shardlm_server.worker.ops import reference
from shardlm_server.worker.quant import (
    QuantizedWeight,
    dequantize_blocks,
    dequantize_rows,
    regrouped,
)
from tests.gguf_files import random_k_blocks

TOL = {"atol": 1e-4, "rtol": 1e-4}  # float32: summation order only


# GGML type -> (the layout the CPU kernels read it in, weights and bytes of that layout's block
# of 8 rows).
LAYOUTS = {"Q4_K": ("Q4Kx8", 256, kquant.Q4KX8_SUPER_BYTES),
           "Q5_K": ("Q5Kx8", 256, kquant.Q5KX8_SUPER_BYTES),
           "Q6_K": ("Q6Kx8", 256, kquant.Q6KX8_SUPER_BYTES),
           "Q5_0": ("Q5x8", 32, kquant.Q5X8_BLOCK_BYTES),
           "Q5_1": ("Q51x8", 32, kquant.Q51X8_BLOCK_BYTES),
           "IQ4_XS": ("IQ4x8", 256, iquant.IQ4X8_SUPER_BYTES),
           "IQ4_NL": ("IQ4NLx8", 32, iquant.IQ4NLX8_BLOCK_BYTES),
           "Q3_K": ("Q3Kx8", 256, lowbit.Q3KX8_SUPER_BYTES),
           "Q2_K": ("Q2Kx8", 256, lowbit.Q2KX8_SUPER_BYTES),
           **{qtype: (grid.layout, 256, lowbit.Q3KX8_SUPER_BYTES if grid.three_bit
                      else iquant.IQ4X8_SUPER_BYTES) for qtype, grid in gridquant.TYPES.items()}}
#: Each 8-row layout of LAYOUTS by name, with the GGML type the tests make it from.
SOURCES = {layout: qtype for qtype, (layout, _, _) in LAYOUTS.items()}


def k_blocks(n: int, k: int, qtype: str = "Q4_K", seed: int = 0) -> torch.Tensor:
    """Random `qtype` blocks [n, K / block * bytes] with scales like a quantizer's."""
    rng = np.random.default_rng(seed)
    kind = gguf.GGMLQuantizationType[qtype]
    if qtype in ("Q5_0", "Q5_1"):
        values = rng.standard_normal((n, k)).astype(np.float32) * 0.05
        return torch.from_numpy(gguf.quants.quantize(values, kind))
    return torch.from_numpy(random_k_blocks(n, k, kind, rng))


def k_weight(n: int, k: int, qtype: str = "Q4_K", seed: int = 0) -> QuantizedWeight:
    """A random `qtype` weight as the CPU kernels hold it (LAYOUTS)."""
    return regrouped(QuantizedWeight(qtype, k_blocks(n, k, qtype, seed), (n, k)))


def ggml_dequantize(blocks: torch.Tensor, qtype: str) -> torch.Tensor:
    values = gguf.quants.dequantize(blocks.numpy(), gguf.GGMLQuantizationType[qtype])
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))


@pytest.mark.parametrize("qtype", list(LAYOUTS))
def test_k_quants_dequantize_as_ggml(qtype):
    blocks = k_blocks(5, 768, qtype)
    torch.testing.assert_close(dequantize_blocks(blocks, qtype), ggml_dequantize(blocks, qtype),
                               atol=0, rtol=0)


@pytest.mark.parametrize("qtype", list(LAYOUTS))
def test_regrouped_k_quants_hold_the_same_weights(qtype):
    layout, weights, size = LAYOUTS[qtype]
    blocks = k_blocks(24, 512, qtype, seed=1)
    w = regrouped(QuantizedWeight(qtype, blocks, (24, 512)))
    assert w.qtype == layout and w.shape == (24, 512)
    assert w.blocks.shape == (3, 512 // weights * size)  # bytes per 8 rows
    torch.testing.assert_close(w.dequantize(), ggml_dequantize(blocks, qtype), atol=0, rtol=0)


@pytest.mark.parametrize("qtype", list(LAYOUTS))
def test_regrouped_rows_equal_the_table(qtype):
    w = k_weight(32, 256, qtype, seed=2)
    rows = torch.tensor([0, 31, 9, 9, 16, 7])
    torch.testing.assert_close(dequantize_rows(w, rows), w.dequantize()[rows], atol=0, rtol=0)


def test_q2kx8_holds_q2_k_at_the_file_s_size():
    blocks = k_blocks(16, 512, "Q2_K", seed=4)
    w = regrouped(QuantizedWeight("Q2_K", blocks, (16, 512)))
    assert w.blocks.nbytes == blocks.nbytes  # 2.625 bits a weight, as in the file


def test_q5_0_as_q8_0_holds_the_same_weights():
    rng = np.random.default_rng(3)
    values = rng.standard_normal((6, 320)).astype(np.float32)
    q5 = torch.from_numpy(gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q5_0))
    q8 = kquant.q5_0_to_q8_0(q5)
    assert q8.shape == (6, 10 * 34)
    torch.testing.assert_close(dequantize_blocks(q8, "Q8_0"), ggml_dequantize(q5, "Q5_0"),
                               atol=0, rtol=0)


# m: the matrix-vector kernels (AVX-512 pairs take up to 8 a pass, single groups 4: 5 and 9
# leave remainders; up to 47 rows), the panel path (from 48 rows: csrc/cpu/panel_linear.h).
# n: 5 groups of 8 (AVX-512 pairs plus one), 4 groups; k: one and three super-blocks.
@pytest.mark.parametrize("qtype", list(LAYOUTS))
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 9, 16, 23, 47, 48, 64, 300])
@pytest.mark.parametrize("n,k", [(40, 256), (32, 768)])
def test_quant_linear_on_regrouped_k_quants_matches_reference(qtype, m, n, k):
    w = k_weight(n, k, qtype, seed=m)
    gen = torch.Generator().manual_seed(m + n)
    x = torch.randn(m, k, generator=gen) * 2
    bias = torch.randn(n, generator=gen)
    torch.testing.assert_close(ops.quant_linear(x, w, bias),
                               reference.quant_linear(x, w.blocks, w.qtype, bias), **TOL)
    expected = x.double() @ ggml_dequantize(k_blocks(n, k, qtype, seed=m), qtype).double().T
    torch.testing.assert_close(ops.quant_linear(x, w).double(), expected, **TOL)


@pytest.mark.parametrize("qtype", list(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_quant_linear_on_regrouped_k_quants_in_half_precision(qtype, dtype):
    w = k_weight(16, 512, qtype, seed=7)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(7)).to(dtype)
    torch.testing.assert_close(ops.quant_linear(x, w), reference.quant_linear(x, w.blocks, w.qtype),
                               atol=3e-2, rtol=1.6e-2)
