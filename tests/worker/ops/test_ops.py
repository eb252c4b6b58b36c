"""Compiled ops (torch.ops.shardlm.*) against the PyTorch reference in worker.ops.reference.

Every comparison runs on CPU and, when a GPU and a CUDA build are present, on CUDA.
"""

from __future__ import annotations

import math

import pytest
import torch

from shardlm_server.worker import ops
from shardlm_server.worker.ops import reference as ref

if ops.USE_REFERENCE:
    pytest.skip("SHARDLM_OPS=reference: nothing compiled to test", allow_module_level=True)

CUDA_OK = torch.cuda.is_available() and ops.CUDA_BUILT
DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.cuda,
            pytest.mark.skipif(not CUDA_OK, reason="needs a GPU and a CUDA build of shardlm_server.worker._C"),
        ],
    ),
]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Kernels and reference round identically; remaining differences come from the
# order of float32 sums (one low-precision ulp at most after rounding).
TOL = {
    torch.float32: {"atol": 2e-5, "rtol": 1e-4},
    torch.bfloat16: {"atol": 1.6e-2, "rtol": 1.6e-2},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
}
EXACT = {"atol": 0.0, "rtol": 0.0}


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# --------------------------------------------------------------------------- norms / act

# Widths that are no multiple of the CUDA kernels' 16-byte vector (4 floats, 8 halves) run
# their scalar variant (VEC = 1): 13 and 1001 here, 2 * 13 and 2 * 1001 for silu_and_mul.


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "shape", [(1, 8), (5, 40), (17, 1000), (2, 3, 4096), (3, 13), (7, 1001)]
)
def test_rms_norm(device, dtype, shape):
    x = torch.randn(shape, dtype=dtype, device=device) * 3
    w = torch.randn(shape[-1], dtype=dtype, device=device)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6), **TOL[dtype])
    expected = ref.rms_norm(x, w, 1e-5)
    ops.rms_norm(x, w, 1e-5, out=x)  # in place
    torch.testing.assert_close(x, expected, **TOL[dtype])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 24), (9, 4096), (3, 13), (7, 1001)])
def test_fused_add_rms_norm(device, dtype, shape):
    x = torch.randn(shape, dtype=dtype, device=device)
    res = torch.randn(shape, dtype=dtype, device=device)
    w = torch.randn(shape[-1], dtype=dtype, device=device)
    x_ref, res_ref = x.clone(), res.clone()
    ref.fused_add_rms_norm(x_ref, res_ref, w, 1e-6)
    ops.fused_add_rms_norm(x, res, w, 1e-6)
    torch.testing.assert_close(res, res_ref, **EXACT)  # one rounded add: bit-exact
    torch.testing.assert_close(x, x_ref, **TOL[dtype])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "shape", [(1, 2 * 8), (3, 2 * 24), (33, 2 * 1000), (3, 2 * 13), (7, 2 * 1001)]
)
def test_silu_and_mul(device, dtype, shape):
    x = torch.randn(shape, dtype=dtype, device=device) * 4
    torch.testing.assert_close(ops.silu_and_mul(x), ref.silu_and_mul(x), **TOL[dtype])


# --------------------------------------------------------------------------- rotary


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "heads,kv_heads,head_size,rot_dim,fused",
    [(4, 2, 64, 64, True), (3, 3, 24, 24, False), (2, 1, 128, 64, True), (8, 1, 72, 72, False)],
)
def test_rotary_embedding(device, dtype, heads, kv_heads, head_size, rot_dim, fused):
    tokens = 11
    cache = ops.compute_cos_sin_cache(rot_dim, 4096, 10000.0).to(device)
    positions = torch.randint(0, 4096, (tokens,), device=device)
    q_w, k_w = heads * head_size, kv_heads * head_size
    if fused:  # q and k are row-strided slices of one qkv tensor, as in the model
        qkv = torch.randn(tokens, q_w + 2 * k_w, dtype=dtype, device=device)
        q, k = qkv[:, :q_w], qkv[:, q_w : q_w + k_w]
    else:  # 3-D [T, heads, head_size] layout
        q = torch.randn(tokens, heads, head_size, dtype=dtype, device=device)
        k = torch.randn(tokens, kv_heads, head_size, dtype=dtype, device=device)
    q_ref, k_ref = q.clone(), k.clone()
    ref.rotary_embedding(positions, q_ref, k_ref, head_size, cache)
    ops.rotary_embedding(positions, q, k, head_size, cache)
    # Same float32 products and sums, one rounding: bit-exact in every dtype.
    torch.testing.assert_close(q, q_ref, **EXACT)
    torch.testing.assert_close(k, k_ref, **EXACT)
    if fused:
        v_before = qkv[:, q_w + k_w :].clone()
        ops.rotary_embedding(positions, q, k, head_size, cache)
        assert torch.equal(qkv[:, q_w + k_w :], v_before)  # v untouched


@pytest.mark.parametrize(
    "rope_scaling",
    [
        None,
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ],
)
def test_rotary_matches_transformers(rope_scaling):
    """float32: cos/sin cache + op reproduce HF's LlamaRotaryEmbedding bit for bit."""
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    from transformers import LlamaConfig

    head_dim, heads, base, tokens = 64, 4, 500000.0, 9
    rope = {"rope_type": "default", "rope_theta": base, **(rope_scaling or {})}
    config = LlamaConfig(
        hidden_size=head_dim * heads,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=head_dim,
        max_position_embeddings=131072,
        rope_parameters=rope,
    )
    positions = torch.tensor([0, 1, 2, 100, 4095, 8191, 8192, 30000, 131071])
    q = torch.randn(1, heads, tokens, head_dim)
    k = torch.randn(1, heads, tokens, head_dim)
    cos, sin = llama.LlamaRotaryEmbedding(config)(q, positions[None])
    q_hf, k_hf = llama.apply_rotary_pos_emb(q, k, cos, sin)

    cache = ops.compute_cos_sin_cache(head_dim, 131072, base, rope_scaling)
    q_ours = q[0].transpose(0, 1).contiguous()  # [T, heads, head_dim]
    k_ours = k[0].transpose(0, 1).contiguous()
    ops.rotary_embedding(positions, q_ours, k_ours, head_dim, cache)
    torch.testing.assert_close(q_ours, q_hf[0].transpose(0, 1), **EXACT)
    torch.testing.assert_close(k_ours, k_hf[0].transpose(0, 1), **EXACT)


def test_cos_sin_cache_rope_types():
    cache = ops.compute_cos_sin_cache(8, 5, 10000.0)
    assert cache.shape == (5, 8) and cache.dtype == torch.float32
    torch.testing.assert_close(cache[0], torch.tensor([1.0] * 4 + [0.0] * 4))
    legacy = {"type": "default"}  # pre-4.45 transformers spelling
    assert torch.equal(ops.compute_cos_sin_cache(8, 5, 10000.0, legacy), cache)
    with pytest.raises(ValueError, match="yarn"):
        ops.compute_cos_sin_cache(8, 5, 10000.0, {"rope_type": "yarn", "factor": 2.0})


# --------------------------------------------------------------------------- kv cache


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size,kv_heads,head_dim", [(1, 2, 24), (3, 1, 40), (16, 4, 64)])
def test_reshape_and_cache(device, dtype, block_size, kv_heads, head_dim):
    tokens, num_blocks = 10, 12
    # k/v as views of a fused qkv projection: row stride > kv_heads * head_dim.
    width = kv_heads * head_dim
    qkv = torch.randn(tokens, 3 * width, dtype=dtype, device=device)
    k = qkv[:, width : 2 * width].view(tokens, kv_heads, head_dim)
    v = qkv[:, 2 * width :].view(tokens, kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, device=device)[:tokens]
    slots[[2, 7]] = -1  # padding tokens
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, dtype=dtype, device=device)
    v_cache = torch.randn(shape, dtype=dtype, device=device)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    ref.reshape_and_cache(k, v, k_ref, v_ref, slots)
    ops.reshape_and_cache(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


# --------------------------------------------------------------------------- attention


def make_paged_cache(seq_lens, block_size, kv_heads, head_dim, dtype, device, misalign=False):
    """Random caches and shuffled block tables; unused table entries are -1.

    misalign=True offsets the caches by one element (still contiguous), which forces the
    CUDA kernels off their 16-byte vector loads onto the scalar path.
    """
    needed = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(needed) + 2
    perm = torch.randperm(num_blocks).tolist()
    tables = torch.full((len(seq_lens), max(needed + [1])), -1, dtype=torch.int32)
    for b, n in enumerate(needed):
        tables[b, :n] = torch.tensor(perm[:n], dtype=torch.int32)
        perm = perm[n:]
    shape = (num_blocks, block_size, kv_heads, head_dim)
    off = int(misalign)
    numel = math.prod(shape)
    k_cache = torch.randn(numel + off, dtype=dtype, device=device)[off:].view(shape)
    v_cache = torch.randn(numel + off, dtype=dtype, device=device)[off:].view(shape)
    return k_cache, v_cache, tables.to(device)


# (heads, kv_heads, head_dim, block_size, context lengths, misaligned cache); 0 = padding row.
DECODE_CASES = [
    (4, 4, 64, 16, [1, 17, 0, 300], False),
    (4, 2, 24, 3, [5, 0, 40], False),
    (8, 2, 40, 1, [33, 2], False),
    (7, 1, 72, 16, [2000, 1, 513], False),
    (4, 1, 128, 16, [1100, 7], False),
    (2, 2, 80, 3, [512, 1024, 0], False),
    (2, 1, 256, 16, [600, 9], False),
    (4, 2, 36, 16, [700, 3], False),
    (4, 2, 128, 3, [530, 0, 64], True),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size,ctx,misalign", DECODE_CASES)
def test_paged_attention_decode(
    device, dtype, heads, kv_heads, head_dim, block_size, ctx, misalign
):
    k_cache, v_cache, tables = make_paged_cache(
        ctx, block_size, kv_heads, head_dim, dtype, device, misalign
    )
    # q as a strided view of a fused qkv row (the model passes such views).
    fused = torch.randn(len(ctx), heads + 2 * kv_heads, head_dim, dtype=dtype, device=device)
    q = fused[:, :heads]
    context_lens = torch.tensor(ctx, dtype=torch.int32, device=device)
    scale = head_dim**-0.5
    out = torch.full(q.shape, float("nan"), dtype=dtype, device=device)  # every element written
    ops.paged_attention_decode(q, k_cache, v_cache, tables, context_lens, scale, max(ctx), out=out)
    expected = ref.paged_attention_decode(
        q, k_cache, v_cache, tables, context_lens, scale, max(ctx)
    )
    torch.testing.assert_close(out, expected, **TOL[dtype])
    assert torch.all(out[context_lens == 0] == 0)


# (heads, kv_heads, head_dim, block_size, [(cached prefix, new tokens), ...], misaligned cache)
PREFILL_CASES = [
    (4, 4, 64, 16, [(0, 5), (13, 7), (0, 1), (40, 33)], False),
    (4, 2, 24, 3, [(0, 19), (5, 0), (2, 4)], False),
    (7, 1, 72, 1, [(10, 17), (0, 9)], False),
    (8, 2, 40, 16, [(100, 40)], False),
    (2, 1, 128, 3, [(0, 37), (70, 2)], False),
    (2, 2, 256, 16, [(20, 18)], False),
    (4, 2, 36, 16, [(3, 21)], False),
    (4, 1, 64, 3, [(50, 20), (0, 3)], True),
]


def _prefill_inputs(seqs, device):
    q_lens = [n for _, n in seqs]
    seq_lens = [p + n for p, n in seqs]
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return qsl.to(device), torch.tensor(seq_lens, dtype=torch.int32, device=device), q_lens


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size,seqs,misalign", PREFILL_CASES)
def test_paged_attention_prefill(
    device, dtype, heads, kv_heads, head_dim, block_size, seqs, misalign
):
    qsl, seq_lens, q_lens = _prefill_inputs(seqs, device)
    k_cache, v_cache, tables = make_paged_cache(
        seq_lens.tolist(), block_size, kv_heads, head_dim, dtype, device, misalign
    )
    q = torch.randn(sum(q_lens), heads, head_dim, dtype=dtype, device=device)
    scale = head_dim**-0.5
    args = (q, k_cache, v_cache, tables, qsl, seq_lens, scale, max(q_lens), max(seq_lens.tolist()))
    out = ops.paged_attention_prefill(*args)
    torch.testing.assert_close(out, ref.paged_attention_prefill(*args), **TOL[dtype])


@pytest.mark.parametrize("device", DEVICES)
def test_prefill_continuation_and_decode_agree(device):
    """Whole-prompt prefill == cached prefix + continued prefill == token-by-token decode."""
    heads, kv_heads, head_dim, block_size, n = 4, 2, 40, 3, 29
    k_cache, v_cache, tables = make_paged_cache(
        [n], block_size, kv_heads, head_dim, torch.float32, device
    )
    q = torch.randn(n, heads, head_dim, device=device)
    scale = head_dim**-0.5

    def prefill(prefix):
        qsl = torch.tensor([0, n - prefix], dtype=torch.int32, device=device)
        lens = torch.tensor([n], dtype=torch.int32, device=device)
        return ops.paged_attention_prefill(
            q[prefix:], k_cache, v_cache, tables, qsl, lens, scale, n - prefix, n
        )

    full = prefill(0)
    torch.testing.assert_close(prefill(20), full[20:], **TOL[torch.float32])
    for t in (0, 11, n - 1):
        lens = torch.tensor([t + 1], dtype=torch.int32, device=device)
        dec = ops.paged_attention_decode(q[t : t + 1], k_cache, v_cache, tables, lens, scale, t + 1)
        torch.testing.assert_close(dec[0], full[t], **TOL[torch.float32])


# --------------------------------------------------------------------------- linear


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 7, 64])
@pytest.mark.parametrize("out_features,in_features", [(64, 48), (37, 1003), (1030, 13), (5, 0)])
@pytest.mark.parametrize("bias", [False, True])
def test_skinny_linear(dtype, rows, out_features, in_features, bias):
    """Odd sizes reach every tail: rows past the last pair, features past the last block of 4,
    inputs past the last 8 lanes."""
    x = torch.randn(rows, in_features, dtype=dtype)
    w = torch.randn(out_features, in_features, dtype=dtype) / max(1, in_features) ** 0.5
    b = torch.randn(out_features, dtype=dtype) if bias else None
    expected = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
    torch.testing.assert_close(ops.skinny_linear(x, w, b).float(), expected, **TOL[dtype])
    torch.testing.assert_close(ref.skinny_linear(x, w, b).float(), expected, **TOL[dtype])


def test_linear_routes_decode_rows_to_skinny_linear(monkeypatch):
    calls = []
    monkeypatch.setattr(ops, "skinny_linear", lambda x, w, b=None: calls.append(x.shape) or x)
    w = torch.randn(8, 8)
    ops.linear(torch.randn(2, 8), w)
    ops.linear(torch.randn(ops.SKINNY_MAX_ROWS[torch.float32] + 1, 8), w)  # BLAS's turn
    ops.linear(torch.randn(8, 2).t(), w)  # not contiguous: torch handles it
    assert calls == [(2, 8)]


def test_reference_switch(monkeypatch):
    calls = []
    monkeypatch.setattr(ops, "USE_REFERENCE", True)
    monkeypatch.setattr(ref, "silu_and_mul", lambda x, out=None: calls.append(x) or x)
    ops.silu_and_mul(torch.ones(1, 2))
    assert len(calls) == 1


# --------------------------------------------------------------------------- opcheck


def _opcheck_cases():
    t, h, kvh, d, bs = 3, 2, 1, 8, 2
    x = torch.randn(t, 16)
    w = torch.randn(16)
    cache = torch.randn(4, bs, kvh, d)
    tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    return {
        "rms_norm": (torch.empty_like(x), x, w, 1e-6),
        "fused_add_rms_norm": (x.clone(), x.clone(), w, 1e-6),
        "rotary_embedding": (
            torch.tensor([0, 5, 2]),
            torch.randn(t, h * d),
            torch.randn(t, kvh * d),
            d,
            ops.compute_cos_sin_cache(d, 8, 10000.0),
        ),
        "silu_and_mul": (torch.empty(t, 8), x),
        "gelu_tanh_and_mul": (torch.empty(t, 8), x),
        "skinny_linear": (torch.empty(t, 5), x, torch.randn(5, 16), torch.randn(5)),
        "reshape_and_cache": (
            torch.randn(t, kvh, d),
            torch.randn(t, kvh, d),
            cache.clone(),
            cache.clone(),
            torch.tensor([0, -1, 5]),
        ),
        "paged_attention_decode": (
            torch.empty(2, h, d),
            torch.randn(2, h, d),
            cache,
            cache.clone(),
            tables,
            torch.tensor([3, 0], dtype=torch.int32),
            0.3,
            3,
        ),
        "paged_attention_prefill": (
            torch.empty(3, h, d),
            torch.randn(3, h, d),
            cache,
            cache.clone(),
            tables,
            torch.tensor([0, 2, 3], dtype=torch.int32),
            torch.tensor([4, 1], dtype=torch.int32),
            0.3,
            2,
            4,
        ),
    }


@pytest.mark.parametrize("name", sorted(_opcheck_cases()))
def test_opcheck(name):
    op = getattr(torch.ops.shardlm, name).default
    torch.library.opcheck(op, _opcheck_cases()[name])
