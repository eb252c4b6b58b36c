"""Which sequences hold KV blocks on the workers, and which ones the workers must forget.

Every way a sequence loses its cache (released, evicted, preempted, expired, failed) is one
operation, `drop`: its blocks go back to the allocator, the sequence is marked uncached (it is
rebuilt from its history if used again) and its id is queued for the workers' next ResetCache,
which the scheduler sends before its next step. Its published blocks stay in the allocator's
prefix cache, so a rebuild (or any other sequence with the same beginning) starts from them.
Under pressure, cached blocks no sequence holds are reclaimed first (the allocator counts them
free); then `make_room` evicts idle sessions' caches, least recently used first. Sessions idle
past their timeout are removed.

Before each prefill `prefill_start` says where the sequence's computation starts: a sequence
holding no blocks looks up the longest cached prefix of its history; one that holds blocks is
rewound so that it never writes into a shared block. After each step `publish` offers the
blocks it completed.
"""

from __future__ import annotations

import logging
import time

from shardlm_server.gateway.batching.sequence import Phase, Sequence
from shardlm_server.gateway.batching.sessions import SessionStore
from shardlm_server.gateway.kv.allocator import BlockAllocator
from shardlm_server.gateway.metrics import Metrics

log = logging.getLogger("shardlm.gateway")


class SequenceCaches:
    def __init__(self, allocator: BlockAllocator, sessions: SessionStore,
                 metrics: Metrics) -> None:
        self.allocator = allocator
        self.sessions = sessions
        self.metrics = metrics
        self._resets: list[int] = []
        self._next_expiry_check = 0.0

    def drop(self, seq: Sequence) -> None:
        """Free the sequence's blocks and have the workers forget it."""
        if self.allocator.free(seq.seq_id):
            self._resets.append(seq.seq_id)
        seq.forget_cache()

    def prefill_start(self, seq: Sequence) -> int:
        """Set `seq.cached` to where its next prefill starts and return it: at least one token
        (the last) is always computed; a cached prefix is reused when the sequence holds no
        blocks; shared blocks are never written."""
        if seq.cached >= len(seq.tokens):
            seq.cached = len(seq.tokens) - 1  # re-run the last token so one is sampled
        if self.allocator.holds(seq.seq_id):
            seq.cached = self.allocator.rewind(seq.seq_id, seq.cached)
        elif seq.prefix_salt is not None and self.allocator.prefix_cache:
            hit = self.allocator.attach_prefix(seq.seq_id, seq.tokens, seq.prefix_salt)
            self.metrics.prefix_cache_lookups.inc()
            self.metrics.prefix_cache_hit_tokens.inc(hit)
            seq.cached, seq.unsent_prefix = hit, hit > 0
        return seq.cached

    def publish(self, seq: Sequence) -> None:
        """Offer the sequence's completed blocks to later sequences (unless it bypasses)."""
        if seq.prefix_salt is not None:
            self.allocator.publish(seq.seq_id, seq.tokens, seq.cached, seq.prefix_salt)

    def clear_prefix_cache(self) -> None:
        self.allocator.clear_prefix_cache()

    def trim(self, seq: Sequence) -> None:
        """Return the blocks pre-allocated beyond what the sequence now holds (its cached tokens
        and the pending one)."""
        self.allocator.shrink(seq.seq_id, seq.cached + 1)

    def make_room(self, blocks: int, protect: Sequence | None = None) -> bool:
        """Evict idle sessions' caches until `blocks` blocks are free; whether they are."""
        for session in self.sessions.eviction_candidates():
            if self.allocator.free_blocks >= blocks:
                break
            if session.seq is not protect:
                log.info("evicting idle session %s to free KV blocks", session.session_id)
                self.drop(session.seq)
        return self.allocator.free_blocks >= blocks

    def expire_idle_sessions(self) -> None:
        """Remove the sessions idle past their timeout, and their caches. A scan of every
        session: at most once a second, not at every step."""
        now = time.monotonic()
        if now < self._next_expiry_check:
            return
        self._next_expiry_check = now + 1.0
        for session in self.sessions.expired(now):
            self.sessions.remove(session.session_id)
            self.drop(session.seq)
            session.seq.phase = Phase.DONE

    def take_resets(self) -> list[int]:
        """The sequence ids the workers must forget, once."""
        ids, self._resets = self._resets, []
        return ids

    def lose_all(self) -> None:
        """The workers lost every cache (they failed or were reconfigured): every session is
        rebuilt from its history when next used, and there is nothing left to reset."""
        for session in self.sessions.all():
            self.drop(session.seq)
        self._resets.clear()
        self.allocator.clear_prefix_cache()
