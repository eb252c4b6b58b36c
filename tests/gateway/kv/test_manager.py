"""The KV manager, the scheduler's one interface to KV blocks, on ids and token lists without a
scheduler: the prefix cache's salt policy, where a prefill starts (prefix hits, rewinds, the last
token), reserving blocks, eviction of the idle sequences it is given, and the ids the workers
must forget."""

from __future__ import annotations

import pytest
from shardlm.common.v1 import common_pb2

from shardlm_server.gateway.config import PREFIX_CACHE_SCOPE_GLOBAL, PREFIX_CACHE_SCOPE_IDENTITY
from shardlm_server.gateway.kv.allocator import BlockAllocator
from shardlm_server.gateway.kv.manager import KvManager, model_namespace, prefix_salt
from shardlm_server.gateway.metrics import Metrics

BLOCK = 4
SALT = prefix_salt("model", "", "")
TOKENS = list(range(10, 21))  # 11 tokens: two full blocks and a partial one


def manager(blocks: int = 8, *, prefix_cache: bool = True, namespace: str = "model") -> KvManager:
    metrics = Metrics()
    allocator = BlockAllocator(blocks, BLOCK, prefix_cache=prefix_cache,
                               on_evict=metrics.prefix_cache_evictions.inc)
    return KvManager(allocator, metrics, namespace=namespace)


def cached_by(kv: KvManager, seq_id: int, tokens: list[int]) -> None:
    """`seq_id` computed `tokens` and published its full blocks, then ended."""
    assert kv.grow(seq_id, len(tokens))
    kv.publish(seq_id, tokens, len(tokens), SALT)
    kv.release(seq_id)


# ----------------------------------------------------------------- the salt policy
def test_the_salt_names_the_model_the_caller_and_the_requests_own_salt():
    kv = manager()

    def salt(identity: str, own: str = "", scope: str = PREFIX_CACHE_SCOPE_IDENTITY):
        return kv.salt_for(identity, own, scope=scope, bypass=False)

    assert salt("alice") == prefix_salt("model", "alice", "")
    assert len({salt("alice"), salt("bob"), salt("alice", "x"), salt("bob", "x")}) == 4
    everyone = salt("alice", scope=PREFIX_CACHE_SCOPE_GLOBAL)
    assert everyone == salt("bob", scope=PREFIX_CACHE_SCOPE_GLOBAL) == prefix_salt("model", "", "")
    other_model = manager(namespace="other").salt_for("alice", "", scope="identity", bypass=False)
    assert other_model != salt("alice")


def test_a_request_that_bypasses_the_cache_has_no_salt():
    assert manager().salt_for("alice", "x", scope=PREFIX_CACHE_SCOPE_IDENTITY, bypass=True) is None


def test_the_salts_parts_never_run_into_each_other():
    assert prefix_salt("ab", "c", "") != prefix_salt("a", "bc", "")
    assert prefix_salt("m", "", "x") != prefix_salt("m", "x", "")


def test_the_models_namespace_is_its_checkpoint_dtype_and_tensor_parallel_size():
    base = common_pb2.ModelInfo(model_path="/m", dtype=common_pb2.DTYPE_FLOAT32,
                                tensor_parallel_size=1)
    variants = [base]
    for change in ({"model_path": "/n"}, {"dtype": common_pb2.DTYPE_BFLOAT16},
                   {"tensor_parallel_size": 2}):
        info = common_pb2.ModelInfo()
        info.CopyFrom(base)
        for name, value in change.items():
            setattr(info, name, value)
        variants.append(info)
    assert len({model_namespace(info) for info in variants}) == 4


# ----------------------------------------------------------------- where a prefill starts
def test_a_sequence_holding_nothing_takes_the_longest_cached_prefix():
    kv = manager()
    cached_by(kv, 1, TOKENS)
    assert not kv.allocator.holds(1) and kv.allocator.idle_cached_blocks == 2  # stay cached
    assert kv.prefill_start(2, TOKENS[:9] + [99, 98], 0, SALT) == 8
    assert len(kv.table(2)) == 2 and kv.allocator.idle_cached_blocks == 0  # held now
    assert kv.metrics.value("shardlm_prefix_cache_lookups_total") == 1
    assert kv.metrics.value("shardlm_prefix_cache_hit_tokens_total") == 8
    assert kv.prefill_start(3, [1, 2, 3, 4, 5], 0, SALT) == 0
    assert kv.metrics.value("shardlm_prefix_cache_lookups_total") == 2


def test_the_last_token_is_always_computed():
    kv = manager()
    cached_by(kv, 1, TOKENS[:8])  # exactly two blocks
    assert kv.prefill_start(2, TOKENS[:8], 0, SALT) == 4
    assert kv.grow(3, 5)
    assert kv.prefill_start(3, TOKENS[:5], 5, None) == 4


def test_a_sequence_holding_blocks_is_rewound_before_a_shared_block_it_would_write():
    kv = manager()
    assert kv.grow(1, 10)
    kv.publish(1, TOKENS[:10], 10, SALT)  # blocks 0 and 1 are shared now
    changed = TOKENS[:6] + [0, 0, 0]  # differs inside block 1
    assert kv.prefill_start(1, changed, 6, SALT) == 4
    assert len(kv.table(1)) == 1  # block 1 is written again in a private block
    own = manager()
    assert own.grow(1, 7)  # nothing published: its own blocks are rewritten in place
    assert own.prefill_start(1, TOKENS[:7], 6, SALT) == 6


@pytest.mark.parametrize("prefix_cache, salt", [(True, None), (False, SALT)])
def test_a_bypass_or_a_disabled_cache_neither_looks_up_nor_publishes(prefix_cache, salt):
    kv = manager(prefix_cache=prefix_cache)
    assert kv.grow(1, 11)
    kv.publish(1, TOKENS, 11, salt)
    assert kv.allocator.cached_blocks == 0
    assert kv.prefill_start(2, TOKENS, 0, salt) == 0
    assert kv.metrics.value("shardlm_prefix_cache_lookups_total") == 0


# ----------------------------------------------------------------- reserving blocks
def test_grow_is_refused_without_a_change_when_blocks_are_short():
    kv = manager(blocks=3)
    assert kv.grow(1, 8)
    assert kv.blocks_needed(2, 8) == 2 and not kv.has_room(2, 8) and kv.has_room(2, 4)
    assert not kv.grow(2, 8)
    assert not kv.allocator.holds(2) and kv.free_blocks == 1


def test_grow_up_to_gives_as_many_steps_as_fit():
    kv = manager(blocks=3)
    assert kv.grow(1, 4)
    assert kv.grow_up_to(2, 3, 10) == 5  # room for 8 tokens: 5 steps after 3 held
    assert kv.grow_up_to(3, 0, 2) == 0 and not kv.allocator.holds(3)


def test_trim_returns_blocks_allocated_ahead():
    kv = manager()
    assert kv.grow(1, 16)
    kv.trim(1, 5)
    assert len(kv.table(1)) == 2 and kv.free_blocks == 6


def test_make_room_releases_the_idle_sequences_given_in_their_order_until_there_is_room():
    kv = manager(blocks=5)
    for seq_id in (1, 2, 3, 4):
        assert kv.grow(seq_id, 4)  # one block each; one left
    released = kv.make_room(4, 12, [4, 2, 1, 3])  # sequence 4 needs 2 more: 1 is released
    assert released == [2] and kv.has_room(4, 12)
    assert all(kv.allocator.holds(s) for s in (1, 3, 4))
    assert kv.make_room(4, 12, [1, 3]) == []  # room already
    assert kv.make_room(4, 40, [1, 3]) == [1, 3] and not kv.has_room(4, 40)  # not enough
    assert kv.take_resets() == [2, 1, 3]


def test_cached_blocks_no_sequence_holds_go_before_any_idle_sequence():
    kv = manager(blocks=4)
    cached_by(kv, 1, [7] * 4)  # one idle cached block
    assert kv.grow(2, 4)
    assert kv.make_room(3, 12, [2]) == []  # free plus idle cached blocks are enough
    assert kv.grow(3, 12) and kv.allocator.holds(2)
    assert kv.metrics.value("shardlm_prefix_cache_evictions_total") == 1


# ----------------------------------------------------------------- what the workers forget
def test_release_queues_the_id_for_the_workers_once():
    kv = manager()
    assert kv.grow(1, 5)
    assert kv.release(1) and not kv.release(1)
    assert not kv.release(7)  # never held blocks: nothing for the workers to forget
    assert kv.take_resets() == [1] and kv.take_resets() == []


def test_losing_the_workers_frees_every_block_and_empties_the_prefix_cache():
    kv = manager()
    assert kv.grow(1, 8)
    kv.publish(1, TOKENS[:8], 8, SALT)
    assert kv.grow(2, 4)
    kv.release(2)
    kv.workers_lost()
    assert (kv.allocator.used_blocks, kv.allocator.cached_blocks, kv.free_blocks) == (0, 0, 8)
    assert kv.take_resets() == []  # the workers hold nothing to reset
    assert kv.prefill_start(3, TOKENS, 0, SALT) == 0
    kv.update_gauges()
    assert kv.metrics.value("shardlm_kv_blocks_used") == 0
    assert kv.metrics.value("shardlm_kv_blocks_total") == 8


def test_the_reported_capacity_builds_paged_or_static_blocks():
    model = common_pb2.ModelInfo(model_path="m")
    paged = KvManager.for_capacity(common_pb2.KvCacheCapacity(
        mode=common_pb2.KV_CACHE_MODE_PAGED, num_blocks=8, block_size=BLOCK), model, Metrics())
    assert paged.allocator.prefix_cache  # the serve default
    assert paged.grow(1, 5) and len(paged.table(1)) == 2
    static = KvManager.for_capacity(common_pb2.KvCacheCapacity(
        mode=common_pb2.KV_CACHE_MODE_STATIC, num_blocks=8, block_size=BLOCK, max_sequences=2),
        model, Metrics())
    assert not static.allocator.prefix_cache
    assert static.grow(1, 1) and len(static.table(1)) == 4  # a whole slot at once
    assert not static.grow(2, 17)  # longer than a slot
