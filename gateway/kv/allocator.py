"""The gateway's KV block allocator: which worker cache blocks each sequence holds, and the
prefix cache over them.

It mirrors the workers' pool (`num_blocks` from their Load). In STATIC mode the pool is cut into
fixed runs of blocks, one per sequence slot, and a sequence takes a whole slot at once
(predictable memory, no churn; no prefix cache).

The prefix cache (paged mode): a full block whose tokens a sequence has computed is published
under a key, a hash chain over every token up to its end, started from a salt (the model, and
whoever may share it: the salt policy of gateway/kv/manager.py). A new sequence takes the
longest run of published blocks that holds a beginning of its prompt instead of computing it.
Blocks are reference-counted; a published block no sequence holds stays cached, on a
least-recently-used list, and is reclaimed only when no free block is left. Only full blocks are
ever shared and a sequence never writes into a published block (`rewind` hands it a private
one), so shared blocks are immutable.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from shardlm_server.gateway.config import default
from shardlm_server.gateway.kv.events import KvEventLog


class OutOfBlocks(Exception):
    """Not enough free blocks for the request right now."""

    def __init__(self, needed: int, free: int) -> None:
        super().__init__(f"needs {needed} KV blocks, {free} free")


def _root_key(salt: bytes) -> bytes:
    return hashlib.blake2b(salt, digest_size=16, person=b"shardlm-prefix").digest()


def _chain_key(previous: bytes, tokens: list[int]) -> bytes:
    return hashlib.blake2b(previous + array("i", tokens).tobytes(), digest_size=16).digest()


@dataclass
class BlockTable:
    blocks: list[int]
    keys: list[bytes] = field(default_factory=list)  # chain keys of the first full blocks

    def capacity(self, block_size: int) -> int:
        return len(self.blocks) * block_size


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int, *, static_slot_blocks: int = 0,
                 prefix_cache: bool = default("prefix_cache"),
                 on_evict: Callable[[], None] = lambda: None,
                 events: KvEventLog | None = None) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.static_slot_blocks = static_slot_blocks
        self.prefix_cache = prefix_cache and not static_slot_blocks
        self._on_evict = on_evict
        self._events = events if self.prefix_cache else None  # what the routers are told
        self.reset()

    def reset(self) -> None:
        """Every block free, no table, no cached prefix (the workers lost their caches)."""
        self._refs = [0] * self.num_blocks
        if self.static_slot_blocks:
            slots = self.num_blocks // self.static_slot_blocks
            self._free_slots = list(range(slots - 1, -1, -1))
            self._free: list[int] = []
        else:
            self._free = list(range(self.num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._tables: dict[int, BlockTable] = {}
        self._by_key: dict[bytes, int] = {}  # published blocks
        self._key_of: dict[int, bytes] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()  # published, held by none; LRU first
        if self._events is not None:
            self._events.cleared()

    # ----------------------------------------------------------------- queries
    @property
    def free_blocks(self) -> int:
        """Blocks a sequence can take now: free ones and cached ones no sequence holds."""
        if self.static_slot_blocks:
            return len(self._free_slots) * self.static_slot_blocks
        return len(self._free) + len(self._idle)

    @property
    def used_blocks(self) -> int:
        """Blocks held by at least one sequence."""
        return sum(1 for r in self._refs if r)

    @property
    def cached_blocks(self) -> int:
        """Blocks holding a cached prefix, held by sequences or not."""
        return len(self._key_of)

    @property
    def idle_cached_blocks(self) -> int:
        """Cached blocks no sequence holds (reclaimed first when blocks run out)."""
        return len(self._idle)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def table(self, sequence_id: int) -> list[int]:
        table = self._tables.get(sequence_id)
        return list(table.blocks) if table else []

    def holds(self, sequence_id: int) -> bool:
        return sequence_id in self._tables

    def held_by_others(self, sequence_id: int) -> bool:
        """Whether a sequence other than `sequence_id` holds a block."""
        return any(t.blocks for sid, t in self._tables.items() if sid != sequence_id)

    def extra_blocks_needed(self, sequence_id: int, tokens: int) -> int:
        """Blocks to add so the sequence can hold `tokens` tokens in total."""
        have = len(self._tables[sequence_id].blocks) if sequence_id in self._tables else 0
        if self.static_slot_blocks:
            return 0 if have else self.static_slot_blocks
        return max(0, self.blocks_for(tokens) - have)

    def can_grow(self, sequence_id: int, tokens: int) -> bool:
        if self.static_slot_blocks:
            if tokens > self.static_slot_blocks * self.block_size:
                return False
            return self.holds(sequence_id) or bool(self._free_slots)
        return self.extra_blocks_needed(sequence_id, tokens) <= self.free_blocks

    # ----------------------------------------------------------------- changes
    def grow(self, sequence_id: int, tokens: int) -> None:
        """Make the sequence able to hold `tokens` tokens."""
        table = self._tables.setdefault(sequence_id, BlockTable([]))
        if self.static_slot_blocks:
            if tokens > self.static_slot_blocks * self.block_size:
                raise OutOfBlocks(self.blocks_for(tokens), self.static_slot_blocks)
            if not table.blocks:
                if not self._free_slots:
                    del self._tables[sequence_id]
                    raise OutOfBlocks(self.static_slot_blocks, 0)
                slot = self._free_slots.pop()
                table.blocks = list(range(slot * self.static_slot_blocks,
                                          (slot + 1) * self.static_slot_blocks))
                for b in table.blocks:
                    self._refs[b] = 1
            return
        needed = self.blocks_for(tokens) - len(table.blocks)
        if needed > self.free_blocks:
            if not table.blocks:
                del self._tables[sequence_id]
            raise OutOfBlocks(needed, self.free_blocks)
        for _ in range(max(0, needed)):
            block = self._take()
            self._refs[block] = 1
            table.blocks.append(block)

    def shrink(self, sequence_id: int, tokens: int) -> None:
        """Return blocks beyond what `tokens` tokens need (unused pre-allocation)."""
        table = self._tables.get(sequence_id)
        if table is None or self.static_slot_blocks:
            return
        keep = max(self.blocks_for(tokens), 0)
        while len(table.blocks) > keep:
            self._release(table.blocks.pop())
        del table.keys[keep:]

    def free(self, sequence_id: int) -> bool:
        """Return all the sequence's blocks (its published ones stay cached); whether it held
        any table at all."""
        table = self._tables.pop(sequence_id, None)
        if table is None:
            return False
        if self.static_slot_blocks and table.blocks:
            for b in table.blocks:
                self._refs[b] = 0
            self._free_slots.append(table.blocks[0] // self.static_slot_blocks)
            return True
        for block in table.blocks:
            self._release(block)
        return True

    # ----------------------------------------------------------------- prefix cache
    def attach_prefix(self, sequence_id: int, tokens: list[int], salt: bytes) -> int:
        """For a sequence holding no blocks: hold the longest run of cached blocks that holds a
        beginning of `tokens` (never its last token, whose logits must be computed). Returns
        how many tokens they hold; 0 and no table when nothing matched."""
        if not self.prefix_cache or sequence_id in self._tables:
            return 0
        table = BlockTable([])
        for block, key in self._cached_run(tokens, salt):
            self._idle.pop(block, None)
            self._refs[block] += 1
            table.blocks.append(block)
            table.keys.append(key)
        if table.blocks:
            self._tables[sequence_id] = table
        return len(table.blocks) * self.block_size

    def cached_prefix(self, tokens: list[int], salt: bytes) -> int:
        """How many tokens attach_prefix would find cached now, holding nothing."""
        return len(self._cached_run(tokens, salt)) * self.block_size

    def block_keys(self, tokens: list[int], salt: bytes, first: int, end: int) -> list[bytes]:
        """The chain keys of full blocks first..end-1 of `tokens` (a block is named by its
        whole prefix, so the chain is hashed from the start)."""
        key, keys, bs = _root_key(salt), [], self.block_size
        for i in range(min(end, len(tokens) // bs)):
            key = _chain_key(key, tokens[i * bs:(i + 1) * bs])
            if i >= first:
                keys.append(key)
        return keys

    def _cached_run(self, tokens: list[int], salt: bytes) -> list[tuple[int, bytes]]:
        """(block, key) of the cached blocks holding a beginning of `tokens`, its last token
        excluded."""
        run = []
        key = _root_key(salt)
        bs = self.block_size
        for i in range((len(tokens) - 1) // bs):
            key = _chain_key(key, tokens[i * bs:(i + 1) * bs])
            block = self._by_key.get(key)
            if block is None:
                break
            run.append((block, key))
        return run

    def publish(self, sequence_id: int, tokens: list[int], cached: int, salt: bytes) -> None:
        """Offer the full blocks among the sequence's first `cached` tokens (computed, never
        written again) to later sequences with the same salt."""
        table = self._tables.get(sequence_id)
        if not self.prefix_cache or table is None:
            return
        bs = self.block_size
        full = min(cached // bs, len(table.blocks))
        if len(table.keys) >= full:
            return
        key = table.keys[-1] if table.keys else _root_key(salt)
        for i in range(len(table.keys), full):
            parent = key if i else None
            key = _chain_key(key, tokens[i * bs:(i + 1) * bs])
            table.keys.append(key)
            block = table.blocks[i]
            # A block is shared only where its whole chain is: not when another sequence
            # published the same tokens first (this copy stays private), nor after a block
            # before it was forgotten by a clear of the cache (no lookup could reach it).
            if (key not in self._by_key and block not in self._key_of
                    and (parent is None or parent in self._by_key)):
                self._by_key[key] = block
                self._key_of[block] = key
                if self._events is not None:
                    self._events.stored(salt, key, parent, tokens[i * bs:(i + 1) * bs], i)

    def rewind(self, sequence_id: int, position: int) -> int:
        """The sequence writes its cache from `position` on. A published block there is shared
        and immutable: it leaves the table with every block after it, and writing starts at
        that block's first position instead (returned)."""
        table = self._tables.get(sequence_id)
        if table is None or self.static_slot_blocks:
            return position
        bs = self.block_size
        first = position // bs
        del table.keys[first:]
        for i in range(first, len(table.blocks)):
            if table.blocks[i] in self._key_of or self._refs[table.blocks[i]] > 1:
                for block in table.blocks[i:]:
                    self._release(block)
                del table.blocks[i:]
                return min(position, i * bs)
        return position

    def clear_prefix_cache(self) -> None:
        """Forget every cached prefix (the workers' caches were reset or lost). Blocks that
        sequences hold stay theirs, now private, and so do the blocks they go on to complete
        after those (their chains start at a forgotten block)."""
        self._free.extend(self._idle)
        self._idle.clear()
        self._by_key.clear()
        self._key_of.clear()
        if self._events is not None:
            self._events.cleared()

    # ----------------------------------------------------------------- internals
    def _take(self) -> int:
        """A block to write: a free one, else the least recently used idle cached one."""
        if self._free:
            return self._free.pop()
        block, _ = self._idle.popitem(last=False)
        key = self._key_of.pop(block)
        del self._by_key[key]
        self._on_evict()
        if self._events is not None:
            self._events.removed(key)
        return block

    def _release(self, block: int) -> None:
        self._refs[block] -= 1
        if self._refs[block] == 0:
            if block in self._key_of:
                self._idle[block] = None  # most recently used last
            else:
                self._free.append(block)
