"""The fused CPU decoder-layer halves (attention_block, mlp_block) against the same steps run op
by op (bit for bit: they call the same kernels) and against the plain reference, for dense and
GGML-block weights, decode and prefill over a cached prefix, with and without biases; opcheck.
DecoderStack (every layer in one call) against those blocks layer by layer and the reference."""

from __future__ import annotations

import pytest
import torch

from shardlm_server.worker import ops
from shardlm_server.worker.attention import AttentionMetadata
from shardlm_server.worker.ops import reference
from shardlm_server.worker.quant import quantize

from .test_ops import make_paged_cache

if ops.USE_REFERENCE:
    pytest.skip("SHARDLM_OPS=reference: nothing compiled to test", allow_module_level=True)

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, BLOCK = 96, 4, 2, 24, 128, 4
TOL = {torch.float32: {"atol": 2e-4, "rtol": 2e-4}, torch.bfloat16: {"atol": 6e-2, "rtol": 3e-2}}


def _weight(n, k, kind, dtype, gen):
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
    return w if kind == "dense" else quantize(w.float(), kind)


def _layer(kind, dtype, bias, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q_size, kv_size = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM

    def vec(n):
        return (torch.randn(n, generator=gen) * 0.1).to(dtype) if bias else None

    return {
        "input_norm": (1 + 0.1 * torch.randn(HIDDEN, generator=gen)).to(dtype),
        "post_norm": (1 + 0.1 * torch.randn(HIDDEN, generator=gen)).to(dtype),
        "qkv": _weight(q_size + 2 * kv_size, HIDDEN, kind, dtype, gen), "qkv_bias": vec(
            q_size + 2 * kv_size),
        "o": _weight(HIDDEN, q_size, kind, dtype, gen), "o_bias": vec(HIDDEN),
        "gate_up": _weight(2 * INTER, HIDDEN, kind, dtype, gen), "gate_up_bias": vec(2 * INTER),
        "down": _weight(HIDDEN, INTER, kind, dtype, gen), "down_bias": vec(HIDDEN),
    }


def _meta(new_tokens, cached, tables, is_decode):
    """Metadata for sequences with `cached` tokens in the cache and `new_tokens` new ones."""
    positions, slots, starts = [], [], [0]
    for b, (n, c) in enumerate(zip(new_tokens, cached, strict=True)):
        for p in range(c, c + n):
            positions.append(p)
            slots.append(int(tables[b, p // BLOCK]) * BLOCK + p % BLOCK)
        starts.append(starts[-1] + n)
    seq_lens = [n + c for n, c in zip(new_tokens, cached, strict=True)]
    return AttentionMetadata(
        is_decode=is_decode, positions=torch.tensor(positions), slot_mapping=torch.tensor(slots),
        block_tables=tables, seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32), max_query_len=max(new_tokens),
        max_seq_len=max(seq_lens), logits_indices=torch.tensor(starts[1:]) - 1)


def _unfused(layer, hidden, residual, cos_sin, k_cache, v_cache, meta, window=0):
    """The same steps op by op, as DecoderLayer.forward runs them; `window`: the attention's
    sliding window (0: none)."""
    tokens = hidden.shape[0]
    q_size, kv_size = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    ops.fused_add_rms_norm(hidden, residual, layer["input_norm"], 1e-5)
    q, k, v = ops.linear(hidden, layer["qkv"], layer["qkv_bias"]).split(
        [q_size, kv_size, kv_size], dim=-1)
    ops.rotary_embedding(meta.positions, q, k, HEAD_DIM, cos_sin)
    ops.reshape_and_cache(k.view(tokens, KV_HEADS, HEAD_DIM), v.view(tokens, KV_HEADS, HEAD_DIM),
                          k_cache, v_cache, meta.slot_mapping)
    q = q.reshape(tokens, HEADS, HEAD_DIM).contiguous()
    scale = HEAD_DIM**-0.5
    if meta.is_decode:
        attn = ops.paged_attention_decode(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                          scale, meta.max_seq_len, window)
    else:
        attn = ops.paged_attention_prefill(q, k_cache, v_cache, meta.block_tables,
                                           meta.query_start_loc, meta.seq_lens, scale,
                                           meta.max_query_len, meta.max_seq_len, window)
    hidden = ops.linear(attn.view(tokens, q_size), layer["o"], layer["o_bias"])
    ops.fused_add_rms_norm(hidden, residual, layer["post_norm"], 1e-5)
    return ops.linear(ops.silu_and_mul(ops.linear(hidden, layer["gate_up"], layer["gate_up_bias"])),
                      layer["down"], layer["down_bias"])


def _fused(impl, layer, hidden, residual, cos_sin, k_cache, v_cache, meta, window=0):
    heads = (HEADS, KV_HEADS, HEAD_DIM)
    out = impl.attention_block(hidden, residual, layer["input_norm"], 1e-5, layer["qkv"],
                               layer["qkv_bias"], layer["o"], layer["o_bias"], heads, cos_sin,
                               k_cache, v_cache, meta, HEAD_DIM**-0.5, window)
    return impl.mlp_block(out, residual, layer["post_norm"], 1e-5, layer["gate_up"],
                          layer["gate_up_bias"], layer["down"], layer["down_bias"])


CASES = [  # (new tokens per sequence, cached tokens per sequence, decode)
    ([1, 1, 1], [0, 6, 19], True),
    ([5, 70], [3, 0], False),
]


@pytest.mark.parametrize("kind", ["dense", "int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("new_tokens,cached,is_decode", CASES)
def test_blocks_equal_the_layer_op_by_op_and_the_reference(kind, dtype, bias, new_tokens, cached,
                                                           is_decode):
    layer = _layer(kind, dtype, bias)
    seq_lens = [n + c for n, c in zip(new_tokens, cached, strict=True)]
    k_cache, v_cache, tables = make_paged_cache(seq_lens, BLOCK, KV_HEADS, HEAD_DIM, dtype, "cpu")
    meta = _meta(new_tokens, cached, tables, is_decode)
    cos_sin = ops.compute_cos_sin_cache(HEAD_DIM, 128, 10000.0)
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(sum(new_tokens), HIDDEN, generator=gen).to(dtype)
    residual = torch.randn(sum(new_tokens), HIDDEN, generator=gen).to(dtype)

    runs = {}
    for name, run in (("fused", lambda *a: _fused(ops, layer, *a)),
                      ("unfused", lambda *a: _unfused(layer, *a)),
                      ("reference", lambda *a: _fused(reference, layer, *a))):
        h, r, kc, vc = hidden.clone(), residual.clone(), k_cache.clone(), v_cache.clone()
        out = run(h, r, cos_sin, kc, vc, meta)
        runs[name] = (out, r, kc, vc)
    for got, want in zip(runs["fused"], runs["unfused"], strict=True):
        assert torch.equal(got, want)
    for got, want in zip(runs["fused"], runs["reference"], strict=True):
        torch.testing.assert_close(got, want, **TOL[dtype])
    assert not torch.equal(runs["fused"][2], k_cache)  # the new keys were written


def _stack_args(layer):
    return (layer["input_norm"], layer["post_norm"], layer["qkv"], layer["qkv_bias"], layer["o"],
            layer["o_bias"], layer["gate_up"], layer["gate_up_bias"], layer["down"],
            layer["down_bias"])


@pytest.mark.parametrize("kind", ["dense", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("new_tokens,cached,is_decode", CASES)
def test_stack_equals_the_blocks_layer_by_layer_and_the_reference(kind, dtype, new_tokens, cached,
                                                                  is_decode):
    layers = [_layer(kind, dtype, bias=i == 1, seed=i) for i in range(3)]
    seq_lens = [n + c for n, c in zip(new_tokens, cached, strict=True)]
    caches = [make_paged_cache(seq_lens, BLOCK, KV_HEADS, HEAD_DIM, dtype, "cpu") for _ in layers]
    meta = _meta(new_tokens, cached, caches[0][2], is_decode)
    cos_sin = ops.compute_cos_sin_cache(HEAD_DIM, 128, 10000.0)
    hidden = torch.randn(sum(new_tokens), HIDDEN, generator=torch.Generator().manual_seed(1))
    hidden = hidden.to(dtype)
    heads, scale = (HEADS, KV_HEADS, HEAD_DIM), HEAD_DIM**-0.5

    def fresh_caches():
        return [(k.clone(), v.clone()) for k, v, _ in caches]

    stack = ops.DecoderStack(1e-5, heads, scale)
    for layer in layers:
        stack.add_layer(*_stack_args(layer))
    kv_stack = fresh_caches()
    got = stack.forward(hidden.clone(), cos_sin, kv_stack, meta)

    kv_blocks = fresh_caches()
    h, r = hidden.clone(), torch.zeros_like(hidden)
    for layer, (kc, vc) in zip(layers, kv_blocks, strict=True):
        h = _fused(ops, layer, h, r, cos_sin, kc, vc, meta)
    assert torch.equal(got[0], h) and torch.equal(got[1], r)
    for (k1, v1), (k2, v2) in zip(kv_stack, kv_blocks, strict=True):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)

    kv_ref = fresh_caches()
    want = reference.decoder_stack(hidden.clone(), [_stack_args(layer) for layer in layers], 1e-5,
                                   heads, scale, cos_sin, kv_ref, meta)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, **TOL[dtype])


@pytest.mark.parametrize("kind", ["dense", "int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("new_tokens,cached,is_decode", CASES)
def test_stack_logits_equal_forward_then_the_norm_and_head(kind, dtype, new_tokens, cached,
                                                          is_decode):
    """DecoderStack.logits is forward, the final norm, the last rows and the head, bit for bit
    as the model's Python runs them, and as the reference within rounding."""
    gen = torch.Generator().manual_seed(7)
    layers = [_layer(kind, dtype, bias=False, seed=i) for i in range(2)]
    norm = (1 + 0.1 * torch.randn(HIDDEN, generator=gen)).to(dtype)
    head = _weight(200, HIDDEN, kind, dtype, gen)
    seq_lens = [n + c for n, c in zip(new_tokens, cached, strict=True)]
    caches = [make_paged_cache(seq_lens, BLOCK, KV_HEADS, HEAD_DIM, dtype, "cpu") for _ in layers]
    meta = _meta(new_tokens, cached, caches[0][2], is_decode)
    cos_sin = ops.compute_cos_sin_cache(HEAD_DIM, 128, 10000.0)
    hidden = torch.randn(sum(new_tokens), HIDDEN, generator=gen).to(dtype)
    stack = ops.DecoderStack(1e-5, (HEADS, KV_HEADS, HEAD_DIM), HEAD_DIM**-0.5)
    for layer in layers:
        stack.add_layer(*_stack_args(layer))
    with pytest.raises(RuntimeError, match="no head set"):
        stack.logits(hidden.clone(), cos_sin, [(k.clone(), v.clone()) for k, v, _ in caches],
                     meta)
    stack.set_head(norm, 1e-6, head)

    got = stack.logits(hidden.clone(), cos_sin, [(k.clone(), v.clone()) for k, v, _ in caches],
                       meta)
    last, residual = stack.forward(hidden.clone(), cos_sin,
                                   [(k.clone(), v.clone()) for k, v, _ in caches], meta)
    ops.fused_add_rms_norm(last, residual, norm, 1e-6)
    want = ops.linear(last.index_select(0, meta.logits_indices), head)
    assert got.shape == (len(new_tokens), 200) and got.dtype == dtype
    assert torch.equal(got, want)

    last, residual = reference.decoder_stack(
        hidden.clone(), [_stack_args(layer) for layer in layers], 1e-5,
        (HEADS, KV_HEADS, HEAD_DIM), HEAD_DIM**-0.5, cos_sin,
        [(k.clone(), v.clone()) for k, v, _ in caches], meta)
    reference.fused_add_rms_norm(last, residual, norm, 1e-6)
    ref = reference.linear_of(last.index_select(0, meta.logits_indices), head)
    torch.testing.assert_close(got, ref, **TOL[dtype])


def test_stack_rejects_a_cache_count_that_does_not_match_its_layers():
    stack = ops.DecoderStack(1e-5, (HEADS, KV_HEADS, HEAD_DIM), HEAD_DIM**-0.5)
    stack.add_layer(*_stack_args(_layer("dense", torch.float32, False)))
    k, v, tables = make_paged_cache([2], BLOCK, KV_HEADS, HEAD_DIM, torch.float32, "cpu")
    meta = _meta([1], [1], tables, True)
    cos_sin = ops.compute_cos_sin_cache(HEAD_DIM, 128, 10000.0)
    with pytest.raises(RuntimeError, match="one key and one value cache per layer"):
        stack.forward(torch.randn(1, HIDDEN), cos_sin, [(k, v), (k, v)], meta)


def test_opcheck():
    layer = _layer("int4", torch.float32, True)
    k_cache, v_cache, tables = make_paged_cache([7, 3], BLOCK, KV_HEADS, HEAD_DIM, torch.float32,
                                                "cpu")
    meta = _meta([1, 1], [6, 2], tables, True)
    cos_sin = ops.compute_cos_sin_cache(HEAD_DIM, 128, 10000.0)
    hidden, residual = torch.randn(2, HIDDEN), torch.randn(2, HIDDEN)
    qkv, o = layer["qkv"], layer["o"]
    torch.library.opcheck(torch.ops.shardlm.attention_block, (
        torch.empty(2, HIDDEN), hidden, residual, layer["input_norm"], 1e-5, qkv.blocks,
        qkv.ggml_type, layer["qkv_bias"], o.blocks, o.ggml_type, layer["o_bias"], meta.positions,
        cos_sin, HEADS, KV_HEADS, HEAD_DIM, k_cache, v_cache, meta.slot_mapping, meta.block_tables,
        meta.seq_lens, meta.query_start_loc, True, 1, meta.max_seq_len, HEAD_DIM**-0.5))
    dense = _layer("dense", torch.float32, False)
    torch.library.opcheck(torch.ops.shardlm.mlp_block, (
        torch.empty(2, HIDDEN), hidden, residual, dense["post_norm"], 1e-5, dense["gate_up"], -1,
        None, dense["down"], -1, None))
