"""One sequence as the gateway tracks it: its token history, its progress on the workers and its
current call, and the events it streams. Each change of progress is one method below.

A sequence's progress is one notion, what the workers hold of its history (as vLLM v1's
num_computed_tokens): `computed` counts the history's first tokens whose K/V the workers hold in
the sequence's blocks, and `on_workers` says how:
- NOTHING: nothing under this sequence's id (it is new, or its cache was dropped). `computed` is
  0, or counts blocks just taken from the prefix cache: their ids go with the next prefill.
- COMPUTED: the first `computed` tokens, as this sequence's; the next prefill continues there.
- SAMPLED: that, and the history's last token (`computed == len(tokens) - 1`) as the one they
  sampled and hold pending, so a decode step feeds it and no prefill is needed.
The full history stays here, so the workers' copy can always be rebuilt (eviction, preemption, a
worker restart) by prefilling `tokens[computed:]`.

The scheduler owns this state: handlers and the stream writer change a sequence only through the
scheduler's methods, which call the ones here; the stream writer only reads it.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from enum import Enum, StrEnum

from shardlm.common.v1 import common_pb2
from shardlm.worker.v1 import worker_pb2

from shardlm_server.gateway.batching.finish import CallLimits
from shardlm_server.gateway.constraints.compiler import CompiledConstraint


class Phase(StrEnum):
    IDLE = "idle"  # parked: holds its cache, nobody is generating (a session between calls)
    WAITING = "waiting"  # queued for (re)prefill
    RUNNING = "running"  # in the decode batch
    DONE = "done"


class OnWorkers(Enum):
    """How the workers hold a sequence's first `computed` tokens (see the module docstring)."""

    NOTHING = "nothing"
    COMPUTED = "computed"
    SAMPLED = "sampled"


@dataclass
class TokenEvent:
    """One generated token as the scheduler reports it to the request's stream."""

    token_id: int
    logprobs: common_pb2.Logprobs | None = None
    finish_reason: int = common_pb2.FINISH_REASON_UNSPECIFIED


@dataclass
class ErrorEvent:
    error: BaseException


@dataclass
class FinishEvent:
    """The call ended without a new token (its session was reset under it)."""

    finish_reason: int


@dataclass
class SequenceState:
    seq_id: int
    tokens: list[int]
    sampling: common_pb2.SamplingParams
    ephemeral: bool = False  # a Generate's sequence: freed when its call ends
    # The prefix cache: the salt of the keys this sequence's blocks are shared under, or None
    # when it bypasses the cache (neither reuses nor publishes blocks).
    prefix_salt: bytes | None = None
    phase: Phase = Phase.IDLE
    sampling_changed: bool = False  # the workers must be sent `sampling` with the next decode
    # Constrained decoding: the grammar of the current turn, from history position
    # `constraint_start` on (the first token generated under it); `constraint_changed` as
    # sampling_changed; `constraint_complete` once a token ended its grammar.
    constraint: CompiledConstraint | None = None
    constraint_start: int = 0
    constraint_changed: bool = False
    constraint_complete: bool = False
    # The history position of the current turn's first generated token (a Generate's after its
    # prompt, a session's after its last turn): the presence and frequency penalties count the
    # tokens from there on, and the workers are told so with every prefill (a recompute too).
    output_start: int = field(init=False, default=0)
    # Progress (the module docstring):
    computed: int = 0
    on_workers: OnWorkers = OnWorkers.NOTHING
    # The current call (Prefill, Decode or Generate):
    limits: CallLimits = field(default_factory=lambda: CallLimits(0, 0))
    generated: int = 0
    prefill_only: bool = False  # a Prefill RPC: one token, then park
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: bool = False  # its end was asked for: the loop ends it before its next step
    # ... keeping only this many of its generated tokens (those its client was sent); None: all
    keep_generated: int | None = None
    enqueued_at: float = field(default_factory=time.monotonic)
    admitted_at: float | None = None  # when its first prefill step ran (or, with none, it began)
    # Usage: the prompt tokens this call took from the KV cache (set when its first prefill is
    # scheduled).
    cached_prompt_tokens: int = 0
    # ... and the draft tokens the workers verified for it, and accepted (speculative decoding).
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0

    def __post_init__(self) -> None:
        self.output_start = len(self.tokens)  # a Generate's prompt; a session's turns move it

    # ----------------------------------------------------------------- reading
    @property
    def in_call(self) -> bool:
        """A call still runs on the sequence (or is winding down after its client left)."""
        return self.phase in (Phase.WAITING, Phase.RUNNING)

    @property
    def uncomputed(self) -> list[int]:
        return self.tokens[self.computed:]

    @property
    def needs_prefill(self) -> bool:
        return self.prefill_only or self.on_workers is not OnWorkers.SAMPLED

    @property
    def prefix_ids(self) -> list[int]:
        """The ids a prefill sends with the computed tokens the workers have not seen as this
        sequence's (a cached prefix); empty when they have."""
        return self.tokens[:self.computed] if self.on_workers is OnWorkers.NOTHING else []

    @property
    def budget(self) -> int:
        """Tokens the current call may still generate."""
        return self.limits.budget(len(self.tokens), self.generated)

    def worker_stop(self) -> common_pb2.StopConditions:
        return self.limits.worker_stop(len(self.tokens), self.generated)

    # ----------------------------------------------------------------- between calls
    def start_call(self, limits: CallLimits, prefill_only: bool) -> None:
        self.limits = limits
        self.generated = 0
        self.prefill_only = prefill_only
        self.events = asyncio.Queue()
        self.cancelled = False
        self.keep_generated = None
        self.enqueued_at = time.monotonic()
        self.admitted_at = None
        self.cached_prompt_tokens = 0 if self.needs_prefill else self.computed
        self.draft_tokens = self.accepted_draft_tokens = 0

    def extend_history(self, tokens: list[int]) -> None:
        """A new turn: append to the history. The computed tokens stay; a pending token is
        prefilled again with the turn."""
        self.tokens = self.tokens + list(tokens)
        self.output_start = len(self.tokens)
        self._unpend()

    def replace_history(self, tokens: list[int]) -> None:
        """A re-rendered conversation: the computed tokens are good up to the first token where
        the new history differs from the old one."""
        keep = 0
        for old, new in zip(self.tokens, tokens, strict=False):
            if old != new:
                break
            keep += 1
        self.tokens = list(tokens)
        self.output_start = len(self.tokens)
        self.computed = min(self.computed, keep)
        self._unpend()

    def set_sampling(self, sampling: common_pb2.SamplingParams) -> None:
        self.sampling, self.sampling_changed = sampling, True

    def set_constraint(self, constraint: CompiledConstraint | None) -> None:
        """The next generated token (the one after the history's end) starts this constraint
        (None: none)."""
        self.constraint, self.constraint_start = constraint, len(self.tokens)
        self.constraint_changed, self.constraint_complete = True, False

    def worker_constraint(self) -> worker_pb2.GrammarConstraint:
        """The constraint as the workers run it (an empty grammar: none)."""
        if self.constraint is None:
            return worker_pb2.GrammarConstraint()
        return worker_pb2.GrammarConstraint(grammar=self.constraint.grammar,
                                            start_position=self.constraint_start)

    # ----------------------------------------------------------------- progress in a call
    def begin_prefill(self, position: int) -> None:
        """Its next prefill starts at `position` (gateway/kv's prefill_start): where its
        computed tokens end or before (a rewind: the last token, or a shared block, is computed
        again), or after a prefix just taken from the prefix cache."""
        self.computed = position
        self._unpend()

    def prefilled(self, end: int) -> None:
        """A prefill step wrote the K/V of its tokens up to `end`."""
        self.computed = end
        self.on_workers = OnWorkers.COMPUTED

    def sampled(self, token_id: int) -> None:
        """The prefill of its whole history sampled `token_id`, which the workers hold pending.
        It counts as generated unless the call is a Prefill."""
        self.tokens.append(token_id)
        self.on_workers = OnWorkers.SAMPLED
        if not self.prefill_only:
            self.generated += 1

    def stepped(self, token_id: int) -> None:
        """A decode step computed the pending token and sampled `token_id`, now pending."""
        self.computed += 1
        self.tokens.append(token_id)
        self.generated += 1

    def forget(self) -> None:
        """The workers no longer hold the sequence: rebuild it from its history when used."""
        self.computed, self.on_workers = 0, OnWorkers.NOTHING

    # ----------------------------------------------------------------- ending a call
    def request_end(self, keep_generated: int | None) -> None:
        """End the call before its next step; `keep_generated` as the field says."""
        self.cancelled = True
        if keep_generated is not None:
            self.keep_generated = keep_generated

    def trim(self, keep_generated: int) -> None:
        """The call keeps only its first `keep_generated` generated tokens: the later ones,
        which no client saw, leave the history. The workers hold the longer history, so its
        last token is computed again."""
        extra = self.generated - keep_generated
        if extra <= 0:
            return
        del self.tokens[-extra:]
        self.generated = keep_generated
        self.computed = min(self.computed, len(self.tokens) - 1)
        self._unpend()

    def _unpend(self) -> None:
        """The workers' pending token is not the history's last token any more: it is computed
        again by the next prefill."""
        if self.on_workers is OnWorkers.SAMPLED:
            self.on_workers = OnWorkers.COMPUTED
