"""Host-side preparation of one forward pass: packed token ids, positions, slot mapping and the
attention metadata, built in plain Python lists and copied to the device once per tensor."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from worker.attention import AttentionMetadata


@dataclass
class Batch:
    input_ids: torch.Tensor
    meta: AttentionMetadata


def slots_for(table: list[int], start: int, count: int, block_size: int) -> list[int]:
    """Cache slots of positions start .. start+count-1 of a sequence with this block table."""
    return [table[p // block_size] * block_size + p % block_size for p in range(start, start + count)]


def _tables(tables: list[list[int]], device: torch.device) -> torch.Tensor:
    width = max((len(t) for t in tables), default=1) or 1
    padded = [t + [0] * (width - len(t)) for t in tables]  # never read past seq_lens
    return torch.tensor(padded, dtype=torch.int32, device=device)


def build_prefill_batch(
    sequences: list[tuple[list[int], int, int]],
    tables: list[list[int]],
    block_size: int,
    device: torch.device,
) -> Batch:
    """`sequences`: per sequence (all its tokens, start position, number of new tokens)."""
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    q_lens: list[int] = []
    seq_lens: list[int] = []
    for (tokens, start, count), table in zip(sequences, tables, strict=True):
        ids.extend(tokens[start : start + count])
        positions.extend(range(start, start + count))
        slots.extend(slots_for(table, start, count, block_size))
        q_lens.append(count)
        seq_lens.append(start + count)
    starts = [0, *accumulate(q_lens)]
    return Batch(
        input_ids=torch.tensor(ids, dtype=torch.int64, device=device),
        meta=AttentionMetadata(
            is_decode=False,
            positions=torch.tensor(positions, dtype=torch.int64, device=device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            block_tables=_tables(tables, device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            max_query_len=max(q_lens),
            max_seq_len=max(seq_lens),
            logits_indices=torch.tensor([s - 1 for s in starts[1:]], dtype=torch.int64,
                                        device=device),
        ),
    )


def build_decode_batch(
    tokens: list[int],
    positions: list[int],
    tables: list[list[int]],
    block_size: int,
    device: torch.device,
) -> Batch:
    """One new token per sequence, at `positions` (= tokens already cached)."""
    n = len(tokens)
    slots = [t[p // block_size] * block_size + p % block_size
             for t, p in zip(tables, positions, strict=True)]
    seq_lens = [p + 1 for p in positions]
    return Batch(
        input_ids=torch.tensor(tokens, dtype=torch.int64, device=device),
        meta=AttentionMetadata(
            is_decode=True,
            positions=torch.tensor(positions, dtype=torch.int64, device=device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            block_tables=_tables(tables, device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=device),
            max_query_len=1,
            max_seq_len=max(seq_lens),
            logits_indices=torch.arange(n, dtype=torch.int64, device=device),
        ),
    )
