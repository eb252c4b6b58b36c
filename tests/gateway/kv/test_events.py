"""KV events (gateway/kv/events.py) fed by the allocator: stored chains with their parents,
removed on eviction, cleared; numbered batches; a subscriber from 0 gets a snapshot, one
resuming gets exactly the batches it missed, one the history no longer reaches gets a snapshot
filling its gap, an unknown number gets DATA_LOSS; a slow subscriber never blocks the publisher."""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest
from shardlm.errors import ShardLMError

from shardlm_server.gateway.kv.allocator import BlockAllocator, _chain_key, _root_key
from shardlm_server.gateway.kv.events import KvEventLog, block_hash

SALT = b"routable"
BS = 4


def make(num_blocks: int = 8, **options) -> tuple[BlockAllocator, KvEventLog]:
    log = KvEventLog(**options)
    log.routable_salt = SALT
    return BlockAllocator(num_blocks, BS, events=log), log


def cache(a: BlockAllocator, seq: int, tokens: list[int], salt: bytes = SALT) -> None:
    a.grow(seq, len(tokens))
    a.publish(seq, tokens, len(tokens), salt)


def hashes(tokens: list[int], salt: bytes = SALT) -> list[int]:
    key, out = _root_key(salt), []
    for i in range(len(tokens) // BS):
        key = _chain_key(key, tokens[i * BS:(i + 1) * BS])
        out.append(block_hash(key))
    return out


def events(batch):
    return [e.WhichOneof("data") for e in batch.events]


def drain(log: KvEventLog, start: int, count: int) -> list:
    async def main():
        got, stream = [], log.subscribe(start)
        async for batch in stream:
            got.append(batch)
            if len(got) == count:
                break
        await stream.aclose()
        return got
    return asyncio.run(main())


def test_a_chain_is_stored_parent_first_and_continued_from_its_last_block():
    a, log = make()
    log.flush()  # the allocator's opening clear
    tokens = list(range(1, 13))
    cache(a, 1, tokens[:8])
    a.grow(1, 12)
    a.publish(1, tokens, 12, SALT)
    log.flush()
    batch = log._history[-1]
    assert batch.sequence_number == log.last_sequence_number
    assert events(batch) == ["stored"]  # one chain, one event
    stored = batch.events[0].stored
    expected = hashes(tokens)
    assert [b.block_hash for b in stored.blocks] == expected
    assert [list(b.token_ids) for b in stored.blocks] == [tokens[0:4], tokens[4:8], tokens[8:12]]
    assert not stored.HasField("parent_block_hash")
    cache(a, 2, tokens[:4] + [99, 98, 97, 96])  # shares the first block, adds a branch
    log.flush()
    branch = log._history[-1].events[0].stored
    assert branch.parent_block_hash == expected[0] and len(branch.blocks) == 1


def test_blocks_of_another_salt_are_not_published_and_eviction_and_clear_are():
    a, log = make(num_blocks=2)
    cache(a, 1, [5, 6, 7, 8], salt=b"someone else's")
    cache(a, 2, [1, 2, 3, 4])
    log.flush()
    assert [events(b) for b in log._history] == [["cleared", "stored"]]
    assert log.live_blocks == 1
    a.free(1)
    a.free(2)
    a.grow(3, 8)  # takes both cached blocks: the routable one is removed
    log.flush()
    assert events(log._history[-1]) == ["removed"]
    assert list(log._history[-1].events[0].removed.block_hashes) == hashes([1, 2, 3, 4])
    a.clear_prefix_cache()
    log.flush()
    assert events(log._history[-1]) == ["cleared"] and log.live_blocks == 0


def test_from_zero_a_snapshot_then_live_batches_numbered_on():
    a, log = make()
    cache(a, 1, list(range(8)))
    cache(a, 2, list(range(4)) + [9, 9, 9, 9])
    log.flush()
    last = log.last_sequence_number

    async def main():
        stream = log.subscribe(0)
        snapshot = await anext(stream)
        cache(a, 3, [7, 7, 7, 7])
        log.flush()
        live = await anext(stream)
        await stream.aclose()
        return snapshot, live

    snapshot, live = asyncio.run(main())
    assert snapshot.sequence_number == last and snapshot.snapshot.count == 1
    assert events(snapshot) == ["cleared", "stored", "stored", "stored"]
    parents = {b.blocks[0].block_hash: b.parent_block_hash if b.HasField("parent_block_hash")
               else None for b in (e.stored for e in snapshot.events[1:])}
    seen = set()
    for h, parent in parents.items():  # parents before children
        assert parent is None or parent in seen
        seen.add(h)
    assert live.sequence_number == last + 1 and events(live) == ["stored"]


def test_a_resumed_subscriber_gets_exactly_the_batches_it_missed():
    a, log = make(num_blocks=64)
    for i in range(5):
        cache(a, i, [i] * 4)
        log.flush()
    last = log.last_sequence_number
    replay = drain(log, last - 3, 3)
    assert [b.sequence_number for b in replay] == [last - 2, last - 1, last]
    assert [b.events[0].stored.blocks[0].token_ids[0] for b in replay] == [2, 3, 4]


def test_past_the_history_a_snapshot_fills_the_gap_and_unknown_numbers_are_data_loss():
    a, log = make(num_blocks=64, history_batches=2)
    first = log.last_sequence_number
    for i in range(6):
        cache(a, i, [i] * 4)
        log.flush()
    last = log.last_sequence_number
    gap = drain(log, first + 1, last - first - 1)
    assert [b.sequence_number for b in gap] == list(range(first + 2, last + 1))
    assert gap[0].snapshot.count == len(gap) and events(gap[0])[0] == "cleared"
    stored = [e for b in gap for e in b.events if e.WhichOneof("data") == "stored"]
    assert len(stored) == log.live_blocks == 6
    for bad in (first - 5, last + 10):
        with pytest.raises(ShardLMError) as caught:
            drain(log, bad, 1)
        assert caught.value.code == grpc.StatusCode.DATA_LOSS
        assert "resubscribe from zero" in caught.value.message


def test_a_slow_subscriber_is_resynced_by_a_snapshot_and_never_blocks_the_publisher():
    a, log = make(num_blocks=64, queue_batches=2)

    async def main():
        stream = log.subscribe(0)
        opening = await anext(stream)
        for i in range(6):  # published while the subscriber reads nothing
            cache(a, i, [i] * 4)
            log.flush()
        caught_up = [await anext(stream) for _ in range(log.last_sequence_number
                                                        - opening.sequence_number)]
        await stream.aclose()
        return opening, caught_up

    opening, caught_up = asyncio.run(main())
    numbers = [b.sequence_number for b in caught_up]
    assert numbers == list(range(opening.sequence_number + 1, log.last_sequence_number + 1))
    assert caught_up[0].HasField("snapshot") and events(caught_up[0])[0] == "cleared"


def test_an_idle_stream_carries_load_records_numbered_as_its_last_batch():
    from smg_grpc_proto.generated import common_pb2 as kv_pb2

    _a, log = make(heartbeat_s=0.01)
    log.load = lambda: kv_pb2.EngineLoad(running_requests=3)
    first, beat = drain(log, 0, 2)
    assert beat.load.load_only and beat.load.running_requests == 3 and not beat.events
    assert beat.sequence_number == first.sequence_number and beat.load.sample > first.load.sample


def test_publishing_can_be_switched_off():
    a, log = make(enabled=False)
    cache(a, 1, [1, 2, 3, 4])
    log.flush()
    assert not log._history and log.live_blocks == 0


def test_random_operations_keep_the_routers_view_equal_to_the_cache():
    """Allocations, publishing under the routable salt and another, rewinds, frees, evictions
    and clears at random: replaying every batch gives, after each one, exactly the routable
    blocks the prefix cache shares, each stored after its parent."""
    rng = random.Random(11)
    a, log = make(num_blocks=16)
    private: set[bytes] = set()  # the chain keys published under the other salt
    view: dict[int, int | None] = {}  # what a router that replays the batches knows: parents
    histories: dict[int, tuple[list[int], bytes]] = {}
    replayed = 0  # the last batch's number the view holds
    for step in range(2000):
        sid, op = rng.randrange(8), rng.random()
        if sid not in histories:
            tokens = [rng.randrange(3) for _ in range(rng.randrange(1, 20))]
            salt = SALT if rng.random() < 0.8 else b"private"
            a.attach_prefix(sid, tokens, salt)
            if not a.can_grow(sid, len(tokens)):
                a.free(sid)
                continue
            a.grow(sid, len(tokens))
            histories[sid] = (tokens, salt)
        elif op < 0.3:
            a.free(sid)
            del histories[sid]
            continue
        elif op < 0.35:
            a.clear_prefix_cache()
            continue
        else:
            tokens, salt = histories[sid]
            start = a.rewind(sid, rng.randrange(len(tokens) + 1))
            tokens[start:] = [rng.randrange(3) for _ in range(rng.randrange(1, 6))]
            if not a.can_grow(sid, len(tokens)):
                a.free(sid)
                del histories[sid]
                continue
            a.grow(sid, len(tokens))
        tokens, salt = histories[sid]
        a.publish(sid, tokens, len(tokens), salt)
        if salt != SALT:
            key = _root_key(salt)
            for i in range(len(tokens) // BS):
                key = _chain_key(key, tokens[i * BS:(i + 1) * BS])
                private.add(key)
        log.flush()
        batches = [b for b in log._history if b.sequence_number > replayed]
        replayed = log.last_sequence_number
        for event in (e for batch in batches for e in batch.events):
            kind = event.WhichOneof("data")
            if kind == "cleared":
                view.clear()
            elif kind == "removed":
                for h in event.removed.block_hashes:
                    del view[h]  # only what it was told of is removed
            else:
                parent = (event.stored.parent_block_hash
                          if event.stored.HasField("parent_block_hash") else None)
                assert parent is None or parent in view, step
                for block in event.stored.blocks:
                    view[block.block_hash] = parent
                    parent = block.block_hash
        shared = {block_hash(k) for k in a._by_key if k not in private}
        assert set(view) == shared, step
