"""A sequence's progress, one transition at a time: what the workers hold of its history
(`computed` tokens, and how: NOTHING / COMPUTED / SAMPLED), what its next prefill sends, and how
new turns, rewinds, steps, trims and a lost cache change it."""

from __future__ import annotations

from shardlm.common.v1 import common_pb2

from shardlm_server.gateway.batching.finish import CallLimits
from shardlm_server.gateway.batching.sequence import OnWorkers, SequenceState

PROMPT = [1, 5, 9, 14, 2, 7]


def sequence(tokens: list[int] = PROMPT, *, prefill_only: bool = False) -> SequenceState:
    seq = SequenceState(1, list(tokens), common_pb2.SamplingParams())
    seq.start_call(CallLimits(10, 100), prefill_only)
    return seq


def sampled(tokens: list[int] = PROMPT, token: int = 40) -> SequenceState:
    """A generation call whose whole prompt was prefilled and sampled `token`."""
    seq = sequence(tokens)
    seq.begin_prefill(0)
    seq.prefilled(len(tokens))
    seq.sampled(token)
    return seq


def test_a_new_sequence_is_on_no_worker_and_needs_its_whole_history_prefilled():
    seq = sequence()
    assert (seq.computed, seq.on_workers) == (0, OnWorkers.NOTHING)
    assert seq.needs_prefill and seq.uncomputed == PROMPT and seq.prefix_ids == []


def test_a_prefix_from_the_cache_sends_its_ids_until_a_prefill_ran():
    seq = sequence()
    seq.begin_prefill(4)  # four tokens from the prefix cache
    assert (seq.computed, seq.on_workers) == (4, OnWorkers.NOTHING)
    assert seq.prefix_ids == PROMPT[:4] and seq.uncomputed == PROMPT[4:]
    seq.prefilled(5)  # a first chunk: now the workers hold the sequence as its own
    assert (seq.computed, seq.on_workers, seq.prefix_ids) == (5, OnWorkers.COMPUTED, [])


def test_sampling_after_the_whole_history_leaves_a_pending_token_for_decode():
    seq = sampled()
    assert seq.tokens == PROMPT + [40] and seq.computed == len(PROMPT)
    assert seq.on_workers is OnWorkers.SAMPLED and not seq.needs_prefill
    assert seq.generated == 1


def test_a_prefill_calls_token_is_not_generated_and_the_next_call_prefills_again():
    seq = sequence(prefill_only=True)
    seq.begin_prefill(0)
    seq.prefilled(len(PROMPT))
    seq.sampled(40)
    assert seq.on_workers is OnWorkers.SAMPLED and seq.generated == 0
    assert seq.needs_prefill  # a Prefill always prefills, even in sync


def test_a_decode_step_computes_the_pending_token_and_holds_the_new_one():
    seq = sampled()
    seq.stepped(41)
    assert seq.tokens == PROMPT + [40, 41] and seq.computed == len(PROMPT) + 1
    assert seq.on_workers is OnWorkers.SAMPLED and seq.generated == 2


def test_a_new_turn_keeps_the_computed_tokens_and_prefills_the_pending_one_with_it():
    seq = sampled()
    seq.extend_history([3, 4])
    assert seq.computed == len(PROMPT) and seq.on_workers is OnWorkers.COMPUTED
    assert seq.uncomputed == [40, 3, 4] and seq.needs_prefill


def test_a_rerendered_history_keeps_the_computed_tokens_up_to_the_first_difference():
    seq = sampled()
    seq.replace_history(PROMPT[:3] + [0, 0])
    assert (seq.computed, seq.on_workers) == (3, OnWorkers.COMPUTED)
    longer = sampled()
    longer.replace_history(PROMPT + [40, 8])  # differs nowhere: all computed tokens stay
    assert (longer.computed, longer.on_workers) == (len(PROMPT), OnWorkers.COMPUTED)


def test_a_rewind_computes_the_last_token_or_a_shared_block_again():
    seq = sampled()
    seq.begin_prefill(2)
    assert (seq.computed, seq.on_workers) == (2, OnWorkers.COMPUTED)
    assert seq.uncomputed == PROMPT[2:] + [40] and seq.prefix_ids == []


def test_a_trim_drops_the_tokens_no_client_saw():
    seq = sampled()
    for token in (41, 42, 43):
        seq.stepped(token)
    seq.trim(2)  # the client was sent 40 and 41
    assert seq.tokens == PROMPT + [40, 41] and seq.generated == 2
    # The workers hold 42 and 43 too: 41 is computed again, then decoding goes on from it.
    assert seq.computed == len(seq.tokens) - 1 and seq.on_workers is OnWorkers.COMPUTED
    assert seq.needs_prefill and seq.uncomputed == [41]


def test_a_trim_that_keeps_everything_changes_nothing():
    seq = sampled()
    seq.stepped(41)
    seq.trim(2)
    assert seq.tokens == PROMPT + [40, 41] and seq.on_workers is OnWorkers.SAMPLED


def test_forgetting_rebuilds_from_the_whole_history():
    seq = sampled()
    seq.forget()
    assert (seq.computed, seq.on_workers) == (0, OnWorkers.NOTHING)
    assert seq.uncomputed == PROMPT + [40]


def test_a_plain_end_request_keeps_the_count_of_an_earlier_one():
    seq = sampled()
    seq.request_end(1)
    seq.request_end(None)  # a later plain cancel keeps the count
    assert seq.cancelled and seq.keep_generated == 1


def test_a_new_call_starts_clean_and_counts_a_synced_history_as_cached():
    seq = sampled()
    seq.request_end(1)
    seq.start_call(CallLimits(5, 100), prefill_only=False)
    assert not seq.cancelled and seq.keep_generated is None and seq.generated == 0
    assert seq.cached_prompt_tokens == seq.computed  # decodes on at once: nothing recomputed
    seq.extend_history([3])
    seq.start_call(CallLimits(5, 100), prefill_only=True)
    assert seq.cached_prompt_tokens == 0  # known when its prefill is scheduled
