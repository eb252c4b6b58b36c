"""The exact 4-, 5- and 6-bit kernels that read quants as float32 subnormals (csrc/cpu/subnormal.h) give
the converting kernels' results bit for bit, on every layout they take, every row count and
both SIMD paths; inputs they must not take (huge ones, rows of tiny ones) go to the converting
kernels; and a thread whose MXCSR treats subnormal inputs as zero (DAZ, what flush-denormal
settings and -ffast-math builds set) still gets the right sums.
"""

from __future__ import annotations

import pytest
import torch

from shardlm_server.worker import ops
from shardlm_server.worker.ops import reference
from shardlm_server.worker.quant import to_q4x8

from .test_kquant import k_weight
from .test_quant_ops import TOL, ggml_weight

if ops.USE_REFERENCE or not ops.cpu_simd_active():
    pytest.skip("the subnormal kernels are compiled SIMD paths", allow_module_level=True)

# Every 8-row layout in 7 groups of 8 rows: AVX-512 takes pairs and leaves one group to the
# one-group kernels. The 5- and 6-bit ones join each quant's high bits before it is read.
WEIGHTS = {
    "Q4x8": lambda: to_q4x8(ggml_weight(56, 576, "Q4_1", seed=1)),
    "Q40x8": lambda: to_q4x8(ggml_weight(56, 288, "Q4_0", seed=2)),
    "Q4Kx8": lambda: k_weight(56, 512, "Q4_K", seed=3),
    "Q6Kx8": lambda: k_weight(56, 768, "Q6_K", seed=5),
    "Q5x8": lambda: k_weight(56, 512, "Q5_0", seed=4),
    "Q5Kx8": lambda: k_weight(56, 512, "Q5_K", seed=6),
    "Q51x8": lambda: k_weight(56, 512, "Q5_1", seed=7),
    "IQ4x8": lambda: k_weight(56, 512, "IQ4_XS", seed=8),  # never subnormal: the same sums
    "IQ4NLx8": lambda: k_weight(56, 512, "IQ4_NL", seed=9),
    "Q3Kx8": lambda: k_weight(56, 768, "Q3_K", seed=10),
    "Q2Kx8": lambda: k_weight(56, 768, "Q2_K", seed=11),
    "IQ3XXSx8": lambda: k_weight(56, 512, "IQ3_XXS", seed=12),  # tables: never subnormal
    "IQ3Sx8": lambda: k_weight(56, 512, "IQ3_S", seed=13),
    "IQ2XXSx8": lambda: k_weight(56, 512, "IQ2_XXS", seed=14),
    "IQ1Sx8": lambda: k_weight(56, 512, "IQ1_S", seed=15),
    "IQ2XSx8": lambda: k_weight(56, 512, "IQ2_XS", seed=16),
    "IQ2Sx8": lambda: k_weight(56, 512, "IQ2_S", seed=17),
    "IQ1Mx8": lambda: k_weight(56, 512, "IQ1_M", seed=18),
}


@pytest.fixture
def subnormal_modes():
    """Restores the defaults (the widest SIMD path, subnormals where the probe allows)."""
    yield
    ops.set_cpu_simd(True)
    ops.set_cpu_subnormal_quants("auto")


def _both(x: torch.Tensor, w) -> tuple[torch.Tensor, torch.Tensor]:
    ops.set_cpu_subnormal_quants(True)
    subnormal = ops.quant_linear(x, w)
    ops.set_cpu_subnormal_quants(False)
    converted = ops.quant_linear(x, w)
    return subnormal, converted


@pytest.mark.parametrize("level", ["avx512", "avx2"])
@pytest.mark.parametrize("layout", list(WEIGHTS))
def test_subnormal_quants_give_the_converted_sums_bit_for_bit(subnormal_modes, level, layout):
    ops.set_cpu_simd(level)
    w = WEIGHTS[layout]()
    gen = torch.Generator().manual_seed(len(layout))
    for m in (1, 2, 3, 4, 5, 8):  # every row count of the matrix-vector kernels
        x = torch.randn(m, w.shape[1], generator=gen) * 3
        subnormal, converted = _both(x, w)
        assert torch.equal(subnormal, converted), f"{level} {layout} m={m}"
        torch.testing.assert_close(subnormal, reference.quant_linear(x, w.blocks, w.qtype),
                                   **TOL[torch.float32])


def test_the_setting_is_what_the_kernels_report(subnormal_modes):
    ops.set_cpu_subnormal_quants(True)
    assert ops.cpu_subnormal_quants_active()
    ops.set_cpu_subnormal_quants(False)
    assert not ops.cpu_subnormal_quants_active()
    ops.set_cpu_subnormal_quants(True)
    ops.set_cpu_simd(False)  # the portable loops convert
    assert not ops.cpu_subnormal_quants_active()
    with pytest.raises(ValueError, match="subnormal quants"):
        ops.set_cpu_subnormal_quants("sometimes")


@pytest.mark.parametrize("scale", [1e-24, 2.0 ** 41, float("inf")])
def test_inputs_out_of_range_take_the_converting_kernels(subnormal_modes, scale):
    """A row of inputs all below 2^-30 would sum near the subnormals, and an input of 2^40 or
    more would overflow its pre-scaling: both go to the converting kernels, so the results are
    still theirs (for infinity: the same NaNs and infinities)."""
    w = WEIGHTS["Q4x8"]()
    x = torch.randn(2, w.shape[1], generator=torch.Generator().manual_seed(9))
    x[1] *= scale
    subnormal, converted = _both(x, w)
    torch.testing.assert_close(subnormal, converted, atol=0, rtol=0, equal_nan=True)
    if scale < 1:
        expected = x[1].double() @ w.dequantize().double().T
        torch.testing.assert_close(subnormal[1].double(), expected, atol=1e-5 * scale, rtol=1e-5)


def test_a_row_of_zeros_beside_normal_rows_keeps_the_subnormal_path(subnormal_modes):
    w = WEIGHTS["Q40x8"]()
    x = torch.randn(3, w.shape[1], generator=torch.Generator().manual_seed(3))
    x[1] = 0
    subnormal, converted = _both(x, w)
    assert torch.equal(subnormal, converted)
    assert torch.count_nonzero(subnormal[1]) == 0


def test_tiny_inputs_beside_normal_ones_keep_the_bits(subnormal_modes):
    """Inputs near 2^-70 in rows of normal ones: their products land among the subnormals
    after the scaling (where a chain starts with one) and are still far below the sums' ulp."""
    w = WEIGHTS["Q4Kx8"]()
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(4, w.shape[1], generator=gen)
    tiny = torch.rand(x.shape, generator=gen) < 0.3
    x[tiny] *= 2.0 ** -70
    subnormal, converted = _both(x, w)
    assert torch.equal(subnormal, converted)


@pytest.mark.parametrize("layout", ["Q4x8", "Q5Kx8", "Q6Kx8"])
def test_denormals_as_zero_on_the_thread_does_not_zero_the_quants(subnormal_modes, layout):
    """torch.set_flush_denormal(True) sets FTZ and DAZ on the calling thread; the kernels clear
    both around their work (one thread: the calling one runs them) and restore them."""
    w = WEIGHTS[layout]()
    x = torch.randn(1, w.shape[1], generator=torch.Generator().manual_seed(4))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    if not torch.set_flush_denormal(True):
        torch.set_num_threads(threads)
        pytest.skip("this CPU cannot flush denormals")
    try:
        subnormal, converted = _both(x, w)
        flushed = torch.tensor([1e-40]) * 1.0  # DAZ/FTZ still on for the thread's own math
    finally:
        torch.set_flush_denormal(False)
        torch.set_num_threads(threads)
    assert torch.equal(subnormal, converted)
    assert flushed.item() == 0.0
