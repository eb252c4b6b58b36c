"""What the gateway knows about one sequence on the workers, and the events it streams.

A sequence's full token history lives here, so its KV cache can always be rebuilt (eviction,
preemption, a worker restart) by prefilling `tokens[cached:]`. `cached` counts the tokens whose
K/V the workers hold; `in_sync` says the workers also hold its last token as the pending one, so
a decode step can feed it directly.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from enum import StrEnum

from shardlm.common.v1 import common_pb2


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
class Limits:
    """The stop conditions of the current generation call, as the gateway enforces them."""

    max_new_tokens: int
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False


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
    finish_reason: int = common_pb2.FINISH_REASON_UNSPECIFIED
    # The current call (Prefill, Decode or Generate):
    limits: Limits = field(default_factory=lambda: Limits(0))
    generated: int = 0
    prefill_only: bool = False  # a Prefill RPC: one token, then park
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: bool = False
    finish_after: int | None = None  # a stop sequence matched: keep this many generated tokens
    enqueued_at: float = field(default_factory=time.monotonic)
    admitted_at: float | None = None

    @property
    def uncached(self) -> list[int]:
        return self.tokens[self.cached:]

    def start_call(self, limits: Limits, prefill_only: bool) -> None:
        self.limits = limits
        self.generated = 0
        self.prefill_only = prefill_only
        self.events = asyncio.Queue()
        self.cancelled = False
        self.finish_after = None
        self.finish_reason = common_pb2.FINISH_REASON_UNSPECIFIED
        self.enqueued_at = time.monotonic()
        self.admitted_at = None

    @property
    def needs_prefill(self) -> bool:
        return self.prefill_only or not self.in_sync

    def worker_stop(self) -> common_pb2.StopConditions:
        remaining = max(self.limits.max_new_tokens - self.generated, 1)
        return common_pb2.StopConditions(max_new_tokens=remaining,
                                         stop_token_ids=self.limits.stop_token_ids,
                                         ignore_eos=self.limits.ignore_eos)
