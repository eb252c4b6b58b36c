"""The gateway's KV block allocator: paged growth, shrinking, freeing, and static slots."""

from __future__ import annotations

import pytest

from shardlm_server.gateway.kv.allocator import BlockAllocator, OutOfBlocks


def test_grow_hands_out_low_ids_and_only_what_is_needed():
    a = BlockAllocator(8, 4)
    a.grow(1, 5)
    assert a.table(1) == [0, 1]
    a.grow(1, 8)
    assert a.table(1) == [0, 1]  # still fits
    a.grow(2, 1)
    assert a.table(2) == [2]
    a.grow(1, 9)
    assert a.table(1) == [0, 1, 3]
    assert (a.used_blocks, a.free_blocks) == (4, 4)
    assert a.extra_blocks_needed(2, 12) == 2 and a.extra_blocks_needed(9, 4) == 1


def test_shrink_returns_unused_preallocation():
    a = BlockAllocator(8, 4)
    a.grow(1, 16)
    a.shrink(1, 5)
    assert a.table(1) == [0, 1] and a.free_blocks == 6
    a.shrink(7, 3)  # unknown sequence: nothing happens
    assert a.free_blocks == 6


def test_free_reports_whether_the_sequence_held_blocks():
    a = BlockAllocator(4, 4)
    a.grow(1, 8)
    assert a.free(1) is True and a.free_blocks == 4 and not a.holds(1)
    assert a.free(1) is False


def test_out_of_blocks_leaves_no_partial_table():
    a = BlockAllocator(3, 4)
    a.grow(1, 8)
    assert not a.can_grow(2, 8)
    with pytest.raises(OutOfBlocks) as err:
        a.grow(2, 8)
    assert str(err.value) == "needs 2 KV blocks, 1 free"
    assert not a.holds(2) and a.free_blocks == 1


def test_freed_blocks_are_reused():
    a = BlockAllocator(4, 2)
    a.grow(1, 4)
    a.grow(2, 4)
    a.free(1)
    a.grow(3, 4)
    assert sorted(a.table(3)) == [0, 1]


def test_static_slots_take_a_whole_run_at_once():
    a = BlockAllocator(8, 4, static_slot_blocks=4)  # two slots of 16 tokens
    a.grow(1, 1)
    assert a.table(1) == [0, 1, 2, 3]
    assert a.extra_blocks_needed(1, 16) == 0 and a.extra_blocks_needed(2, 1) == 4
    assert not a.can_grow(1, 17)
    with pytest.raises(OutOfBlocks):
        a.grow(1, 17)
    a.grow(2, 3)
    assert a.table(2) == [4, 5, 6, 7]
    assert a.free_blocks == 0 and not a.can_grow(3, 1)
    a.shrink(1, 1)  # slots never shrink
    assert len(a.table(1)) == 4
    assert a.free(1) and a.free_blocks == 4
    a.grow(3, 2)
    assert a.table(3) == [0, 1, 2, 3]


def test_invalid_pool_is_refused():
    with pytest.raises(ValueError):
        BlockAllocator(0, 16)
