"""What the gateway knows about one sequence on the workers, and the events it streams.

A sequence's full token history lives here, so its KV cache can always be rebuilt (eviction,
preemption, a worker restart) by prefilling `tokens[cached:]`. `cached` counts the tokens whose
K/V the workers hold; `in_sync` says the workers also hold its last token as the pending one, so
a decode step can feed it directly.

The scheduler owns this state: handlers and the stream writer change a sequence only through the
scheduler's methods, which call the ones here.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from enum import StrEnum

from shardlm.common.v1 import common_pb2

from shardlm_server.gateway.batching.finish import CallLimits


class Phase(StrEnum):
    IDLE = "idle"  # parked: holds its cache, nobody is generating (a session between calls)
    WAITING = "waiting"  # queued for (re)prefill
    RUNNING = "running"  # in the decode batch
    DONE = "done"


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
class Sequence:
    seq_id: int
    tokens: list[int]
    sampling: common_pb2.SamplingParams
    cached: int = 0
    in_sync: bool = False
    phase: Phase = Phase.IDLE
    ephemeral: bool = False  # a Generate's sequence: freed when its call ends
    sampling_changed: bool = False  # the workers must be sent `sampling` with the next decode
    # The prefix cache: the salt of the keys this sequence's blocks are shared under, or None
    # when it bypasses the cache (neither reuses nor publishes blocks).
    prefix_salt: bytes | None = None
    # Its first `cached` tokens are cached blocks another sequence computed, which the workers
    # have not seen as this sequence's: their ids go with its next prefill.
    unsent_prefix: bool = False
    finish_reason: int = common_pb2.FINISH_REASON_UNSPECIFIED
    # The current call (Prefill, Decode or Generate):
    limits: CallLimits = field(default_factory=lambda: CallLimits(0, 0))
    generated: int = 0
    prefill_only: bool = False  # a Prefill RPC: one token, then park
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: bool = False
    finish_after: int | None = None  # a stop sequence matched: keep this many generated tokens
    enqueued_at: float = field(default_factory=time.monotonic)
    admitted_at: float | None = None
    # Prompt tokens of this call that were not computed (cached before its first prefill);
    # None until that prefill is scheduled.
    call_cached: int | None = None

    @property
    def uncached(self) -> list[int]:
        return self.tokens[self.cached:]

    @property
    def needs_prefill(self) -> bool:
        return self.prefill_only or not self.in_sync

    @property
    def budget(self) -> int:
        """Tokens the current call may still generate."""
        return self.limits.budget(len(self.tokens), self.generated)

    def worker_stop(self) -> common_pb2.StopConditions:
        return self.limits.worker_stop(len(self.tokens), self.generated)

    def start_call(self, limits: CallLimits, prefill_only: bool) -> None:
        self.limits = limits
        self.generated = 0
        self.prefill_only = prefill_only
        self.events = asyncio.Queue()
        self.cancelled = False
        self.finish_after = None
        self.finish_reason = common_pb2.FINISH_REASON_UNSPECIFIED
        self.enqueued_at = time.monotonic()
        self.admitted_at = None
        self.call_cached = None if self.needs_prefill else self.cached

    @property
    def cached_prompt_tokens(self) -> int:
        """Usage: the prompt tokens this call took from the KV cache."""
        return self.call_cached or 0

    def forget_cache(self) -> None:
        """The workers no longer hold this sequence: rebuild it from its history when used."""
        self.cached, self.in_sync, self.unsent_prefix = 0, False, False

    def extend_history(self, tokens: list[int]) -> None:
        """A new turn: append to the history; the cache stays valid."""
        self.tokens = self.tokens + list(tokens)

    def replace_history(self, tokens: list[int]) -> None:
        """A re-rendered conversation: the cache is good up to the first token where the new
        history differs from the old one."""
        keep = 0
        for old, new in zip(self.tokens, tokens, strict=False):
            if old != new:
                break
            keep += 1
        self.tokens = list(tokens)
        self.cached, self.in_sync = min(self.cached, keep), False

    def set_sampling(self, sampling: common_pb2.SamplingParams) -> None:
        self.sampling, self.sampling_changed = sampling, True

    def drop_unsent(self) -> None:
        """The call ended after `finish_after` generated tokens (a stop sequence matched, or the
        client left): forget the tokens generated after them, which no client saw."""
        if self.finish_after is None:
            return
        extra = self.generated - self.finish_after
        if extra > 0:
            del self.tokens[-extra:]
            self.cached = min(self.cached, len(self.tokens) - 1)
            self.in_sync = False  # the workers hold the longer history: rebuild from `cached`
            self.generated = self.finish_after
