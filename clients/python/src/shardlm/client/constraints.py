"""Constraints for constrained decoding: the generated text must belong to a formal language.

Each function returns a `shardlm.common.v1.Constraint` message to pass as the `constraint=`
keyword of `generate`, `stream_generate`, `prefill`, `decode` and `stream_decode`::

    from shardlm.client import Client, constraints

    with Client("127.0.0.1:50051") as client:
        out = client.generate("Answer:", constraint=constraints.choice(["yes", "no"]))
        out.finish_reason            # "grammar_complete": the constraint allowed nothing more
        out.usage.constraint_kind    # "choice"

At every step the server lets the model choose only tokens the language allows, and ends the
generation with finish reason "grammar_complete" when the text is complete. A constraint that
does not compile is refused with `InvalidArgumentError` (reason "INVALID_CONSTRAINT"). Grammars
are compiled by llguidance on the server; see `Constraint` in `shardlm/common/v1/common.proto`.

For a session, `prefill(..., constraint=...)` constrains the turn it starts, through the
following `decode` calls; `decode(..., constraint=...)` replaces it, and `unconstrained()` (an
empty `Constraint`) removes it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, TypeAlias

from shardlm.common.v1 import common_pb2

__all__ = ["JsonSchema", "choice", "grammar", "json_object", "json_schema", "regex",
           "structural_tag", "unconstrained"]

# A JSON Schema: a mapping (serialized with json.dumps), a boolean schema (true: any JSON value,
# false: none) or the schema's JSON text, sent as is.
JsonSchema: TypeAlias = Mapping[str, Any] | bool | str


def _plain(value: object) -> object:
    # json.dumps serializes dicts only; read any other mapping (MappingProxyType, ...) as one.
    if isinstance(value, Mapping):
        return dict(value)
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def _json_text(value: Mapping[str, Any] | bool | str, what: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, bool | Mapping):
        return json.dumps(value, default=_plain)
    raise TypeError(f"{what} must be a mapping or JSON text, not {type(value).__name__}")


def json_schema(schema: JsonSchema) -> common_pb2.Constraint:
    """The output is one JSON value that validates against `schema`: a mapping (serialized with
    `json.dumps`), `True`/`False`, or the schema's JSON text (sent as is)."""
    return common_pb2.Constraint(json_schema=_json_text(schema, "json_schema"))


def json_object() -> common_pb2.Constraint:
    """The output is any JSON object."""
    return common_pb2.Constraint(json_object=True)


def regex(pattern: str) -> common_pb2.Constraint:
    """The whole output matches `pattern` (Rust regex syntax, as llguidance reads it)."""
    return common_pb2.Constraint(regex=pattern)


def grammar(text: str) -> common_pb2.Constraint:
    """The output is a sentence of a context-free grammar: Lark syntax (`start: ...`) or GBNF /
    EBNF (llama.cpp's `root ::= ...`), told apart by the server from the text."""
    return common_pb2.Constraint(grammar=text)


def choice(options: Sequence[str]) -> common_pb2.Constraint:
    """The output is exactly one of `options` (at least one string)."""
    if isinstance(options, str | bytes):
        raise TypeError("choice takes a sequence of strings, not a single string")
    return common_pb2.Constraint(choice=common_pb2.ChoiceConstraint(choices=list(options)))


def structural_tag(tag: Mapping[str, Any] | str) -> common_pb2.Constraint:
    """Free text in which a trigger string opens a constrained region (how tool calls are
    forced): the structural-tag JSON that vLLM and SGLang accept, as a mapping (serialized with
    `json.dumps`) or as JSON text (sent as is). Both the `{"type": "structural_tag",
    "structures": [...], "triggers": [...]}` form and the `{"format": {...}}` form are read."""
    if isinstance(tag, bool):
        raise TypeError("structural_tag must be a mapping or JSON text, not bool")
    return common_pb2.Constraint(structural_tag=_json_text(tag, "structural_tag"))


def unconstrained() -> common_pb2.Constraint:
    """An empty Constraint: passed to `decode`, it removes the session's constraint from that
    call on (passing None, the default, continues it). Elsewhere it means no constraint."""
    return common_pb2.Constraint()
