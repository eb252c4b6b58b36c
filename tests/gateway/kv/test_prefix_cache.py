"""The prefix cache: the allocator's keys, reference counts, LRU reclaim and rewind (unit tests),
and the scheduler reusing cached prefixes against the fake worker pool, whose slots remember the
history each one was written for, so a shared block written again or attached with the wrong
contents fails the run."""

from __future__ import annotations

import asyncio
import random

import pytest
from shardlm.common.v1 import common_pb2
from shardlm.errors import UnavailableError

from shardlm_server.gateway.batching.finish import CallLimits, prefill_limits
from shardlm_server.gateway.batching.scheduler import Scheduler
from shardlm_server.gateway.batching.sequence import SequenceState
from shardlm_server.gateway.batching.sessions import SessionStore
from shardlm_server.gateway.kv.allocator import BlockAllocator
from shardlm_server.gateway.kv.manager import KvManager, prefix_salt
from shardlm_server.gateway.metrics import Metrics
from tests.gateway.batching.test_scheduler import drain, until
from tests.gateway.fake_workers import FakeWorkerPool, greedy

BLOCK = 4
SALT = prefix_salt("model", "", "")


def balanced(a: BlockAllocator) -> bool:
    """Every block is held, free, or cached and idle: exactly one of them."""
    return a.used_blocks + a.free_blocks == a.num_blocks


# ----------------------------------------------------------------- the allocator
def test_published_blocks_outlive_their_sequence_and_are_found_by_the_next():
    evictions = []
    a = BlockAllocator(8, BLOCK, prefix_cache=True, on_evict=lambda: evictions.append(1))
    tokens = list(range(10, 20))  # 10 tokens: two full blocks and a partial one
    a.grow(1, 10)
    a.publish(1, tokens, 10, SALT)
    first = a.table(1)
    assert a.cached_blocks == 2
    a.free(1)
    assert (a.used_blocks, a.idle_cached_blocks, a.free_blocks) == (0, 2, 8) and balanced(a)
    assert a.attach_prefix(2, tokens[:9] + [99, 98], SALT) == 8
    assert a.table(2) == first[:2] and a.idle_cached_blocks == 0 and balanced(a)
    assert a.attach_prefix(3, tokens[:6] + [77], SALT) == 4  # shares only the first block
    assert a.table(3) == first[:1] and a.used_blocks == 2
    assert not evictions


def test_the_last_prompt_token_is_never_served_from_the_cache():
    a = BlockAllocator(8, BLOCK, prefix_cache=True)
    tokens = list(range(30, 38))  # exactly two blocks
    a.grow(1, 8)
    a.publish(1, tokens, 8, SALT)
    assert a.attach_prefix(2, tokens, SALT) == 4  # its last token must be computed
    assert a.attach_prefix(3, tokens + [5], SALT) == 8


@pytest.mark.parametrize("other", [prefix_salt("model", "bob", ""), prefix_salt("model", "", "x"),
                                   prefix_salt("other-model", "", "")])
def test_a_different_salt_finds_nothing(other):
    a = BlockAllocator(8, BLOCK, prefix_cache=True)
    tokens = list(range(40, 52))
    a.grow(1, 12)
    a.publish(1, tokens, 12, SALT)
    assert a.attach_prefix(2, tokens + [1], other) == 0 and not a.holds(2)
    assert a.attach_prefix(3, tokens + [1], SALT) == 12


def test_a_changed_block_breaks_the_chain_after_it():
    a = BlockAllocator(8, BLOCK, prefix_cache=True)
    tokens = list(range(12))
    a.grow(1, 12)
    a.publish(1, tokens, 12, SALT)
    changed = tokens[:4] + [0] + tokens[5:] + [1]
    assert a.attach_prefix(2, changed, SALT) == 4  # block 2 matches alone, but not its chain


def test_idle_cached_blocks_are_reclaimed_only_when_none_is_free_least_recent_first():
    evictions = []
    a = BlockAllocator(4, BLOCK, prefix_cache=True, on_evict=lambda: evictions.append(1))
    old, new = [1] * 4 + [2], [3] * 4 + [4]
    for sid, tokens in ((1, old), (2, new)):
        a.grow(sid, 5)
        a.publish(sid, tokens, 5, SALT)
        a.free(sid)
    assert a.idle_cached_blocks == 2 and a.free_blocks == 4
    a.grow(3, 8)  # the two never-cached blocks first
    assert not evictions and a.cached_blocks == 2
    a.grow(3, 12)  # then the least recently released cached block: `old`'s
    assert len(evictions) == 1 and a.attach_prefix(4, old, SALT) == 0
    assert a.attach_prefix(5, new, SALT) == 4 and balanced(a)


def test_a_held_cached_block_is_never_reclaimed():
    a = BlockAllocator(2, BLOCK, prefix_cache=True)
    a.grow(1, 5)
    a.publish(1, [7] * 5, 5, SALT)
    assert a.free_blocks == 0 and not a.can_grow(2, 1)


def test_rewind_gives_a_sequence_a_private_block_instead_of_writing_a_shared_one():
    a = BlockAllocator(8, BLOCK, prefix_cache=True)
    tokens = list(range(100, 110))
    a.grow(1, 10)
    a.publish(1, tokens, 10, SALT)
    shared = a.table(1)[:2]
    assert a.rewind(1, 9) == 9 and a.table(1)[:2] == shared  # writes only its private tail
    assert a.rewind(1, 6) == 4  # block 1 is published: recompute it in a new block
    assert a.table(1) == shared[:1] and a.idle_cached_blocks == 1
    a.grow(1, 10)
    assert shared[1] not in a.table(1) and balanced(a)
    assert a.attach_prefix(2, tokens + [0], SALT) == 8  # the published block is intact


def test_clearing_the_prefix_cache_frees_idle_blocks_and_keeps_held_ones():
    a = BlockAllocator(8, BLOCK, prefix_cache=True)
    a.grow(1, 9)
    a.publish(1, list(range(9)), 9, SALT)
    a.grow(2, 5)
    a.publish(2, [5] * 5, 5, SALT)
    a.free(2)
    a.clear_prefix_cache()
    assert (a.cached_blocks, a.idle_cached_blocks, a.used_blocks) == (0, 0, 3) and balanced(a)
    assert a.attach_prefix(3, [5] * 5, SALT) == 0 and a.attach_prefix(4, list(range(9)), SALT) == 0


def test_no_prefix_cache_in_static_mode_or_when_off():
    static = BlockAllocator(8, BLOCK, static_slot_blocks=4, prefix_cache=True)
    off = BlockAllocator(8, BLOCK, prefix_cache=False)
    for a in (static, off):
        a.grow(1, 9)
        a.publish(1, list(range(9)), 9, SALT)
        a.free(1)
        assert not a.prefix_cache and a.cached_blocks == 0
        assert a.attach_prefix(2, list(range(9)), SALT) == 0


def test_random_operations_never_leak_a_block():
    rng = random.Random(7)
    a = BlockAllocator(16, BLOCK, prefix_cache=True)
    histories: dict[int, list[int]] = {}
    for step in range(3000):
        sid = rng.randrange(8)
        op = rng.random()
        if sid not in histories:
            tokens = [rng.randrange(3) for _ in range(rng.randrange(1, 20))]
            cached = a.attach_prefix(sid, tokens, SALT)
            assert cached % BLOCK == 0 and cached < len(tokens)
            if a.can_grow(sid, len(tokens)):
                a.grow(sid, len(tokens))
                a.publish(sid, tokens, len(tokens), SALT)
                histories[sid] = tokens
            else:
                a.free(sid)
        elif op < 0.3:
            a.free(sid)
            del histories[sid]
        elif op < 0.6:
            tokens = histories[sid]
            start = a.rewind(sid, rng.randrange(len(tokens) + 1))
            tokens[start:] = [rng.randrange(3) for _ in range(rng.randrange(1, 6))]
            if a.can_grow(sid, len(tokens)):
                a.grow(sid, len(tokens))
                a.publish(sid, tokens, len(tokens), SALT)
            else:
                a.free(sid)
                del histories[sid]
        else:
            a.shrink(sid, len(histories[sid]) + 1)
        assert balanced(a), step
        held = [b for t in histories for b in a.table(t)]
        assert a.used_blocks == len(set(held))
    for sid in list(histories):
        a.free(sid)
    assert a.used_blocks == 0 and a.cached_blocks == a.idle_cached_blocks and balanced(a)


# ----------------------------------------------------------------- the scheduler
CONTEXT = 512


class Harness:
    def __init__(self, blocks: int = 64, **scheduler) -> None:
        self.pool = FakeWorkerPool(BLOCK)
        self.metrics = Metrics()
        self.allocator = BlockAllocator(blocks, BLOCK, prefix_cache=True,
                                        on_evict=self.metrics.prefix_cache_evictions.inc)
        self.sessions = SessionStore()
        self.kv = KvManager(self.allocator, self.metrics, namespace="model")
        self.scheduler = Scheduler(self.pool, self.kv, self.sessions, self.metrics, **scheduler)

    def generate(self, prompt: list[int], max_new: int,
                 salt: bytes | None = SALT) -> SequenceState:
        seq = self.scheduler.new_sequence(prompt, common_pb2.SamplingParams(), ephemeral=True,
                                          prefix_salt=salt)
        self.scheduler.submit(seq, CallLimits(max_new, CONTEXT), prefill_only=False)
        return seq

    async def run(self, prompt: list[int], max_new: int, salt: bytes | None = SALT):
        seq = self.generate(prompt, max_new, salt)
        tokens, _reason = await drain(seq)
        self.scheduler.release(seq)
        return tokens, seq.cached_prompt_tokens

    def first_prefill(self, seq: SequenceState):
        return next(s for r in self.pool.prefills for s in r.sequences
                    if s.sequence_id == seq.seq_id)


def on(test, blocks: int = 64, **scheduler) -> None:
    """Run `test(harness)` on a started scheduler; fail rather than hang."""
    async def main():
        h = Harness(blocks, **scheduler)
        h.scheduler.start()
        try:
            await asyncio.wait_for(test(h), 20)
        finally:
            await h.scheduler.stop()
    asyncio.run(main())


def test_prefixes_of_every_length_around_block_boundaries():
    async def body(h):
        base = [50 + i for i in range(3 * BLOCK + 2)]
        for shared in range(1, len(base) + 1):
            first, second = base[:shared] + [1, 2], base[:shared] + [9, 8, 7]
            for prompt in (first, second):
                tokens, cached = await h.run(prompt, 6)
                assert tokens == greedy(prompt, 6), shared
            assert cached == min(shared, len(second) - 1) // BLOCK * BLOCK, shared
        assert h.metrics.value("shardlm_prefix_cache_hit_tokens_total") > 0
        await until(lambda: h.allocator.used_blocks == 0)
        assert h.allocator.cached_blocks == h.allocator.idle_cached_blocks
    on(body)


def test_a_hit_sends_the_prefix_ids_and_computes_only_the_rest():
    async def body(h):
        prompt = list(range(60, 71))  # 11 tokens
        await h.run(prompt, 3)
        seq = h.generate(prompt + [5, 6], 3)
        tokens, _ = await drain(seq)
        sent = h.first_prefill(seq)
        assert sent.start_position == 8 and list(sent.prefix_token_ids) == prompt[:8]
        assert list(sent.token_ids) == prompt[8:] + [5, 6]
        assert tokens == greedy(prompt + [5, 6], 3) and seq.cached_prompt_tokens == 8
    on(body)


def test_the_same_prompt_again_still_computes_its_last_token():
    async def body(h):
        prompt = list(range(70, 78))  # exactly two blocks
        assert (await h.run(prompt, 4))[0] == greedy(prompt, 4)
        tokens, cached = await h.run(prompt, 4)
        assert tokens == greedy(prompt, 4) and cached == 4
    on(body)


def test_bypass_neither_reuses_nor_publishes():
    async def body(h):
        prompt = list(range(80, 93))
        await h.run(prompt, 2, salt=None)
        assert h.allocator.cached_blocks == 0
        await h.run(prompt, 2)
        tokens, cached = await h.run(prompt, 2, salt=None)
        assert cached == 0 and tokens == greedy(prompt, 2)
        assert h.metrics.value("shardlm_prefix_cache_lookups_total") == 1
    on(body)


def test_concurrent_sequences_share_blocks_while_running():
    async def body(h):
        h.pool.step_delay_s = 0.002
        system = list(range(3, 3 + 3 * BLOCK))
        first = h.generate(system + [1], 12)
        await until(lambda: h.allocator.cached_blocks >= 3)
        others = [h.generate(system + [2 + i, 5], 10) for i in range(4)]
        assert (await drain(first))[0] == greedy(system + [1], 12)
        for i, seq in enumerate(others):
            assert (await drain(seq))[0] == greedy(system + [2 + i, 5], 10)
            assert seq.cached_prompt_tokens == 3 * BLOCK
        for seq in [first, *others]:
            h.scheduler.release(seq)
        await until(lambda: h.allocator.used_blocks == 0)
    on(body)


def test_sessions_find_cached_prefixes_and_rebuild_from_them():
    async def body(h):
        prompt = list(range(20, 31))
        await h.run(prompt + [1], 2)
        seq = h.scheduler.new_sequence([], common_pb2.SamplingParams(), prefix_salt=SALT)
        session = h.sessions.create(seq)
        h.scheduler.start_turn(seq, prompt, prefill_limits(CONTEXT), rerendered=False)
        first = (await seq.events.get()).token_id
        assert first == greedy(prompt, 1)[0] and seq.cached_prompt_tokens == 8
        h.scheduler.submit(seq, CallLimits(5, CONTEXT), prefill_only=False)
        tokens, _ = await drain(seq)
        assert [first, *tokens] == greedy(prompt, 6)
        # Evicted (its blocks stay cached), then used again: rebuilt from the cached prefix.
        h.kv.release(seq.seq_id)
        seq.forget()
        assert not h.allocator.holds(seq.seq_id) and session.seq is seq
        prefills = len(h.pool.prefills)
        h.scheduler.submit(seq, CallLimits(3, CONTEXT), prefill_only=False)
        tokens, _ = await drain(seq)
        assert tokens == greedy(prompt, 9)[6:]
        rebuilt = h.pool.prefills[prefills].sequences[0]
        assert rebuilt.start_position == 16 and list(rebuilt.token_ids) == seq.tokens[16:17]
        assert seq.cached_prompt_tokens == 16
    on(body)


def test_a_rerendered_history_never_writes_a_shared_block():
    async def body(h):
        prompt = list(range(40, 50))  # blocks 0 and 1 full, published
        seq = h.scheduler.new_sequence([], common_pb2.SamplingParams(), prefix_salt=SALT)
        h.sessions.create(seq)
        h.scheduler.start_turn(seq, prompt, prefill_limits(CONTEXT), rerendered=False)
        await seq.events.get()
        reader = h.generate(prompt + [7, 7], 2)  # holds the session's two published blocks
        assert (await drain(reader))[0] == greedy(prompt + [7, 7], 2)
        shared = h.allocator.table(seq.seq_id)[:2]
        changed = prompt[:6] + [9, 9, 9, 9, 9]  # differs inside block 1
        h.scheduler.start_turn(seq, changed, prefill_limits(CONTEXT), rerendered=True)
        assert (await seq.events.get()).token_id == greedy(changed, 1)[0]
        assert h.allocator.table(seq.seq_id)[0] == shared[0]
        assert shared[1] not in h.allocator.table(seq.seq_id)
        # The shared block still holds the old tokens: another sequence reads them correctly.
        tokens, cached = await h.run(prompt + [3], 2)
        assert tokens == greedy(prompt + [3], 2) and cached == 8
    on(body)


def test_preempted_sequences_resume_from_their_cached_blocks():
    async def body(h):
        prompts = [[10 + i] * 9 for i in range(3)]
        seqs = [h.generate(p, 20) for p in prompts]
        for prompt, seq in zip(prompts, seqs, strict=True):
            assert (await drain(seq))[0] == greedy(prompt, 20)
            h.scheduler.release(seq)
        assert h.metrics.value("shardlm_preemptions_total") > 0
        assert h.metrics.value("shardlm_prefix_cache_hit_tokens_total") > 0
        await until(lambda: h.allocator.used_blocks == 0)
        assert balanced(h.allocator)
    on(body, blocks=12)


def test_blocks_run_out_cached_ones_go_before_idle_sessions():
    async def body(h):
        seq = h.scheduler.new_sequence([], common_pb2.SamplingParams(), prefix_salt=SALT)
        h.sessions.create(seq)
        h.scheduler.start_turn(seq, [5] * 9, prefill_limits(CONTEXT), rerendered=False)
        await seq.events.get()  # the idle session holds 3 blocks
        await h.run([6] * 13, 1)  # leaves 3 idle cached blocks
        assert h.allocator.idle_cached_blocks == 3
        await h.run([8] * 9, 2)  # needs 3 new blocks: 2 free, 1 reclaimed; session untouched
        assert h.allocator.holds(seq.seq_id) and seq.computed > 0
        assert h.metrics.value("shardlm_prefix_cache_evictions_total") >= 1
    on(body, blocks=8)


def test_losing_the_workers_empties_the_prefix_cache():
    async def body(h):
        await h.run(list(range(9)), 2)
        assert h.allocator.cached_blocks > 0
        h.scheduler.fail_all(UnavailableError("gone", reason="WORKER_UNAVAILABLE"))
        assert h.allocator.cached_blocks == 0 and balanced(h.allocator)
        tokens, cached = await h.run(list(range(9)), 2)
        assert cached == 0 and tokens == greedy(list(range(9)), 2)
    on(body)


def test_a_hit_composes_with_chunked_prefill():
    async def body(h):
        system = list(range(3, 3 + 2 * BLOCK + 1))
        await h.run(system + [1, 2, 3, 4, 5], 2)
        prompt = system + [9] * 7
        seq = h.generate(prompt, 4)
        tokens, _ = await drain(seq)
        assert tokens == greedy(prompt, 4) and seq.cached_prompt_tokens == 2 * BLOCK
        chunks = [s for r in h.pool.prefills for s in r.sequences if s.sequence_id == seq.seq_id]
        assert [c.start_position for c in chunks] == [8, 11, 14]  # 3-token chunks after the hit
        assert [len(c.prefix_token_ids) for c in chunks] == [8, 0, 0]
    on(body, prefill_token_budget=3)


def test_serve_flags_and_config_keys_switch_and_scope_the_cache(tmp_path):
    import argparse

    from shardlm_server.gateway.config import ConfigError
    from shardlm_server.gateway.serve.config_sources import add_serve_arguments, resolve

    def settings(argv: list[str], environ: dict[str, str] | None = None):
        parser = argparse.ArgumentParser()
        add_serve_arguments(parser)
        args = parser.parse_args(argv)
        return resolve(vars(args), args.config, environ or {}).limits

    defaults = settings([])
    assert (defaults.prefix_cache, defaults.prefix_cache_scope) == (True, "identity")
    flags = settings(["--no-prefix-cache", "--prefix-cache-scope", "global"])
    assert (flags.prefix_cache, flags.prefix_cache_scope) == (False, "global")
    config = tmp_path / "serve.toml"
    config.write_text('prefix_cache = false\nprefix_cache_scope = "global"\n')
    from_file = settings(["--config", str(config)])
    assert (from_file.prefix_cache, from_file.prefix_cache_scope) == (False, "global")
    from_env = settings([], {"SHARDLM_PREFIX_CACHE": "off"})
    assert from_env.prefix_cache is False
    with pytest.raises(ConfigError):
        settings(["--prefix-cache-scope", "everyone"])
