"""The int16 activation precision of quant_linear (ops.activations, csrc/cpu/panel_int16.cpp):
products the panel path takes from 32 input rows round each 64-element block of the input to
14-bit integers and each row of the dequantized weight to 13-bit ones; its AVX-512 VNNI, AVX2 and
portable kernels against the reference on every panel layout, the rounding, the integer range's
worst case, and that shorter products, other weights and other K stay exact.
"""

from __future__ import annotations

import pytest
import torch

from shardlm_server.worker import ops
from shardlm_server.worker.ops import activations, reference
from shardlm_server.worker.quant import dequantize_blocks, quantize, to_q4x8
from tests.worker.ops.test_int8_activations import layout_weight, simd_paths_match_reference
from tests.worker.ops.test_quant_ops import TOL, ggml_weight

if ops.USE_REFERENCE:
    pytest.skip("SHARDLM_OPS=reference: nothing compiled to test", allow_module_level=True)

LEVELS = activations.INT16_LEVELS
BLOCK = activations.INT16_BLOCK


@pytest.fixture
def int16_mode():
    ops.set_activation_precision("int16")
    yield
    ops.set_activation_precision("exact")


def panel_weight(layout: str, seed: int = 0):
    """A weight of 7 groups of 8 rows with K a multiple of 64 (the K-quant layouts' 512)."""
    if layout == "Q8_0":
        return ggml_weight(56, 5 * BLOCK, "Q8_0", seed=seed)
    if layout in ("Q4x8", "Q40x8"):
        return to_q4x8(ggml_weight(56, 5 * BLOCK, "Q4_1" if layout == "Q4x8" else "Q4_0",
                                   seed=seed))
    return layout_weight(layout, seed=seed)


def _assert_rounded(got: torch.Tensor, blocks: torch.Tensor, levels: int) -> None:
    """got is blocks ([..., block]) rounded to the nearest of 2 levels + 1 steps of its block."""
    step = blocks.abs().amax(-1, keepdim=True) / levels
    assert torch.all((got - blocks).abs() <= step / 2 * (1 + 1e-5))
    multiples = got.double() / torch.where(step > 0, step, 1).double()
    torch.testing.assert_close(multiples, multiples.round(), atol=1e-2, rtol=0)
    assert multiples.round().abs().max() <= levels


def test_rounding_is_per_input_block_and_per_weight_row():
    x = torch.randn(3, 3 * BLOCK) * torch.logspace(-3, 3, 3 * BLOCK)
    x[1, BLOCK:2 * BLOCK] = 0  # an all-zero block stays zero
    w = torch.randn(5, 3 * BLOCK) * torch.logspace(-2, 2, 3 * BLOCK)
    w[2] = 0
    rx, rw = activations.round_to_int16(x, w)
    _assert_rounded(rx.reshape(3, 3, BLOCK), x.reshape(3, 3, BLOCK), LEVELS)
    assert torch.all(rx[1, BLOCK:2 * BLOCK] == 0)
    _assert_rounded(rw, w, activations.INT16_WEIGHT_LEVELS)
    assert torch.all(rw[2] == 0)


@pytest.mark.parametrize("layout", activations.PANEL_LAYOUTS)
@pytest.mark.parametrize("m", [32, 45, 300, 1030])  # 1030: three chunks of the panel path
def test_kernel_matches_reference(int16_mode, layout, m):
    w = panel_weight(layout, seed=m)
    x, bias = torch.randn(m, w.shape[1]), torch.randn(w.shape[0])
    assert activations.rounds_panel(w.qtype, m, *w.shape)
    expected = reference.quant_linear(x, w.blocks, w.qtype, bias)
    torch.testing.assert_close(ops.quant_linear(x, w, bias), expected, **TOL[torch.float32])


@pytest.mark.parametrize("layout", ["Q4x8", "Q6Kx8", "Q8_0"])
def test_int16_is_near_exact_but_not_equal(layout):
    """On when set (results move), off again after, and about 20 times closer to exact than the
    int8 mode (relative errors about 2.4e-4 and 5e-3 on these random weights)."""
    w = panel_weight(layout)
    x = torch.randn(32, w.shape[1])
    exact = ops.quant_linear(x, w)
    errors = {}
    for precision in ("int16", "int8"):
        ops.set_activation_precision(precision)
        try:
            errors[precision] = (ops.quant_linear(x, w) - exact).norm() / exact.norm()
        finally:
            ops.set_activation_precision("exact")
    assert 0 < errors["int16"] < 4e-4
    if layout != "Q8_0":  # the int8 mode leaves Q8_0 exact
        assert errors["int16"] < errors["int8"] / 10
    torch.testing.assert_close(ops.quant_linear(x, w), exact, atol=0, rtol=0)  # off again


def test_decode_rows_and_other_weights_stay_exact(int16_mode):
    w = layout_weight("Q4Kx8")
    x = torch.randn(31, w.shape[1])  # under the int16 precision's 32 rows: the exact panel
    with activations.using("exact"):
        exact = ops.quant_linear(x, w)
    torch.testing.assert_close(ops.quant_linear(x, w), exact, atol=0, rtol=0)
    odd = ggml_weight(37, 288, "Q8_0")  # not whole groups of 8 rows: no panel
    x = torch.randn(40, 288)
    assert not activations.rounds_panel(odd.qtype, 40, 37, 288)
    torch.testing.assert_close(ops.quant_linear(x, odd),
                               x @ dequantize_blocks(odd.blocks, odd.qtype).T,
                               **TOL[torch.float32])
    # K = 288 is no whole number of 64-element blocks: the exact panel.
    w = to_q4x8(ggml_weight(56, 288, "Q4_1"))
    assert not activations.rounds_panel(w.qtype, 40, 56, 288)
    with activations.using("exact"):
        exact = ops.quant_linear(x, w)
    torch.testing.assert_close(ops.quant_linear(x, w), exact, atol=0, rtol=0)


def test_the_integer_sums_cannot_overflow(int16_mode):
    """Every input and weight at the top of its range, all of one sign: 64 products of 8191 x
    4095 a block, the most an int32 sum takes."""
    w = quantize(torch.full((64, 256), 0.5), "int8")
    x = torch.full((32, 256), 3.0)
    out = ops.quant_linear(x, w)
    with activations.using("exact"):
        exact = ops.quant_linear(x, w)
    torch.testing.assert_close(out, exact, atol=0, rtol=1e-6)
    torch.testing.assert_close(ops.quant_linear(-x, w), -out, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs(int16_mode, dtype):
    w = layout_weight("Q5x8")
    x = torch.randn(40, w.shape[1]).to(dtype)
    expected = reference.quant_linear(x, w.blocks, w.qtype)
    torch.testing.assert_close(ops.quant_linear(x, w), expected, **TOL[dtype])


@pytest.mark.parametrize("scale", [1e-20, 1e20])
def test_tiny_and_huge_activations(int16_mode, scale):
    w = layout_weight("Q40x8")
    x = torch.randn(33, w.shape[1]) * scale
    expected = reference.quant_linear(x, w.blocks, w.qtype)
    torch.testing.assert_close(ops.quant_linear(x, w) / scale, expected / scale,
                               **TOL[torch.float32])


# ------------------------------------------------------------------ AVX-512 / AVX2 / portable

def test_vnni_avx2_and_portable_paths_agree(tmp_path, int16_mode):
    inputs = {}
    for layout in activations.PANEL_LAYOUTS:
        for m in (32, 43):
            w = panel_weight(layout, seed=m)
            inputs[f"{layout} m={m}"] = {"x": torch.randn(m, w.shape[1]), "qtype": w.qtype,
                                         "blocks": w.blocks, "shape": w.shape,
                                         "b": torch.randn(w.shape[0])}
    simd_paths_match_reference(tmp_path, "int16", inputs)
