"""What the engine checks of a step's items before it builds the step, and when a sequence's
call ends: pure functions of the items, the cache's geometry and the model's vocabulary and
context. A bad item is an InvalidRequestError naming its field, raised before any tensor moves,
so the ops' own index checks (csrc/checks.cpp) never see what the engine sends fail."""

from __future__ import annotations

from shardlm_server.worker.engine_types import FinishReason, ResidentSequence
from shardlm_server.worker.errors import InvalidRequestError
from shardlm_server.worker.kv_cache import KVCache


def check_unique(ids: list[int]) -> None:
    if len(set(ids)) != len(ids):
        raise InvalidRequestError("a batch names the same sequence twice")


def check_block_table(table: list[int], tokens: int, sequence_id: int, cache: KVCache) -> None:
    """Every entry inside the cache, and enough blocks for `tokens` tokens."""
    bs, nb = cache.block_size, cache.num_blocks
    if any(b < 0 or b >= nb for b in table):
        raise InvalidRequestError(
            f"sequence {sequence_id}: block table entries must be in [0, {nb})",
            field="block_table",
        )
    if len(table) * bs < tokens:
        raise InvalidRequestError(
            f"sequence {sequence_id}: block table of {len(table)} blocks cannot hold "
            f"{tokens} tokens (block size {bs})",
            field="block_table",
        )


def check_tokens(token_ids: list[int], sequence_id: int, vocab_size: int) -> None:
    if any(t < 0 or t >= vocab_size for t in token_ids):
        raise InvalidRequestError(
            f"sequence {sequence_id}: token ids must be in [0, {vocab_size})", field="token_ids"
        )


def finish_reason(seq: ResidentSequence, token_id: int, max_positions: int) -> FinishReason | None:
    """Whether the sequence leaves the batch after `token_id`: only what it was sent counts."""
    if token_id in seq.stop.stop_token_ids:
        return FinishReason.STOP_TOKEN
    if seq.stop.max_new_tokens and seq.generated >= seq.stop.max_new_tokens:
        return FinishReason.LENGTH
    if seq.num_cached >= max_positions:
        return FinishReason.CONTEXT_LENGTH  # no position left to feed the new token
    return None
