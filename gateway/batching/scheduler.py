"""The scheduler: what request handlers ask of continuous batching. It creates sequences and
starts, changes and ends their calls; its base, the batch loop (gateway/batching/loop.py), runs
them on the workers step by step.

The scheduler owns every sequence's state (gateway/batching/sequence.py): handlers change a
sequence (its history, sampling, where its call ends) only through the methods below, never by
its fields, and only between calls, except to end one. A stop sequence, found in the text by the
stream writer, is such an end: the handler has the call end there (`cancel`), and the history
keeps only the tokens its client was sent.
"""

from __future__ import annotations

import itertools
import time

from shardlm.common.v1 import common_pb2
from shardlm.errors import ResourceExhaustedError, ShardLMError, UnavailableError

from shardlm_server.gateway.batching.finish import CallLimits
from shardlm_server.gateway.batching.loop import BatchLoop
from shardlm_server.gateway.batching.sequence import ErrorEvent, Phase, SequenceState
from shardlm_server.gateway.constraints.compiler import CompiledConstraint

# Sequence ids are unique for the life of the process: sessions outlive a scheduler (a worker
# restart builds a new one) and their ids must never collide with new sequences.
_SEQUENCE_IDS = itertools.count(1)


class Scheduler(BatchLoop):
    """The batch loop with the calls' API (the one object a loaded model's handlers use)."""

    def new_sequence(self, tokens: list[int], sampling: common_pb2.SamplingParams, *,
                     ephemeral: bool = False, prefix_salt: bytes | None = None,
                     constraint: CompiledConstraint | None = None) -> SequenceState:
        """A sequence of `tokens`; `ephemeral` (a Generate's) is freed when its call ends. It
        shares cached prefixes with the sequences of the same `prefix_salt` (None: bypass).
        `constraint` covers the tokens it generates."""
        seq = SequenceState(next(_SEQUENCE_IDS), list(tokens), sampling, ephemeral=ephemeral,
                            prefix_salt=prefix_salt)
        if constraint is not None:
            seq.set_constraint(constraint)
        return seq

    # Changes between calls (a session's handler holds it busy; no step may be using it):
    def start_turn(self, seq: SequenceState, tokens: list[int], limits: CallLimits, *,
                   rerendered: bool, sampling: common_pb2.SamplingParams | None = None,
                   constraint: CompiledConstraint | None = None) -> None:
        """A Prefill: add a turn's tokens to the history (or, `rerendered`, replace it with the
        whole re-rendered conversation), take new sampling parameters if given, the turn's
        constraint (None: an unconstrained turn), and prefill. Refused (queue full) before
        anything changes."""
        self._check_queue()
        self._between_calls(seq)
        if sampling is not None:
            seq.set_sampling(sampling)
        if rerendered:
            seq.replace_history(tokens)
        else:
            seq.extend_history(tokens)
        seq.set_constraint(constraint)
        self.submit(seq, limits, prefill_only=True)

    def set_sampling(self, seq: SequenceState, sampling: common_pb2.SamplingParams) -> None:
        self._between_calls(seq)
        seq.set_sampling(sampling)

    def set_constraint(self, seq: SequenceState, constraint: CompiledConstraint | None) -> None:
        """A Decode's new constraint, from its first generated token on."""
        self._between_calls(seq)
        seq.set_constraint(constraint)

    def _between_calls(self, seq: SequenceState) -> None:
        if seq.in_call:
            raise RuntimeError(f"sequence {seq.seq_id} is in a call; its state is the loop's")

    def submit(self, seq: SequenceState, limits: CallLimits, *, prefill_only: bool) -> None:
        """Start a call on `seq`: prefill what is not computed (or all, for prefill_only) and
        then decode until `limits`; events arrive on `seq.events`."""
        self._check_queue()
        self.submitted += 1
        self.last_submitted = time.monotonic()
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
        if self.stopped:  # a handler that found this model before it was unloaded or reset
            raise UnavailableError("the model was unloaded or its KV cache reconfigured; retry",
                                   reason="WORKER_UNAVAILABLE", retry_after_s=1.0)
        if len(self._waiting) >= self.max_waiting:
            raise ResourceExhaustedError(
                f"the request queue is full ({self.max_waiting} waiting)", reason="QUEUE_FULL",
                retry_after_s=1.0, metadata={"waiting": len(self._waiting)})

    def cancel(self, seq: SequenceState, *, keep_generated: int | None = None) -> None:
        """End the sequence's call before its next step. `keep_generated`: the call's history
        keeps only that many of its generated tokens (what its client was sent, as when a stop
        sequence matched or the client left); the others are forgotten, also when the call
        had already ended."""
        if seq.in_call:
            seq.request_end(keep_generated)
            self._wake.set()
        elif seq.phase is Phase.IDLE and keep_generated is not None:
            seq.trim(keep_generated)
            self.kv.trim(seq.seq_id, seq.computed + 1)

    def release(self, seq: SequenceState) -> None:
        """The sequence is gone for good (Generate ended, session reset): free its cache."""
        seq.request_end(None)
        if seq.phase in (Phase.IDLE, Phase.DONE):  # in no step: free now, so callers see it
            self.residency.drop(seq)
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

    def fail_all(self, error: ShardLMError) -> None:
        """Workers are gone: every in-flight call ends with `error`; caches are lost (every
        session is rebuilt from its history when next used)."""
        for seq in list(self._waiting) + self._running + self.prefilling:
            seq.events.put_nowait(ErrorEvent(error))
            self.residency.park_or_free(seq)
        self._waiting.clear()
        self._running.clear()
        for session in self.sessions.all():
            session.seq.forget()
        self.kv.workers_lost()

    def clear_prefix_cache(self) -> None:
        """ResetCache of all: no cached prefix is reused from now on."""
        self.kv.clear_prefix_cache()
        self._update_gauges()
