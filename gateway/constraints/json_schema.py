"""How a JSON schema is read for generation: as written, with two defaults that keep a model's
output short and whole (both are the defaults of xgrammar, vLLM's and SGLang's default grammar
backend, so a schema behaves here as it does there).

- Objects are closed: an object schema with `properties` and no word on other keys
  (`additionalProperties`, `patternProperties`, `unevaluatedProperties`) takes only the keys it
  names. JSON Schema would allow any extra key, and a model may then add keys until its token
  budget ends instead of closing the object. Every output still validates against the schema as
  written. Branches of an `allOf` stay open: closing each would forbid the keys of the others.
- Whitespace is that of `json.dumps`: one space after `,` and `:`, none elsewhere, instead of any
  run of whitespace, which a model could likewise extend without end.
A schema's own `x-guidance` options (llguidance's) override the second.
"""

from __future__ import annotations

from typing import Any

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties")
# Keywords whose value is one subschema, a list of them, or a name -> subschema map.
_ONE = ("items", "additionalItems", "contains", "not", "if", "then", "else",
        "additionalProperties", "propertyNames", "unevaluatedItems", "unevaluatedProperties")
_MANY = ("anyOf", "oneOf", "prefixItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def generation_schema(schema: Any) -> Any:
    """`schema` (a parsed JSON schema) with objects closed and the output's whitespace fixed."""
    if not isinstance(schema, dict):
        return schema
    closed = _closed(schema)
    if "x-guidance" not in closed:
        closed["x-guidance"] = dict(JSON_OPTIONS)
    return closed


def _closed(schema: Any, *, in_all_of: bool = False) -> Any:
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _ONE:
        if isinstance(out.get(key), dict):
            out[key] = _closed(out[key])
    for key in _MANY:
        if isinstance(out.get(key), list):
            out[key] = [_closed(s) for s in out[key]]
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [_closed(s, in_all_of=True) for s in out["allOf"]]
    for key in _MAP:
        if isinstance(out.get(key), dict):
            out[key] = {name: _closed(s) for name, s in out[key].items()}
    if ("properties" in out and not in_all_of and "allOf" not in out
            and not any(k in out for k in _OPEN_KEYS)):
        out["additionalProperties"] = False
    return out
