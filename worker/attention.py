"""Attention over the paged KV cache for one forward pass.

One metadata object describes the whole packed batch. Prefill (any number of new tokens per
sequence, with or without a cached prefix) and decode (one new token per sequence) differ only in
which kernel reads the cache; both first write the new K/V through the slot mapping, where a slot
of -1 writes nothing so padded rows need no branches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardlm_server.worker import ops


@dataclass
class AttentionMetadata:
    is_decode: bool
    positions: torch.Tensor  # int64 [T] absolute position of every packed token
    slot_mapping: torch.Tensor  # int64 [T] cache slot per token (-1: padding, write nothing)
    block_tables: torch.Tensor  # int32 [B, max_blocks]
    seq_lens: torch.Tensor  # int32 [B] tokens in the cache after this pass, per sequence
    query_start_loc: torch.Tensor  # int32 [B+1] prefix sums of new tokens per sequence
    max_query_len: int
    max_seq_len: int
    # int64 [B] row of each sequence's last token in the packed batch (a decode step: every row)
    logits_indices: torch.Tensor


class PagedAttention:
    """One layer's attention over its paged KV cache. ``sliding_window`` W > 0 limits each
    query to its last W positions (itself included), as transformers' sliding-window layers;
    0 attends to the whole sequence. The caches may hold another float dtype than q / k / v
    (written and read converted)."""

    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, sliding_window: int = 0
    ) -> None:
        if sliding_window < 0:
            raise ValueError(f"sliding_window must be >= 0 (0: none), got {sliding_window}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.sliding_window = sliding_window
        self.scale = head_dim**-0.5

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        tokens = q.shape[0]
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        ops.reshape_and_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        q = q.reshape(tokens, self.num_heads, self.head_dim).contiguous()
        if meta.is_decode:
            out = ops.paged_attention_decode(
                q,
                k_cache,
                v_cache,
                meta.block_tables,
                meta.seq_lens,
                self.scale,
                meta.max_seq_len,
                self.sliding_window,
            )
        else:
            out = ops.paged_attention_prefill(
                q,
                k_cache,
                v_cache,
                meta.block_tables,
                meta.query_start_loc,
                meta.seq_lens,
                self.scale,
                meta.max_query_len,
                meta.max_seq_len,
                self.sliding_window,
            )
        return out.view(tokens, self.num_heads * self.head_dim)
