"""A row's result does not depend on the other rows of the call, bit for bit, on the exact CPU
paths that decode and speculative verify steps take: the grouped layouts' matrix-vector kernels
at every SIMD level (1 to 9 input rows, below the panel path's rows), and paged attention, where a
verify step's rows (the prefill path) must get the bits a decode step gives each of them and a
sequence must attend the same alone or in a batch, at one thread and two (csrc/cpu/attention.cpp:
slices cut at absolute key positions). A greedy run with drafts is identical to one without only
because of this."""

from __future__ import annotations

import math

import pytest
import torch

from shardlm_server.worker import ops
from shardlm_server.worker.ops import activations
from tests.worker.ops.test_int8_activations import layout_weight

if ops.USE_REFERENCE:
    pytest.skip("SHARDLM_OPS=reference: nothing compiled to test", allow_module_level=True)

BLOCK = 16


@pytest.fixture
def threads():
    """Sets torch's intra-op thread count for one test, then puts it back."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.mark.parametrize("simd", ["avx512", "avx2", "portable"])
@pytest.mark.parametrize("layout", activations.INT8_LAYOUTS)
def test_a_grouped_row_does_not_depend_on_the_rows_beside_it(layout, simd):
    """7 groups of 8 output rows: AVX-512 takes the first six in pairs and the seventh on AVX2."""
    w = layout_weight(layout, seed=3)
    x = torch.randn(9, w.shape[1])
    ops.set_cpu_simd(simd)
    try:
        alone = torch.cat([ops.quant_linear(x[i:i + 1], w) for i in range(len(x))])
        for m in range(2, len(x) + 1):
            assert torch.equal(ops.quant_linear(x[:m], w), alone[:m]), f"{m} rows"
    finally:
        ops.set_cpu_simd(True)


def _cache(blocks: int, kv_heads: int, head_dim: int, dtype: torch.dtype):
    shape = (blocks, BLOCK, kv_heads, head_dim)
    return torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)


def _decode(q, k, v, table, context, scale, window):
    out = torch.empty_like(q)
    torch.ops.shardlm.paged_attention_decode(out, q, k, v, table, context, scale,
                                             int(context.max()), window)
    return out


# (heads, kv heads, head dim): SmolLM2's 9 / 3 (fewer kv heads than two a thread: sliced calls),
# a Llama-1B-like 32 / 8, a Qwen2.5-0.5B-like 14 / 2 (groups of 7: blocks of rows of 4 and 3
# with AVX-512, csrc/cpu/attention_rows.h; row by row with AVX2), one kv head.
HEADS = [(9, 3, 64), (32, 8, 64), (14, 2, 64), (4, 1, 32)]
# Contexts inside the first slice, across the short slices, and past them into the long ones.
CONTEXTS = [40, 300, 1030, 2600]


@pytest.fixture
def simd_level():
    """Caps the CPU ops' SIMD level for one test, then lifts the cap."""
    yield ops.set_cpu_simd
    ops.set_cpu_simd(True)


@pytest.mark.parametrize("simd", ["avx512", "avx2"])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window", [0, 700])
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("n_threads", [1, 2])
def test_a_verify_row_gets_the_bits_of_a_decode_step(threads, simd_level, n_threads, heads,
                                                     window, cache_dtype, simd):
    """A verify call's rows of a kv head go through the tile steps in blocks of rows that see
    the same keys (a token's group of heads, or several tokens' where a tile is whole for all):
    each row's bits are those of its decode step, whose block is its group alone."""
    threads(n_threads)
    simd_level(simd)
    h, kv_heads, d = heads
    scale = d ** -0.5
    for context in CONTEXTS:
        for rows in (2, 5, 9):
            blocks = math.ceil((context + rows) / BLOCK) + 1
            k, v = _cache(blocks, kv_heads, d, cache_dtype)
            table = torch.randperm(blocks, dtype=torch.int32).view(1, blocks)
            q = torch.randn(rows, h, d)
            verify = torch.empty_like(q)
            torch.ops.shardlm.paged_attention_prefill(
                verify, q, k, v, table, torch.tensor([0, rows], dtype=torch.int32),
                torch.tensor([context + rows], dtype=torch.int32), scale, rows, context + rows,
                window)
            for r in range(rows):
                decode = _decode(q[r:r + 1].contiguous(), k, v, table,
                                 torch.tensor([context + r + 1], dtype=torch.int32), scale, window)
                assert torch.equal(decode[0], verify[r]), f"context {context}, row {r} of {rows}"


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("n_threads", [1, 2])
def test_a_sequence_attends_the_same_alone_or_in_a_batch(threads, n_threads, heads, cache_dtype):
    """A batch splits its work by kv head or by runs of slices (attention_slices.h), a lone
    sequence by runs and heads: the same bits either way."""
    threads(n_threads)
    h, kv_heads, d = heads
    contexts = [2600, 37, 900, 1030]
    per_seq = math.ceil(max(contexts) / BLOCK)
    k, v = _cache(per_seq * len(contexts), kv_heads, d, cache_dtype)
    tables = torch.randperm(per_seq * len(contexts), dtype=torch.int32).view(len(contexts), per_seq)
    q = torch.randn(len(contexts), h, d)
    batch = _decode(q, k, v, tables, torch.tensor(contexts, dtype=torch.int32), d ** -0.5, 0)
    for b, context in enumerate(contexts):
        alone = _decode(q[b:b + 1].contiguous(), k, v, tables[b:b + 1].contiguous(),
                        torch.tensor([context], dtype=torch.int32), d ** -0.5, 0)
        assert torch.equal(alone[0], batch[b]), f"sequence {b}"
