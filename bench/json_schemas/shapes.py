"""Pieces the corpus's modules share: common leaf schemas, and a tree schema cut at a depth."""

from __future__ import annotations

from typing import Any

S40 = {"type": "string", "minLength": 1, "maxLength": 40}  # a name, a title, a short label
TEXT = {"type": "string", "maxLength": 40}  # a short label or name
UNIT = {"type": "number", "minimum": 0, "maximum": 1}  # a confidence or a share
PORT = {"type": "integer", "minimum": 1, "maximum": 65535}


def depth_bounded(schema: dict[str, Any], name: str, array: str, levels: int) -> dict[str, Any]:
    """A tree schema whose `$defs[name]` lists its children under `array`, cut at `levels`
    levels: each level's children are the next level's, the last level's list is empty. Trees
    as apps send them are bounded like this; with the self-reference as written, greedy decoding
    on the 135M default model nests without end until its token budget runs out (measured: 4 of
    4 such schemas at 512 tokens), which says nothing about the constraint's correctness."""
    node = schema["$defs"][name]
    defs = {k: v for k, v in schema["$defs"].items() if k != name}
    for level in range(levels):
        here = {**node, "properties": dict(node["properties"])}
        children = dict(here["properties"][array])
        if level + 1 < levels:
            children["items"] = {"$ref": f"#/$defs/{name}{level + 2}"}
        else:
            children = {"type": "array", "maxItems": 0}
        here["properties"][array] = children
        defs[f"{name}{level + 1}"] = here
    rest = _renamed_refs({k: v for k, v in schema.items() if k != "$defs"},
                         f"#/$defs/{name}", f"#/$defs/{name}1")
    return {"$defs": defs, **rest}


def _renamed_refs(value: Any, old: str, new: str) -> Any:
    if isinstance(value, dict):
        return {k: (new if k == "$ref" and v == old else _renamed_refs(v, old, new))
                for k, v in value.items()}
    if isinstance(value, list):
        return [_renamed_refs(v, old, new) for v in value]
    return value
