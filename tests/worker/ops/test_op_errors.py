"""Bad inputs to the compiled ops raise a RuntimeError that names the cause.

The paged attention index checks (lengths against the max_* values that size the CUDA grids,
block-table entries against the cache) live in csrc/checks.cpp and are shared by the CPU ops
and the CUDA launchers, which run them on a host copy of the index tensors. So the index tests
run on both devices, with the same messages; each also checks that nothing was written,
since the checks come before any kernel runs.
"""

from __future__ import annotations

import pytest
import torch

from shardlm_server.worker import ops

from .test_ops import DEVICES, _prefill_inputs, make_paged_cache

if ops.USE_REFERENCE:
    pytest.skip("SHARDLM_OPS=reference: nothing compiled to test", allow_module_level=True)

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 2, 1, 8, 4


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def test_clear_errors():
    x = torch.randn(2, 8)
    with pytest.raises(RuntimeError, match="input has 8 features but weight expects 6"):
        ops.skinny_linear(x, torch.randn(4, 6))
    with pytest.raises(RuntimeError, match="must share a dtype"):
        ops.skinny_linear(x, torch.randn(4, 8, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="bias must be a contiguous \\[4\\] tensor"):
        ops.skinny_linear(x, torch.randn(4, 8), torch.randn(5))
    with pytest.raises(RuntimeError, match="weight must be a contiguous"):
        ops.rms_norm(x, torch.ones(4), 1e-6)
    with pytest.raises(RuntimeError, match="must be float32, float16 or bfloat16"):
        ops.silu_and_mul(torch.ones(2, 8, dtype=torch.int32))
    k = torch.randn(2, 1, 8)
    cache = torch.zeros(2, 4, 1, 8)
    with pytest.raises(RuntimeError, match="slot 8 of token 1 is outside"):
        ops.reshape_and_cache(k, k, cache, cache.clone(), torch.tensor([0, 8]))
    q = torch.randn(1, 2, 8)
    tables = torch.zeros(1, 2, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="outside \\[0, max_context_len=4\\]"):
        ops.paged_attention_decode(
            q, cache, cache, tables, torch.tensor([5], dtype=torch.int32), 1.0, 4
        )
    with pytest.raises(RuntimeError, match="block_tables\\[0\\]\\[1\\] = 9"):
        ops.paged_attention_decode(
            q,
            cache,
            cache,
            torch.tensor([[0, 9]], dtype=torch.int32),
            torch.tensor([6], dtype=torch.int32),
            1.0,
            8,
        )


# --------------------------------------------------------------------------- paged attention


def decode_args(device: str, ctx: list[int]) -> list:
    """Valid positional arguments of ops.paged_attention_decode for context lengths `ctx`."""
    k_cache, v_cache, tables = make_paged_cache(
        ctx, BLOCK_SIZE, KV_HEADS, HEAD_DIM, torch.float32, device
    )
    q = torch.randn(len(ctx), HEADS, HEAD_DIM, device=device)
    lens = torch.tensor(ctx, dtype=torch.int32, device=device)
    return [q, k_cache, v_cache, tables, lens, HEAD_DIM**-0.5, max(ctx)]


def prefill_args(device: str, seqs: list[tuple[int, int]]) -> list:
    """Valid positional arguments of ops.paged_attention_prefill for (cached, new) tokens."""
    qsl, seq_lens, q_lens = _prefill_inputs(seqs, device)
    k_cache, v_cache, tables = make_paged_cache(
        seq_lens.tolist(), BLOCK_SIZE, KV_HEADS, HEAD_DIM, torch.float32, device
    )
    q = torch.randn(sum(q_lens), HEADS, HEAD_DIM, device=device)
    scale, max_query_len, max_seq_len = HEAD_DIM**-0.5, max(q_lens), max(seq_lens.tolist())
    return [q, k_cache, v_cache, tables, qsl, seq_lens, scale, max_query_len, max_seq_len]


def raises_and_writes_nothing(op, args: list, match: str) -> None:
    """op(*args) raises a RuntimeError matching `match`, and leaves its output untouched."""
    out = torch.full(args[0].shape, float("nan"), device=args[0].device)
    with pytest.raises(RuntimeError, match=match):
        op(*args, out=out)
    assert out.isnan().all()


# Two sequences: 6 and 9 tokens in blocks of 4 need 2 and 3 blocks; the cache has 2 spare.
DECODE_CTX = [6, 9]
NUM_BLOCKS = 2 + 3 + 2


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("entry", [NUM_BLOCKS, -1], ids=["past_end", "negative"])
def test_decode_block_table_entry_outside_cache(device, entry):
    args = decode_args(device, DECODE_CTX)
    assert args[1].shape[0] == NUM_BLOCKS
    args[3][1, 2] = entry
    raises_and_writes_nothing(
        ops.paged_attention_decode,
        args,
        rf"block_tables\[1\]\[2\] = {entry} is outside \[0, {NUM_BLOCKS}\)",
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("length", [600, -1])
def test_decode_context_outside_max_context_len(device, length):
    """600 > 512: on CUDA, one partition of 512 tokens would silently drop the rest."""
    args = decode_args(device, [5, 600])
    args[4][1] = length
    args[6] = 512
    raises_and_writes_nothing(
        ops.paged_attention_decode,
        args,
        rf"context_lens\[1\] = {length} is outside \[0, max_context_len=512\]",
    )


@pytest.mark.parametrize("device", DEVICES)
def test_decode_block_table_too_narrow(device):
    args = decode_args(device, DECODE_CTX)
    args[3] = args[3][:, :2].contiguous()
    raises_and_writes_nothing(
        ops.paged_attention_decode,
        args,
        "sequence 1 needs 3 blocks for 9 tokens but block_tables has 2 columns",
    )


# Two sequences: 5 new tokens, and 3 new after 4 cached (seq_lens 5 and 7, 8 query rows).
PREFILL_SEQS = [(0, 5), (4, 3)]


@pytest.mark.parametrize("device", DEVICES)
def test_prefill_query_longer_than_max_query_len(device):
    """On CUDA the grid covers max_query_len rows: the 5th row would be left unwritten."""
    args = prefill_args(device, PREFILL_SEQS)
    args[7] = 4
    raises_and_writes_nothing(
        ops.paged_attention_prefill,
        args,
        r"query length 5 of sequence 0 is outside \[0, max_query_len=4\]",
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "seq,length,max_seq_len,match",
    [
        (1, 7, 6, r"seq_lens\[1\] = 7 must be in \[query length 3, max_seq_len=6\]"),
        (0, 4, 7, r"seq_lens\[0\] = 4 must be in \[query length 5, max_seq_len=7\]"),
    ],
    ids=["above_max_seq_len", "below_query_length"],
)
def test_prefill_seq_len_out_of_range(device, seq, length, max_seq_len, match):
    args = prefill_args(device, PREFILL_SEQS)
    args[5][seq] = length
    args[8] = max_seq_len
    raises_and_writes_nothing(ops.paged_attention_prefill, args, match)


@pytest.mark.parametrize("device", DEVICES)
def test_prefill_query_start_loc_must_span_the_query(device):
    args = prefill_args(device, PREFILL_SEQS)
    args[4][-1] = 7
    raises_and_writes_nothing(
        ops.paged_attention_prefill,
        args,
        r"query_start_loc must start at 0 and end at the number of query tokens \(8\), "
        r"got \[0, \.\.\., 7\]",
    )


@pytest.mark.parametrize("device", DEVICES)
def test_prefill_block_table_entry_outside_cache(device):
    args = prefill_args(device, PREFILL_SEQS)
    num_blocks = args[1].shape[0]
    args[3][1, 1] = num_blocks
    raises_and_writes_nothing(
        ops.paged_attention_prefill,
        args,
        rf"block_tables\[1\]\[1\] = {num_blocks} is outside \[0, {num_blocks}\)",
    )


@pytest.mark.parametrize("device", DEVICES)
def test_prefill_block_table_too_narrow(device):
    args = prefill_args(device, PREFILL_SEQS)
    args[3] = args[3][:, :1].contiguous()
    raises_and_writes_nothing(
        ops.paged_attention_prefill,
        args,
        "sequence 0 needs 2 blocks for 5 tokens but block_tables has 1 columns",
    )
