"""What the engine is asked to run and what it remembers of each sequence between calls."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

import torch

from shardlm_server.worker.sampling import SampledToken, SamplerSettings, TokenHistory


class FinishReason(StrEnum):
    """Why a sequence left the batch. The reason clients see is the gateway's to decide."""

    LENGTH = "length"  # its max_new_tokens budget is used up
    STOP_TOKEN = "stop_token"  # it generated one of its stop ids
    CONTEXT_LENGTH = "context_length"  # no position left to feed the new token


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


@dataclass
class DecodeItem:
    sequence_id: int
    block_table: list[int]
    max_steps: int
    sampling: SamplerSettings | None = None  # replaces the sequence's parameters when given
    stop: StopParams | None = None


@dataclass
class TokenOutput:
    sequence_id: int
    token: SampledToken


@dataclass
class StepOutput:
    tokens: list[TokenOutput]
    taps: dict[str, torch.Tensor] = field(default_factory=dict)


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
    generator: torch.Generator | None = None
    history: TokenHistory | None = None

    @property
    def num_cached(self) -> int:
        return len(self.tokens)
