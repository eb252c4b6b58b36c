"""The CPU kernels' AVX-512, AVX2 and portable paths agree.

The compiled CPU ops pick the widest SIMD code the CPU has at run time and fall
back to portable loops on CPUs without AVX2; ``ops.set_cpu_simd(level)`` caps
the level (``False``, what a worker does for EngineOptions.disable_cpu_simd,
forces the portable loops). Every level runs on the same inputs and the
outputs are compared with the portable ones here. A level the machine lacks
takes the next narrower path, and its comparison is then trivially true.
"""

from __future__ import annotations

import pytest
import torch

from shardlm_server.worker import ops

from .test_ops import TOL, make_paged_cache

if ops.USE_REFERENCE:
    pytest.skip("SHARDLM_OPS=reference: nothing compiled to test", allow_module_level=True)


def _apply(inp: dict) -> dict:
    """Every op on the inputs; the outputs by input name."""
    out = {}
    for name, a in inp.items():
        if name.startswith("rms_norm"):
            out[name] = ops.rms_norm(a["x"], a["w"], 1e-6)
        elif name.startswith("fused"):
            x, res = a["x"].clone(), a["res"].clone()
            ops.fused_add_rms_norm(x, res, a["w"], 1e-6)
            out[name] = (x, res)
        elif name.startswith("silu"):
            out[name] = ops.silu_and_mul(a["x"])
        elif name.startswith("gelu"):
            out[name] = ops.gelu_tanh_and_mul(a["x"])
        elif name.startswith("cache"):
            kc, vc = a["k_cache"].clone(), a["v_cache"].clone()
            ops.reshape_and_cache(a["k"], a["v"], kc, vc, a["slots"])
            out[name] = (kc, vc)
        elif name.startswith("rotary"):
            q, k = a["q"].clone(), a["k"].clone()
            ops.rotary_embedding(a["pos"], q, k, a["q"].shape[-1], a["cache"])
            out[name] = (q, k)
        elif name.startswith("linear"):
            out[name] = ops.skinny_linear(a["x"], a["w"], a["b"])
        elif name.startswith("decode"):
            out[name] = ops.paged_attention_decode(*a["args"])
        elif name.startswith("prefill"):
            out[name] = ops.paged_attention_prefill(*a["args"])
    return out


def _inputs(dtype):
    torch.manual_seed(0)
    inp = {}
    # Widths with and without a tail past the last multiple of 8.
    for n in (768, 1003):
        x = torch.randn(9, n, dtype=dtype) * 3
        w = torch.randn(n, dtype=dtype)
        inp[f"rms_norm {n}"] = {"x": x, "w": w}
        inp[f"fused {n}"] = {"x": x, "res": torch.randn(9, n, dtype=dtype), "w": w}
        inp[f"silu {n}"] = {"x": torch.randn(9, 2 * n, dtype=dtype) * 4}
        inp[f"gelu {n}"] = {"x": torch.randn(9, 2 * n, dtype=dtype) * 4}
        inp[f"linear {n}"] = {"x": torch.randn(5, n, dtype=dtype),
                              "w": torch.randn(67, n, dtype=dtype) / n**0.5,
                              "b": torch.randn(67, dtype=dtype)}
    for head_dim in (64, 36):
        inp[f"rotary {head_dim}"] = {
            "q": torch.randn(7, 12, head_dim, dtype=dtype),
            "k": torch.randn(7, 4, head_dim, dtype=dtype),
            "pos": torch.randint(0, 4096, (7,)),
            "cache": ops.compute_cos_sin_cache(head_dim, 4096, 10000.0),
        }
    # Converting writes to a cache of every other dtype (head_dim with and without a tail).
    for cache_dtype in [t for t in (torch.float32, torch.bfloat16, torch.float16) if t != dtype]:
        for head_dim in (64, 36):
            shape = (8, 4, 2, head_dim)
            inp[f"cache {cache_dtype} {head_dim}"] = {
                "k": torch.randn(7, 2, head_dim, dtype=dtype) * 3,
                "v": torch.randn(7, 2, head_dim, dtype=dtype),
                "k_cache": torch.zeros(shape, dtype=cache_dtype),
                "v_cache": torch.zeros(shape, dtype=cache_dtype),
                "slots": torch.tensor([0, 5, -1, 31, 8, 9, 17]),
            }
    # (heads, kv_heads, head_dim, block_size, context lengths, sliding window, cache dtype)
    other = torch.float32 if dtype != torch.float32 else torch.bfloat16
    for heads, kv_heads, head_dim, block_size, ctx, window, cache_dtype in [
        (12, 4, 64, 16, [1024, 1, 0, 77], 0, dtype),
        (4, 1, 36, 3, [100, 9], 0, dtype),
        (8, 2, 80, 16, [300], 0, dtype),
        (12, 4, 64, 16, [1024, 1, 0, 77], 45, dtype),
        (8, 2, 80, 16, [300, 40], 0, other),
        (4, 1, 36, 3, [100, 9], 7, torch.float16),
    ]:
        k_cache, v_cache, tables = make_paged_cache(
            ctx, block_size, kv_heads, head_dim, cache_dtype, "cpu"
        )
        q = torch.randn(len(ctx), heads, head_dim, dtype=dtype)
        lens = torch.tensor(ctx, dtype=torch.int32)
        scale = head_dim**-0.5
        args = (q, k_cache, v_cache, tables, lens, scale, max(ctx), window)
        name = f"{heads}/{kv_heads}x{head_dim} window {window} cache {cache_dtype}"
        inp[f"decode {name}"] = {"args": args}
        # Prefill: the last q_len tokens of each sequence are new.
        q_lens = [min(n, 40) for n in ctx]
        qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
        pq = torch.randn(sum(q_lens), heads, head_dim, dtype=dtype)
        pargs = (pq, k_cache, v_cache, tables, qsl, lens, scale, max(q_lens), max(ctx), window)
        inp[f"prefill {name}"] = {"args": pargs}
    return inp


def _run(inputs: dict, simd: bool | str) -> dict:
    ops.set_cpu_simd(simd)
    try:
        return _apply(inputs)
    finally:
        ops.set_cpu_simd(True)


@pytest.mark.parametrize("level", ["avx512", "avx2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_simd_and_portable_paths_agree(dtype, level):
    inputs = _inputs(dtype)
    simd, portable = _run(inputs, level), _run(inputs, False)
    assert simd.keys() == portable.keys()
    for name in simd:
        # Same operations in the same order: equal bits. SiLU's and GELU's exp
        # and the attention and linear sums differ in rounding only.
        exact = name.split()[0] in ("rms_norm", "fused", "rotary", "cache")
        tol = {"atol": 0.0, "rtol": 0.0} if exact else TOL[dtype]
        torch.testing.assert_close(
            simd[name], portable[name], **tol, msg=lambda m, n=name: f"{level} {n}: {m}"
        )
