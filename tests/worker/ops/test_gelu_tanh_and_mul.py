"""gelu_tanh_and_mul (Gemma's MLP activation, ``gelu(gate, approximate="tanh") * up``) against
torch.nn.functional.gelu and the reference, on CPU and, with a GPU and a CUDA build, on CUDA;
its SIMD path against the portable one is in test_cpu_paths.py, opcheck in test_ops.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shardlm_server.worker import ops
from shardlm_server.worker.ops import reference as ref

from .test_ops import DEVICES, DTYPES, TOL

if ops.USE_REFERENCE:
    pytest.skip("SHARDLM_OPS=reference: nothing compiled to test", allow_module_level=True)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


EXACT = {"atol": 0.0, "rtol": 0.0}
# Widths that are no multiple of 8 (the AVX2 lanes, the CUDA vector of halves) reach the tails.
SHAPES = [(1, 2 * 8), (3, 2 * 24), (33, 2 * 1000), (3, 2 * 13), (7, 2 * 1001), (2, 3, 2 * 64)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_gelu_tanh_and_mul(device, dtype, shape):
    x = torch.randn(shape, dtype=dtype, device=device) * 4
    d = shape[-1] // 2
    # The activation rounded to the dtype before the multiply, as Gemma's MLP in that dtype.
    want = F.gelu(x[..., :d], approximate="tanh") * x[..., d:]
    got = ops.gelu_tanh_and_mul(x)
    assert got.shape == (*shape[:-1], d) and got.dtype == dtype
    torch.testing.assert_close(got, want, **TOL[dtype])
    torch.testing.assert_close(ref.gelu_tanh_and_mul(x), want, **EXACT)
    out = torch.full_like(got, float("nan"))
    assert ops.gelu_tanh_and_mul(x, out=out) is out
    torch.testing.assert_close(out, got, **EXACT)


@pytest.mark.parametrize("device", DEVICES)
def test_extreme_inputs(device):
    """Large |gate|: gelu(g) -> g for g >> 0 and -> 0 (not NaN: exp overflows to inf) for
    g << 0; float32, where the tanh and the sigmoid forms agree to a few ulp."""
    gate = torch.tensor([-1e4, -100.0, -20.0, -5.0, -1e-3, 0.0, 1e-3, 5.0, 20.0, 100.0, 1e4],
                        device=device)
    x = torch.cat((gate, torch.full_like(gate, 1.5)))[None]
    want = F.gelu(gate, approximate="tanh") * 1.5
    got = ops.gelu_tanh_and_mul(x)[0]
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_errors(device):
    with pytest.raises(RuntimeError, match="gelu_tanh_and_mul: input's last dimension must be even"):
        ops.gelu_tanh_and_mul(torch.randn(2, 7, device=device))
    with pytest.raises(RuntimeError, match="gelu_tanh_and_mul: out must have shape"):
        ops.gelu_tanh_and_mul(torch.randn(2, 8, device=device),
                              out=torch.empty(2, 5, device=device))
