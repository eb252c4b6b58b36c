"""Continuous batching: one loop decides, step by step, what the workers run.

Each iteration: drop what was cancelled or stopped and free its blocks; admit waiting sequences
into one packed prefill within a token budget (long prompts are chunked); then run the running
batch for k decode steps (k small while others wait, else as many as fit in about
decode_call_s at the recent step time, up to max_decode_steps), streaming every
step's tokens to their requests as they arrive. New requests join between iterations, never
waiting for the batch to finish. When blocks run out, idle sessions give up their caches first
(least recently used), then the newest running sequence is preempted and later recomputed.

Only this loop talks to the workers' Prefill/Decode, so all ranks see one ordered stream of steps.
The scheduler owns every sequence's state: handlers and the stream writer change a sequence (its
history, sampling, where its call ends) through the methods below, never by its fields. Why a
call ends is decided by the finish policy (gateway/batching/finish.py) on each token as it arrives.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable

from shardlm.common.v1 import common_pb2
from shardlm.errors import ResourceExhaustedError, ShardLMError
from shardlm.worker.v1 import worker_pb2

from shardlm_server.gateway.batching.finish import UNFINISHED, CallLimits
from shardlm_server.gateway.batching.sequence import (
    ErrorEvent,
    FinishEvent,
    Phase,
    Sequence,
    TokenEvent,
)
from shardlm_server.gateway.batching.sessions import SessionStore
from shardlm_server.gateway.kv.allocator import BlockAllocator
from shardlm_server.gateway.kv.cache import SequenceCaches
from shardlm_server.gateway.metrics import Metrics
from shardlm_server.gateway.workers.client import WorkerPool

log = logging.getLogger("shardlm.gateway")
# Sequence ids are unique for the life of the process: sessions outlive a scheduler (a worker
# restart builds a new one) and their ids must never collide with new sequences.
_SEQUENCE_IDS = itertools.count(1)


class Scheduler:
    def __init__(
        self,
        pool: WorkerPool,
        allocator: BlockAllocator,
        sessions: SessionStore,
        metrics: Metrics,
        *,
        prefill_token_budget: int = 2048,
        max_decode_steps: int = 32,
        decode_call_s: float = 0.25,
        busy_decode_steps: int = 2,
        max_waiting: int = 1024,
        max_running: int = 256,
        on_worker_failure: Callable[[ShardLMError], None] = lambda _e: None,
    ) -> None:
        self.pool = pool
        self.allocator = allocator
        self.sessions = sessions
        self.caches = SequenceCaches(allocator, sessions, metrics)
        self.metrics = metrics
        self.prefill_token_budget = prefill_token_budget
        self.max_decode_steps = max_decode_steps
        self.decode_call_s = decode_call_s
        self.busy_decode_steps = busy_decode_steps
        self._step_s = 0.0  # seconds per decode step, a running average (0: none timed yet)
        self.max_waiting = max_waiting
        self.max_running = max_running
        self.on_worker_failure = on_worker_failure
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []
        self._to_free: list[Sequence] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    # ----------------------------------------------------------------- API for the service
    def new_sequence(self, tokens: list[int], sampling: common_pb2.SamplingParams, *,
                     ephemeral: bool = False, prefix_salt: bytes | None = None) -> Sequence:
        """A sequence of `tokens`; `ephemeral` (a Generate's) is freed when its call ends. It
        shares cached prefixes with the sequences of the same `prefix_salt` (None: bypass)."""
        return Sequence(next(_SEQUENCE_IDS), list(tokens), sampling, ephemeral=ephemeral,
                        prefix_salt=prefix_salt)

    @staticmethod
    def is_busy(seq: Sequence) -> bool:
        """A call still runs on the sequence (or is winding down after its client left)."""
        return seq.phase in (Phase.WAITING, Phase.RUNNING)

    # Changes between calls (a session's handler holds it busy; no step may be using it):
    def start_turn(self, seq: Sequence, tokens: list[int], limits: CallLimits, *,
                   rerendered: bool, sampling: common_pb2.SamplingParams | None = None) -> None:
        """A Prefill: add a turn's tokens to the history (or, `rerendered`, replace it with the
        whole re-rendered conversation), take new sampling parameters if given, and prefill.
        Refused (queue full) before anything changes."""
        self._check_queue()
        self._between_calls(seq)
        if sampling is not None:
            seq.set_sampling(sampling)
        if rerendered:
            seq.replace_history(tokens)
        else:
            seq.extend_history(tokens)
        self.submit(seq, limits, prefill_only=True)

    def set_sampling(self, seq: Sequence, sampling: common_pb2.SamplingParams) -> None:
        self._between_calls(seq)
        seq.set_sampling(sampling)

    def _between_calls(self, seq: Sequence) -> None:
        if self.is_busy(seq):
            raise RuntimeError(f"sequence {seq.seq_id} is in a call; its state is the loop's")

    def submit(self, seq: Sequence, limits: CallLimits, *, prefill_only: bool) -> None:
        """Start a call on `seq`: prefill what is not cached (or all, for prefill_only) and then
        decode until `limits`; events arrive on `seq.events`."""
        self._check_queue()
        seq.start_call(limits, prefill_only)
        if seq.needs_prefill:
            seq.phase = Phase.WAITING
            self._waiting.append(seq)
        else:
            seq.phase = Phase.RUNNING
            seq.admitted_at = time.monotonic()
            self._running.append(seq)
        self._wake.set()

    def _check_queue(self) -> None:
        if len(self._waiting) >= self.max_waiting:
            raise ResourceExhaustedError(
                f"the request queue is full ({self.max_waiting} waiting)", reason="QUEUE_FULL",
                retry_after_s=1.0, metadata={"waiting": len(self._waiting)})

    def cancel(self, seq: Sequence, *, keep_generated: int | None = None) -> None:
        """End the sequence's call before its next step. `keep_generated`: the call's history
        keeps only that many of its generated tokens (what its client was sent), as when a stop
        sequence matched or the client left; the others are forgotten."""
        if keep_generated is not None:
            seq.finish_after = keep_generated
        seq.cancelled = True
        self._wake.set()

    def release(self, seq: Sequence) -> None:
        """The sequence is gone for good (Generate ended, session reset): free its cache."""
        seq.cancelled = True
        if seq.phase in (Phase.IDLE, Phase.DONE):  # in no step: free now, so callers see it
            self.caches.drop(seq)
            seq.phase = Phase.DONE
        else:
            self._to_free.append(seq)
        self._wake.set()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return len(self._running)

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    def fail_all(self, error: ShardLMError) -> None:
        """Workers are gone: every in-flight call ends with `error`; caches are lost."""
        for seq in list(self._waiting) + self._running:
            seq.events.put_nowait(ErrorEvent(error))
            self._park_or_free(seq)
        self._waiting.clear()
        self._running.clear()
        self.caches.lose_all()

    def clear_prefix_cache(self) -> None:
        """ResetCache of all: no cached prefix is reused from now on."""
        self.caches.clear_prefix_cache()
        self._update_gauges()

    # ----------------------------------------------------------------- the loop
    async def _loop(self) -> None:
        while True:
            # Sleep until woken, or 1 s (idle sessions expire even when nothing else happens).
            # asyncio.wait, unlike wait_for, never delays this task's own cancellation.
            waiter = asyncio.ensure_future(self._wake.wait())
            try:
                await asyncio.wait([waiter], timeout=1.0)
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
            self._update_gauges()
            if self._waiting or self._running:
                self._wake.set()

    async def _iteration(self) -> None:
        self._reap()
        resets = self.caches.take_resets()
        if resets:
            await self.pool.reset(worker_pb2.ResetCacheRequest(sequence_ids=resets))
        batch = self._admit()
        if batch:
            await self._prefill(batch)
        self._reap()
        if self._running:
            await self._decode()

    def _reap(self) -> None:
        for seq in self._to_free:
            if seq.phase in (Phase.WAITING, Phase.RUNNING):  # a call still streams from it
                seq.events.put_nowait(FinishEvent(common_pb2.FINISH_REASON_CANCELLED))
            self.caches.drop(seq)
            seq.phase = Phase.DONE
        freed = {id(s) for s in self._to_free}
        self._to_free.clear()
        self.caches.expire_idle_sessions()
        keep = deque()
        for seq in self._waiting:
            if id(seq) in freed or seq.phase is Phase.DONE:
                continue
            if seq.cancelled:
                self._park_or_free(seq)
            else:
                keep.append(seq)
        self._waiting = keep
        running = []
        for seq in self._running:
            if id(seq) in freed or seq.phase is Phase.DONE:
                continue
            if seq.cancelled or seq.finish_after is not None:
                self._park_or_free(seq)
            elif seq.phase is Phase.RUNNING:
                running.append(seq)
        self._running = running

    def _park_or_free(self, seq: Sequence) -> None:
        """The call is over: a session's sequence keeps its cache, a Generate's is freed."""
        seq.drop_unsent()
        if seq.ephemeral:
            self.caches.drop(seq)
            seq.phase = Phase.DONE
        else:
            self.caches.trim(seq)
            seq.phase = Phase.IDLE

    # ----------------------------------------------------------------- prefill

    def _admit(self) -> list[tuple[Sequence, int, list[int], bool]]:
        budget = self.prefill_token_budget
        batch: list[tuple[Sequence, int, list[int], bool]] = []
        while self._waiting and budget > 0 and len(self._running) + len(batch) < self.max_running:
            seq = self._waiting[0]
            self.caches.prefill_start(seq)
            if seq.call_cached is None:  # the call's first prefill: what its prompt reused
                seq.call_cached = seq.cached
                self.metrics.cached_prompt_tokens.inc(seq.cached)
            seq.in_sync = False
            chunk = seq.uncached[:budget]
            need = self.allocator.extra_blocks_needed(seq.seq_id, seq.cached + len(chunk))
            if need > self.allocator.free_blocks and not self.caches.make_room(need, seq):
                if not self._running and not batch:  # nothing will ever free enough blocks
                    self._waiting.popleft()
                    seq.events.put_nowait(ErrorEvent(ResourceExhaustedError(
                        "the KV cache is too small for this request", reason="KV_CACHE_FULL",
                        retry_after_s=5.0, metadata={"required_blocks": need,
                                                     "free_blocks": self.allocator.free_blocks})))
                    self._park_or_free(seq)
                    continue
                break  # wait for running sequences to free blocks
            self._waiting.popleft()
            self.allocator.grow(seq.seq_id, seq.cached + len(chunk))
            final = len(chunk) == len(seq.uncached)
            batch.append((seq, seq.cached, chunk, final))
            budget -= len(chunk)
            if not final:
                self._waiting.appendleft(seq)  # its next chunk goes first next iteration
                break
        return batch

    async def _prefill(self, batch: list[tuple[Sequence, int, list[int], bool]]) -> None:
        request = worker_pb2.PrefillRequest(sequences=[
            worker_pb2.PrefillSequence(
                sequence_id=seq.seq_id, token_ids=chunk, start_position=start,
                block_table=self.allocator.table(seq.seq_id), sampling=seq.sampling,
                stop=seq.worker_stop(), sample=final,
                prefix_token_ids=seq.tokens[:start] if seq.unsent_prefix else [])
            for seq, start, chunk, final in batch])
        self.metrics.prefill_batch_tokens.observe(sum(len(c) for _s, _st, c, _f in batch))
        try:
            reply = await self.pool.prefill(request)
        except ShardLMError as exc:
            self._fail_step([seq for seq, *_ in batch], exc)
            raise
        tokens = {t.sequence_id: t for t in reply.tokens}
        now = time.monotonic()
        for seq, start, chunk, final in batch:
            seq.cached, seq.unsent_prefix = start + len(chunk), False
            self.caches.publish(seq)
            if seq.admitted_at is None:
                seq.admitted_at = now
                self.metrics.queue_seconds.observe(now - seq.enqueued_at)
            if not final:
                continue
            self._accept_token(seq, tokens[seq.seq_id], counts=not seq.prefill_only)
            seq.in_sync = True
            if seq.prefill_only:
                seq.events.put_nowait(TokenEvent(seq.tokens[-1], _logprobs(tokens[seq.seq_id])))
                self._park_or_free(seq)
            elif seq.phase is not Phase.DONE and seq.phase is not Phase.IDLE:
                seq.phase = Phase.RUNNING
                self._running.append(seq)

    # ----------------------------------------------------------------- decode
    def _steps_per_call(self) -> int:
        """Steps for the next decode call: few while prompts wait, else as many as fit in
        decode_call_s at the recent step time (up to max_decode_steps). Long calls save round
        trips; short ones let a prompt that arrives during one in sooner."""
        if self._waiting or self._step_s <= 0:
            return self.busy_decode_steps
        fit = int(self.decode_call_s / self._step_s)
        return max(self.busy_decode_steps, min(self.max_decode_steps, fit))

    def _time_steps(self, seconds: float, steps: int) -> None:
        if steps > 0:
            step = seconds / steps
            self._step_s = step if self._step_s <= 0 else (self._step_s + step) / 2

    def _plan_steps(self) -> dict[int, int]:
        k = self._steps_per_call()
        plan: dict[int, int] = {}
        for seq in sorted(self._running, key=lambda s: s.admitted_at or 0):
            steps = max(1, min(k, seq.budget))
            need = self.allocator.extra_blocks_needed(seq.seq_id, seq.cached + steps)
            if need > self.allocator.free_blocks:
                self.caches.make_room(need, seq)
            while steps > 1 and not self.allocator.can_grow(seq.seq_id, seq.cached + steps):
                steps -= 1
            if not self.allocator.can_grow(seq.seq_id, seq.cached + steps):
                continue
            self.allocator.grow(seq.seq_id, seq.cached + steps)
            plan[seq.seq_id] = steps
        for seq in list(self._running):
            if seq.seq_id not in plan:
                self._preempt(seq)
        return plan

    def _preempt(self, seq: Sequence) -> None:
        log.info("preempting sequence %d (recompute later): KV cache full", seq.seq_id)
        self.metrics.preemptions.inc()
        self.caches.drop(seq)
        seq.phase = Phase.WAITING
        self._running.remove(seq)
        self._waiting.appendleft(seq)

    async def _decode(self) -> None:
        plan = self._plan_steps()
        if not plan:
            return
        by_id = {s.seq_id: s for s in self._running if s.seq_id in plan}
        request = worker_pb2.DecodeRequest(num_steps=max(plan.values()), sequences=[
            worker_pb2.DecodeSequence(
                sequence_id=sid, block_table=self.allocator.table(sid), max_steps=steps,
                stop=by_id[sid].worker_stop(),
                **({"sampling": by_id[sid].sampling} if by_id[sid].sampling_changed else {}))
            for sid, steps in plan.items()])
        for seq in by_id.values():
            seq.sampling_changed = False
        self.metrics.decode_batch_size.observe(len(plan))
        started, steps = time.monotonic(), 0
        try:
            async for step in self.pool.decode(request):
                steps += 1
                for token in step.tokens:
                    seq = by_id[token.sequence_id]
                    seq.cached += 1  # the fed token's K/V is cached now
                    if seq.cached % self.allocator.block_size == 0:
                        self.caches.publish(seq)  # a block is complete
                    if seq.phase is Phase.RUNNING:
                        self._accept_token(seq, token, counts=True)
                    else:  # finished (stop sequence) while the call ran on: keep history exact
                        seq.tokens.append(token.token_id)
                        seq.generated += 1
        except ShardLMError as exc:
            self._fail_step(list(by_id.values()), exc)
            raise
        self._time_steps(time.monotonic() - started, steps)
        for seq in by_id.values():
            if seq.phase is not Phase.DONE:
                self.caches.trim(seq)

    def _accept_token(self, seq: Sequence, token: worker_pb2.SequenceToken, counts: bool) -> None:
        """Add a sampled token to the history and, for a generation call, stream it with the
        finish policy's verdict (the worker's own finish_reason only told it to stop)."""
        seq.tokens.append(token.token_id)
        if not counts:
            return
        seq.generated += 1
        reason = seq.limits.finish_reason(token.token_id, len(seq.tokens), seq.generated)
        seq.events.put_nowait(TokenEvent(token.token_id, _logprobs(token), reason))
        if reason != UNFINISHED:
            seq.finish_reason = reason
            self._park_or_free(seq)
            if seq in self._running:
                self._running.remove(seq)

    def _fail_step(self, seqs: list[Sequence], error: ShardLMError) -> None:
        for seq in seqs:
            seq.events.put_nowait(ErrorEvent(error))
            self.caches.drop(seq)
            seq.phase = Phase.DONE if seq.ephemeral else Phase.IDLE
            if seq in self._running:
                self._running.remove(seq)

    def _update_gauges(self) -> None:
        self.metrics.queue_length.set(len(self._waiting))
        self.metrics.running_sequences.set(len(self._running))
        a = self.allocator
        self.metrics.observe_kv_cache(a.used_blocks, a.num_blocks, a.cached_blocks,
                                      a.idle_cached_blocks)


def _logprobs(token: worker_pb2.SequenceToken) -> common_pb2.Logprobs | None:
    return token.logprobs if token.HasField("logprobs") else None
