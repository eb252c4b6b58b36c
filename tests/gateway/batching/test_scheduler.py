"""The scheduler against a fake worker pool (no processes): admission under the prefill token
budget, chunked prefill, preemption and recompute, eviction and expiry of idle sessions,
cancellation, a caller's deadline, and the finish policy as the workers and clients see it."""

from __future__ import annotations

import asyncio
import time

import pytest
from shardlm.common.v1 import common_pb2
from shardlm.errors import ResourceExhaustedError, UnavailableError

from shardlm_server.gateway.batching.finish import CallLimits, prefill_limits
from shardlm_server.gateway.batching.scheduler import Scheduler
from shardlm_server.gateway.batching.sequence import (
    ErrorEvent,
    FinishEvent,
    Phase,
    SequenceState,
    TokenEvent,
)
from shardlm_server.gateway.batching.sessions import SessionStore
from shardlm_server.gateway.kv.allocator import BlockAllocator
from shardlm_server.gateway.kv.manager import KvManager
from shardlm_server.gateway.metrics import Metrics
from tests.gateway.fake_workers import FakeWorkerPool, greedy

BLOCK = 4
CONTEXT = 512
LENGTH = common_pb2.FINISH_REASON_LENGTH


def limits(max_new: int, **kwargs) -> CallLimits:
    return CallLimits(max_new_tokens=max_new, max_context=kwargs.pop("context", CONTEXT), **kwargs)


class Harness:
    def __init__(self, blocks: int = 64, idle_timeout_s: float = 600.0, **scheduler) -> None:
        self.pool = FakeWorkerPool(BLOCK)
        self.allocator = BlockAllocator(blocks, BLOCK)
        self.sessions = SessionStore(idle_timeout_s)
        self.metrics = Metrics()
        self.kv = KvManager(self.allocator, self.metrics, namespace="model")
        self.scheduler = Scheduler(self.pool, self.kv, self.sessions, self.metrics, **scheduler)

    def generate(self, prompt: list[int], call: CallLimits) -> SequenceState:
        seq = self.scheduler.new_sequence(prompt, common_pb2.SamplingParams(), ephemeral=True)
        self.scheduler.submit(seq, call, prefill_only=False)
        return seq

    def session(self, prompt: list[int]) -> SequenceState:
        seq = self.scheduler.new_sequence([], common_pb2.SamplingParams())
        self.sessions.create(seq)
        self.scheduler.start_turn(seq, prompt, prefill_limits(CONTEXT), rerendered=False)
        return seq


async def drain(seq: SequenceState, count: int | None = None) -> tuple[list[int], int]:
    """The call's tokens and finish reason (or the first `count` tokens, unfinished)."""
    tokens: list[int] = []
    while True:
        event = await seq.events.get()
        if isinstance(event, ErrorEvent):
            raise event.error
        if isinstance(event, FinishEvent):
            return tokens, event.finish_reason
        assert isinstance(event, TokenEvent)
        tokens.append(event.token_id)
        if event.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
            return tokens, event.finish_reason
        if count is not None and len(tokens) == count:
            return tokens, common_pb2.FINISH_REASON_UNSPECIFIED


async def until(condition, timeout: float = 3.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.005)


def run(test, **harness):
    """Run `test(harness)` on a started scheduler; fail rather than hang."""
    async def main():
        h = Harness(**harness)
        h.scheduler.start()
        try:
            await asyncio.wait_for(test(h), 10)
        finally:
            await h.scheduler.stop()
        return h
    return asyncio.run(main())


PROMPT = [1, 5, 9, 14, 2]


# ----------------------------------------------------------------------------- a whole call
def test_generate_streams_the_tokens_and_frees_everything():
    async def test(h):
        seq = h.generate(PROMPT, limits(12))
        assert await drain(seq) == (greedy(PROMPT, 12), LENGTH)
        h.scheduler.release(seq)
        await until(lambda: seq.seq_id in h.pool.resets)
        assert h.allocator.used_blocks == 0 and seq.phase is Phase.DONE
    run(test)


# ----------------------------------------------------------------------------- admission
def test_admission_packs_prompts_within_the_token_budget():
    prompts = [[1, 10 + i, 20 + i, 30 + i, 40 + i, 50 + i] for i in range(6)]

    async def test(h):
        seqs = [h.generate(p, limits(3)) for p in prompts]
        results = await asyncio.gather(*(drain(s) for s in seqs))
        assert [r[0] for r in results] == [greedy(p, 3) for p in prompts]
        sizes = [sum(len(s.token_ids) for s in r.sequences) for r in h.pool.prefills]
        assert max(sizes) <= 16 and sizes[0] > len(prompts[0])  # packed, within the budget
    run(test, prefill_token_budget=16)


def test_queue_limit_refuses_beyond_max_waiting():
    async def test(h):
        h.generate(PROMPT, limits(2))
        with pytest.raises(Exception) as err:
            h.generate(PROMPT, limits(2))
        assert getattr(err.value, "reason", "") == "QUEUE_FULL"
    h = Harness(max_waiting=1)  # never started: the first request stays queued
    asyncio.run(test(h))


def test_a_turn_refused_for_a_full_queue_changes_nothing():
    async def test(h):
        session = h.scheduler.new_sequence(PROMPT, common_pb2.SamplingParams())
        h.generate([1, 2], limits(2))  # the queue is full
        with pytest.raises(ResourceExhaustedError):
            h.scheduler.start_turn(session, [7, 8], prefill_limits(CONTEXT), rerendered=False,
                                   sampling=common_pb2.SamplingParams(temperature=1.0))
        assert session.tokens == PROMPT and not session.sampling_changed
        assert session.phase is Phase.IDLE
    asyncio.run(test(Harness(max_waiting=1)))  # never started: the first request stays queued


def test_long_prompt_is_prefilled_in_chunks():
    prompt = [1] + [(5 * j) % 90 + 3 for j in range(39)]

    async def test(h):
        seq = h.generate(prompt, limits(5))
        assert await drain(seq) == (greedy(prompt, 5), LENGTH)
        chunks = [(s.start_position, len(s.token_ids), s.sample)
                  for r in h.pool.prefills for s in r.sequences]
        assert chunks == [(0, 16, False), (16, 16, False), (32, 8, True)]
    run(test, prefill_token_budget=16)


def test_rerendered_conversation_reuses_the_cache_up_to_the_first_difference():
    async def test(h):
        history = list(range(1, 21))
        session = h.session(history)
        first, _ = await drain(session, 1)
        await until(lambda: session.phase is Phase.IDLE)
        rendered = history[:12] + [99, 98, 97]  # differs from token 12 on
        h.scheduler.start_turn(session, rendered, prefill_limits(CONTEXT), rerendered=True)
        assert session.computed == 12
        reply, _ = await drain(session, 1)
        last = h.pool.prefills[-1].sequences[0]
        assert (last.start_position, list(last.token_ids)) == (12, [99, 98, 97])
        assert reply == greedy(rendered, 1)
    run(test)


def test_prompts_sharing_a_prefix_in_one_step_compute_it_once():
    async def test(h):
        shared = list(range(1, 18))  # four full blocks, then the question
        prompts = [shared + [40, 41, 42], shared + [50, 51], [7, 8, 9, 10, 11]]
        seqs = [h.scheduler.new_sequence(p, common_pb2.SamplingParams(), ephemeral=True,
                                         prefix_salt=b"anyone") for p in prompts]
        for seq in seqs:
            h.scheduler.submit(seq, limits(2), prefill_only=False)
        results = await asyncio.gather(*(drain(s) for s in seqs))
        assert [r[0] for r in results] == [greedy(p, 2) for p in prompts]
        first, second = h.pool.prefills[0], h.pool.prefills[1]
        # The second prompt waits one step (the unrelated third does not) and reuses the blocks
        # the first computed: 16 tokens from the cache, its own 3 computed.
        assert [len(s.token_ids) for s in first.sequences] == [20, 5]
        assert [(s.start_position, len(s.token_ids)) for s in second.sequences] == [(16, 3)]
    run(test)


def test_queued_prefill_work_counts_only_what_no_cache_holds():
    shared = list(range(1, 18))  # four full blocks, then one token

    async def test(h):
        warm = h.scheduler.new_sequence(shared, common_pb2.SamplingParams(), ephemeral=True,
                                        prefix_salt=b"anyone")
        h.scheduler.submit(warm, limits(1), prefill_only=False)
        await drain(warm)
        h.scheduler.release(warm)
        await until(lambda: h.allocator.used_blocks == 0)
        assert h.metrics.value("shardlm_waiting_uncached_prompt_tokens") == 0
        h.pool.prefill_gate = asyncio.Event()  # the loop waits on this prefill: the rest queue
        blocker = h.generate([90, 91], limits(1))
        await until(lambda: len(h.pool.prefills) == 2)  # warm's, then the blocker's
        queued = [shared + [40, 41], [7, 8, 9]]  # 16 of the first 19 tokens are cached
        for prompt in queued:
            seq = h.scheduler.new_sequence(prompt, common_pb2.SamplingParams(), ephemeral=True,
                                           prefix_salt=b"anyone")
            h.scheduler.submit(seq, limits(1), prefill_only=False)
        assert h.scheduler.waiting_uncached_tokens() == 3 + 3
        h.pool.prefill_gate.set()
        await drain(blocker)
    run(test)


# ----------------------------------------------------------------------------- memory pressure
def test_preempted_sequence_is_recomputed_with_the_same_tokens():
    # 8 blocks of 4: each sequence grows to 6 + 12 = 18 tokens (5 blocks): both cannot fit. Calls
    # of at most 8 steps: both sequences hold blocks when they run out.
    prompts = [[1, 2, 3, 4, 5, 6], [1, 7, 8, 9, 10, 11]]

    async def test(h):
        seqs = [h.generate(p, limits(12)) for p in prompts]
        results = await asyncio.gather(*(drain(s) for s in seqs))
        assert [r[0] for r in results] == [greedy(p, 12) for p in prompts]
        assert h.metrics.preemptions._value.get() >= 1
        for seq in seqs:
            h.scheduler.release(seq)
        await until(lambda: h.allocator.used_blocks == 0)
    run(test, blocks=8, max_decode_steps=8)


def test_waiting_sequences_give_up_their_blocks_when_nothing_runs():
    # 6 blocks of 4, prompts sharing a 5-token prefix, each fitting alone: a waiting sequence
    # holds the prefix it attached (or a prompt's first chunks) when the running ones are
    # preempted. The one admitted next must not be refused for blocks only waiting ones hold.
    shared = [1, 2, 3, 4, 5]
    calls = [(shared + [59, 52, 47, 24, 40, 75], 11), (shared + [85, 67, 89, 76], 9),
             (shared + [24, 23, 66], 8)]

    async def test(h):
        seqs = []
        for prompt, max_new in calls:
            seq = h.scheduler.new_sequence(prompt, common_pb2.SamplingParams(), ephemeral=True,
                                           prefix_salt=b"anyone")
            h.scheduler.submit(seq, limits(max_new), prefill_only=False)
            seqs.append(seq)
        results = await asyncio.gather(*(drain(s) for s in seqs))
        assert [r[0] for r in results] == [greedy(p, n) for p, n in calls]
        assert h.metrics.preemptions._value.get() >= 1
        await until(lambda: h.allocator.used_blocks == 0)
    run(test, blocks=6, max_decode_steps=2, prefill_token_budget=8)


def test_idle_session_is_evicted_for_a_new_request_and_rebuilt():
    async def test(h):
        session = h.session(list(range(1, 11)))  # 10 tokens + the first one: 3 blocks
        first, _ = await drain(session, 1)
        await until(lambda: session.phase is Phase.IDLE)
        assert h.allocator.holds(session.seq_id)
        other = h.generate(list(range(20, 30)), limits(5))  # needs 4 of the 4 blocks
        await drain(other)
        assert session.computed == 0
        await until(lambda: session.seq_id in h.pool.resets)  # before the next step
        h.scheduler.submit(session, limits(4), prefill_only=False)  # rebuilt from history
        tokens, _ = await drain(session)
        assert first + tokens == greedy(list(range(1, 11)), 5)
    run(test, blocks=4)


def test_expired_session_is_removed_and_its_cache_dropped():
    async def test(h):
        session = h.session(PROMPT)
        await drain(session, 1)
        await until(lambda: session.phase is Phase.IDLE)
        await until(lambda: len(h.sessions) == 0)  # the loop checks expiry every second
        assert session.seq_id in h.pool.resets and h.allocator.used_blocks == 0
    run(test, idle_timeout_s=0.05)


# ----------------------------------------------------------------------------- ending early
def test_cancel_keeps_only_what_the_client_was_sent():
    async def test(h):
        session = h.session(PROMPT)
        first, _ = await drain(session, 1)
        h.scheduler.submit(session, limits(200), prefill_only=False)
        sent, _ = await drain(session, 3)
        h.scheduler.cancel(session, keep_generated=3)  # the client left after three tokens
        await until(lambda: session.phase is Phase.IDLE)
        assert session.tokens == PROMPT + first + sent
        h.scheduler.submit(session, limits(4), prefill_only=False)
        more, _ = await drain(session)
        assert first + sent + more == greedy(PROMPT, 8)  # continues from exactly there
        await until(lambda: session.phase is Phase.IDLE)
        # The parked session keeps blocks for its cache only, none of the calls' pre-allocation.
        used, blocks_for = h.allocator.used_blocks, h.allocator.blocks_for
        assert blocks_for(session.computed) <= used <= blocks_for(session.computed + 1)
    run(test)


def test_a_stop_sequence_found_after_the_call_ended_still_trims_the_history():
    async def test(h):
        session = h.session(PROMPT)
        first, _ = await drain(session, 1)
        await until(lambda: session.phase is Phase.IDLE)
        h.scheduler.submit(session, limits(6), prefill_only=False)
        await until(lambda: session.phase is Phase.IDLE)  # generated all 6 before any was read
        sent, _ = await drain(session, 2)
        h.scheduler.cancel(session, keep_generated=2)  # the text of those two held a stop
        assert session.tokens == PROMPT + first + sent
        h.scheduler.submit(session, limits(3), prefill_only=False)
        more, _ = await drain(session)
        assert first + sent + more == greedy(PROMPT, 6)  # continues from exactly there
        await until(lambda: session.phase is Phase.IDLE)
        used, blocks_for = h.allocator.used_blocks, h.allocator.blocks_for
        assert blocks_for(session.computed) <= used <= blocks_for(session.computed + 1)
    run(test)


def test_a_prompt_the_whole_cache_cannot_hold_is_refused():
    async def test(h):
        seq = h.generate(list(range(1, 13)), limits(2))  # 12 tokens: 3 blocks of the 2
        with pytest.raises(ResourceExhaustedError) as err:
            await drain(seq)
        assert err.value.reason == "KV_CACHE_FULL"
        assert err.value.metadata == {"required_blocks": "3", "free_blocks": "2"}
        await until(lambda: seq.phase is Phase.DONE)
        assert h.allocator.used_blocks == 0 and not h.pool.prefills
    run(test, blocks=2)


def test_release_of_a_running_call_ends_it_cancelled():
    async def test(h):
        session = h.session(PROMPT)
        await drain(session, 1)
        h.scheduler.submit(session, limits(200), prefill_only=False)
        await drain(session, 2)
        h.scheduler.release(session)  # ResetCache of the session while it decodes
        _tokens, reason = await drain(session)
        assert reason == common_pb2.FINISH_REASON_CANCELLED
        await until(lambda: h.allocator.used_blocks == 0 and session.seq_id in h.pool.resets)
    run(test)


def test_a_callers_deadline_frees_its_sequence_and_spares_the_others():
    async def test(h):
        h.pool.step_delay_s = 0.002
        doomed = h.generate(PROMPT, limits(300))
        other = h.generate([1, 3, 5], limits(40))
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.05):  # as a gRPC deadline cancels the handler
                await drain(doomed)
        h.scheduler.release(doomed)  # what Generate's handler does on its way out
        assert await drain(other) == (greedy([1, 3, 5], 40), LENGTH)
        await until(lambda: doomed.seq_id in h.pool.resets and doomed.phase is Phase.DONE)
        h.scheduler.release(other)
        await until(lambda: h.allocator.used_blocks == 0)
    run(test)


def test_stopping_the_loop_mid_prefill_fails_those_calls_and_refuses_new_ones():
    # What unloading the model or reconfiguring its cache does: stop the loop, fail every call.
    async def test(h):
        h.pool.prefill_gate = asyncio.Event()  # the workers never answer this prefill
        seq = h.generate(PROMPT, limits(10))
        await until(lambda: h.pool.prefills)
        await h.scheduler.stop()
        h.scheduler.fail_all(UnavailableError("reconfigured", reason="WORKER_UNAVAILABLE"))
        with pytest.raises(UnavailableError):
            await drain(seq)
        with pytest.raises(UnavailableError) as refused:  # a handler that found this model
            h.generate(PROMPT, limits(10))
        assert refused.value.reason == "WORKER_UNAVAILABLE"
    run(test)


def test_a_failed_step_fails_its_calls_and_drops_their_caches():
    async def test(h):
        h.pool.fail_next_decode = UnavailableError("gone", reason="WORKER_UNAVAILABLE")
        seq = h.generate(PROMPT, limits(10))
        with pytest.raises(UnavailableError):
            await drain(seq)
        assert seq.computed == 0 and not h.allocator.holds(seq.seq_id)
    run(test)


# ----------------------------------------------------------------------------- the finish policy
def test_eos_is_sent_as_a_stop_id_and_reported_as_eos():
    expected = greedy(PROMPT, 10)
    eos = expected[3]

    async def test(h):
        seq = h.generate(PROMPT, limits(10, eos_ids=frozenset({eos})))
        assert await drain(seq) == (expected[:4], common_pb2.FINISH_REASON_EOS)
        assert eos in h.pool.stop_ids_sent(seq.seq_id)
        ignoring = h.generate(PROMPT, limits(10))  # ignore_eos: no EOS ids in the call
        assert await drain(ignoring) == (expected, LENGTH)
        assert eos not in h.pool.stop_ids_sent(ignoring.seq_id)
    run(test)


def test_stop_token_and_context_reasons():
    expected = greedy(PROMPT, 10)

    async def test(h):
        stop = h.generate(PROMPT, limits(10, stop_token_ids=frozenset({expected[2]})))
        assert await drain(stop) == (expected[:3], common_pb2.FINISH_REASON_STOP_TOKEN)
        full = h.generate(PROMPT, limits(10, context=len(PROMPT) + 6))
        assert await drain(full) == (expected[:6], common_pb2.FINISH_REASON_CONTEXT_LENGTH)
    run(test)


def test_the_scheduler_paces_its_decode_calls_with_its_settings():
    h = Harness(max_decode_steps=32, decode_call_s=0.1, busy_decode_steps=3)  # not the defaults
    pacer = h.scheduler.pacer
    assert (pacer.max_decode_steps, pacer.decode_call_s, pacer.busy_decode_steps) == (32, 0.1, 3)


def test_steps_sent_several_to_a_message_stream_the_same_tokens_and_pace_by_step():
    """With a stream interval the workers send several steps in one message (the fake one: a
    whole call's); the tokens and finish are those of one message a step, and the pacer still
    times a step, not a message."""
    async def test(h):
        h.pool.step_delay_s = 0.01
        seq = h.generate(PROMPT, limits(12))
        assert await drain(seq) == (greedy(PROMPT, 12), LENGTH)
        assert {d.stream_interval_ms for d in h.pool.decodes} == {7}
        assert len(h.pool.decodes) >= 2  # calls of 2 and 9 steps, each one message
        assert h.scheduler.pacer.step_s < 0.02  # ~0.01 a step; a message is 0.02-0.09
    h = run(test, stream_interval_ms=7)
    assert h.scheduler.stream_interval_ms == 7
