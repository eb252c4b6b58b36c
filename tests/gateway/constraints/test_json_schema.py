"""How schemas are read for generation: objects closed where the schema says nothing of other
keys, json.dumps's whitespace, and the schema's own choices left alone."""

from __future__ import annotations

from shardlm_server.gateway.constraints.json_schema import JSON_OPTIONS, generation_schema


def test_objects_with_properties_are_closed_at_every_depth():
    schema = {"type": "object", "properties": {
        "a": {"type": "object", "properties": {"b": {"type": "string"}}},
        "list": {"type": "array", "items": {"properties": {"c": {}}}},
        "either": {"anyOf": [{"properties": {"d": {}}}, {"type": "string"}]},
        "ref": {"$ref": "#/$defs/thing"}},
        "$defs": {"thing": {"properties": {"e": {}}}}}
    out = generation_schema(schema)
    assert out["additionalProperties"] is False
    props = out["properties"]
    assert props["a"]["additionalProperties"] is False
    assert props["list"]["items"]["additionalProperties"] is False
    assert props["either"]["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in props["either"]["anyOf"][1]
    assert out["$defs"]["thing"]["additionalProperties"] is False
    assert schema["properties"]["a"] == {"type": "object", "properties": {"b": {"type": "string"}}}


def test_what_the_schema_says_is_kept():
    for open_key in ({"additionalProperties": True}, {"additionalProperties": {"type": "integer"}},
                     {"patternProperties": {"^x": {}}}, {"unevaluatedProperties": False}):
        out = generation_schema({"properties": {"a": {}}, **open_key})
        assert {k: out[k] for k in open_key} == open_key
    assert "additionalProperties" not in generation_schema({"type": "object"})
    custom = {"x-guidance": {"whitespace_flexible": True}}
    assert generation_schema(custom)["x-guidance"] == custom["x-guidance"]
    assert generation_schema({})["x-guidance"] == JSON_OPTIONS
    assert generation_schema(True) is True


def test_all_of_branches_stay_open():
    out = generation_schema({"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]})
    assert all("additionalProperties" not in branch for branch in out["allOf"])
    assert "additionalProperties" not in out
