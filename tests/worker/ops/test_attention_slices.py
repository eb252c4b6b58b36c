"""CPU attention over long contexts with few tasks: decode with few (sequence, kv head) pairs,
and prefill of a few new tokens a sequence (a speculative verify step). The keys are cut into
slices attended by separate tasks and merged by their log-sum-exp (attention.cpp,
attend_sliced). Whether a call slices depends on the thread count, so each case runs with one
thread (never sliced), two and four, against the reference and against the one-thread result;
with sliding windows, padding rows and every cache dtype under a float32 query.
"""

from __future__ import annotations

import pytest
import torch

from shardlm_server.worker import ops
from shardlm_server.worker.ops import reference as ref

from .test_ops import TOL, make_paged_cache

if ops.USE_REFERENCE:
    pytest.skip("SHARDLM_OPS=reference: nothing compiled to test", allow_module_level=True)


@pytest.fixture
def threads():
    """Sets torch's intra-op thread count for one test, then puts it back."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def outputs_at_thread_counts(threads, op, args, expected) -> list[torch.Tensor]:
    """`op(*args)` with 1 (never sliced), 2 and 4 threads: each close to the reference, and the
    sliced ones close to the unsliced one."""
    outs = []
    for n in (1, 2, 4):
        threads(n)
        out = torch.full(args[0].shape, float("nan"))
        op(*args, out=out)
        torch.testing.assert_close(out, expected, **TOL[torch.float32], msg=f"{n} threads")
        outs.append(out)
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], **TOL[torch.float32])
    return outs


# (heads, kv_heads, head_dim, block_size, context lengths); 0 = padding row.
CASES = [
    (9, 3, 64, 16, [4100]),  # the default model's heads at a 4k depth
    (4, 1, 36, 3, [1500, 0]),  # one kv head, a padding row, odd block and head sizes
    (8, 2, 80, 16, [700, 1, 2049]),  # one sequence shorter than a slice
    (9, 3, 64, 16, [300]),  # just past the shortest slice: one slice a thread
    (4, 1, 32, 16, [9000]),  # long enough for several slices a thread
]


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window", [0, 300])
@pytest.mark.parametrize("case", CASES)
def test_sliced_decode_matches_the_reference_at_every_thread_count(threads, case, window,
                                                                   cache_dtype):
    torch.manual_seed(0)
    heads, kv_heads, head_dim, block_size, ctx = case
    k_cache, v_cache, tables = make_paged_cache(ctx, block_size, kv_heads, head_dim,
                                                cache_dtype, "cpu")
    q = torch.randn(len(ctx), heads, head_dim)
    lens = torch.tensor(ctx, dtype=torch.int32)
    args = (q, k_cache, v_cache, tables, lens, head_dim**-0.5, max(ctx), window)
    expected = ref.paged_attention_decode(q, k_cache.float(), v_cache.float(), *args[3:])
    for out in outputs_at_thread_counts(threads, ops.paged_attention_decode, args, expected):
        assert torch.all(out[lens == 0] == 0)


# (heads, kv_heads, head_dim, block_size, [(context length, new tokens)]): the new tokens are the
# last of each context; a sequence with none adds nothing to the call.
PREFILL_CASES = [
    (9, 3, 64, 16, [(300, 5)]),  # the default model verifying 4 drafts: one slice a thread
    (9, 3, 64, 16, [(4100, 9)]),  # a verify step at a 4k depth
    (4, 1, 36, 3, [(1500, 16), (40, 0)]),  # a whole query tile; a sequence with no new tokens
    (8, 2, 80, 16, [(700, 2), (3, 3), (2049, 1)]),  # a sequence whose tokens are all its keys
    (4, 1, 32, 16, [(9000, 3)]),  # several slices a thread
]


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window", [0, 300])
@pytest.mark.parametrize("case", PREFILL_CASES)
def test_sliced_prefill_matches_the_reference_at_every_thread_count(threads, case, window,
                                                                    cache_dtype):
    torch.manual_seed(0)
    heads, kv_heads, head_dim, block_size, seqs = case
    lens = [n for n, _ in seqs]
    k_cache, v_cache, tables = make_paged_cache(lens, block_size, kv_heads, head_dim,
                                                cache_dtype, "cpu")
    counts = [t for _, t in seqs]
    starts = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(counts), heads, head_dim)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    args = (q, k_cache, v_cache, tables, starts, seq_lens, head_dim**-0.5, max(counts),
            max(lens), window)
    expected = ref.paged_attention_prefill(q, k_cache.float(), v_cache.float(), *args[3:])
    outputs_at_thread_counts(threads, ops.paged_attention_prefill, args, expected)
