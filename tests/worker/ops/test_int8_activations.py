"""The int8 activation fast mode of quant_linear (ops.activations, csrc/cpu/int8_linear.cpp):
its AVX-512 VNNI, AVX2 and portable kernels against the reference on every grouped layout, the
rounding it applies, and that it stays off unless asked for and covers the grouped layouts only.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from shardlm_server.worker import ops
from shardlm_server.worker.ops import activations, reference
from shardlm_server.worker.quant import dequantize_blocks, to_q4x8
from tests.worker.ops.test_kquant import SOURCES, k_weight
from tests.worker.ops.test_quant_ops import TOL, ggml_weight

if ops.USE_REFERENCE:
    pytest.skip("SHARDLM_OPS=reference: nothing compiled to test", allow_module_level=True)


@pytest.fixture
def int8_mode():
    ops.set_activation_precision("int8")
    yield
    ops.set_activation_precision("exact")


def layout_weight(layout: str, seed: int = 0):
    """A weight of 7 groups of 8 rows (AVX-512 takes groups in pairs: one is left alone)."""
    if layout in ("Q4x8", "Q40x8"):
        return to_q4x8(ggml_weight(56, 288, "Q4_1" if layout == "Q4x8" else "Q4_0", seed=seed))
    return k_weight(56, 512, SOURCES[layout], seed=seed)


def test_rounding_is_per_block_to_the_nearest_of_255_levels():
    x = torch.randn(3, 96) * torch.logspace(-3, 3, 96)
    x[1, 32:64] = 0  # an all-zero block stays zero
    rounded = activations.round_to_int8(x)
    blocks, got = x.reshape(3, 3, 32), rounded.reshape(3, 3, 32)
    step = blocks.abs().amax(-1, keepdim=True) / 127
    assert torch.all((got - blocks).abs() <= step / 2 * (1 + 1e-6))
    assert torch.all(got[1, 1] == 0)
    levels = got / torch.where(step > 0, step, 1)
    torch.testing.assert_close(levels, levels.round(), atol=1e-4, rtol=0)


@pytest.mark.parametrize("layout", activations.INT8_LAYOUTS)
@pytest.mark.parametrize("m", [1, 2, 3, 5, 40, 72])
def test_kernel_matches_reference(int8_mode, layout, m):
    w = layout_weight(layout, seed=m)
    x, bias = torch.randn(m, w.shape[1]), torch.randn(w.shape[0])
    expected = reference.quant_linear(x, w.blocks, w.qtype, bias)
    torch.testing.assert_close(ops.quant_linear(x, w, bias), expected, **TOL[torch.float32])


@pytest.mark.parametrize("simd,vnni", [("avx512", True), ("avx512", False), ("avx2", True)])
@pytest.mark.parametrize("layout", activations.INT8_LAYOUTS)
def test_a_row_does_not_depend_on_the_rows_beside_it(int8_mode, layout, simd, vnni):
    """Many rows take each pair of groups (AVX2: each group) unpacked once
    (csrc/cpu/int8_unpacked.h), one row the direct kernels: the same sums, bit for bit (a verify
    step must compute what decode does). AVX-512 runs the odd seventh group on AVX2 too, and
    without VNNI every pair (two groups a buffer)."""
    w = layout_weight(layout, seed=7)
    x = torch.randn(72, w.shape[1])
    ops.set_cpu_simd(simd)
    ops.set_cpu_vnni(vnni)
    try:
        one_by_one = torch.cat([ops.quant_linear(x[i:i + 1], w) for i in range(len(x))])
        together = ops.quant_linear(x, w)
    finally:
        ops.set_cpu_simd(True)
        ops.set_cpu_vnni(True)
    assert torch.equal(together, one_by_one)


@pytest.mark.parametrize("layout", ["Q4Kx8", "Q6Kx8"])
def test_int8_is_close_to_exact_but_not_equal(layout):
    """The fast mode is on when set (results move) and rounds only the input (they move little)."""
    w = layout_weight(layout)
    x = torch.randn(4, w.shape[1])
    exact = ops.quant_linear(x, w)
    ops.set_activation_precision("int8")
    try:
        fast = ops.quant_linear(x, w)
    finally:
        ops.set_activation_precision("exact")
    assert not torch.equal(fast, exact)
    assert (fast - exact).norm() / exact.norm() < 2e-2
    torch.testing.assert_close(ops.quant_linear(x, w), exact, atol=0, rtol=0)  # off again


def test_other_weights_stay_exact(int8_mode):
    w = ggml_weight(37, 288, "Q8_0")  # one-row blocks: not a grouped layout
    x = torch.randn(3, 288)
    torch.testing.assert_close(ops.quant_linear(x, w),
                               x @ dequantize_blocks(w.blocks, w.qtype).T,
                               **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs(int8_mode, dtype):
    w = layout_weight("Q4Kx8")
    x = torch.randn(5, w.shape[1]).to(dtype)
    expected = reference.quant_linear(x, w.blocks, w.qtype)
    torch.testing.assert_close(ops.quant_linear(x, w), expected, **TOL[dtype])


@pytest.mark.parametrize("scale", [1e-20, 1e20])
def test_tiny_and_huge_activations(int8_mode, scale):
    w = layout_weight("Q40x8")
    x = torch.randn(2, w.shape[1]) * scale
    expected = reference.quant_linear(x, w.blocks, w.qtype)
    torch.testing.assert_close(ops.quant_linear(x, w) / scale, expected / scale,
                               **TOL[torch.float32])


def test_vnni_can_be_kept_off_and_only_takes_a_bool():
    """set_cpu_vnni(False) makes this process take an AVX-512 CPU without VNNI's paths (the
    tests above compare them); anything but a bool is refused."""
    with pytest.raises(ValueError, match="True or False"):
        ops.set_cpu_vnni(0)
    ops.set_cpu_vnni(False)
    ops.set_cpu_vnni(True)


@pytest.mark.skipif(not ops.cpu_amx_active(),
                    reason="needs a CPU with AMX int8 tiles (Intel Xeon from Sapphire Rapids on)")
@pytest.mark.parametrize("layout", activations.INT8_LAYOUTS)
def test_amx_rows_equal_the_vnni_rows(int8_mode, layout):
    """On AMX, 16 rows a pass take tiles for the layouts with one scale a block
    (csrc/cpu/int8_amx.h), the rest VNNI: the same integer sums scaled the same way, so the same
    results bit for bit with AMX kept off. 72 rows: four tiles, then a pass of 8 on VNNI."""
    w = layout_weight(layout, seed=11)
    x, bias = torch.randn(72, w.shape[1]), torch.randn(w.shape[0])
    with_amx = ops.quant_linear(x, w, bias)
    ops.set_cpu_amx(False)
    try:
        assert not ops.cpu_amx_active()
        without = ops.quant_linear(x, w, bias)
    finally:
        ops.set_cpu_amx(True)
    assert torch.equal(with_amx, without)


def test_amx_can_be_kept_off_and_only_takes_a_bool():
    with pytest.raises(ValueError, match="True or False"):
        ops.set_cpu_amx(1)
    ops.set_cpu_amx(False)
    try:
        assert not ops.cpu_amx_active()
    finally:
        ops.set_cpu_amx(True)


def test_unknown_precision_is_refused():
    with pytest.raises(ValueError, match="exact, int8"):
        ops.set_activation_precision("int4")
    assert ops.activation_precision() == "exact"


# ------------------------------------------------------------------ AVX-512 / AVX2 / portable

_SCRIPT = """
import sys, torch
from shardlm_server.worker import ops
from shardlm_server.worker.quant import QuantizedWeight
level, _, vnni = sys.argv[3].partition("-")  # "avx512-novnni": AVX-512 with VNNI kept off
ops.set_cpu_simd(level)
ops.set_cpu_vnni(vnni != "novnni")
ops.set_activation_precision(sys.argv[4])
inp = torch.load(sys.argv[1])
out = {name: ops.quant_linear(a["x"], QuantizedWeight(a["qtype"], a["blocks"], a["shape"]), a["b"])
       for name, a in inp.items()}
torch.save(out, sys.argv[2])
"""


def simd_paths_match_reference(tmp_path, precision: str, inputs: dict) -> None:
    """quant_linear of each of `inputs` (name -> x, qtype, blocks, shape, b) with `precision`
    set, run in a fresh process per SIMD level (AVX-512, AVX-512 without VNNI, AVX2, portable),
    against the reference computed here (the caller has set the same precision)."""
    inputs_file = tmp_path / "inputs.pt"
    torch.save(inputs, inputs_file)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    for level in ("avx512", "avx512-novnni", "avx2", "portable"):
        out_file = tmp_path / f"out_{level}.pt"
        subprocess.run([sys.executable, "-c", _SCRIPT, str(inputs_file), str(out_file), level,
                        precision], env=env, check=True, timeout=300)
        out = torch.load(out_file)
        for name, a in inputs.items():
            expected = reference.quant_linear(a["x"], a["blocks"], a["qtype"], a["b"])
            torch.testing.assert_close(out[name], expected, **TOL[torch.float32],
                                       msg=lambda msg, n=name, lv=level: f"{lv} {n}: {msg}")


def test_vnni_avx2_and_portable_paths_agree(tmp_path, int8_mode):
    inputs = {}
    for layout in activations.INT8_LAYOUTS:
        for m in (1, 4, 9, 72):  # 9 and 72 rows: the many-rows paths (int8_linear.cpp)
            w = layout_weight(layout, seed=m)
            inputs[f"{layout} m={m}"] = {"x": torch.randn(m, w.shape[1]), "qtype": w.qtype,
                                         "blocks": w.blocks, "shape": w.shape,
                                         "b": torch.randn(w.shape[0])}
    simd_paths_match_reference(tmp_path, "int8", inputs)
