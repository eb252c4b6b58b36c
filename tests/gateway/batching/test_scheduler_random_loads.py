"""The scheduler under random loads against the fake worker pool: Generate calls and multi-turn
sessions sharing a prefix (or bypassing the prefix cache), busy between their calls for a while
as their handlers hold them, some turns re-rendered from a point on, some calls cancelled
part-way, in a KV cache too small for all of them at once, with random call lengths, prefill
budgets and running limits, and workers that accept drafts or not.

Every call fits the cache alone, so none may fail: each token must be the fake model's next
token after the history its client has seen (whatever was preempted, evicted, chunked or
recomputed), a session's history must be what its client saw, and once every call and session
is gone no block is held."""

from __future__ import annotations

import asyncio
import random

import pytest
from shardlm.common.v1 import common_pb2

from shardlm_server.gateway.batching.finish import prefill_limits
from shardlm_server.gateway.batching.sequence import ErrorEvent, FinishEvent, SequenceState
from tests.gateway.batching.test_scheduler import BLOCK, CONTEXT, Harness, limits, run, until
from tests.gateway.fake_workers import next_token

UNFINISHED = common_pb2.FINISH_REASON_UNSPECIFIED
SALTS = (b"anyone", None)  # sharing cached prefixes, or bypassing the cache


async def next_event(seq: SequenceState) -> tuple[int | None, bool]:
    """The call's next token (None: it ended without one) and whether the call ends with it."""
    event = await seq.events.get()
    if isinstance(event, ErrorEvent):
        raise event.error
    if isinstance(event, FinishEvent):
        return None, True
    return event.token_id, event.finish_reason != UNFINISHED


async def follow_call(h: Harness, seq: SequenceState, history: list[int],
                      rng: random.Random, max_new: int) -> None:
    """Read a call's tokens into `history`, each checked against the fake model; some calls are
    cancelled after a random number of tokens, keeping only those (as a stop sequence does)."""
    cancel_after = rng.choice([None, None, rng.randrange(max_new)])
    got = 0
    while cancel_after is None or got < cancel_after:
        token, finished = await next_event(seq)
        if token is not None:
            assert token == next_token(history)
            history.append(token)
            got += 1
        if finished:
            return
    h.scheduler.cancel(seq, keep_generated=got)
    await until(lambda: not seq.in_call)


async def a_generate(h: Harness, rng: random.Random, shared: list[int], room: int) -> None:
    prompt = (shared + [rng.randint(20, 90) for _ in range(rng.randint(1, 8))])[:room - 1]
    max_new = rng.randint(1, room - len(prompt))
    seq = h.scheduler.new_sequence(prompt, common_pb2.SamplingParams(), ephemeral=True,
                                   prefix_salt=rng.choice(SALTS))
    h.scheduler.submit(seq, limits(max_new), prefill_only=False)
    await follow_call(h, seq, list(prompt), rng, max_new)
    h.scheduler.release(seq)


async def between_calls(h: Harness, session, rng: random.Random) -> None:
    """A session's handler finishing a call: a while still busy (its cache held, not yet
    evictable), then idle a while (evictable) and busy again for the next call."""
    await asyncio.sleep(rng.random() * 0.005)
    h.sessions.release_busy(session)
    await asyncio.sleep(rng.random() * 0.01)
    session.busy = True


async def a_session(h: Harness, rng: random.Random, shared: list[int], room: int) -> None:
    seq = h.scheduler.new_sequence([], common_pb2.SamplingParams(),
                                   prefix_salt=rng.choice(SALTS))
    session = h.sessions.create(seq)
    session.busy = True  # as the Prefill handler holds it
    history: list[int] = []
    for turn in range(rng.randint(1, 4)):
        added = (shared if turn == 0 else []) + [rng.randint(20, 90)
                                                 for _ in range(rng.randint(1, 6))]
        if len(history) + len(added) + 2 > room:
            break
        if history and rng.random() < 0.3:  # the client re-renders it, changed from a point on
            history = history[:rng.randrange(len(history))] + added
            h.scheduler.start_turn(seq, history, prefill_limits(CONTEXT), rerendered=True)
        else:
            h.scheduler.start_turn(seq, added, prefill_limits(CONTEXT), rerendered=False)
            history += added
        first, _ = await next_event(seq)
        assert first == next_token(history)
        history.append(first)
        await between_calls(h, session, rng)
        max_new = rng.randint(1, room - len(history))
        session.busy = True  # as the Decode handler holds it
        h.scheduler.submit(seq, limits(max_new), prefill_only=False)
        await follow_call(h, seq, history, rng, max_new)
        assert seq.tokens == history
        await between_calls(h, session, rng)
    h.scheduler.release(seq)
    h.sessions.remove(session.session_id)


@pytest.mark.parametrize("seed", range(40))
def test_random_calls_and_sessions_under_memory_pressure(seed):
    rng = random.Random(seed)
    blocks = rng.randint(6, 16)
    room = blocks * BLOCK - 2  # each call's history and pending token fit the cache alone
    shared = list(range(1, 1 + rng.randint(0, 12)))
    clients = [rng.choice((a_generate, a_session)) for _ in range(rng.randint(2, 6))]

    async def test(h):
        if rng.random() < 0.5:  # workers that accept drafts: several tokens a step
            h.pool.drafts, h.pool.max_accepted = random.Random(seed), rng.randint(1, 4)
        await asyncio.gather(*(client(h, random.Random(seed * 100 + i), shared, room)
                               for i, client in enumerate(clients)))
        await until(lambda: h.allocator.used_blocks == 0)
    run(test, blocks=blocks, max_decode_steps=rng.choice([2, 4, 8]),
        prefill_token_budget=rng.choice([8, 16, 64]), max_running=rng.choice([2, 3, 256]))
