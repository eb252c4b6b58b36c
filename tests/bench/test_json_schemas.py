"""The JSON Schema corpus of `python -m bench.constrained` (bench/json_schemas/): valid Draft
2020-12 schemas that llguidance compiles, covering the features applications use, and on which
llguidance and jsonschema agree; and the benchmark's pure helpers, without a server."""

from __future__ import annotations

import codecs
import json
import random
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import grpc
import jsonschema
import llguidance
import pytest
from shardlm.common.v1 import common_pb2
from shardlm.gateway.v1 import gateway_pb2, gateway_pb2_grpc

from bench import constrained
from bench.json_schemas import SCHEMAS, SchemaCase

BY_NAME = {case.name: case for case in SCHEMAS}


def _children(node: dict):
    """(sub-schema, is an array's items) for every schema directly under `node`."""
    for key in ("properties", "$defs", "patternProperties"):
        for sub in node.get(key, {}).values():
            yield sub, False
    for key in ("anyOf", "oneOf", "allOf"):
        for sub in node.get(key, []):
            yield sub, False
    for sub in node.get("prefixItems", []):
        yield sub, True
    for key, in_items in (("items", True), ("additionalProperties", False)):
        if isinstance(node.get(key), dict):
            yield node[key], in_items


def _nodes(schema: dict, array_depth: int = 0):
    """Every sub-schema with the number of arrays it is an element of (no $ref followed)."""
    yield schema, array_depth
    for sub, in_items in _children(schema):
        yield from _nodes(sub, array_depth + in_items)


def _recursive(schema: dict) -> bool:
    """Some $defs entry reaches itself through $refs."""
    defs = schema.get("$defs", {})
    refs = {name: {n["$ref"].removeprefix("#/$defs/") for n, _d in _nodes(sub) if "$ref" in n}
            for name, sub in defs.items()}

    def reaches(start: str, goal: str, seen: set) -> bool:
        return any(r == goal or (r not in seen and reaches(r, goal, seen | {r}))
                   for r in refs.get(start, ()))

    return any(reaches(name, name, {name}) for name in defs)


def features(schema: dict) -> set[str]:
    found = set()
    for node, depth in _nodes(schema):
        types = node.get("type")
        checks = {
            "anyOf/oneOf": "anyOf" in node or "oneOf" in node, "$ref": "$ref" in node,
            "pattern": "pattern" in node, "enum": "enum" in node, "const": "const" in node,
            "format": "format" in node, "multipleOf": "multipleOf" in node,
            "exclusiveMinimum": "exclusiveMinimum" in node,
            "numeric bounds": any(k in node for k in ("minimum", "maximum", "exclusiveMinimum",
                                                      "exclusiveMaximum")),
            "nullable": isinstance(types, list) and "null" in types,
            "boolean": types == "boolean",
            "additionalProperties false": node.get("additionalProperties") is False,
            "minItems/maxItems": "minItems" in node or "maxItems" in node,
            "string length": "maxLength" in node or "minLength" in node,
            "nested arrays": types == "array" and depth >= 1,
        }
        found |= {name for name, hit in checks.items() if hit}
    if _recursive(schema):
        found.add("recursive $ref")
    return found


def test_corpus_size_and_unique_names():
    assert len(SCHEMAS) >= 110
    assert len(BY_NAME) == len(SCHEMAS), [n for n, k in Counter(c.name for c in SCHEMAS).items()
                                          if k > 1]
    for case in SCHEMAS:
        assert isinstance(case, SchemaCase)
        assert case.name.isidentifier() and case.name.islower(), case.name
        assert 20 <= len(case.prompt) <= 400, case.name
    with pytest.raises(AttributeError):
        SCHEMAS[0].name = "other"  # frozen


@pytest.mark.parametrize("name", sorted(BY_NAME))
def test_schema_is_draft_2020_12_and_compiles_with_llguidance(name):
    schema = BY_NAME[name].schema
    jsonschema.Draft202012Validator.check_schema(schema)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))
    message = llguidance.LLMatcher.validate_grammar(grammar)
    assert message == "" or message.startswith("WARNING"), message


def test_every_pattern_is_anchored():
    # llguidance, like JSON Schema, matches an unanchored pattern anywhere in the string.
    for case in SCHEMAS:
        for node, _depth in _nodes(case.schema):
            if "pattern" in node:
                assert node["pattern"].startswith("^") and node["pattern"].endswith("$"), \
                    (case.name, node["pattern"])


def test_the_corpus_covers_each_feature():
    counts = Counter(f for case in SCHEMAS for f in features(case.schema))
    wanted = {"anyOf/oneOf": 5, "$ref": 5, "pattern": 5, "enum": 5, "numeric bounds": 5,
              "nested arrays": 5, "recursive $ref": 1, "format": 5, "const": 5, "nullable": 5,
              "additionalProperties false": 5, "minItems/maxItems": 5, "multipleOf": 3,
              "exclusiveMinimum": 3, "boolean": 5, "string length": 5}
    short = {f: counts[f] for f, least in wanted.items() if counts[f] < least}
    assert not short, (short, counts)


def test_strings_and_arrays_are_bounded():
    """Output stays short: every string without a pattern, format or enum has a maxLength,
    every array a maxItems (`minItems` alone only in none)."""
    for case in SCHEMAS:
        for node, _depth in _nodes(case.schema):
            types = node.get("type")
            types = types if isinstance(types, list) else [types]
            if "string" in types and not {"pattern", "format", "enum", "const"} & set(node):
                assert "maxLength" in node, (case.name, node)
            if "array" in types and "prefixItems" not in node:
                assert "maxItems" in node, (case.name, node)


class _ByteTokenizer:
    """256 byte tokens and an end-of-sequence token: llguidance walks any grammar with it."""

    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([b]) for b in range(256)] + [b"<eos>"]
    special_token_ids = [256]

    def __call__(self, text):
        return list(text if isinstance(text, bytes) else text.encode())


BYTES = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteTokenizer()))
CLOSERS = set(b'"]},')
SPACE = set(b" \t\r\n")


def random_output(schema: dict, seed: int, limit: int = 6000) -> str:
    """A random text the schema's grammar allows: allowed bytes drawn at random, with a lean
    toward closing strings, arrays and objects, and no whitespace unless it is all there is."""
    matcher = llguidance.LLMatcher(BYTES, llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(schema)))
    rng = random.Random(seed)
    out = bytearray()
    for _ in range(limit):
        mask = matcher.compute_bitmask()
        allowed = [t for t in range(257) if mask[t // 8] >> (t % 8) & 1]
        assert allowed and not matcher.is_error(), matcher.get_error()
        if 256 in allowed:
            return out.decode()
        closers = [t for t in allowed if t in CLOSERS]
        solid = [t for t in allowed if t not in SPACE] or allowed
        token = rng.choice(closers if closers and rng.random() < 0.4 else solid)
        assert matcher.consume_token(token), matcher.get_error()
        out.append(token)
    raise AssertionError(f"no end after {limit} bytes: {out[:200]!r}")


@pytest.mark.parametrize("name", sorted(BY_NAME))
def test_what_llguidance_allows_validates(name):
    """The benchmark's check and the grammar agree: text the grammar allows parses and
    validates; only a date's 02-29 in a year without one may fail its `format`."""
    schema = BY_NAME[name].schema
    for seed in range(4):
        text = random_output(schema, seed)
        outcome, detail = constrained.check_output(text, schema)
        assert outcome == "valid" or (outcome == "format" and "-02-29' is not a 'date'" in detail), \
            (outcome, detail, text)


# ----------------------------------------------------------------------------- the benchmark's helpers
SIMPLE = {"type": "object", "properties": {"d": {"type": "string", "format": "date"},
                                           "n": {"type": "integer", "maximum": 3}},
          "required": ["d"], "additionalProperties": False}


def test_check_output_outcomes():
    assert constrained.check_output('{"d": "2024-02-29", "n": 1}', SIMPLE) == ("valid", "")
    outcome, detail = constrained.check_output(' {"d": "2023-02-29"}\n', SIMPLE)
    assert outcome == "format" and "is not a 'date'" in detail
    outcome, detail = constrained.check_output('{"d": "2024-01-01", "n": 7}', SIMPLE)
    assert outcome == "invalid" and detail.startswith("at /n:")
    outcome, detail = constrained.check_output('{"d": "2024-01-01", "n"', SIMPLE)
    assert outcome == "unparsable" and "char" in detail
    # A format llguidance does not enforce is not checked (jsonschema's "regex").
    assert constrained.check_output('"("', {"type": "string", "format": "regex"})[0] == "valid"


def test_spread():
    assert constrained.spread([3.0, 1.0, 2.0, 10.0]) == {"median": 2.5, "min": 1.0, "max": 10.0,
                                                         "n": 4}
    assert constrained.spread([])["median"] is None


def test_overhead_schema_cannot_end_before_the_token_budget():
    case = constrained.overhead_case(64, 5)
    assert case.schema["properties"]["records"]["minItems"] == 64
    assert case.prompt != constrained.overhead_case(64, 6).prompt
    assert json.dumps(case.schema) in constrained.user_message(case)
    # Each record takes more than one token of any tokenizer (no token spans a whole record), so
    # 64 records cannot fit into 64 tokens: the shortest text the grammar allows is long.
    assert len(random_output(case.schema, 0)) > 64 * len('{"sku":"ABC-1234","name":"x",')


def test_requests_with_and_without_a_constraint():
    case = BY_NAME["sentiment"]
    on = constrained.request(case, 100, constrained=True)
    off = constrained.request(case, 100, constrained=False, ignore_eos=True)
    assert json.loads(on.constraint.json_schema) == case.schema
    assert on.constraint.WhichOneof("kind") == "json_schema" and not on.stop.ignore_eos
    assert not off.HasField("constraint") and off.stop.ignore_eos
    for req in (on, off):
        assert req.sampling.temperature == 0 and req.stop.max_new_tokens == 100
        (message,) = req.messages.messages
        assert message.role == "user" and message.content.startswith(case.prompt)


class _FakeGateway(gateway_pb2_grpc.GatewayServiceServicer):
    """Generate only: under a JSON Schema, a text the grammar allows (cut at max_new_tokens, one
    byte a token); unconstrained, max_new_tokens filler tokens. Three tokens a chunk."""

    def Generate(self, request, context):
        budget = request.stop.max_new_tokens
        if request.HasField("constraint"):
            text = random_output(json.loads(request.constraint.json_schema), 0)
            kind, finish = "json_schema", common_pb2.FINISH_REASON_GRAMMAR_COMPLETE
            if len(text) > budget:
                text, finish = text[:budget], common_pb2.FINISH_REASON_LENGTH
        else:
            text, kind, finish = "x" * budget, "", common_pb2.FINISH_REASON_LENGTH
        data, utf8 = text.encode(), codecs.getincrementaldecoder("utf-8")()
        for i in range(0, len(data), 3):
            yield gateway_pb2.GenerateResponse(token_ids=list(data[i:i + 3]),
                                               text=utf8.decode(data[i:i + 3]))
        yield gateway_pb2.GenerateResponse(
            finish_reason=finish, usage=common_pb2.Usage(generated_tokens=len(data),
                                                          constraint_kind=kind),
            timings=common_pb2.Timings(tokens_per_second=1000.0))


@pytest.fixture
def fake_gateway():
    server = grpc.server(ThreadPoolExecutor(16))
    gateway_pb2_grpc.add_GatewayServiceServicer_to_server(_FakeGateway(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(0)


def test_the_client_side_against_a_fake_gateway(fake_gateway, capsys):
    """The benchmark's gRPC side end to end, with an in-process fake for the server."""
    cases = [BY_NAME[n] for n in ("sentiment", "coupon", "file_tree", "keywords_only")]
    validity = constrained.validity(fake_gateway, cases, 4000, concurrency=2)
    assert validity["outcomes"]["valid"] == 4 and validity["parsed"] == 4
    assert validity["finish_reasons"] == {"GRAMMAR_COMPLETE": 4}
    assert validity["kind_not_reported"] == 0
    short = constrained.validity(fake_gateway, cases[:1], 5, concurrency=1)
    assert short["outcomes"]["unparsable"] == 1 and short["finish_reasons"] == {"LENGTH": 1}

    compiled = constrained.compile_times(BYTES, cases, repeats=1)
    assert not compiled["errors"] and compiled["max_ms"] >= compiled["p50_ms"] > 0

    over = constrained.overhead(fake_gateway, max_new_tokens=12, concurrency=3, rounds=2,
                                sequential=2, log=lambda _line: None)
    assert set(over["batches"]) == {"1", "3"}
    for row in over["batches"].values():
        for side in ("unconstrained", "constrained"):
            assert row[side]["not_full_length"] == 0 and not row[side]["errors"]
            assert row[side]["finish_reasons"] == {"LENGTH": row[side]["streams"]}
            assert row[side]["total_tokens_per_s"]["n"] == 2
        assert row["ratio_total_tokens_per_s"] > 0

    constrained.print_report({"config": {"max_new_tokens": 4000}, "validity": short,
                              "compile": compiled, "overhead": over})
    printed = capsys.readouterr().out
    for marker in ("== 1. validity", "== 2. grammar compile", "== 3. overhead", "ratio c/u",
                   "unparsable sentiment"):
        assert marker in printed, printed
