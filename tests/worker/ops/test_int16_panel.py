"""The int16 activation precision of quant_linear (ops.activations, csrc/cpu/panel_int16.cpp):
products the panel path takes from 32 input rows round each 32-element block of the input
and of the dequantized weight to 14-bit integers; its AVX-512 VNNI, AVX2 and portable kernels
against the reference on every panel layout, the rounding, the integer range's worst case, and
that shorter products and other weights stay exact.
"""

from __future__ import annotations

import pytest
import torch

from shardlm_server.worker import ops
from shardlm_server.worker.ops import activations, reference
from shardlm_server.worker.quant import dequantize_blocks, quantize
from tests.worker.ops.test_int8_activations import layout_weight, simd_paths_match_reference
from tests.worker.ops.test_quant_ops import TOL, ggml_weight

if ops.USE_REFERENCE:
    pytest.skip("SHARDLM_OPS=reference: nothing compiled to test", allow_module_level=True)

LEVELS = activations.INT16_LEVELS


@pytest.fixture
def int16_mode():
    ops.set_activation_precision("int16")
    yield
    ops.set_activation_precision("exact")


def panel_weight(layout: str, seed: int = 0):
    if layout == "Q8_0":
        return ggml_weight(56, 288, "Q8_0", seed=seed)
    return layout_weight(layout, seed=seed)


def test_rounding_is_per_block_to_the_nearest_of_16383_levels():
    x = torch.randn(3, 96) * torch.logspace(-3, 3, 96)
    x[1, 32:64] = 0  # an all-zero block stays zero
    rounded = activations.round_blocks(x, LEVELS)
    blocks, got = x.reshape(3, 3, 32), rounded.reshape(3, 3, 32)
    step = blocks.abs().amax(-1, keepdim=True) / LEVELS
    assert torch.all((got - blocks).abs() <= step / 2 * (1 + 1e-5))
    assert torch.all(got[1, 1] == 0)
    levels = got.double() / torch.where(step > 0, step, 1).double()
    torch.testing.assert_close(levels, levels.round(), atol=1e-2, rtol=0)
    assert levels.round().abs().max() <= LEVELS


@pytest.mark.parametrize("layout", activations.PANEL_LAYOUTS)
@pytest.mark.parametrize("m", [32, 45, 300, 1030])  # 1030: three chunks of the panel path
def test_kernel_matches_reference(int16_mode, layout, m):
    w = panel_weight(layout, seed=m)
    x, bias = torch.randn(m, w.shape[1]), torch.randn(w.shape[0])
    assert activations.rounds_panel(w.qtype, m, w.shape[0])
    expected = reference.quant_linear(x, w.blocks, w.qtype, bias)
    torch.testing.assert_close(ops.quant_linear(x, w, bias), expected, **TOL[torch.float32])


@pytest.mark.parametrize("layout", ["Q4x8", "Q6Kx8", "Q8_0"])
def test_int16_is_near_exact_but_not_equal(layout):
    """On when set (results move), off again after, and 64 times finer than int8's rounding."""
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
    assert 0 < errors["int16"] < 2e-4
    if layout != "Q8_0":  # the int8 mode leaves Q8_0 exact
        assert errors["int16"] < errors["int8"] / 20
    torch.testing.assert_close(ops.quant_linear(x, w), exact, atol=0, rtol=0)  # off again


def test_decode_rows_and_other_weights_stay_exact(int16_mode):
    w = layout_weight("Q4Kx8")
    x = torch.randn(31, w.shape[1])  # under the int16 precision's 32 rows: the exact panel
    with activations.using("exact"):
        exact = ops.quant_linear(x, w)
    torch.testing.assert_close(ops.quant_linear(x, w), exact, atol=0, rtol=0)
    odd = ggml_weight(37, 288, "Q8_0")  # not whole groups of 8 rows: no panel
    x = torch.randn(40, 288)
    assert not activations.rounds_panel(odd.qtype, 40, 37)
    torch.testing.assert_close(ops.quant_linear(x, odd),
                               x @ dequantize_blocks(odd.blocks, odd.qtype).T,
                               **TOL[torch.float32])


def test_the_integer_sums_cannot_overflow(int16_mode):
    """Every input and weight at the top of its range, all of one sign: 32 products of 8191^2 a
    block, the most an int32 sum takes."""
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
