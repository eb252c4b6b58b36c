"""A request's Constraint compiled to llguidance's grammar, checked against the loaded model's
vocabulary before the request is queued.

Each kind becomes one grammar text (`to_grammar`); llguidance then builds its lexer and parser
for the model's tokens (`LLMatcher.validate_grammar_with_warnings`), which is where a bad
schema, regex or grammar shows, and which is the cost a hostile constraint could inflate. That
check runs on a small thread pool under a time limit, so a slow compile answers its own request
(RESOURCE_EXHAUSTED) and never holds the batch loop or another request. Results are cached by the
constraint's content, failures too (a refused schema sent again is refused at once); a compile
that outlives its request's time limit still finishes and is cached (llguidance's own fuel limits
bound it), so a timeout, which may be the load's fault, is never remembered as the schema's.

The workers get the grammar text (worker GrammarConstraint) and build their own matcher from it:
an llguidance matcher cannot cross processes, and the worker's copy of the grammar is what its
masks come from, on the sampling rank only.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import llguidance
from llguidance.gbnf_to_lark import any_to_lark
from shardlm.common.v1 import common_pb2
from shardlm.errors import (
    FailedPreconditionError,
    FieldViolation,
    InvalidArgumentError,
    ResourceExhaustedError,
)

from shardlm_server.gateway.constraints.json_schema import generation_schema
from shardlm_server.gateway.constraints.structural_tag import (
    StructuralTagError,
    structural_tag_to_lark,
)
from shardlm_server.gateway.metrics import Metrics

log = logging.getLogger("shardlm.gateway")
CACHE_ENTRIES = 512
COMPILE_THREADS = 2
MAX_ERROR_CHARS = 600


@dataclass(frozen=True)
class CompiledConstraint:
    """What a sequence carries: the kind (for usage and metrics) and llguidance's grammar."""

    kind: str
    grammar: str


class ConstraintError(Exception):
    """The constraint's own fault, with a message for its sender."""


def constraint_text(constraint: common_pb2.Constraint) -> str:
    """The constraint's payload as the sender wrote it (its size is what the limit counts)."""
    kind = constraint.WhichOneof("kind")
    if kind == "choice":
        return "\n".join(constraint.choice.choices)
    if kind == "json_object":
        return ""
    return getattr(constraint, kind) if kind else ""


def to_grammar(constraint: common_pb2.Constraint) -> str:
    """llguidance's grammar for a constraint; ConstraintError when it cannot be read."""
    kind = constraint.WhichOneof("kind")
    if kind == "json_schema":
        try:
            schema = json.loads(constraint.json_schema)
        except json.JSONDecodeError as exc:
            raise ConstraintError(f"json_schema is not JSON: {exc}") from None
        if not isinstance(schema, dict | bool):
            raise ConstraintError("json_schema must be a JSON object (or true / false)")
        return llguidance.LLMatcher.grammar_from_json_schema(generation_schema(schema))
    if kind == "json_object":
        if not constraint.json_object:
            raise ConstraintError("json_object must be true when set")
        return llguidance.LLMatcher.grammar_from_json_schema(
            generation_schema({"type": "object"}))
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(constraint.regex)
    if kind == "grammar":
        try:  # GBNF (llama.cpp's) is converted; Lark passes through
            return llguidance.LLMatcher.grammar_from_lark(any_to_lark(constraint.grammar))
        except Exception as exc:  # noqa: BLE001 - the converter raises plain exceptions
            raise ConstraintError(f"grammar: {exc}") from None
    if kind == "choice":
        choices = list(constraint.choice.choices)
        if not choices:
            raise ConstraintError("choice needs at least one string")
        rule = " | ".join(json.dumps(c) for c in dict.fromkeys(choices))
        return llguidance.LLMatcher.grammar_from_lark(f"start: {rule}")
    if kind == "structural_tag":
        try:
            return llguidance.LLMatcher.grammar_from_lark(
                structural_tag_to_lark(constraint.structural_tag))
        except StructuralTagError as exc:
            raise ConstraintError(f"structural_tag: {exc}") from None
    raise ConstraintError("set one kind of constraint")


def _short(message: str) -> str:
    message = message.strip()
    return message if len(message) <= MAX_ERROR_CHARS else message[:MAX_ERROR_CHARS] + " ..."


def _invalid(field: str, problem: str, reason: str = "INVALID_CONSTRAINT") -> InvalidArgumentError:
    return InvalidArgumentError(f"{field}: {problem}", reason=reason,
                                field_violations=[FieldViolation(field, problem)])


class ConstraintCompiler:
    """Compiles and checks constraints for one loaded model (built with it, by Runtime)."""

    def __init__(self, tokenizer: llguidance.LLTokenizer | None, metrics: Metrics, *,
                 timeout_s: float, max_bytes: int, unavailable: str = "") -> None:
        self.tokenizer = tokenizer  # None: this model's tokenizer cannot drive constraints
        self.unavailable = unavailable  # why, for the requests that ask
        self.metrics = metrics
        self.timeout_s = timeout_s
        self.max_bytes = max_bytes
        self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="constraint")
        self._cache: OrderedDict[bytes, CompiledConstraint | InvalidArgumentError] = OrderedDict()
        self._inflight: dict[bytes, asyncio.Future] = {}

    @classmethod
    def for_vocabulary(cls, tokenizer_json: str, vocab_size: int, eos_ids: list[int],
                       metrics: Metrics, *, timeout_s: float,
                       max_bytes: int) -> ConstraintCompiler:
        """Builds llguidance's token table (a fraction of a second; call it off the loop). A
        tokenizer llguidance cannot read leaves the model served, its constraints refused."""
        try:
            try:
                table = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size,
                                               eos_token=eos_ids or None)
            except ValueError as exc:
                if "vocab size too small" not in str(exc):
                    raise
                # The tokenizer has more ids than the model has logits: take its size.
                table = llguidance.LLTokenizer(tokenizer_json, eos_token=eos_ids or None)
        except Exception as exc:  # noqa: BLE001 - llguidance raises plain exceptions
            log.warning("constrained decoding is off for this model: llguidance cannot read "
                        "its tokenizer (%s)", str(exc).splitlines()[0][:200])
            return cls(None, metrics, timeout_s=timeout_s, max_bytes=max_bytes,
                       unavailable=str(exc).splitlines()[0][:200])
        return cls(table, metrics, timeout_s=timeout_s, max_bytes=max_bytes)

    async def compile(self, constraint: common_pb2.Constraint,
                      field: str = "constraint") -> CompiledConstraint | None:
        """The compiled constraint; None when no kind is set. Raises INVALID_ARGUMENT
        (INVALID_CONSTRAINT, CONSTRAINT_TOO_LARGE) or RESOURCE_EXHAUSTED
        (CONSTRAINT_COMPILE_TIMEOUT) naming `field`."""
        kind = constraint.WhichOneof("kind")
        if kind is None:
            return None
        if self.tokenizer is None:
            self.metrics.constraint_failures.labels("CONSTRAINTS_UNAVAILABLE").inc()
            raise FailedPreconditionError(
                f"{field}: the loaded model's tokenizer cannot drive constrained decoding "
                f"({self.unavailable})", reason="CONSTRAINTS_UNAVAILABLE")
        try:
            return await self._compile(constraint, kind, field)
        except (InvalidArgumentError, ResourceExhaustedError) as exc:
            self.metrics.constraint_failures.labels(exc.reason).inc()
            raise

    async def _compile(self, constraint: common_pb2.Constraint, kind: str,
                       field: str) -> CompiledConstraint:
        size = len(constraint_text(constraint).encode())
        if size > self.max_bytes:
            raise _invalid(f"{field}.{kind}", f"{size} bytes; at most {self.max_bytes} are "
                           "accepted (the server's --max-constraint-bytes)",
                           reason="CONSTRAINT_TOO_LARGE")
        key = constraint.SerializeToString(deterministic=True)
        cached = self._cache.get(key)
        if cached is None:
            future = self._inflight.get(key)
            if future is None:  # the first request with this content compiles it
                loop = asyncio.get_running_loop()
                future = loop.run_in_executor(self._pool, self._build, constraint, kind)
                self._inflight[key] = future
                future.add_done_callback(lambda f: self._settle(key, f))
            try:
                cached = await asyncio.wait_for(asyncio.shield(future), self.timeout_s)
            except TimeoutError:
                raise ResourceExhaustedError(
                    f"{field}.{kind} did not compile within {self.timeout_s:g} s (the server's "
                    "--constraint-compile-timeout); simplify it", reason="CONSTRAINT_COMPILE_TIMEOUT",
                    retry_after_s=1.0) from None
        else:
            self._cache.move_to_end(key)
        if isinstance(cached, InvalidArgumentError):
            raise _invalid(f"{field}.{kind}", str(cached))
        self.metrics.constrained_requests.labels(kind).inc()
        return cached

    def _settle(self, key: bytes, future: asyncio.Future) -> None:
        """A compile ended (also one its request stopped waiting for): cache its verdict."""
        self._inflight.pop(key, None)
        if not future.cancelled() and future.exception() is None:
            self._remember(key, future.result())

    def _remember(self, key: bytes, value: CompiledConstraint | InvalidArgumentError) -> None:
        self._cache[key] = value
        self._cache.move_to_end(key)
        while len(self._cache) > CACHE_ENTRIES:
            self._cache.popitem(last=False)

    def _build(self, constraint: common_pb2.Constraint,
               kind: str) -> CompiledConstraint | InvalidArgumentError:
        """On a compile thread: the grammar and llguidance's verdict (its lexer and parser are
        built for the model's tokens here, releasing the GIL)."""
        started = time.perf_counter()
        try:
            grammar = to_grammar(constraint)
        except (ConstraintError, ValueError) as exc:
            return InvalidArgumentError(_short(str(exc)))
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            grammar, self.tokenizer)
        self.metrics.constraint_compile_seconds.labels(kind).observe(
            time.perf_counter() - started)
        if is_error:
            return InvalidArgumentError(_short(messages[0] if messages else "does not compile"))
        return CompiledConstraint(kind, grammar)
