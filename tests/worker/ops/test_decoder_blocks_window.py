"""The fused CPU blocks with a sliding window and / or a KV cache of another dtype than the
model's: attention_block + mlp_block against the same steps op by op (bit for bit) and the
reference; DecoderStack with a window per layer (windowed and global layers interleaved, as
Gemma 3's) against the blocks layer by layer and against its SHARDLM_OPS=reference twin."""

from __future__ import annotations

import pytest
import torch

from shardlm_server.worker import ops
from shardlm_server.worker.ops import native, reference

from .test_decoder_blocks import (
    BLOCK,
    CASES,
    HEAD_DIM,
    HEADS,
    HIDDEN,
    KV_HEADS,
    TOL,
    _fused,
    _layer,
    _meta,
    _stack_args,
    _unfused,
)
from .test_ops import make_paged_cache

if ops.USE_REFERENCE:
    pytest.skip("SHARDLM_OPS=reference: nothing compiled to test", allow_module_level=True)

# TOL has no float16 entry: float16 models are covered by the op tests.
MODEL_CACHE = [
    pytest.param(torch.float32, torch.float32, id="float32"),
    pytest.param(torch.float32, torch.bfloat16, id="float32-cache-bfloat16"),
    pytest.param(torch.float32, torch.float16, id="float32-cache-float16"),
    pytest.param(torch.bfloat16, torch.bfloat16, id="bfloat16"),
    pytest.param(torch.bfloat16, torch.float32, id="bfloat16-cache-float32"),
]


def _tol(dtype, cache_dtype):
    """A float32 model over a bfloat16 / float16 cache: a float32 rounding difference (sum
    order) can flip a key's rounding to the cache dtype, which the next layer carries on; so
    the cache dtype's tolerance."""
    if cache_dtype in (torch.float32, dtype):
        return TOL[dtype]
    return {torch.float16: {"atol": 3e-3, "rtol": 3e-3}, torch.bfloat16: TOL[torch.bfloat16]}[
        cache_dtype]


def _inputs(dtype, cache_dtype, new_tokens, cached, layers=1):
    seq_lens = [n + c for n, c in zip(new_tokens, cached, strict=True)]
    caches = [make_paged_cache(seq_lens, BLOCK, KV_HEADS, HEAD_DIM, cache_dtype, "cpu")
              for _ in range(layers)]
    cos_sin = ops.compute_cos_sin_cache(HEAD_DIM, 128, 10000.0)
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(sum(new_tokens), HIDDEN, generator=gen).to(dtype)
    residual = torch.randn(sum(new_tokens), HIDDEN, generator=gen).to(dtype)
    return caches, cos_sin, hidden, residual


@pytest.mark.parametrize("dtype,cache_dtype", MODEL_CACHE)
@pytest.mark.parametrize("window", [0, 1, 3, 5, 200])
@pytest.mark.parametrize("kind", ["dense", "int4"])
@pytest.mark.parametrize("new_tokens,cached,is_decode", CASES)
def test_blocks_with_window_and_cache_dtype(dtype, cache_dtype, window, kind, new_tokens,
                                            cached, is_decode):
    layer = _layer(kind, dtype, bias=True)
    [(k_cache, v_cache, tables)], cos_sin, hidden, residual = _inputs(
        dtype, cache_dtype, new_tokens, cached)
    meta = _meta(new_tokens, cached, tables, is_decode)
    runs = {}
    for name, run in (("fused", lambda *a: _fused(ops, layer, *a, window)),
                      ("unfused", lambda *a: _unfused(layer, *a, window)),
                      ("reference", lambda *a: _fused(reference, layer, *a, window))):
        h, r, kc, vc = hidden.clone(), residual.clone(), k_cache.clone(), v_cache.clone()
        out = run(h, r, cos_sin, kc, vc, meta)
        runs[name] = (out, r, kc, vc)
    assert runs["fused"][0].dtype == dtype and runs["fused"][2].dtype == cache_dtype
    for got, want in zip(runs["fused"], runs["unfused"], strict=True):
        assert torch.equal(got, want)
    for got, want in zip(runs["fused"], runs["reference"], strict=True):
        torch.testing.assert_close(got, want, **_tol(dtype, cache_dtype))


WINDOWS = [4, 0, 7]  # windowed and global layers interleaved


@pytest.mark.parametrize("dtype,cache_dtype", MODEL_CACHE)
@pytest.mark.parametrize("new_tokens,cached,is_decode", CASES)
def test_stack_with_a_window_per_layer(dtype, cache_dtype, new_tokens, cached, is_decode,
                                       monkeypatch):
    layers = [_layer("dense", dtype, bias=i == 1, seed=i) for i in range(len(WINDOWS))]
    caches, cos_sin, hidden, _ = _inputs(dtype, cache_dtype, new_tokens, cached, len(layers))
    meta = _meta(new_tokens, cached, caches[0][2], is_decode)
    heads, scale = (HEADS, KV_HEADS, HEAD_DIM), HEAD_DIM**-0.5

    def fresh_caches():
        return [(k.clone(), v.clone()) for k, v, _ in caches]

    def run_stack():
        stack = ops.DecoderStack(1e-5, heads, scale)
        for layer, window in zip(layers, WINDOWS, strict=True):
            stack.add_layer(*_stack_args(layer), sliding_window=window)
        kv = fresh_caches()
        return stack.forward(hidden.clone(), cos_sin, kv, meta), kv

    got, kv_stack = run_stack()
    kv_blocks = fresh_caches()
    h, r = hidden.clone(), torch.zeros_like(hidden)
    for layer, (kc, vc), window in zip(layers, kv_blocks, WINDOWS, strict=True):
        h = _fused(ops, layer, h, r, cos_sin, kc, vc, meta, window)
    assert torch.equal(got[0], h) and torch.equal(got[1], r)
    for (k1, v1), (k2, v2) in zip(kv_stack, kv_blocks, strict=True):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)

    monkeypatch.setattr(native, "USE_REFERENCE", True)  # the stack's reference twin
    want, _ = run_stack()
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, **_tol(dtype, cache_dtype))
    if is_decode:  # without the windows the result differs
        no_window = reference.decoder_stack(
            hidden.clone(), [_stack_args(layer) for layer in layers], 1e-5, heads, scale,
            cos_sin, fresh_caches(), meta)
        assert not torch.allclose(got[0].float(), no_window[0].float(), **TOL[dtype])


def test_stack_rejects_a_negative_window():
    stack = ops.DecoderStack(1e-5, (HEADS, KV_HEADS, HEAD_DIM), HEAD_DIM**-0.5)
    with pytest.raises(RuntimeError, match="sliding_window must be >= 0"):
        stack.add_layer(*_stack_args(_layer("dense", torch.float32, False)), sliding_window=-1)


def test_opcheck_attention_block_with_window_and_bfloat16_cache():
    layer = _layer("dense", torch.float32, True)
    k_cache, v_cache, tables = make_paged_cache([7, 3], BLOCK, KV_HEADS, HEAD_DIM,
                                                torch.bfloat16, "cpu")
    meta = _meta([1, 1], [6, 2], tables, True)
    cos_sin = ops.compute_cos_sin_cache(HEAD_DIM, 128, 10000.0)
    hidden, residual = torch.randn(2, HIDDEN), torch.randn(2, HIDDEN)
    torch.library.opcheck(torch.ops.shardlm.attention_block, (
        torch.empty(2, HIDDEN), hidden, residual, layer["input_norm"], 1e-5, layer["qkv"], -1,
        layer["qkv_bias"], layer["o"], -1, layer["o_bias"], meta.positions, cos_sin, HEADS,
        KV_HEADS, HEAD_DIM, k_cache, v_cache, meta.slot_mapping, meta.block_tables,
        meta.seq_lens, meta.query_start_loc, True, 1, meta.max_seq_len, HEAD_DIM**-0.5, 3))
