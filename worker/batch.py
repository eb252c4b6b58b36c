"""Host-side preparation of one prefill pass: packed token ids, positions, slot mapping and the
attention metadata, built in plain Python lists and copied to the device once per tensor without
waiting for it. (Decode steps run on the fixed buffers of `worker.decode_runner`.)"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from shardlm_server.worker.attention import AttentionMetadata
from shardlm_server.worker.transfer import to_device


@dataclass
class Batch:
    input_ids: torch.Tensor
    meta: AttentionMetadata


def slot_of(table: list[int], position: int, block_size: int) -> int:
    """Cache slot of `position` in a sequence with this block table."""
    return table[position // block_size] * block_size + position % block_size


def slots_for(table: list[int], start: int, count: int, block_size: int) -> list[int]:
    """Cache slots of positions start .. start+count-1 of a sequence with this block table."""
    return [slot_of(table, p, block_size) for p in range(start, start + count)]


def _tables(tables: list[list[int]], device: torch.device) -> torch.Tensor:
    width = max((len(t) for t in tables), default=1) or 1
    padded = [t + [0] * (width - len(t)) for t in tables]  # never read past seq_lens
    return to_device(padded, torch.int32, device)


def build_prefill_batch(
    sequences: list[tuple[list[int], int, int]],
    tables: list[list[int]],
    block_size: int,
    device: torch.device,
) -> Batch:
    """`sequences`: per sequence (all its tokens, start position, number of new tokens). Logits
    are computed for each sequence's last token."""
    return build_packed_batch([(tokens[start:start + count], start)
                               for tokens, start, count in sequences],
                              tables, block_size, device, every_row=False)


def build_packed_batch(
    chunks: list[tuple[list[int], int]],
    tables: list[list[int]],
    block_size: int,
    device: torch.device,
    every_row: bool,
) -> Batch:
    """`chunks`: per sequence (its new token ids, the position of the first). Logits are
    computed for every row (`every_row`: a speculative step verifies each draft) or for each
    sequence's last one."""
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    q_lens: list[int] = []
    seq_lens: list[int] = []
    for (new_ids, start), table in zip(chunks, tables, strict=True):
        count = len(new_ids)
        ids.extend(new_ids)
        positions.extend(range(start, start + count))
        slots.extend(slots_for(table, start, count, block_size))
        q_lens.append(count)
        seq_lens.append(start + count)
    starts = [0, *accumulate(q_lens)]
    logits_rows = list(range(len(ids))) if every_row else [s - 1 for s in starts[1:]]
    return Batch(
        input_ids=to_device(ids, torch.int64, device),
        meta=AttentionMetadata(
            is_decode=False,
            positions=to_device(positions, torch.int64, device),
            slot_mapping=to_device(slots, torch.int64, device),
            block_tables=_tables(tables, device),
            seq_lens=to_device(seq_lens, torch.int32, device),
            query_start_loc=to_device(starts, torch.int32, device),
            max_query_len=max(q_lens),
            max_seq_len=max(seq_lens),
            logits_indices=to_device(logits_rows, torch.int64, device),
        ),
    )
