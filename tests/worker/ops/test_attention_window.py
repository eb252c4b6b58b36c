"""Sliding-window paged attention (``sliding_window`` W > 0: a query at position p sees keys
p - W < j <= p) against the reference, on CPU and, with a GPU and a CUDA build, on CUDA.

Windows of 1, shorter than a block, no multiple of the block size, longer than one CUDA decode
partition (512 keys) and longer than the sequence; GQA; several sequences, with and without a
cached prefix; block-table entries before every window marked -1 (never read, so not checked);
the reference's mask against transformers' own sliding-window mask function; prefill
continuation and decode agree; PagedAttention passes its window through.
"""

from __future__ import annotations

import pytest
import torch

from shardlm_server.worker import ops
from shardlm_server.worker.attention import AttentionMetadata, PagedAttention
from shardlm_server.worker.ops import reference as ref

from .test_ops import DEVICES, DTYPES, TOL, _prefill_inputs, make_paged_cache

if ops.USE_REFERENCE:
    pytest.skip("SHARDLM_OPS=reference: nothing compiled to test", allow_module_level=True)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# (heads, kv_heads, head_dim, block_size, context lengths); 0 = padding row.
DECODE_CASES = [
    (4, 2, 64, 16, [1, 17, 0, 300]),
    (8, 2, 40, 3, [33, 2, 40]),
    (7, 1, 72, 16, [2000, 1, 513]),  # CUDA: several partitions within the window
]
WINDOWS = [1, 5, 19, 32, 700, 10_000]


def _decode(device, dtype, case, window, cache_dtype=None):
    heads, kv_heads, head_dim, block_size, ctx = case
    k_cache, v_cache, tables = make_paged_cache(
        ctx, block_size, kv_heads, head_dim, cache_dtype or dtype, device
    )
    q = torch.randn(len(ctx), heads, head_dim, dtype=dtype, device=device)
    lens = torch.tensor(ctx, dtype=torch.int32, device=device)
    return [q, k_cache, v_cache, tables, lens, head_dim**-0.5, max(ctx), window]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", DECODE_CASES)
@pytest.mark.parametrize("window", WINDOWS)
def test_decode_window(device, dtype, case, window):
    args = _decode(device, dtype, case, window)
    out = torch.full(args[0].shape, float("nan"), dtype=dtype, device=device)
    ops.paged_attention_decode(*args, out=out)
    torch.testing.assert_close(out, ref.paged_attention_decode(*args), **TOL[dtype])
    assert torch.all(out[args[4] == 0] == 0)
    if window < max(case[4]):  # the window changes the result
        full = ref.paged_attention_decode(*args[:-1])
        assert not torch.allclose(out.float(), full.float(), atol=1e-3)


# (heads, kv_heads, head_dim, block_size, [(cached prefix, new tokens), ...])
PREFILL_CASES = [
    (4, 4, 64, 16, [(0, 5), (13, 7), (0, 1), (40, 33)]),
    (4, 2, 24, 3, [(0, 19), (5, 0), (2, 4)]),
    (8, 2, 40, 16, [(100, 40), (0, 70)]),
    (2, 1, 128, 5, [(30, 37)]),
]


def _prefill(device, dtype, case, window, cache_dtype=None):
    heads, kv_heads, head_dim, block_size, seqs = case
    qsl, seq_lens, q_lens = _prefill_inputs(seqs, device)
    k_cache, v_cache, tables = make_paged_cache(
        seq_lens.tolist(), block_size, kv_heads, head_dim, cache_dtype or dtype, device
    )
    q = torch.randn(sum(q_lens), heads, head_dim, dtype=dtype, device=device)
    return [q, k_cache, v_cache, tables, qsl, seq_lens, head_dim**-0.5, max(q_lens),
            max(seq_lens.tolist()), window]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", PREFILL_CASES)
@pytest.mark.parametrize("window", [1, 4, 17, 32, 10_000])
def test_prefill_window(device, dtype, case, window):
    args = _prefill(device, dtype, case, window)
    out = ops.paged_attention_prefill(*args)
    torch.testing.assert_close(out, ref.paged_attention_prefill(*args), **TOL[dtype])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("window", [3, 16, 21])
def test_blocks_before_every_window_are_not_read(device, window):
    """A block every window has slid past may be handed back: its table entry (-1 here) is
    neither checked nor read, and the result is the same."""
    block_size = 4
    dec = _decode(device, torch.float32, (4, 2, 32, block_size, [50, 9, 23]), window)
    pre = _prefill(device, torch.float32, (4, 2, 32, block_size, [(40, 6), (3, 2)]), window)
    for op, args, lens, q_lens in ((ops.paged_attention_decode, dec, dec[4], [1, 1, 1]),
                                   (ops.paged_attention_prefill, pre, pre[5], [6, 2])):
        want = op(*args)
        tables = args[3].clone()
        for b, (n, q_len) in enumerate(zip(lens.tolist(), q_lens, strict=True)):
            first = max(0, n - q_len - window + 1)  # the earliest key any new token sees
            tables[b, : first // block_size] = -1
        assert (tables == -1).any()
        args[3] = tables
        torch.testing.assert_close(op(*args), want, **TOL[torch.float32])


@pytest.mark.parametrize("window", [1, 3, 6])
def test_reference_mask_is_transformers_sliding_window_mask(window):
    """The reference masks exactly as transformers' sliding_window_causal_mask_function."""
    masking = pytest.importorskip("transformers.masking_utils")
    mask_fn = masking.sliding_window_causal_mask_function(window)
    n, heads, head_dim = 9, 2, 8
    q = torch.randn(n, heads, head_dim)
    k, v = torch.randn(n, heads, head_dim), torch.randn(n, heads, head_dim)
    idx = torch.arange(n)
    allowed = mask_fn(torch.tensor(0), torch.tensor(0), idx[:, None], idx[None, :])
    scores = torch.einsum("nhd,lhd->hnl", q, k) * 0.5
    want = torch.einsum("hnl,lhd->nhd", scores.masked_fill(~allowed, float("-inf"))
                        .softmax(-1), v)
    got = ref._attend(q, k, v, 0.5, torch.arange(n), window)
    torch.testing.assert_close(got, want)
    assert allowed.sum(-1).max() == min(window, n)  # W keys, the query's own included


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("window", [1, 7, 12])
def test_window_prefill_continuation_and_decode_agree(device, window):
    """Whole-prompt prefill == cached prefix + continued prefill == token-by-token decode."""
    heads, kv_heads, head_dim, block_size, n = 4, 2, 40, 3, 29
    k_cache, v_cache, tables = make_paged_cache(
        [n], block_size, kv_heads, head_dim, torch.float32, device
    )
    q = torch.randn(n, heads, head_dim, device=device)
    scale = head_dim**-0.5
    lens = torch.tensor([n], dtype=torch.int32, device=device)

    def prefill(prefix):
        qsl = torch.tensor([0, n - prefix], dtype=torch.int32, device=device)
        return ops.paged_attention_prefill(q[prefix:], k_cache, v_cache, tables, qsl, lens,
                                           scale, n - prefix, n, window)

    full = prefill(0)
    torch.testing.assert_close(prefill(20), full[20:], **TOL[torch.float32])
    for t in (0, 11, n - 1):
        ctx = torch.tensor([t + 1], dtype=torch.int32, device=device)
        dec = ops.paged_attention_decode(q[t : t + 1], k_cache, v_cache, tables, ctx, scale,
                                         t + 1, window)
        torch.testing.assert_close(dec[0], full[t], **TOL[torch.float32])


@pytest.mark.parametrize("is_decode", [True, False])
def test_paged_attention_passes_its_window(is_decode):
    heads, kv_heads, head_dim, block_size, window = 4, 2, 16, 4, 5
    n_new, cached = (1, 20) if is_decode else (9, 11)
    n = n_new + cached
    k_cache, v_cache, tables = make_paged_cache([n], block_size, kv_heads, head_dim,
                                                torch.float32, "cpu")
    k_cache.zero_()
    v_cache.zero_()
    q = torch.randn(n_new, heads * head_dim)
    k, v = torch.randn(n_new, kv_heads * head_dim), torch.randn(n_new, kv_heads * head_dim)
    positions = torch.arange(cached, n)
    slots = tables[0, positions // block_size].long() * block_size + positions % block_size
    meta = AttentionMetadata(
        is_decode=is_decode, positions=positions, slot_mapping=slots, block_tables=tables,
        seq_lens=torch.tensor([n], dtype=torch.int32),
        query_start_loc=torch.tensor([0, n_new], dtype=torch.int32), max_query_len=n_new,
        max_seq_len=n, logits_indices=torch.tensor([n_new - 1]))
    attn = PagedAttention(heads, kv_heads, head_dim, sliding_window=window)
    got = attn(q, k, v, k_cache, v_cache, meta)
    q3 = q.view(n_new, heads, head_dim)
    qsl = meta.query_start_loc
    want = ref.paged_attention_prefill(q3, k_cache, v_cache, tables, qsl, meta.seq_lens,
                                       attn.scale, n_new, n, window)
    torch.testing.assert_close(got, want.view(n_new, -1), **TOL[torch.float32])
    with pytest.raises(ValueError, match="sliding_window must be >= 0"):
        PagedAttention(heads, kv_heads, head_dim, sliding_window=-1)


@pytest.mark.parametrize("device", DEVICES)
def test_negative_window_is_an_error(device):
    args = _decode(device, torch.float32, DECODE_CASES[0], -1)
    with pytest.raises(RuntimeError, match="sliding_window must be >= 0"):
        ops.paged_attention_decode(*args)
    args = _prefill(device, torch.float32, PREFILL_CASES[0], -2)
    with pytest.raises(RuntimeError, match="sliding_window must be >= 0"):
        ops.paged_attention_prefill(*args)


def _opcheck_cases(device):
    h, kvh, d, bs = 2, 1, 8, 2
    cache = torch.randn(4, bs, kvh, d, device=device)
    tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=device)
    idx = {"dtype": torch.int32, "device": device}
    return {
        "paged_attention_decode": (
            torch.empty(2, h, d, device=device), torch.randn(2, h, d, device=device), cache,
            cache.clone(), tables, torch.tensor([3, 0], **idx), 0.3, 3, 2),
        "paged_attention_prefill": (
            torch.empty(3, h, d, device=device), torch.randn(3, h, d, device=device), cache,
            cache.clone(), tables, torch.tensor([0, 2, 3], **idx), torch.tensor([4, 1], **idx),
            0.3, 2, 4, 3),
    }


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["paged_attention_decode", "paged_attention_prefill"])
def test_opcheck_with_window(device, name):
    op = getattr(torch.ops.shardlm, name).default
    torch.library.opcheck(op, _opcheck_cases(device)[name])
