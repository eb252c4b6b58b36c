"""What the sync and async clients share: request building, retry rules, health, channels.

Nothing here does I/O, so `_sync` and `_async` differ only in how they wait and iterate.
"""

from __future__ import annotations

import enum
import numbers
import random
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata as _pkg_metadata
from typing import Any, TypeAlias, TypedDict

import grpc

from shardlm.common.v1 import common_pb2
from shardlm.errors import FieldViolation, InvalidArgumentError, ShardLMError
from shardlm.gateway.v1 import gateway_pb2

from ._types import ChatMessage

try:
    _VERSION = _pkg_metadata.version("shardlm-client")
except _pkg_metadata.PackageNotFoundError:  # running from a source tree that is not installed
    _VERSION = "0+unknown"

HEALTH_CHECK_METHOD = "/grpc.health.v1.Health/Check"
# grpc.health.v1.HealthCheckResponse.ServingStatus.SERVING
_HEALTH_SERVING = 1


# ------------------------------------------------------------------------------ request building
Message: TypeAlias = ChatMessage | Mapping[str, str]
Prompt: TypeAlias = str | Sequence[int] | Sequence[Message]


def _invalid(field_path: str, description: str) -> InvalidArgumentError:
    # Client-side checks raise the same typed error the server would, so callers handle one shape.
    return InvalidArgumentError(f"{field_path}: {description}", reason="INVALID_FIELD",
                                field_violations=[FieldViolation(field_path, description)],
                                metadata={"field": field_path})


def chat_messages(messages: Sequence[Message]) -> gateway_pb2.ChatMessages:
    """Chat messages (dataclasses or {"role", "content"} mappings) as the proto message."""
    out = gateway_pb2.ChatMessages()
    for i, message in enumerate(messages):
        if isinstance(message, ChatMessage):
            role, content = message.role, message.content
        elif isinstance(message, Mapping):
            for key in ("role", "content"):
                if not isinstance(message.get(key), str):
                    raise _invalid(f"messages[{i}].{key}", "must be a string")
            role, content = message["role"], message["content"]
        else:
            raise TypeError(f"messages[{i}] must be a ChatMessage or a mapping, "
                            f"not {type(message).__name__}")
        out.messages.add(role=role, content=content)
    return out


def _prompt_kind(prompt: Prompt) -> str:
    if isinstance(prompt, str):
        return "text"
    if isinstance(prompt, bytes | bytearray):
        raise TypeError("prompt must be str, not bytes: decode it first")
    items = list(prompt)
    if all(isinstance(i, numbers.Integral) and not isinstance(i, bool) for i in items):
        return "token_ids"  # an empty list lands here and the server reports EMPTY_PROMPT
    if all(isinstance(i, ChatMessage | Mapping) for i in items):
        return "messages"
    raise TypeError("prompt must be a str, a list of token ids or a list of chat messages")


def set_prompt(request: gateway_pb2.GenerateRequest | gateway_pb2.PrefillRequest,
               prompt: Prompt) -> None:
    """Fill the request's `prompt` oneof from text, token ids or chat messages."""
    kind = _prompt_kind(prompt)
    if kind == "text":
        assert isinstance(prompt, str)
        request.text = prompt
    elif kind == "token_ids":
        request.token_ids.SetInParent()
        request.token_ids.token_ids.extend(int(i) for i in prompt)  # type: ignore[arg-type]
    else:
        request.messages.CopyFrom(chat_messages(prompt))  # type: ignore[arg-type]


def tokenize_request(text: str | Sequence[Message],
                     add_special_tokens: bool | None) -> gateway_pb2.TokenizeRequest:
    """A TokenizeRequest for raw text or chat messages."""
    request = gateway_pb2.TokenizeRequest()
    if isinstance(text, str):
        request.text = text
    elif _prompt_kind(text) == "messages":
        request.messages.CopyFrom(chat_messages(text))
    else:
        raise TypeError("tokenize takes text or chat messages")
    if add_special_tokens is not None:
        request.add_special_tokens = add_special_tokens
    return request


def sampling_params(**values: Any) -> common_pb2.SamplingParams | None:
    """SamplingParams from keyword values; None values stay unset. Returns None when every value
    is None, so that Prefill and Decode keep the session's parameters."""
    given = {name: value for name, value in values.items() if value is not None}
    if not given:
        return None
    params = common_pb2.SamplingParams()
    violations: list[FieldViolation] = []
    for name, value in given.items():
        try:  # protobuf rejects wrong types and out-of-range integers (a negative seed)
            setattr(params, name, value)
        except (TypeError, ValueError) as exc:
            violations.append(FieldViolation(f"sampling.{name}", str(exc)))
    if violations:
        raise InvalidArgumentError("invalid sampling parameters", reason="INVALID_FIELD",
                                   field_violations=violations,
                                   metadata={"field": violations[0].field})
    return params


def stop_conditions(max_new_tokens: int | None, stop: Sequence[str] | str | None,
                    stop_token_ids: Sequence[int] | None,
                    ignore_eos: bool) -> common_pb2.StopConditions:
    """StopConditions; a bare string for `stop` is one sequence, not a list of characters."""
    sequences = [stop] if isinstance(stop, str) else list(stop or ())
    if max_new_tokens is not None and max_new_tokens < 0:
        raise _invalid("stop.max_new_tokens", "must be >= 0")
    return common_pb2.StopConditions(max_new_tokens=max_new_tokens or 0,
                                     stop_sequences=sequences,
                                     stop_token_ids=list(stop_token_ids or ()),
                                     ignore_eos=ignore_eos)


_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16",
                  "fp16": "float16", "half": "float16"}


def dtype_value(name: str | None) -> common_pb2.Dtype.ValueType:
    """The Dtype enum for "float32", "bfloat16" or "float16" (None: the server's default)."""
    if name is None:
        return common_pb2.DTYPE_UNSPECIFIED
    canonical = _DTYPE_ALIASES.get(name.lower(), name.lower())
    try:
        return common_pb2.Dtype.Value(f"DTYPE_{canonical.upper()}")
    except ValueError:
        raise _invalid("dtype", f"unknown dtype {name!r}; use float32, bfloat16 "
                                "or float16") from None


# -------------------------------------------------------------------------------- health check
# The SDK talks grpc.health.v1 without depending on grpcio-health-checking (one more package
# for a two-field protocol): the request {service} and the response {status} are encoded here.
def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def encode_health_request(service: str) -> bytes:
    """HealthCheckRequest{service}: field 1, length-delimited (empty for the whole server)."""
    data = service.encode()
    return b"\x0a" + _varint(len(data)) + data if data else b""


def decode_health_status(blob: bytes) -> int:
    """HealthCheckResponse.status (field 1, varint); unknown fields are skipped."""
    pos, status = 0, 0

    def read_varint() -> int:
        nonlocal pos
        value = shift = 0
        while True:
            byte = blob[pos]
            pos += 1
            value |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                return value

    while pos < len(blob):
        key = read_varint()
        number, wire = key >> 3, key & 7
        if wire == 0:
            value = read_varint()
            if number == 1:
                status = value
        elif wire == 2:
            pos += read_varint()
        elif wire in (1, 5):
            pos += 8 if wire == 1 else 4
        else:
            raise ValueError(f"unexpected wire type {wire} in HealthCheckResponse")
    return status


def is_serving(status: int) -> bool:
    return status == _HEALTH_SERVING


# ------------------------------------------------------------------------------- retry policy
class Safety(enum.Enum):
    """How much a failed call may have changed on the server, which decides whether to retry."""

    IDEMPOTENT = "idempotent"  # repeating it changes nothing: retry every transient error
    STATEFUL = "stateful"  # it creates or advances state: retry only when nothing was done


# Transport messages (lower-cased) meaning the connection was never established, so the call
# never reached the server. gRPC has no structured flag for this; these are its stable wordings.
_NOT_CONNECTED = ("failed to connect", "connection refused", "dns resolution failed",
                  "errors resolving", "name resolution", "no route to host",
                  "connect failed", "network is unreachable")


def nothing_was_done(error: ShardLMError) -> bool:
    """Whether a failed call certainly changed nothing on the server."""
    if error.code != grpc.StatusCode.UNAVAILABLE:
        return False
    if error.reason == "DRAINING":
        return True  # a draining server takes no new work and drops its sessions anyway
    # A ShardLM error sets a reason; a transport failure leaves the status code's name.
    text = error.message.lower()
    return error.reason == "UNAVAILABLE" and any(marker in text for marker in _NOT_CONNECTED)


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff for transient failures.

    Retried: UNAVAILABLE, and RESOURCE_EXHAUSTED when the server attached RetryInfo (a full
    queue or KV cache, expected to clear). The wait is the server's RetryInfo delay when given,
    else `backoff * 2**attempt` (capped at `max_backoff`) with jitter. Stateful calls retry only
    when `nothing_was_done`. A retry never starts past the call's deadline.
    """

    max_retries: int = 3
    backoff: float = 0.2
    max_backoff: float = 10.0

    def delay(self, attempt: int, error: ShardLMError, safety: Safety,
              deadline: float | None) -> float | None:
        """Seconds to wait before retry number `attempt + 1`, or None to give up."""
        if attempt >= self.max_retries:
            return None
        if safety is Safety.STATEFUL:
            retry = nothing_was_done(error)
        else:
            retry = error.code == grpc.StatusCode.UNAVAILABLE or (
                error.code == grpc.StatusCode.RESOURCE_EXHAUSTED
                and error.retry_after_s is not None)
        if not retry:
            return None
        if error.retry_after_s is not None and error.retry_after_s > 0:
            wait = error.retry_after_s
        else:  # jitter keeps many clients that failed together from retrying in lockstep
            wait = min(self.max_backoff, self.backoff * 2**attempt) * random.uniform(0.5, 1.0)
        if deadline is not None and time.monotonic() + wait >= deadline:
            return None
        return wait


def deadline_after(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + timeout


def remaining(deadline: float | None) -> float | None:
    """Seconds left before `deadline` (at least a millisecond, so gRPC reports the expiry)."""
    return None if deadline is None else max(deadline - time.monotonic(), 0.001)


# -------------------------------------------------------------------------------- channels
@dataclass(frozen=True)
class ChannelConfig:
    """How to open a channel: credentials for TLS, metadata for plaintext auth, options."""

    address: str
    credentials: grpc.ChannelCredentials | None
    metadata: tuple[tuple[str, str], ...]
    options: list[tuple[str, Any]]


def channel_config(address: str, *, tls: bool, root_certificates: bytes | None,
                   private_key: bytes | None, certificate_chain: bytes | None,
                   auth_token: str | None, retry_backoff: float,
                   options: Sequence[tuple[str, Any]] | None) -> ChannelConfig:
    """Channel settings. Certificates imply TLS. With TLS the token travels as call credentials
    (gRPC attaches it to every call and refuses to send it in clear); gRPC refuses call
    credentials on plaintext channels, so there it is plain `authorization` metadata."""
    secure = tls or any(x is not None for x in (root_certificates, private_key, certificate_chain))
    credentials = None
    metadata: tuple[tuple[str, str], ...] = ()
    if secure:
        credentials = grpc.ssl_channel_credentials(root_certificates, private_key,
                                                   certificate_chain)
        if auth_token:
            credentials = grpc.composite_channel_credentials(
                credentials, grpc.access_token_call_credentials(auth_token))
    elif auth_token:
        metadata = (("authorization", f"Bearer {auth_token}"),)
    # gRPC waits 1 s (growing 1.6x) before reconnecting and fails calls at once meanwhile; a
    # shorter first wait lets our own retries actually reach a server that came back.
    reconnect_ms = int(min(max(retry_backoff * 1000, 50), 1000))
    merged: list[tuple[str, Any]] = [
        ("grpc.primary_user_agent", f"shardlm-python/{_VERSION}"),
        ("grpc.initial_reconnect_backoff_ms", reconnect_ms),
        ("grpc.max_reconnect_backoff_ms", 10_000),
    ]
    merged += list(options or ())
    return ChannelConfig(address, credentials, metadata, merged)


# ------------------------------------------------------------------------------ call requests
class SamplingOptions(TypedDict, total=False):
    """Sampling keyword arguments of `prefill` and `decode` (see `SamplingParams` in
    common.proto). Any one given replaces the session's whole set of parameters."""

    temperature: float
    top_k: int
    top_p: float
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    seed: int
    logprobs: bool
    top_logprobs: int


_SAMPLING_NAMES = frozenset(SamplingOptions.__annotations__)


def session_sampling(options: Mapping[str, Any]) -> common_pb2.SamplingParams | None:
    """SamplingParams from `**sampling` keyword arguments, rejecting unknown names as Python
    would for a misspelt keyword."""
    unknown = sorted(set(options) - _SAMPLING_NAMES)
    if unknown:
        raise TypeError(f"unexpected keyword argument(s): {', '.join(unknown)}")
    return sampling_params(**options)


def set_constraint(request: gateway_pb2.GenerateRequest | gateway_pb2.PrefillRequest
                   | gateway_pb2.DecodeRequest,
                   constraint: common_pb2.Constraint | None) -> None:
    """Set the request's `constraint` (None leaves it unset; an empty Constraint is sent as set,
    which for Decode removes the session's constraint)."""
    if constraint is None:
        return
    if not isinstance(constraint, common_pb2.Constraint):
        raise TypeError("constraint must be a shardlm.common.v1.Constraint (build one with "
                        "shardlm.client.constraints), not " + type(constraint).__name__)
    request.constraint.CopyFrom(constraint)


def generate_request(prompt: Prompt, sampling: common_pb2.SamplingParams | None,
                     stop: common_pb2.StopConditions, add_special_tokens: bool | None,
                     constraint: common_pb2.Constraint | None = None,
                     ) -> gateway_pb2.GenerateRequest:
    request = gateway_pb2.GenerateRequest(stop=stop)
    set_prompt(request, prompt)
    if sampling is not None:
        request.sampling.CopyFrom(sampling)
    if add_special_tokens is not None:
        request.add_special_tokens = add_special_tokens
    set_constraint(request, constraint)
    return request


def prefill_request(prompt: Prompt, session_id: str | None, add_special_tokens: bool | None,
                    sampling: Mapping[str, Any],
                    constraint: common_pb2.Constraint | None = None,
                    ) -> gateway_pb2.PrefillRequest:
    request = gateway_pb2.PrefillRequest(session_id=session_id or "")
    set_prompt(request, prompt)
    params = session_sampling(sampling)
    if params is not None:
        request.sampling.CopyFrom(params)
    if add_special_tokens is not None:
        request.add_special_tokens = add_special_tokens
    set_constraint(request, constraint)
    return request


def decode_request(session_id: str, stop: common_pb2.StopConditions,
                   sampling: Mapping[str, Any],
                   constraint: common_pb2.Constraint | None = None,
                   ) -> gateway_pb2.DecodeRequest:
    if not session_id:
        raise _invalid("session_id", "must name a session created by prefill")
    request = gateway_pb2.DecodeRequest(session_id=session_id, stop=stop)
    params = session_sampling(sampling)
    if params is not None:
        request.sampling.CopyFrom(params)
    set_constraint(request, constraint)
    return request


def reset_request(session_ids: Iterable[str] | str | None,
                  all_sessions: bool) -> gateway_pb2.ResetCacheRequest:
    ids = [session_ids] if isinstance(session_ids, str) else list(session_ids or ())
    return gateway_pb2.ResetCacheRequest(session_ids=ids, all=all_sessions)


def load_request(model_path: str, dtype: str | None, tensor_parallel_size: int,
                 kv_cache: common_pb2.KvCacheConfig | None) -> gateway_pb2.LoadRequest:
    request = gateway_pb2.LoadRequest(model_path=str(model_path), dtype=dtype_value(dtype),
                                      tensor_parallel_size=tensor_parallel_size)
    if kv_cache is not None:
        request.kv_cache.CopyFrom(kv_cache)
    return request


def progress_text(progress: common_pb2.LoadProgress) -> str:
    """What a progress callback receives: the human-readable message, else the stage name."""
    return progress.message or progress.stage
