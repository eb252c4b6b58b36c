"""What the engine is asked to run and what it remembers of each sequence between calls."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import torch

from shardlm_server.worker.drafting import Acceptance, NgramDrafter
from shardlm_server.worker.grammar import SequenceConstraint
from shardlm_server.worker.sampling import SampledToken, SamplerSettings, TokenHistory


class FinishReason(StrEnum):
    """Why a sequence left the batch. The reason clients see is the gateway's to decide."""

    LENGTH = "length"  # its max_new_tokens budget is used up
    STOP_TOKEN = "stop_token"  # it generated one of its stop ids
    CONTEXT_LENGTH = "context_length"  # no position left to feed the new token
    CONSTRAINT_COMPLETE = "constraint_complete"  # its grammar allows no further token


@dataclass(frozen=True)
class StopParams:
    """When a sequence stops. There is no EOS rule: whoever wants the sequence to stop on the
    model's EOS ids includes them in stop_token_ids."""

    max_new_tokens: int = 0  # 0 = bounded only by the context
    stop_token_ids: tuple[int, ...] = ()


@dataclass
class PrefillItem:
    sequence_id: int
    token_ids: list[int]  # new tokens only
    start_position: int  # tokens of this sequence already in the cache
    block_table: list[int]
    sampling: SamplerSettings = field(default_factory=SamplerSettings)
    stop: StopParams = field(default_factory=StopParams)
    sample: bool = True  # False for a non-final chunk of a chunked prefill
    # The ids of the first start_position tokens, when their K/V is a prefix another sequence
    # computed (cached by the gateway) and this worker does not know the sequence.
    prefix_token_ids: list[int] = field(default_factory=list)
    constraint: SequenceConstraint | None = None  # after this prefill (read when sampling)
    # Position of the current turn's first generated token: the tokens from there on count as
    # generated for the presence and frequency penalties (0: none is).
    output_start: int = 0


@dataclass
class DecodeItem:
    sequence_id: int
    block_table: list[int]
    max_steps: int
    sampling: SamplerSettings | None = None  # replaces the sequence's parameters when given
    stop: StopParams | None = None
    # Replaces the sequence's constraint when given (an empty grammar removes it).
    constraint: SequenceConstraint | None = None


@dataclass
class TokenOutput:
    sequence_id: int
    token: SampledToken
    constraint_complete: bool = False  # its constraint allows nothing after this token


@dataclass(frozen=True)
class DraftCount:
    """What one sequence's drafts did in a speculative step."""

    sequence_id: int
    proposed: int  # draft tokens verified
    accepted: int  # of which the sampler kept (each saved a step)


@dataclass
class StepOutput:
    """One step's tokens: one per sequence, or with speculation several (its accepted drafts and
    the token after them), in order."""

    tokens: list[TokenOutput]
    taps: dict[str, torch.Tensor] = field(default_factory=dict)
    mask_seconds: float = 0.0  # constrained rows' masks in this step (rank 0)
    drafts: list[DraftCount] = field(default_factory=list)


@dataclass
class ResidentSequence:
    """What a rank remembers of a sequence between calls."""

    sequence_id: int
    tokens: list[int]  # every token whose K/V is in the cache, in order
    block_table: list[int]
    sampling: SamplerSettings
    stop: StopParams
    pending: int | None = None  # sampled but not yet fed (its K/V is not cached yet)
    generated: int = 0
    finished: FinishReason | None = None
    history: TokenHistory | None = None
    output_start: int = 0  # the tokens from there on were generated in the current turn
    matcher: Any = None  # llguidance's LLMatcher of its constraint, on rank 0 (worker/grammar.py)
    constrained: bool = False  # a grammar constrains its next tokens (known on every rank)
    # Speculative decoding (worker/speculative.py): its prompt-lookup index, made at its first
    # speculative step, and how its drafts have fared.
    drafter: NgramDrafter | None = None
    acceptance: Acceptance = field(default_factory=Acceptance)

    @property
    def num_cached(self) -> int:
        return len(self.tokens)

    @property
    def draw_position(self) -> int:
        """The position of the token its next sample draws: after its cached tokens and the
        pending one being fed, if any (a seeded draw's key, worker/sampling.py)."""
        return len(self.tokens) + (self.pending is not None)
