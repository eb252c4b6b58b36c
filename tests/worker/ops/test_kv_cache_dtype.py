"""A KV cache of another dtype than the model's: every (query dtype, cache dtype) pair of
float32 / bfloat16 / float16 for reshape_and_cache (converted on write, rounded as ``.to()``:
bit for bit) and paged decode / prefill (the cache read in its dtype, the output in the
query's), with and without a sliding window, against the reference (which converts the cache
to float32), on CPU and, with a GPU and a CUDA build, on CUDA. The fused CPU attention_block
over such a cache is checked in test_decoder_blocks_window.py.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from shardlm_server.worker import ops
from shardlm_server.worker.ops import reference as ref

from .test_attention_window import _decode, _prefill
from .test_ops import DEVICES, DTYPES, TOL, make_paged_cache

if ops.USE_REFERENCE:
    pytest.skip("SHARDLM_OPS=reference: nothing compiled to test", allow_module_level=True)

PAIRS = [pytest.param(q, c, id=f"{str(q)[6:]}-cache-{str(c)[6:]}")
         for q, c in itertools.product(DTYPES, DTYPES)]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,cache_dtype", PAIRS)
@pytest.mark.parametrize("block_size,kv_heads,head_dim", [(3, 1, 40), (16, 4, 64), (4, 2, 13)])
def test_reshape_and_cache_converts(device, dtype, cache_dtype, block_size, kv_heads, head_dim):
    tokens, num_blocks = 10, 12
    width = kv_heads * head_dim
    qkv = torch.randn(tokens, 3 * width, dtype=dtype, device=device) * 3
    k = qkv[:, width : 2 * width].view(tokens, kv_heads, head_dim)
    v = qkv[:, 2 * width :].view(tokens, kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, device=device)[:tokens]
    slots[[2, 7]] = -1  # padding tokens
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, dtype=cache_dtype, device=device)
    v_cache = torch.randn(shape, dtype=cache_dtype, device=device)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    ref.reshape_and_cache(k, v, k_ref, v_ref, slots)
    ops.reshape_and_cache(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


# (heads, kv_heads, head_dim, block_size, context lengths): GQA, a padding row, a head_dim
# that is no multiple of the vector width, and (CUDA) several decode partitions.
DECODE_CASES = [
    (4, 2, 64, 16, [1, 17, 0, 300]),
    (8, 2, 36, 3, [33, 2]),
    (4, 1, 128, 16, [1100, 7]),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,cache_dtype", PAIRS)
@pytest.mark.parametrize("case", DECODE_CASES)
@pytest.mark.parametrize("window", [0, 19])
def test_decode_over_a_cache_of_another_dtype(device, dtype, cache_dtype, case, window):
    args = _decode(device, dtype, case, window, cache_dtype)
    assert args[1].dtype == cache_dtype
    out = torch.full(args[0].shape, float("nan"), dtype=dtype, device=device)
    ops.paged_attention_decode(*args, out=out)
    assert out.dtype == dtype
    torch.testing.assert_close(out, ref.paged_attention_decode(*args), **TOL[dtype])


PREFILL_CASES = [
    (4, 4, 64, 16, [(0, 5), (13, 7), (40, 33)]),
    (4, 2, 24, 3, [(0, 19), (5, 0), (2, 4)]),
    (2, 1, 80, 5, [(30, 37)]),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,cache_dtype", PAIRS)
@pytest.mark.parametrize("case", PREFILL_CASES)
@pytest.mark.parametrize("window", [0, 17])
def test_prefill_over_a_cache_of_another_dtype(device, dtype, cache_dtype, case, window):
    args = _prefill(device, dtype, case, window, cache_dtype)
    out = ops.paged_attention_prefill(*args)
    assert out.dtype == dtype
    torch.testing.assert_close(out, ref.paged_attention_prefill(*args), **TOL[dtype])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.bfloat16),
                                               (torch.float32, torch.float16),
                                               (torch.bfloat16, torch.float32)])
def test_misaligned_cache_of_another_dtype(device, dtype, cache_dtype):
    """A cache one element off 16 bytes takes the CUDA kernels' scalar loads."""
    heads, kv_heads, head_dim, block_size, ctx = 4, 2, 128, 3, [530, 0, 64]
    k_cache, v_cache, tables = make_paged_cache(ctx, block_size, kv_heads, head_dim,
                                                cache_dtype, device, misalign=True)
    q = torch.randn(len(ctx), heads, head_dim, dtype=dtype, device=device)
    lens = torch.tensor(ctx, dtype=torch.int32, device=device)
    args = (q, k_cache, v_cache, tables, lens, head_dim**-0.5, max(ctx))
    torch.testing.assert_close(ops.paged_attention_decode(*args),
                               ref.paged_attention_decode(*args), **TOL[dtype])


@pytest.mark.parametrize("device", DEVICES)
def test_cache_dtype_errors(device):
    q = torch.randn(1, 2, 8, device=device)
    cache = torch.zeros(2, 4, 1, 8, device=device)
    tables = torch.zeros(1, 2, dtype=torch.int32, device=device)
    lens = torch.tensor([3], dtype=torch.int32, device=device)
    with pytest.raises(RuntimeError, match="value_cache dtype BFloat16 != key_cache dtype Float"):
        ops.paged_attention_decode(q, cache, cache.bfloat16(), tables, lens, 1.0, 4)
    with pytest.raises(RuntimeError, match="key_cache must be float32, float16 or bfloat16"):
        ops.paged_attention_decode(q, cache.int(), cache.int(), tables, lens, 1.0, 4)
    k = torch.randn(2, 1, 8, device=device)
    slots = torch.tensor([0, 1], device=device)
    with pytest.raises(RuntimeError, match="value_cache dtype Half != key_cache dtype Float"):
        ops.reshape_and_cache(k, k, cache, cache.half(), slots)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["reshape_and_cache", "paged_attention_decode",
                                  "paged_attention_prefill"])
def test_opcheck_with_a_bfloat16_cache(device, name):
    h, kvh, d, bs, t = 2, 1, 8, 2, 3
    cache = torch.randn(4, bs, kvh, d, device=device, dtype=torch.bfloat16)
    tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=device)
    idx = {"dtype": torch.int32, "device": device}
    cases = {
        "reshape_and_cache": (
            torch.randn(t, kvh, d, device=device), torch.randn(t, kvh, d, device=device),
            cache.clone(), cache.clone(), torch.tensor([0, -1, 5], device=device)),
        "paged_attention_decode": (
            torch.empty(2, h, d, device=device), torch.randn(2, h, d, device=device), cache,
            cache.clone(), tables, torch.tensor([3, 0], **idx), 0.3, 3),
        "paged_attention_prefill": (
            torch.empty(3, h, d, device=device), torch.randn(3, h, d, device=device), cache,
            cache.clone(), tables, torch.tensor([0, 2, 3], **idx), torch.tensor([4, 1], **idx),
            0.3, 2, 4),
    }
    torch.library.opcheck(getattr(torch.ops.shardlm, name).default, cases[name])
