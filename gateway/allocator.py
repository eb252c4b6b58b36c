"""The gateway's KV block allocator: which worker cache blocks each sequence holds.

It mirrors the workers' pool (`num_blocks` from their Load). Blocks are reference-counted so that
a later prefix-sharing feature can hand one block to several sequences; today each block has one
owner. In STATIC mode the pool is cut into fixed runs of blocks, one per sequence slot, and a
sequence takes a whole slot at once (predictable memory, no churn).
"""

from __future__ import annotations

from dataclasses import dataclass


class OutOfBlocks(Exception):
    """Not enough free blocks for the request right now."""

    def __init__(self, needed: int, free: int) -> None:
        super().__init__(f"needs {needed} KV blocks, {free} free")


@dataclass
class BlockTable:
    blocks: list[int]

    def capacity(self, block_size: int) -> int:
        return len(self.blocks) * block_size


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int, *, static_slot_blocks: int = 0) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.static_slot_blocks = static_slot_blocks
        self._refs = [0] * num_blocks
        if static_slot_blocks:
            slots = num_blocks // static_slot_blocks
            self._free_slots = list(range(slots - 1, -1, -1))
            self._free: list[int] = []
        else:
            self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._tables: dict[int, BlockTable] = {}

    # ----------------------------------------------------------------- queries
    @property
    def free_blocks(self) -> int:
        if self.static_slot_blocks:
            return len(self._free_slots) * self.static_slot_blocks
        return len(self._free)

    @property
    def used_blocks(self) -> int:
        return sum(1 for r in self._refs if r)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def table(self, sequence_id: int) -> list[int]:
        table = self._tables.get(sequence_id)
        return list(table.blocks) if table else []

    def holds(self, sequence_id: int) -> bool:
        return sequence_id in self._tables

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
        return self.extra_blocks_needed(sequence_id, tokens) <= len(self._free)

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
        if needed > len(self._free):
            if not table.blocks:
                del self._tables[sequence_id]
            raise OutOfBlocks(needed, len(self._free))
        for _ in range(max(0, needed)):
            block = self._free.pop()
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

    def free(self, sequence_id: int) -> bool:
        """Return all the sequence's blocks; whether it held any table at all."""
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

    def _release(self, block: int) -> None:
        self._refs[block] -= 1
        if self._refs[block] == 0:
            self._free.append(block)
