"""Checks every field of a request before any work is done.

All violations of a request are collected and returned together as one INVALID_ARGUMENT with a
BadRequest detail; the ErrorInfo reason is the most specific one found (EMPTY_PROMPT,
TOKEN_OUT_OF_VOCABULARY, ... or INVALID_FIELD).
"""

from __future__ import annotations

import math

from shardlm.common.v1 import common_pb2
from shardlm.errors import FieldViolation, InvalidArgumentError

from shardlm_server.gateway.text.tokenizer import ALLOWED_ROLES

MAX_STOP_SEQUENCES = 16
MAX_STOP_SEQUENCE_CHARS = 256
MAX_TOP_LOGPROBS = 20
MAX_PROMPT_CHARS = 4 << 20


MAX_VIOLATIONS = 10  # error details travel in trailers, which gRPC caps at a few KiB
MAX_TOKEN_IDS = 1 << 20


class Violations:
    def __init__(self) -> None:
        self.items: list[tuple[FieldViolation, str]] = []
        self.dropped = 0

    def add(self, field: str, description: str, reason: str = "INVALID_FIELD") -> None:
        if len(self.items) >= MAX_VIOLATIONS:
            self.dropped += 1
            return
        self.items.append((FieldViolation(field[:200], description[:200]), reason))

    def raise_if_any(self) -> None:
        if not self.items:
            return
        reasons = [r for _v, r in self.items if r != "INVALID_FIELD"]
        reason = reasons[0] if reasons else "INVALID_FIELD"
        first = self.items[0][0]
        raise InvalidArgumentError(
            f"invalid {first.field}: {first.description}"
            + (f" (and {len(self.items) - 1 + self.dropped} more)"
               if len(self.items) + self.dropped > 1 else ""),
            reason=reason, field_violations=[v for v, _r in self.items],
            metadata={"field": first.field})


def _finite(x: float) -> bool:
    return not (math.isnan(x) or math.isinf(x))


def check_session_id(session_id: str, v: Violations, *, required: bool) -> None:
    """`required`: the call needs an existing session (Decode); otherwise an empty id asks for
    a new one (Prefill)."""
    if required and not session_id:
        v.add("session_id", "must name a session (ids are issued by Prefill)")
    elif len(session_id) > 128:
        v.add("session_id", "at most 128 characters (ids are issued by Prefill)")


def check_sampling(p: common_pb2.SamplingParams, v: Violations, path: str = "sampling") -> None:
    if not _finite(p.temperature) or p.temperature < 0:
        v.add(f"{path}.temperature", "must be >= 0 (0 means greedy)")
    if p.top_k < 0:
        v.add(f"{path}.top_k", "must be >= 0 (0 disables it)")
    if p.HasField("top_p") and not (_finite(p.top_p) and 0 < p.top_p <= 1):
        v.add(f"{path}.top_p", "must be in (0, 1]")
    if not (_finite(p.min_p) and 0 <= p.min_p <= 1):
        v.add(f"{path}.min_p", "must be in [0, 1]")
    if p.HasField("repetition_penalty") and not (
            _finite(p.repetition_penalty) and p.repetition_penalty > 0):
        v.add(f"{path}.repetition_penalty", "must be > 0 (1 disables it)")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(p, name)
        if not (_finite(value) and -2 <= value <= 2):
            v.add(f"{path}.{name}", "must be in [-2, 2]")
    if not 0 <= p.top_logprobs <= MAX_TOP_LOGPROBS:
        v.add(f"{path}.top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}]")


def check_stop(p: common_pb2.StopConditions, v: Violations, *, max_new_tokens_limit: int,
               vocab_size: int, path: str = "stop") -> None:
    if p.max_new_tokens > max_new_tokens_limit:
        v.add(f"{path}.max_new_tokens", f"must be at most {max_new_tokens_limit}")
    if len(p.stop_sequences) > MAX_STOP_SEQUENCES:
        v.add(f"{path}.stop_sequences", f"at most {MAX_STOP_SEQUENCES} stop sequences")
    for i, s in enumerate(p.stop_sequences):
        if not s or len(s) > MAX_STOP_SEQUENCE_CHARS:
            v.add(f"{path}.stop_sequences[{i}]",
                  f"must be 1 to {MAX_STOP_SEQUENCE_CHARS} characters")
    for i, t in enumerate(p.stop_token_ids):
        if not 0 <= t < vocab_size:
            v.add(f"{path}.stop_token_ids[{i}]", f"must be in [0, {vocab_size})",
                  "TOKEN_OUT_OF_VOCABULARY")


def check_prompt(request, v: Violations, *, vocab_size: int, allow_empty: bool = False) -> None:
    """`request` has the `prompt` oneof of text / messages / token_ids."""
    kind = request.WhichOneof("prompt")
    if kind is None:
        if not allow_empty:
            v.add("prompt", "set one of text, messages or token_ids", "EMPTY_PROMPT")
        return
    if kind == "text":
        if not request.text:
            v.add("text", "must not be empty", "EMPTY_PROMPT")
        elif len(request.text) > MAX_PROMPT_CHARS:
            v.add("text", f"longer than {MAX_PROMPT_CHARS} characters")
    elif kind == "messages":
        messages = request.messages.messages
        if not messages:
            v.add("messages.messages", "must hold at least one message", "EMPTY_PROMPT")
        if sum(len(m.content) for m in messages) > MAX_PROMPT_CHARS:
            v.add("messages.messages", f"longer than {MAX_PROMPT_CHARS} characters in all")
        for i, m in enumerate(messages):
            if m.role not in ALLOWED_ROLES:
                v.add(f"messages.messages[{i}].role",
                      f"unknown role '{m.role[:32]}'; one of {', '.join(sorted(ALLOWED_ROLES))}")
    else:
        ids = request.token_ids.token_ids
        if not ids:
            v.add("token_ids.token_ids", "must not be empty", "EMPTY_PROMPT")
        if len(ids) > MAX_TOKEN_IDS:
            v.add("token_ids.token_ids", f"more than {MAX_TOKEN_IDS} token ids")
        for i, t in enumerate(ids):
            if not 0 <= t < vocab_size:
                v.add(f"token_ids.token_ids[{i}]", f"token id {t} is outside [0, {vocab_size})",
                      "TOKEN_OUT_OF_VOCABULARY")
                break


MAX_PREFIX_CACHE_SALT_BYTES = 256


def check_prefix_cache(options, v: Violations) -> None:
    """A request's PrefixCacheOptions."""
    if len(options.salt.encode()) > MAX_PREFIX_CACHE_SALT_BYTES:
        v.add("prefix_cache.salt", f"longer than {MAX_PREFIX_CACHE_SALT_BYTES} bytes")
