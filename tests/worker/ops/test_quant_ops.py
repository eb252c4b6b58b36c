"""quant_linear against its reference, opcheck, and its AVX-512 / AVX2 / portable paths.

Blocks come from the `gguf` package's own quantizer, so the kernel is checked on the layout
llama.cpp writes; the int8 / int4 load-time quantizer is checked against its error bound.
"""

from __future__ import annotations

import os
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch

from shardlm_server.worker import ops
from shardlm_server.worker.errors import InvalidRequestError
from shardlm_server.worker.ops import reference
from shardlm_server.worker.quant import (
    BLOCK,
    QuantizedWeight,
    cat_rows,
    check_mode,
    dequantize_blocks,
    quantize,
    to_q4x8,
)
from tests.worker.ops.test_kquant import SOURCES, k_weight

if ops.USE_REFERENCE:
    pytest.skip("SHARDLM_OPS=reference: nothing compiled to test", allow_module_level=True)

QTYPES = ("Q8_0", "Q4_0", "Q4_1")
# Float32 results differ from the reference in summation order only.
TOL = {torch.float32: {"atol": 1e-4, "rtol": 1e-4},
       torch.bfloat16: {"atol": 3e-2, "rtol": 1.6e-2},
       torch.float16: {"atol": 4e-3, "rtol": 2e-3}}


def ggml_weight(n: int, k: int, qtype: str, seed: int = 0) -> QuantizedWeight:
    rng = np.random.default_rng(seed)
    values = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)
    blocks = gguf.quants.quantize(values, gguf.GGMLQuantizationType[qtype])
    return QuantizedWeight(qtype, torch.from_numpy(np.ascontiguousarray(blocks)), (n, k))


@pytest.mark.parametrize("qtype", QTYPES)
def test_dequantize_blocks_equals_ggml(qtype):
    w = ggml_weight(9, 256, qtype)
    expected = gguf.quants.dequantize(w.blocks.numpy(), gguf.GGMLQuantizationType[qtype])
    torch.testing.assert_close(dequantize_blocks(w.blocks, qtype), torch.from_numpy(expected),
                               atol=0, rtol=0)


SHAPES = [(m, n, k) for m in (1, 2, 3, 17, 64, 512)
          for n, k in ((1, 32), (7, 256), (67, 576), (129, 1536)) if m < 512 or n * k <= 67 * 576]


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_quant_linear_matches_reference(qtype, m, n, k):
    w = ggml_weight(n, k, qtype, seed=m)
    gen = torch.Generator().manual_seed(m + n)
    x = torch.randn(m, k, generator=gen) * 2
    bias = torch.randn(n, generator=gen)
    expected = reference.quant_linear(x, w.blocks, qtype, bias)
    torch.testing.assert_close(ops.quant_linear(x, w, bias), expected, **TOL[torch.float32])
    torch.testing.assert_close(ops.quant_linear(x, w), reference.quant_linear(x, w.blocks, qtype),
                               **TOL[torch.float32])


@pytest.mark.parametrize("simd", ["avx512", "avx2"])
@pytest.mark.parametrize("n,k", [(37, 576), (130, 1536)])
@pytest.mark.parametrize("m", [2, 3, 5, 8, 9, 15])
def test_q8_0_rows_do_not_depend_on_the_batch(n, k, m, simd):
    """On AVX-512, 37 x 576 takes the scaled order (csrc/cpu/q8_0_scaled.h: eight weight rows a
    pass for one input row) and 130 x 1536 the unscaled one (four), the rest one by one; more
    input rows take each weight row alone, up to 8 a pass (9 and 15: a second pass). A row's sums
    run in its matrix's one order either way, so decoding a sequence alone, beside others or in a
    step verifying its drafts gives the same bits. AVX2 (a CPU without AVX-512, or the cap) takes
    up to 4 input rows a pass, every row in the one-row order."""
    w = ggml_weight(n, k, "Q8_0", seed=n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k + m))
    ops.set_cpu_simd(simd)
    try:
        together = ops.quant_linear(x, w)
        for i in range(m):
            assert torch.equal(ops.quant_linear(x[i:i + 1], w), together[i:i + 1])
    finally:
        ops.set_cpu_simd(True)


@pytest.mark.parametrize("m", [16, 17, 40, 130, 300, 1100])
@pytest.mark.parametrize("n,k", [(8, 32), (64, 576), (136, 1536)])
def test_q8_0_in_whole_groups_matches_reference(m, n, k):
    """From 16 rows, Q8_0 weights whose rows fill groups of 8 take the panel path
    (csrc/cpu/panel_linear.h): eight rows transposed into one panel; 1100 rows go through in
    three chunks."""
    w = ggml_weight(n, k, "Q8_0", seed=m)
    gen = torch.Generator().manual_seed(m + n)
    x = torch.randn(m, k, generator=gen) * 2
    bias = torch.randn(n, generator=gen)
    torch.testing.assert_close(ops.quant_linear(x, w, bias),
                               reference.quant_linear(x, w.blocks, "Q8_0", bias),
                               **TOL[torch.float32])


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_q4x8_holds_the_same_weights(qtype):
    w = ggml_weight(24, 96, qtype, seed=3)
    grouped = to_q4x8(w)
    layout, group_block = ("Q4x8", 160) if qtype == "Q4_1" else ("Q40x8", 144)  # the file's size
    assert grouped.qtype == layout and grouped.shape == w.shape
    assert grouped.blocks.shape == (3, 3 * group_block)
    torch.testing.assert_close(grouped.dequantize(), w.dequantize(), atol=0, rtol=0)
    assert to_q4x8(ggml_weight(12, 96, qtype)).qtype == qtype  # 12 rows: no whole groups
    assert to_q4x8(ggml_weight(8, 96, "Q8_0")).qtype == "Q8_0"


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 6, 7, 8, 9, 40, 70, 300])
@pytest.mark.parametrize("n,k", [(8, 32), (64, 576), (136, 1536)])
def test_q4x8_linear_matches_reference(qtype, m, n, k):
    w = to_q4x8(ggml_weight(n, k, qtype, seed=m))
    gen = torch.Generator().manual_seed(m + n)
    x = torch.randn(m, k, generator=gen) * 2
    bias = torch.randn(n, generator=gen)
    torch.testing.assert_close(ops.quant_linear(x, w, bias),
                               reference.quant_linear(x, w.blocks, w.qtype, bias),
                               **TOL[torch.float32])
    torch.testing.assert_close(ops.quant_linear(x, w), reference.quant_linear(x, w.blocks, w.qtype),
                               **TOL[torch.float32])


@pytest.mark.parametrize("scale", [1e-20, 1.0, 1e20])
def test_q4x8_takes_tiny_and_huge_activations(scale):
    """The AVX2 kernel pre-scales the input by powers of two down to 2^-24; products stay exact
    for normal inputs far from the subnormal range, so only summation order differs."""
    w = to_q4x8(ggml_weight(16, 64, "Q4_1", seed=5))
    x = torch.randn(2, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    expected = (x @ w.dequantize().double().T) * scale
    got = ops.quant_linear((x * scale).float(), w).double()
    torch.testing.assert_close(got, expected, atol=1e-5 * scale, rtol=1e-5)


def test_fused_q4x8_rows():
    a, b = to_q4x8(ggml_weight(16, 64, "Q4_1", 1)), to_q4x8(ggml_weight(8, 64, "Q4_1", 2))
    fused = cat_rows([a, b])
    assert fused.qtype == "Q4x8" and fused.shape == (24, 64)
    torch.testing.assert_close(fused.dequantize(), torch.cat((a.dequantize(), b.dequantize())))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 5, 40])
@pytest.mark.parametrize("kind", ["Q4_1", "Q4x8", "Q8_0"])
def test_half_activations_are_widened_not_the_weights_rounded(dtype, m, kind):
    w = to_q4x8(ggml_weight(40, 512, "Q4_1")) if kind == "Q4x8" else ggml_weight(
        33 if kind == "Q4_1" else 40, 512, kind)
    x = torch.randn(m, 512).to(dtype)
    bias = torch.randn(w.shape[0]).to(dtype)
    out = ops.quant_linear(x, w, bias)
    assert out.dtype == dtype
    torch.testing.assert_close(out, reference.quant_linear(x, w.blocks, w.qtype, bias),
                               **TOL[dtype])


def test_linear_dispatches_on_a_quantized_weight():
    w = ggml_weight(10, 64, "Q8_0")
    x = torch.randn(3, 64)
    torch.testing.assert_close(ops.linear(x, w), x @ w.dequantize().T, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("scheme,qtype,levels", [("int8", "Q8_0", 254), ("int4", "Q4_1", 15)])
def test_quantizer_error_is_within_half_a_step(scheme, qtype, levels):
    w = torch.randn(13, 128) * torch.rand(13, 1) * 3
    w[0, :BLOCK] = 0  # an all-zero block has scale 0
    q = quantize(w, scheme)
    assert q.qtype == qtype and q.shape == (13, 128) and q.blocks.dtype == torch.uint8
    blocks = w.reshape(13, -1, BLOCK)
    spread = blocks.amax(-1) - blocks.amin(-1) if qtype == "Q4_1" else 2 * blocks.abs().amax(-1)
    # Half a quantization step, plus the float16 rounding of the scale and offset.
    bound = (spread / levels * 0.5 * 1.01 + 2e-3 * blocks.abs().amax(-1)).repeat_interleave(BLOCK, 1)
    assert ((q.dequantize() - w).abs() <= bound + 1e-7).all()
    assert (q.dequantize()[0, :BLOCK] == 0).all()


def test_quantizer_writes_what_ggml_reads():
    q = quantize(torch.randn(4, 64), "int4")
    expected = gguf.quants.dequantize(q.blocks.numpy(), gguf.GGMLQuantizationType.Q4_1)
    torch.testing.assert_close(q.dequantize(), torch.from_numpy(expected), atol=0, rtol=0)


def test_fused_rows_keep_their_blocks_and_mixed_types_do_not_fuse():
    a, b = ggml_weight(4, 64, "Q4_1", 1), ggml_weight(2, 64, "Q4_1", 2)
    fused = cat_rows([a, b])
    assert fused.shape == (6, 64)
    torch.testing.assert_close(fused.dequantize(), torch.cat((a.dequantize(), b.dequantize())))
    assert cat_rows([a, ggml_weight(2, 64, "Q8_0")]) is None


def test_unknown_quantize_mode_names_the_field():
    with pytest.raises(InvalidRequestError) as err:
        check_mode("int3")
    assert err.value.metadata["field"] == "quantize"


def test_bad_inputs_are_rejected_with_a_message():
    w = ggml_weight(4, 64, "Q8_0")
    with pytest.raises(RuntimeError, match="features but the blocks hold 64"):
        torch.ops.shardlm.quant_linear(torch.empty(1, 4), torch.randn(1, 32), w.blocks, 8, None)
    with pytest.raises(RuntimeError, match="block type 12 is not supported"):
        torch.ops.shardlm.quant_linear(torch.empty(1, 4), torch.randn(1, 64), w.blocks, 12, None)
    with pytest.raises(RuntimeError, match="whole number of 20-byte blocks"):
        torch.ops.shardlm.quant_linear(torch.empty(1, 4), torch.randn(1, 64), w.blocks, 3, None)


def test_opcheck():
    w = ggml_weight(7, 64, "Q4_1")
    groupeds = [to_q4x8(ggml_weight(16, 64, qtype)) for qtype in ("Q4_0", "Q4_1")]
    rows8 = ggml_weight(16, 64, "Q8_0")
    for m in (1, 12, 20):
        x = torch.randn(m, 64)
        torch.library.opcheck(torch.ops.shardlm.quant_linear,
                              (torch.empty(m, 7), x, w.blocks, 3, torch.randn(7)))
        for grouped in groupeds:  # Q40x8 (105) and Q4x8 (100)
            torch.library.opcheck(torch.ops.shardlm.quant_linear,
                                  (torch.empty(m, 16), x, grouped.blocks, grouped.ggml_type,
                                   torch.randn(16)))
        torch.library.opcheck(torch.ops.shardlm.quant_linear,
                              (torch.empty(m, 16), x, rows8.blocks, 8, None))


# ------------------------------------------------------------------ AVX-512 / AVX2 / portable

_SCRIPT = """
import sys, torch
from shardlm_server.worker import ops
from shardlm_server.worker.quant import QuantizedWeight
ops.set_cpu_simd(sys.argv[3])
inp = torch.load(sys.argv[1])
out = {name: ops.quant_linear(a["x"], QuantizedWeight(a["qtype"], a["blocks"], a["shape"]), a["b"])
       for name, a in inp.items()}
torch.save(out, sys.argv[2])
"""


def _run(tmp_path, inputs_file, level: str):
    out_file = tmp_path / f"out_{level}.pt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    subprocess.run([sys.executable, "-c", _SCRIPT, str(inputs_file), str(out_file), level], env=env,
                   check=True, timeout=300)
    return torch.load(out_file)


def test_avx512_avx2_and_portable_paths_agree(tmp_path):
    inputs = {}
    # Q4x8 in 5 and 7 groups of 8 rows: AVX-512 takes groups in pairs for decode and in fours
    # (then twos, then ones) for the panel, so odd counts leave every remainder. Q40x8 (Q4_0)
    # is Q4x8 with m = -8 d implied. Q4Kx8, Q5Kx8, Q5x8, Q51x8 and the table layouts (Q4_K,
    # Q5_K, Q5_0, Q5_1, IQ4_XS, IQ4_NL, the grid i-quants; test_kquant.py) run the same kernels
    # with their own scales, high bits or table; Q6Kx8, Q3Kx8 and Q2Kx8 (Q6_K, Q3_K, Q2_K)
    # their own kernels.
    k_layouts = SOURCES
    for qtype in (*QTYPES, "Q4x8", "Q4x8 in 7 groups", "Q40x8 in 5 groups", "Q8_0 in groups",
                  *k_layouts):
        # 16, 23: Q8_0's panel tiles 8 + 8, 11 + 12, the grouped layouts' matrix-vector kernels
        # at many rows; 50, 300: their panel too.
        for m in (1, 2, 3, 4, 5, 8, 9, 16, 23, 50, 300):
            if qtype in k_layouts:
                w = k_weight(56, 512, k_layouts[qtype], seed=m)
            elif qtype.startswith("Q4x8") or qtype.startswith("Q40x8"):
                rows = 56 if "7 groups" in qtype else 40
                source = "Q4_0" if qtype.startswith("Q40x8") else "Q4_1"
                w = to_q4x8(ggml_weight(rows, 288, source, seed=m))
            else:
                w = ggml_weight(40 if qtype == "Q8_0 in groups" else 37, 288, qtype[:4], seed=m)
            inputs[f"{qtype} m={m}"] = {"x": torch.randn(m, w.shape[1]), "qtype": w.qtype,
                                        "blocks": w.blocks, "shape": w.shape,
                                        "b": torch.randn(w.shape[0])}
    inputs_file = tmp_path / "inputs.pt"
    torch.save(inputs, inputs_file)
    runs = {level: _run(tmp_path, inputs_file, level) for level in ("avx512", "avx2", "portable")}
    for name, a in inputs.items():
        expected = reference.quant_linear(a["x"], a["blocks"], a["qtype"], a["b"])
        for level, out in runs.items():
            torch.testing.assert_close(out[name], expected, **TOL[torch.float32],
                                       msg=lambda msg, n=name, lv=level: f"{lv} {n}: {msg}")
