"""The batch loop: one iteration after another decides what the workers run, over the queues of
waiting and running sequences.

Each iteration: drop what was cancelled or stopped and free its blocks; admit waiting sequences
into one packed prefill within a token budget (long prompts are chunked); then run the running
batch for k decode steps (k set by the pacer, gateway/batching/pacing.py), streaming every
step's tokens to their requests as they arrive. New requests join between iterations, never
waiting for the batch to finish. When blocks run out, idle sessions give up their caches first
(least recently used), then the newest running sequence is preempted and later recomputed;
when nothing runs, waiting sequences give up the blocks they hold (attached prefixes, a long
prompt's first chunks), and a request is refused as too large for the cache only when no other
sequence holds a block (it waits for a session between calls, or a released call being freed).

Only this loop talks to the workers' Prefill/Decode, so all ranks see one ordered stream of steps.
Every KV question goes to the KV manager (gateway/kv/manager.py), and what a sequence's cache
becomes when its call ends or room is needed to gateway/batching/residency.py; every change of a sequence's
progress is a transition of gateway/batching/sequence.py. Why a call ends is decided by the
finish policy (gateway/batching/finish.py) on each token as it arrives. The handlers' side of the
scheduler (starting, changing and ending calls) is gateway/batching/scheduler.py.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable

from shardlm.common.v1 import common_pb2
from shardlm.errors import ResourceExhaustedError, ShardLMError
from shardlm.worker.v1 import worker_pb2

from shardlm_server.gateway.batching.finish import UNFINISHED
from shardlm_server.gateway.batching.load_stats import LoadStats
from shardlm_server.gateway.batching.pacing import BUSY_DECODE_STEPS, DecodePacer
from shardlm_server.gateway.batching.residency import EXPIRY_CHECK_S, CacheResidency
from shardlm_server.gateway.batching.sequence import (
    ErrorEvent,
    FinishEvent,
    Phase,
    SequenceState,
    TokenEvent,
)
from shardlm_server.gateway.batching.sessions import SessionStore
from shardlm_server.gateway.batching.steps import PrefillChunk, decode_request, prefill_request
from shardlm_server.gateway.config import Limits
from shardlm_server.gateway.kv.manager import KvManager
from shardlm_server.gateway.metrics import Metrics
from shardlm_server.gateway.workers.client import WorkerPool

log = logging.getLogger("shardlm.gateway")
_DEFAULTS = Limits()  # the serve settings' defaults (gateway/config.py)
# While a prompt waits for blocks that only sequences outside the loop's queues hold (a released
# call not yet freed, a session between its calls), the loop looks again this often.
STALL_RETRY_S = 0.01


class BatchLoop:
    def __init__(
        self,
        pool: WorkerPool,
        kv: KvManager,
        sessions: SessionStore,
        metrics: Metrics,
        *,
        prefill_token_budget: int = _DEFAULTS.prefill_token_budget,
        max_decode_steps: int = _DEFAULTS.max_decode_steps,
        decode_call_s: float = _DEFAULTS.decode_call_s,
        stream_interval_ms: int | None = _DEFAULTS.stream_interval_ms,
        busy_decode_steps: int = BUSY_DECODE_STEPS,
        max_waiting: int = _DEFAULTS.max_waiting,
        max_running: int = _DEFAULTS.max_running,
        on_worker_failure: Callable[[ShardLMError], None] = lambda _e: None,
    ) -> None:
        self.pool = pool
        self.kv = kv
        self.sessions = sessions
        self.residency = CacheResidency(kv, sessions)
        self.metrics = metrics
        self.prefill_token_budget = prefill_token_budget
        self.pacer = DecodePacer(max_decode_steps=max_decode_steps, decode_call_s=decode_call_s,
                                 busy_decode_steps=busy_decode_steps)
        self.stream_interval_ms = stream_interval_ms
        self.max_waiting = max_waiting
        self.max_running = max_running
        self.on_worker_failure = on_worker_failure
        self._waiting: deque[SequenceState] = deque()
        self._running: list[SequenceState] = []
        self._to_free: list[SequenceState] = []
        self._stalled = False  # the last admission waits for blocks held outside the queues
        self.stopped = False
        self.prefilling: list[SequenceState] = []  # the sequences of a prefill step in flight
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.stats = LoadStats()
        self.submitted = 0  # calls started
        self.last_submitted = 0.0  # time.monotonic() of the newest one's start

    def start(self) -> None:
        self.metrics.follow_load(self.stats, self.max_running)
        self._task = asyncio.ensure_future(self._loop())

    async def stop(self) -> None:
        """Stop the loop for good (the model is unloaded or its cache reconfigured; a new
        scheduler takes over): calls submitted from now on are refused."""
        self.stopped = True
        self.metrics.unfollow_load(self.stats)
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    # ----------------------------------------------------------------- the loop
    async def _loop(self) -> None:
        while True:
            # Sleep until woken, or 1 s (idle sessions expire even when nothing else happens).
            # asyncio.wait, unlike wait_for, never delays this task's own cancellation.
            waiter = asyncio.ensure_future(self._wake.wait())
            try:
                await asyncio.wait([waiter], timeout=EXPIRY_CHECK_S)
            finally:
                waiter.cancel()
            self._wake.clear()
            try:
                await self._iteration()
            except ShardLMError as exc:
                log.error("worker step failed: %s", exc)
                self.on_worker_failure(exc)
            except Exception:  # noqa: BLE001 - the loop must survive a bug in one iteration
                log.exception("scheduler iteration failed")
            self.kv.flush_events()
            self._update_gauges()
            if self._waiting or self._running:
                self._wake.set()

    async def _iteration(self) -> None:
        self._reap()
        resets = self.kv.take_resets()
        if resets:
            await self.pool.reset(worker_pb2.ResetCacheRequest(sequence_ids=resets))
        batch = self._admit()
        if batch:
            await self._prefill(batch)
        self._reap()
        if self._running:
            await self._decode()
        elif self._stalled:
            await asyncio.sleep(STALL_RETRY_S)

    def _reap(self) -> None:
        for seq in self._to_free:
            if seq.in_call:  # a call still streams from it
                seq.events.put_nowait(FinishEvent(common_pb2.FINISH_REASON_CANCELLED))
            self.residency.drop(seq)
            seq.phase = Phase.DONE
        freed = {id(s) for s in self._to_free}
        self._to_free.clear()
        self.residency.expire_idle_sessions()
        keep = deque()
        for seq in self._waiting:
            if id(seq) in freed or seq.phase is Phase.DONE:
                continue
            if seq.cancelled:
                self.residency.park_or_free(seq)
            else:
                keep.append(seq)
        self._waiting = keep
        running = []
        for seq in self._running:
            if id(seq) in freed or seq.phase is Phase.DONE:
                continue
            if seq.cancelled:
                self.residency.park_or_free(seq)
            elif seq.phase is Phase.RUNNING:
                running.append(seq)
        self._running = running

    def _release_waiting(self, but: SequenceState) -> bool:
        """Every waiting sequence other than `but` gives up its blocks; whether any held one."""
        released = False
        for other in self._waiting:
            if other is not but and self.kv.allocator.holds(other.seq_id):
                self.residency.drop(other)
                released = True
        return released

    # ----------------------------------------------------------------- prefill
    def _admit(self) -> list[PrefillChunk]:
        budget = self.prefill_token_budget
        batch: list[PrefillChunk] = []
        # Blocks this step's chunks compute: a waiting sequence whose first uncached block is one
        # of them waits a step and reuses them (in-batch prefix sharing), instead of computing
        # the same prefix beside them.
        pending: set[bytes] = set()
        deferred: list[SequenceState] = []
        self._stalled = False
        while self._waiting and budget > 0 and len(self._running) + len(batch) < self.max_running:
            seq = self._waiting[0]
            if self.kv.shares_pending(seq.seq_id, seq.tokens, seq.prefix_salt, pending):
                deferred.append(self._waiting.popleft())
                continue
            seq.begin_prefill(self.kv.prefill_start(seq.seq_id, seq.tokens, seq.computed,
                                                    seq.prefix_salt))
            chunk = seq.uncomputed[:budget]
            end = seq.computed + len(chunk)
            self.residency.make_room(seq, end)
            alone = False  # whether the other waiting sequences gave up their blocks for it
            if not self.kv.grow(seq.seq_id, end):
                if self._running or batch:
                    break  # wait for running sequences to free blocks
                # Nothing runs, yet waiting sequences may hold blocks: the prefix a sequence
                # attached before it had to wait, a long prompt's first chunks. They give them
                # up, as a preempted sequence does, and are recomputed later.
                alone = self._release_waiting(but=seq)
                if not self.kv.grow(seq.seq_id, end):
                    if self.kv.others_hold(seq.seq_id):
                        # Held outside the queues: a released call the next iteration frees, a
                        # session between its calls (evictable once its handler is done).
                        self._stalled = True
                        break
                    self._waiting.popleft()  # all else is free: it can never have them
                    seq.events.put_nowait(ErrorEvent(ResourceExhaustedError(
                        "the KV cache is too small for this request", reason="KV_CACHE_FULL",
                        retry_after_s=5.0, metadata={
                            "required_blocks": self.kv.blocks_needed(seq.seq_id, end),
                            "free_blocks": self.kv.free_blocks})))
                    self.residency.park_or_free(seq)
                    break  # the next waiting sequence comes next iteration, after the resets
            self._waiting.popleft()
            if seq.admitted_at is None:  # the call's first prefill: what its prompt reuses
                seq.cached_prompt_tokens = seq.computed
                self.metrics.cached_prompt_tokens.inc(seq.computed)
                self.stats.admitted(len(seq.tokens), seq.computed)
            final = len(chunk) == len(seq.uncomputed)
            batch.append(PrefillChunk(seq, seq.computed, chunk, final, seq.prefix_ids))
            if self._waiting:  # only a sequence behind it can share what it computes
                pending.update(self.kv.computing_keys(seq.tokens, seq.prefix_salt, seq.computed,
                                                      end))
            budget -= len(chunk)
            if not final:
                self._waiting.appendleft(seq)  # its next chunk goes first next iteration
                break
            if alone:  # the workers forget the released sequences before any is prefilled
                break
        # First again, in their order (behind a sequence whose next chunk goes first).
        head = [self._waiting.popleft()] if batch and not batch[-1].final else []
        self._waiting.extendleft(reversed(head + deferred))
        return batch

    async def _prefill(self, batch: list[PrefillChunk]) -> None:
        self.metrics.prefill_batch_tokens.observe(sum(len(c.token_ids) for c in batch))
        # The blocks this step completes are shared from now on: only a later iteration admits
        # anyone to them, after the step. Routers hear of them while the step runs, so a request
        # with the same prefix comes here rather than computing it on another replica.
        for c in batch:
            self.kv.publish(c.seq.seq_id, c.seq.tokens, c.start + len(c.token_ids),
                            c.seq.prefix_salt)
        self.kv.flush_events()
        # In neither queue while the workers prefill them: if the loop is stopped meanwhile
        # (the task cancelled here), fail_all still finds them.
        self.prefilling = [c.seq for c in batch]
        try:
            reply = await self.pool.prefill(prefill_request(batch, self.kv))
        except ShardLMError as exc:
            self.prefilling = []
            self._fail_step([c.seq for c in batch], exc)
            raise
        self.prefilling = []
        tokens = {t.sequence_id: t for t in reply.tokens}
        self._observe_masks(reply.constraint_mask_seconds)
        now = time.monotonic()
        for c in batch:
            seq = c.seq
            seq.prefilled(c.start + len(c.token_ids))
            if seq.admitted_at is None:
                seq.admitted_at = now
                self.metrics.queue_seconds.observe(now - seq.enqueued_at)
            if not c.final:
                continue
            token = tokens[seq.seq_id]
            seq.sampled(token.token_id)
            seq.constraint_changed = False  # the prefill carried it
            seq.constraint_complete = token.constraint_complete
            if seq.prefill_only:
                seq.events.put_nowait(TokenEvent(token.token_id, _logprobs(token)))
                self.residency.park_or_free(seq)
                continue
            self._stream(seq, token)
            if seq.phase is Phase.WAITING:  # the call goes on: decode it
                seq.phase = Phase.RUNNING
                self._running.append(seq)

    # ----------------------------------------------------------------- decode
    def _plan_steps(self) -> tuple[int, dict[int, int]]:
        """The steps of the next decode call and each sequence's tokens in it, with the blocks
        for them; sequences that get not even one step are preempted. A sequence may take more
        tokens than steps where the workers accept drafts (speculative decoding): up to what
        the room left in its last block holds, so accepted drafts take it further within the
        call instead of leaving it idle once it has one token per step (no block is reserved
        for drafts, and the unused room stays its own)."""
        k = self.pacer.steps(prompts_waiting=bool(self._waiting))
        plan: dict[int, int] = {}
        longest = 0
        for seq in sorted(self._running, key=lambda s: s.admitted_at or 0):
            want = max(1, min(k, seq.budget))
            self.residency.make_room(seq, seq.computed + want)
            steps = self.kv.grow_up_to(seq.seq_id, seq.computed, want)
            if steps:
                spare = self.kv.room_after(seq.seq_id, seq.computed + steps)
                plan[seq.seq_id] = max(steps, min(seq.budget, steps + spare))
                longest = max(longest, steps)
        for seq in list(self._running):
            if seq.seq_id not in plan:
                self._preempt(seq)
        return longest, plan

    def _preempt(self, seq: SequenceState) -> None:
        log.info("preempting sequence %d (recompute later): KV cache full", seq.seq_id)
        self.metrics.preemptions.inc()
        self.residency.drop(seq)
        seq.phase = Phase.WAITING
        self._running.remove(seq)
        self._waiting.appendleft(seq)

    async def _decode(self) -> None:
        num_steps, plan = self._plan_steps()
        if not plan:
            return
        by_id = {s.seq_id: s for s in self._running if s.seq_id in plan}
        request = decode_request(num_steps, plan, by_id, self.kv, self.stream_interval_ms)
        for seq in by_id.values():
            seq.sampling_changed = seq.constraint_changed = False  # sent with this call
        self.metrics.decode_batch_size.observe(len(plan))
        started, steps = time.monotonic(), 0
        try:
            async for step in self.pool.decode(request):
                steps = step.step + 1  # a message may carry several steps
                for seconds in step.constraint_mask_seconds:
                    self._observe_masks(seconds)
                self._count_drafts(step.drafts, by_id)
                self.stats.generated(len(step.tokens))
                for token in step.tokens:
                    seq = by_id[token.sequence_id]
                    seq.stepped(token.token_id)
                    seq.constraint_complete = token.constraint_complete
                    self.kv.publish(seq.seq_id, seq.tokens, seq.computed, seq.prefix_salt)
                    if seq.phase is Phase.RUNNING:
                        self._stream(seq, token)
        except ShardLMError as exc:
            self._fail_step(list(by_id.values()), exc)
            raise
        self.pacer.timed(time.monotonic() - started, steps)
        for seq in by_id.values():
            if seq.phase is not Phase.DONE:
                self.kv.trim(seq.seq_id, seq.computed + 1)

    def _stream(self, seq: SequenceState, token: worker_pb2.SequenceToken) -> None:
        """Send a generated token to the call's stream with the finish policy's verdict (the
        worker's own finish_reason only told it to stop); a finished call ends here."""
        reason = seq.limits.finish_reason(token.token_id, len(seq.tokens), seq.generated,
                                          grammar_complete=token.constraint_complete)
        seq.events.put_nowait(TokenEvent(token.token_id, _logprobs(token), reason))
        if reason != UNFINISHED:
            self.residency.park_or_free(seq)
            if seq in self._running:
                self._running.remove(seq)

    def _count_drafts(self, drafts, by_id: dict[int, SequenceState]) -> None:
        """Add a step's verified and accepted drafts to its sequences' usage and the counters."""
        for d in drafts:
            seq = by_id[d.sequence_id]
            seq.draft_tokens += d.proposed
            seq.accepted_draft_tokens += d.accepted
            self.metrics.draft_tokens.inc(d.proposed)
            self.metrics.accepted_draft_tokens.inc(d.accepted)

    def _observe_masks(self, seconds: float) -> None:
        if seconds > 0:  # a step with constrained sequences
            self.metrics.constraint_mask_seconds.observe(seconds)

    def _fail_step(self, seqs: list[SequenceState], error: ShardLMError) -> None:
        for seq in seqs:
            seq.events.put_nowait(ErrorEvent(error))
            self.residency.drop(seq)
            seq.phase = Phase.DONE if seq.ephemeral else Phase.IDLE
            if seq in self._running:
                self._running.remove(seq)

    def waiting_uncached_tokens(self) -> int:
        """Prompt tokens of the waiting sequences that neither their own blocks nor the prefix
        cache hold: the prefill work queued."""
        total = 0
        for seq in self._waiting:
            held = seq.computed if self.kv.allocator.holds(seq.seq_id) else self.kv.cached_prefix(
                seq.tokens, seq.prefix_salt)
            total += max(0, len(seq.tokens) - held)
        return total

    def _update_gauges(self) -> None:
        self.metrics.queue_length.set(len(self._waiting))
        self.metrics.running_sequences.set(len(self._running))
        self.metrics.waiting_uncached_prompt_tokens.set(
            self.waiting_uncached_tokens() if self._waiting else 0)
        self.kv.update_gauges()


def _logprobs(token: worker_pb2.SequenceToken) -> common_pb2.Logprobs | None:
    return token.logprobs if token.HasField("logprobs") else None
