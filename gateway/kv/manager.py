"""The scheduler's one interface to the KV cache: each sequence's blocks, the prefix cache (its
salt policy, lookups and publishing), eviction, and which sequences the workers must forget.

It works on sequence ids and token lists. What a sequence is, which ones are idle and how a
history is rebuilt is batching's knowledge (gateway/batching/): it tells the manager ids.

- The salt policy: a request's blocks are shared under a salt made of the model (checkpoint,
  dtype, tensor-parallel size), the caller's identity (unless the scope is global) and the
  request's own salt. A request that bypasses the cache has none: it neither reuses nor
  publishes blocks.
- Before each prefill, `prefill_start` says where the sequence's computation starts: at least its
  last token is computed (its logits give the next token); a sequence holding blocks is rewound
  so that it never writes into a shared block; one holding none takes the longest cached prefix
  of its history. After each step `publish` offers the blocks the sequence completed.
- Reserving: `grow` and `grow_up_to` give a sequence the blocks for the tokens it is about to
  hold, `trim` returns what it no longer needs. When blocks run out, cached blocks no sequence
  holds are reclaimed first (the allocator counts them free); then `make_room` releases the idle
  sequences it is given, in the order given.
- Every way a sequence loses its blocks (released, evicted, preempted, expired, failed) is
  `release`: its blocks go back (its published ones stay in the prefix cache, so a rebuild, or
  any sequence with the same beginning, starts from them) and its id is queued for the workers'
  next ResetCache (`take_resets`), which the scheduler sends before its next step.
"""

from __future__ import annotations

from collections.abc import Iterable

from shardlm.common.v1 import common_pb2

from shardlm_server.gateway.config import PREFIX_CACHE_SCOPE_GLOBAL, default
from shardlm_server.gateway.kv.allocator import BlockAllocator
from shardlm_server.gateway.kv.events import KvEventLog
from shardlm_server.gateway.metrics import Metrics


def prefix_salt(namespace: str, identity: str, salt: str) -> bytes:
    """The start of a key chain: blocks are shared only between requests with equal salts.
    `namespace` names the model; `identity` is the caller's (empty when shared by all)."""
    parts = (namespace, identity, salt)
    return b"".join(len(p.encode()).to_bytes(4, "little") + p.encode() for p in parts)


def model_namespace(model: common_pb2.ModelInfo) -> str:
    """What makes two loads' KV blocks interchangeable: the checkpoint, dtype and TP size."""
    return f"{model.model_path}|{model.dtype}|{model.tensor_parallel_size}"


class KvManager:
    def __init__(self, allocator: BlockAllocator, metrics: Metrics, *, namespace: str,
                 events: KvEventLog | None = None) -> None:
        self.allocator = allocator
        self.metrics = metrics
        self.namespace = namespace
        self.events = events
        self._resets: list[int] = []

    @classmethod
    def for_capacity(cls, capacity: common_pb2.KvCacheCapacity, model: common_pb2.ModelInfo,
                     metrics: Metrics, *,
                     prefix_cache: bool = default("prefix_cache"),
                     events: KvEventLog | None = None) -> KvManager:
        """The manager of the cache the workers reported (Load, ResetCache): paged, or in
        static mode cut into one fixed run of blocks per sequence slot. `events` is told what
        blocks are shared under the salt of requests without identity or salt of their own."""
        static = capacity.mode == common_pb2.KV_CACHE_MODE_STATIC
        slot_blocks = capacity.num_blocks // max(capacity.max_sequences, 1) if static else 0
        namespace = model_namespace(model)
        if events is not None:
            # What a request without identity (a router's, auth off) or salt gets, any scope.
            events.routable_salt = prefix_salt(namespace, "", "")
        allocator = BlockAllocator(capacity.num_blocks, capacity.block_size,
                                   static_slot_blocks=slot_blocks, prefix_cache=prefix_cache,
                                   on_evict=metrics.prefix_cache_evictions.inc, events=events)
        return cls(allocator, metrics, namespace=namespace, events=events)

    # ----------------------------------------------------------------- the salt policy
    def salt_for(self, identity: str, salt: str, *, scope: str, bypass: bool) -> bytes | None:
        """The salt a request's blocks are shared under (see the module docstring); None when
        it bypasses the prefix cache."""
        if bypass:
            return None
        shared_by = "" if scope == PREFIX_CACHE_SCOPE_GLOBAL else identity
        return prefix_salt(self.namespace, shared_by, salt)

    # ----------------------------------------------------------------- reserving blocks
    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def free_blocks(self) -> int:
        return self.allocator.free_blocks

    def blocks_for(self, tokens: int) -> int:
        """Blocks that `tokens` tokens fill."""
        return self.allocator.blocks_for(tokens)

    def blocks_needed(self, seq_id: int, tokens: int) -> int:
        """Blocks the sequence must add to hold `tokens` tokens."""
        return self.allocator.extra_blocks_needed(seq_id, tokens)

    def has_room(self, seq_id: int, tokens: int) -> bool:
        """Whether enough blocks are free for the sequence to hold `tokens` tokens."""
        return self.blocks_needed(seq_id, tokens) <= self.allocator.free_blocks

    def make_room(self, seq_id: int, tokens: int, idle: Iterable[int]) -> list[int]:
        """Release the blocks of `idle` sequences, in their order, until `seq_id` has room for
        `tokens` tokens. Returns the ids released: the caller rebuilds those from their
        histories when they are used again."""
        released = []
        for other in idle:
            if self.has_room(seq_id, tokens):
                break
            if other != seq_id and self.release(other):
                released.append(other)
        return released

    def others_hold(self, seq_id: int) -> bool:
        """Whether blocks are held by sequences other than `seq_id` (free and idle cached
        ones aside): blocks that may still come free."""
        return self.allocator.held_by_others(seq_id)

    def grow(self, seq_id: int, tokens: int) -> bool:
        """Give the sequence blocks to hold `tokens` tokens, if it can have them now."""
        if not self.allocator.can_grow(seq_id, tokens):
            return False
        self.allocator.grow(seq_id, tokens)
        return True

    def grow_up_to(self, seq_id: int, held: int, steps: int) -> int:
        """Give a sequence holding `held` tokens room for as many of `steps` more as fit; how
        many (0: not even one)."""
        while steps > 0 and not self.allocator.can_grow(seq_id, held + steps):
            steps -= 1
        if steps:
            self.allocator.grow(seq_id, held + steps)
        return steps

    def room_after(self, seq_id: int, tokens: int) -> int:
        """Tokens the sequence's blocks hold past its first `tokens`."""
        return max(0, len(self.allocator.table(seq_id)) * self.allocator.block_size - tokens)

    def trim(self, seq_id: int, tokens: int) -> None:
        """Return the blocks beyond what `tokens` tokens need (unused pre-allocation)."""
        self.allocator.shrink(seq_id, tokens)

    def release(self, seq_id: int) -> bool:
        """Free all the sequence's blocks and have the workers forget it; whether it held any."""
        if not self.allocator.free(seq_id):
            return False
        self._resets.append(seq_id)
        return True

    def table(self, seq_id: int) -> list[int]:
        return self.allocator.table(seq_id)

    # ----------------------------------------------------------------- the prefix cache
    def prefill_start(self, seq_id: int, tokens: list[int], computed: int,
                      salt: bytes | None) -> int:
        """Where the next prefill of a sequence with history `tokens`, `computed` of them on
        the workers, starts (see the module docstring); `salt` None bypasses the cache. For a
        sequence that held no blocks, the tokens before it are a cached prefix it now holds."""
        position = min(computed, len(tokens) - 1)
        if self.allocator.holds(seq_id):
            return self.allocator.rewind(seq_id, position)
        if salt is None or not self.allocator.prefix_cache:
            return position
        hit = self.allocator.attach_prefix(seq_id, tokens, salt)
        self.metrics.prefix_cache_lookups.inc()
        self.metrics.prefix_cache_hit_tokens.inc(hit)
        return hit

    def publish(self, seq_id: int, tokens: list[int], computed: int, salt: bytes | None) -> None:
        """Offer the full blocks among the sequence's `computed` tokens to later sequences with
        the same salt (none when it bypasses the cache)."""
        if salt is not None:
            self.allocator.publish(seq_id, tokens, computed, salt)

    def clear_prefix_cache(self) -> None:
        """No cached prefix is reused from now on; blocks sequences hold stay theirs."""
        self.allocator.clear_prefix_cache()
        self.flush_events()

    def cached_prefix(self, tokens: list[int], salt: bytes | None) -> int:
        """Tokens at the start of `tokens` a new sequence would find cached (a lookup only)."""
        if salt is None or not self.allocator.prefix_cache:
            return 0
        return self.allocator.cached_prefix(tokens, salt)

    def shares_pending(self, seq_id: int, tokens: list[int], salt: bytes | None,
                       pending: set[bytes]) -> bool:
        """Whether a sequence that holds no blocks yet would compute, as its first uncached
        block, one of the `pending` blocks (the chain keys another sequence is computing in
        this step): admitted a step later, it reuses them instead."""
        a = self.allocator
        if salt is None or not pending or not a.prefix_cache or a.holds(seq_id):
            return False
        first = a.cached_prefix(tokens, salt) // a.block_size
        return any(k in pending for k in a.block_keys(tokens, salt, first, first + 1))

    def computing_keys(self, tokens: list[int], salt: bytes | None, start: int,
                       end: int) -> list[bytes]:
        """The chain keys of the full blocks a prefill of tokens[start:end] completes."""
        if salt is None or not self.allocator.prefix_cache:
            return []
        bs = self.allocator.block_size
        return self.allocator.block_keys(tokens, salt, start // bs, end // bs)

    def flush_events(self) -> None:
        """Send the prefix cache's changes since the last flush to the routers, as one batch
        (the batch loop calls this after each iteration)."""
        if self.events is not None:
            self.events.flush()

    # ----------------------------------------------------------------- the workers
    def take_resets(self) -> list[int]:
        """The sequence ids the workers must forget, once."""
        ids, self._resets = self._resets, []
        return ids

    def workers_lost(self) -> None:
        """The workers lost every cache (they failed or were reconfigured): every block is
        free and nothing is cached, and there is nothing left to reset."""
        self.allocator.reset()
        self._resets.clear()
        self.flush_events()

    def update_gauges(self) -> None:
        a = self.allocator
        self.metrics.observe_kv_cache(a.used_blocks, a.num_blocks, a.cached_blocks,
                                      a.idle_cached_blocks)
