"""The SDK's result types, and their conversion from the gateway's protobuf messages.

Plain frozen dataclasses, so results print well, compare by value and do not tie callers to the
protobuf runtime's message API.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from shardlm.common.v1 import common_pb2
from shardlm.errors import InternalError
from shardlm.gateway.v1 import gateway_pb2


# ---------------------------------------------------------------------------------- result types
@dataclass(frozen=True)
class ChatMessage:
    """One chat message; `role` is "system", "user", "assistant" or "tool"."""

    role: str
    content: str


@dataclass(frozen=True)
class TokenLogprob:
    """The natural-log probability of one token, with the token's text."""

    token_id: int
    logprob: float
    text: str


@dataclass(frozen=True)
class Logprobs:
    """Log probabilities at one generated position: the chosen token and the top alternatives."""

    chosen: TokenLogprob
    top: list[TokenLogprob]


@dataclass(frozen=True)
class Usage:
    """Token accounting of one call (see `shardlm.common.v1.Usage`). `constraint_kind` names
    the constraint the generated text followed ("json_schema", "json_object", "regex",
    "grammar", "choice", "structural_tag"; see `shardlm.client.constraints`), "" when none."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    constraint_kind: str = ""


@dataclass(frozen=True)
class Timings:
    """Wall-clock timings of one call, measured by the gateway, in seconds."""

    queue_seconds: float = 0.0
    time_to_first_token_seconds: float = 0.0
    mean_inter_token_seconds: float = 0.0
    tokens_per_second: float = 0.0
    total_seconds: float = 0.0


@dataclass(frozen=True)
class Chunk:
    """One streamed piece of a generation. `finish_reason`, `usage` and `timings` are set on the
    final chunk only; joining every chunk's `text` gives the generated text."""

    token_ids: list[int]
    text: str
    logprobs: list[Logprobs]
    finish_reason: str | None = None
    usage: Usage | None = None
    timings: Timings | None = None


@dataclass(frozen=True)
class Completion:
    """A whole generation. `finish_reason` is "length", "eos", "stop_token", "stop_sequence",
    "context_length", "cancelled", "deadline_exceeded", "error" or "grammar_complete" (the
    request's constraint allowed no further token; the last token is part of the constrained
    text). A reason added by a newer server reads "unknown_<number>"."""

    text: str
    token_ids: list[int]
    finish_reason: str
    usage: Usage
    timings: Timings
    logprobs: list[Logprobs] = field(default_factory=list)


@dataclass(frozen=True)
class Token:
    """One generated token."""

    id: int
    text: str
    logprobs: Logprobs | None = None


@dataclass(frozen=True)
class PrefillResult:
    """The outcome of `prefill`: the session to decode from and its first generated token."""

    session_id: str
    first_token: Token
    usage: Usage
    timings: Timings


@dataclass(frozen=True)
class KvCache:
    """The KV cache the server allocated."""

    num_blocks: int
    block_size: int
    mode: str
    bytes_per_block: int
    max_sequences: int
    max_sequence_length: int


@dataclass(frozen=True)
class ModelInfo:
    """A loaded model. `raw` is the full `shardlm.common.v1.ModelInfo` message."""

    architecture: str
    model_path: str
    vocab_size: int
    num_layers: int
    hidden_size: int
    max_position_embeddings: int
    dtype: str
    eos_token_ids: list[int]
    bos_token_id: int | None
    tensor_parallel_size: int
    kv_cache: KvCache | None
    raw: common_pb2.ModelInfo
    format: str = ""  # "safetensors" or "gguf"
    tensor_types: list[str] = field(default_factory=list)  # stored types, e.g. ["Q4_1", "F32"]
    has_chat_template: bool = False
    weight_bytes: int = 0  # held by one rank: packed blocks at their size, the rest dense
    kv_cache_bytes: int = 0  # the KV cache of one rank
    kv_cache_dtype: str = ""  # e.g. "float32"


@dataclass(frozen=True)
class ServerInfo:
    """What `model_info()` reports: the model (None when none is loaded) and server limits."""

    loaded: bool
    model: ModelInfo | None
    server_version: str
    max_new_tokens_limit: int
    max_context_length: int


@dataclass(frozen=True)
class LoadReport:
    """What `load_report()` reports: the replica's load, for routers and autoscalers (all zeros
    and `loaded` False with no model loaded)."""

    loaded: bool
    running_sequences: int
    waiting_sequences: int
    kv_blocks_used: int
    kv_blocks_free: int
    kv_blocks_total: int
    block_size: int
    prefix_cache_blocks: int
    sessions: int
    generated_tokens_per_second: float  # over the last 10 seconds
    prefix_cache_hit_rate: float  # the share of admitted prompt tokens the prefix cache served
    waiting_uncached_prompt_tokens: int  # prefill work queued
    max_running_sequences: int


class Tokens(list[int]):
    """Token ids (a plain `list[int]`) that also carry, per id, the tokenizer's vocabulary string
    (`tokens`, its internal form: "Ġhello", "ð") and the bytes it stands for in decoded text
    (`token_bytes`; a character split over several tokens is split over their bytes too)."""

    def __init__(self, ids: Iterable[int], tokens: Iterable[str],
                 token_bytes: Iterable[bytes] = ()) -> None:
        super().__init__(ids)
        self.tokens: list[str] = list(tokens)
        self.token_bytes: list[bytes] = list(token_bytes)

    @property
    def texts(self) -> list[str]:
        """Each token's bytes as text; bytes of a character split over tokens read as U+FFFD."""
        return [b.decode("utf-8", errors="replace") for b in self.token_bytes]


# ---------------------------------------------------------------------------- result conversion
def _enum_name(enum_type: Any, prefix: str, value: int) -> str:
    try:
        return str(enum_type.Name(value)).removeprefix(prefix).lower()
    except ValueError:  # a newer server's value this client does not know yet
        return f"unknown_{value}"


def finish_reason(value: int) -> str | None:
    """"length", "eos", ... for a FinishReason; None for UNSPECIFIED (not finished)."""
    if value == common_pb2.FINISH_REASON_UNSPECIFIED:
        return None
    return _enum_name(common_pb2.FinishReason, "FINISH_REASON_", value)


def usage_of(pb: common_pb2.Usage) -> Usage:
    return Usage(pb.prompt_tokens, pb.cached_tokens, pb.generated_tokens, pb.constraint_kind)


def timings_of(pb: common_pb2.Timings) -> Timings:
    return Timings(pb.queue_seconds, pb.time_to_first_token_seconds,
                   pb.mean_inter_token_seconds, pb.tokens_per_second, pb.total_seconds)


def _token_logprob(pb: common_pb2.TokenLogprob) -> TokenLogprob:
    return TokenLogprob(pb.token_id, pb.logprob, pb.text)


def logprobs_of(pb: common_pb2.Logprobs) -> Logprobs:
    return Logprobs(_token_logprob(pb.chosen), [_token_logprob(t) for t in pb.top])


def chunk_of(pb: gateway_pb2.GenerateResponse | gateway_pb2.DecodeResponse) -> Chunk:
    """A Chunk from a Generate or Decode stream message."""
    reason = finish_reason(pb.finish_reason)
    final = reason is not None
    return Chunk(token_ids=list(pb.token_ids), text=pb.text,
                 logprobs=[logprobs_of(lp) for lp in pb.logprobs], finish_reason=reason,
                 usage=usage_of(pb.usage) if final else None,
                 timings=timings_of(pb.timings) if final else None)


class Collector:
    """Folds streamed chunks into one Completion."""

    def __init__(self) -> None:
        self._ids: list[int] = []
        self._text: list[str] = []
        self._logprobs: list[Logprobs] = []
        self._final: Chunk | None = None

    def add(self, chunk: Chunk) -> None:
        self._ids += chunk.token_ids
        self._text.append(chunk.text)
        self._logprobs += chunk.logprobs
        if chunk.finish_reason is not None:
            self._final = chunk

    def result(self) -> Completion:
        final = self._final
        if final is None or final.finish_reason is None:
            # The server always ends a successful stream with a finish reason.
            raise InternalError("the stream ended without a finish reason", reason="INTERNAL")
        return Completion(text="".join(self._text), token_ids=self._ids,
                          finish_reason=final.finish_reason, usage=final.usage or Usage(),
                          timings=final.timings or Timings(), logprobs=self._logprobs)


def prefill_result(pb: gateway_pb2.PrefillResponse) -> PrefillResult:
    token = pb.first_token
    return PrefillResult(
        session_id=pb.session_id,
        first_token=Token(token.token_id, token.text,
                          logprobs_of(token.logprobs) if token.HasField("logprobs") else None),
        usage=usage_of(pb.usage), timings=timings_of(pb.timings))


def model_info_of(pb: common_pb2.ModelInfo,
                  capacity: common_pb2.KvCacheCapacity | None) -> ModelInfo:
    cache = None
    if capacity is not None:
        cache = KvCache(capacity.num_blocks, capacity.block_size,
                        _enum_name(common_pb2.KvCacheMode, "KV_CACHE_MODE_", capacity.mode),
                        capacity.bytes_per_block, capacity.max_sequences,
                        capacity.max_sequence_length)
    return ModelInfo(
        architecture=pb.architecture, model_path=pb.model_path, vocab_size=pb.vocab_size,
        num_layers=pb.num_layers, hidden_size=pb.hidden_size,
        max_position_embeddings=pb.max_position_embeddings,
        dtype=_enum_name(common_pb2.Dtype, "DTYPE_", pb.dtype),
        eos_token_ids=list(pb.eos_token_ids),
        bos_token_id=pb.bos_token_id if pb.HasField("bos_token_id") else None,
        tensor_parallel_size=pb.tensor_parallel_size, kv_cache=cache, raw=pb,
        format=_enum_name(common_pb2.CheckpointFormat, "CHECKPOINT_FORMAT_", pb.format),
        tensor_types=list(pb.tensor_types), has_chat_template=pb.has_chat_template,
        weight_bytes=pb.weight_bytes, kv_cache_bytes=pb.kv_cache_bytes,
        kv_cache_dtype=(_enum_name(common_pb2.Dtype, "DTYPE_", pb.kv_cache_dtype)
                        if pb.kv_cache_dtype else ""))


def server_info_of(pb: gateway_pb2.GetModelInfoResponse) -> ServerInfo:
    model = (model_info_of(pb.model, pb.capacity if pb.HasField("capacity") else None)
             if pb.loaded else None)
    return ServerInfo(loaded=pb.loaded, model=model, server_version=pb.server_version,
                      max_new_tokens_limit=pb.max_new_tokens_limit,
                      max_context_length=pb.max_context_length)


def load_report_of(pb: gateway_pb2.GetLoadResponse) -> LoadReport:
    return LoadReport(
        loaded=pb.loaded, running_sequences=pb.running_sequences,
        waiting_sequences=pb.waiting_sequences, kv_blocks_used=pb.kv_blocks_used,
        kv_blocks_free=pb.kv_blocks_free, kv_blocks_total=pb.kv_blocks_total,
        block_size=pb.block_size, prefix_cache_blocks=pb.prefix_cache_blocks,
        sessions=pb.sessions, generated_tokens_per_second=pb.generated_tokens_per_second,
        prefix_cache_hit_rate=pb.prefix_cache_hit_rate,
        waiting_uncached_prompt_tokens=pb.waiting_uncached_prompt_tokens,
        max_running_sequences=pb.max_running_sequences)
