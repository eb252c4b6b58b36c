"""structural_tag_to_lark: the grammars it writes hold a real tokenizer's tokens to the structure
(texts that fit are accepted, texts that break it are refused), and bad input is refused with a
message naming the field."""

from __future__ import annotations

import json

import llguidance
import pytest

from shardlm_server.gateway.constraints.structural_tag import (
    MAX_DEPTH,
    MAX_TAGS,
    StructuralTagError,
    structural_tag_to_lark,
)
from shardlm_server.gateway.serve.default_model import default_model_path
from shardlm_server.gateway.text.tokenizer import Tokenizer

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
        "additionalProperties": False}
EMPTY = {"type": "object", "properties": {}, "additionalProperties": False}
WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
TIME = '{"name": "get_time", "arguments": {}}'


@pytest.fixture(scope="module")
def tokenizers() -> tuple[Tokenizer, llguidance.LLTokenizer]:
    tok = Tokenizer.from_pretrained(default_model_path())
    table = llguidance.LLTokenizer(tok._backend.to_str(), n_vocab=49152,
                                   eos_token=list(tok.eos_token_ids))
    return tok, table


def grammar(spec: dict) -> str:
    return structural_tag_to_lark(json.dumps(spec))


@pytest.fixture
def accepts(tokenizers):
    """accepts(spec, text): whether the grammar lets a model write `text` and stop there."""
    tok, table = tokenizers

    def check(spec: dict | str, text: str) -> bool:
        lark = spec if isinstance(spec, str) else grammar(spec)
        compiled = llguidance.LLMatcher.grammar_from_lark(lark)
        assert llguidance.LLMatcher.validate_grammar(compiled, table) == ""
        # The model's own tokenization first; the lexer may split a text another way, so
        # llguidance's tokenization of it counts too (either one being accepted is enough).
        for tokens in (tok.encode(text, add_special_tokens=False), table.tokenize_str(text)):
            matcher = llguidance.LLMatcher(table, compiled, log_level=0)
            if matcher.try_consume_tokens(tokens) == len(tokens) and matcher.is_accepting():
                return True
        return False

    return check


def tag(begin: str, content: dict, end: str) -> dict:
    return {"type": "tag", "begin": begin, "content": content, "end": end}


def json_content(schema: dict | bool) -> dict:
    return {"type": "json_schema", "json_schema": schema}


def call_tag(name: str, schema: dict) -> dict:
    return tag(f'{{"name": "{name}", "arguments": ', json_content(schema), "}")


def mistral(at_least_one: bool, **extra) -> dict:
    """What SMG sends for Mistral with tool_choice=required (at_least_one) or auto."""
    calls = {"type": "tags_with_separator", "separator": ", ",
             "tags": [call_tag("get_weather", CITY), call_tag("get_time", EMPTY)]}
    return {"format": {"type": "triggered_tags", "triggers": ["[TOOL_CALLS]"],
                       "tags": [tag("[TOOL_CALLS] [", calls, "]")],
                       "at_least_one": at_least_one, **extra}}


LEGACY = {"type": "structural_tag", "triggers": ["<function="], "structures": [
    {"begin": "<function=get_weather>", "schema": CITY, "end": "</function>"},
    {"begin": "<function=get_time>", "schema": EMPTY, "end": "</function>"}]}


# -- the legacy form ------------------------------------------------------------------------------

@pytest.mark.parametrize("text, ok", [
    ("", True),
    ("Just text, no call.", True),
    ('<function=get_weather>{"city": "Paris"}</function>', True),
    ('Let me look. <function=get_weather>{"city": "Paris"}</function> and '
     '<function=get_time>{}</function>\nDone.', True),
    ('Hi <function=get_news>{}</function>', False),  # no structure begins so
    ('<function=get_weather>{"town": "Paris"}</function>', False),  # off the schema
    ('<function=get_weather>{"city": "Paris"}', False),  # stopped before the end
    ('<function=get_time>{}</funct', False),
])
def test_legacy_form_two_structures(accepts, text, ok):
    assert accepts(LEGACY, text) is ok


def test_legacy_form_with_format_type_and_no_type_is_the_same():
    spec = dict(LEGACY)
    del spec["type"]
    assert grammar(spec) == grammar(LEGACY)


# -- triggered_tags -------------------------------------------------------------------------------

@pytest.mark.parametrize("text, ok", [
    (f"[TOOL_CALLS] [{WEATHER}]", True),
    (f"[TOOL_CALLS] [{WEATHER}, {TIME}]", True),
    (f"[TOOL_CALLS] [{WEATHER}] and some text after", True),
    (f"[TOOL_CALLS] [{WEATHER}] then [TOOL_CALLS] [{TIME}]", True),
    (f"Sure. [TOOL_CALLS] [{WEATHER}]", False),  # at_least_one: a tag right away
    ("", False),
    ("No call at all", False),
    (f"[TOOL_CALLS] [{WEATHER}, ]", False),
    ('[TOOL_CALLS] [{"name": "get_news", "arguments": {}}]', False),
])
def test_mistral_tool_choice_required_starts_with_the_tag(accepts, text, ok):
    assert accepts(mistral(at_least_one=True), text) is ok


@pytest.mark.parametrize("text, ok", [
    ("", True),
    ("No call at all", True),
    (f"Sure. [TOOL_CALLS] [{WEATHER}, {TIME}]", True),
    (f"[TOOL_CALLS] [{WEATHER}]", True),
    ("Sure. [TOOL_CALLS] [", False),
    ("Sure. [TOOL_CALLS] hello", False),  # a trigger must open a tag
])
def test_mistral_tool_choice_auto_allows_text_first(accepts, text, ok):
    assert accepts(mistral(at_least_one=False), text) is ok


@pytest.mark.parametrize("at_least_one, text, ok", [
    (False, f"Sure. [TOOL_CALLS] [{WEATHER}]", True),
    (False, "Only text", True),
    (False, f"[TOOL_CALLS] [{WEATHER}] more text", False),  # nothing after the first tag
    (True, f"[TOOL_CALLS] [{WEATHER}, {TIME}]", True),
    (True, f"[TOOL_CALLS] [{WEATHER}] more text", False),
    (True, f"[TOOL_CALLS] [{WEATHER}][TOOL_CALLS] [{TIME}]", False),
    (True, "", False),
])
def test_triggered_tags_stop_after_first(accepts, at_least_one, text, ok):
    assert accepts(mistral(at_least_one, stop_after_first=True), text) is ok


def test_triggered_tags_inside_a_tag_stop_at_its_end(accepts):
    inner = {"type": "triggered_tags", "triggers": ["<call>"],
             "tags": [tag("<call>", json_content(EMPTY), "</call>")]}
    spec = {"format": {"type": "sequence", "elements": [
        tag("<answer>", inner, "</answer>"), {"type": "const_string", "value": "!"}]}}
    assert accepts(spec, "<answer>text <call>{}</call> more</answer>!")
    assert accepts(spec, "<answer></answer>!")
    assert not accepts(spec, "<answer>text</answer> more</answer>!")


def test_triggers_stay_text_never_special_tokens():
    spec = {"format": {"type": "triggered_tags", "triggers": ["<|python_tag|>"],
                       "tags": [tag("<|python_tag|>", json_content(EMPTY), "<|eom_id|>")]}}
    lark = grammar(spec)
    assert '"<|python_tag|>"' in lark and '"<|eom_id|>"' in lark
    assert " <|python_tag|>" not in lark


# -- tags_with_separator --------------------------------------------------------------------------

def with_separator(**flags) -> dict:
    return {"format": {"type": "tags_with_separator", "separator": "\n", **flags, "tags": [
        tag("<weather>", json_content(CITY), "</weather>"),
        tag("<time>", json_content(EMPTY), "</time>")]}}


W, T = '<weather>{"city": "Oslo"}</weather>', "<time>{}</time>"


@pytest.mark.parametrize("flags, text, ok", [
    ({}, "", True),
    ({}, W, True),
    ({}, f"{W}\n{T}\n{W}", True),
    ({}, f"{W}{T}", False),  # the separator is needed
    ({}, f"text {W}", False),  # nothing but tags
    ({}, f"{W}\n", False),
    ({"at_least_one": True}, "", False),
    ({"at_least_one": True}, f"{T}\n{W}", True),
    ({"stop_after_first": True}, "", True),
    ({"stop_after_first": True}, T, True),
    ({"stop_after_first": True}, f"{T}\n{W}", False),
    ({"at_least_one": True, "stop_after_first": True}, W, True),
    ({"at_least_one": True, "stop_after_first": True}, "", False),
])
def test_tags_with_separator_two_tools(accepts, flags, text, ok):
    assert accepts(with_separator(**flags), text) is ok


# -- each format type -----------------------------------------------------------------------------

ODD_TEXT = 'say "hi"\\\n\x7f ✓ 😀'  # quotes, a backslash, a newline, DEL, non-ASCII


@pytest.mark.parametrize("fmt, good, bad", [
    ({"type": "const_string", "value": ODD_TEXT}, ODD_TEXT, "say hi"),
    (json_content(CITY), '{"city": "Rome"}', '{"city": 1}'),
    (json_content(True), '[1, {"a": null}]', "not json"),
    ({"type": "grammar", "grammar": 'start: "a" b+\nb: "b" | "}"'}, "ab}b", "a"),
    ({"type": "grammar", "grammar": 'root ::= "x" [0-9]+'}, "x42", "x"),  # GBNF
    ({"type": "regex", "pattern": r"\d{2}/\d{2}"}, "12/31", "12-31"),
    ({"type": "any_text"}, "anything at all\n</end>", None),
    ({"type": "any_text", "excluded_str": []}, "", None),
    ({"type": "sequence", "elements": [{"type": "const_string", "value": "Answer: "},
                                       {"type": "regex", "pattern": "[a-z]+"}]},
     "Answer: yes", "Answer: YES"),
    ({"type": "or", "elements": [{"type": "const_string", "value": "yes"},
                                 json_content({"type": "integer"})]}, "42", "maybe"),
    (tag("<n>", {"type": "regex", "pattern": "[0-9]+"}, "</n>"), "<n>7</n>", "<n>x</n>"),
])
def test_each_format_type(accepts, fmt, good, bad):
    spec = {"type": "structural_tag", "format": fmt}
    assert accepts(spec, good)
    if bad is not None:
        assert not accepts(spec, bad)


def test_any_text_in_a_tag_stops_at_the_end(accepts):
    think = {"format": tag("<think>", {"type": "any_text"}, "</think>")}
    assert accepts(think, "<think>a\nb < / think</think>")
    assert accepts(think, "<think></think>")
    assert not accepts(think, "<think>one</think>two</think>")
    assert not accepts(think, "<think>unfinished")


def test_any_text_before_a_literal_in_a_sequence_stops_there(accepts):
    spec = {"format": {"type": "sequence", "elements": [
        {"type": "any_text"}, tag("<call>", json_content(EMPTY), "</call>"),
        {"type": "any_text"}, {"type": "const_string", "value": "END"}]}}
    assert accepts(spec, "chat <call>{}</call> more chat END")
    assert not accepts(spec, "chat <call>oops</call> END")
    assert not accepts(spec, "chat <call>{}</call> END and on")


def test_any_text_excluded_strings(accepts):
    spec = {"format": tag("<t>", {"type": "any_text", "excluded_str": ["bad", "worse"]}, "</t>")}
    assert accepts(spec, "<t>good</t>")
    assert not accepts(spec, "<t>a bad one</t>")
    assert not accepts(spec, "<t>worse</t>")


def test_force_think_then_tool_calls(accepts):
    """xgrammar's own example: a reasoning tag, then text with triggered tool calls."""
    spec = {"format": {"type": "sequence", "elements": [
        tag("<think>", {"type": "any_text"}, "</think>"),
        {"type": "triggered_tags", "triggers": ["<function="],
         "tags": [tag("<function=get_time>", json_content(EMPTY), "</function>")]}]}}
    assert accepts(spec, "<think>hmm</think>Calling <function=get_time>{}</function> ok")
    assert not accepts(spec, "Calling <function=get_time>{}</function>")


def test_size_limits_at_the_edge_are_accepted(accepts):
    fmt: dict = {"type": "const_string", "value": "x"}
    for _ in range(MAX_DEPTH - 1):
        fmt = {"type": "sequence", "elements": [fmt]}
    assert accepts({"format": fmt}, "x")
    tags = [tag(f"<t{i}>", {"type": "const_string", "value": "."}, "") for i in range(MAX_TAGS)]
    assert accepts({"format": {"type": "tags_with_separator", "separator": ",", "tags": tags}},
                   "<t7>.,<t999>.")


# -- errors ---------------------------------------------------------------------------------------

def nested(levels: int) -> dict:
    fmt: dict = {"type": "const_string", "value": "x"}
    for _ in range(levels - 1):
        fmt = tag("<", fmt, ">")
    return {"format": fmt}


def triggered(triggers, *begins) -> dict:
    return {"format": {"type": "triggered_tags", "triggers": triggers,
                       "tags": [tag(b, json_content(EMPTY), "") for b in begins]}}


def const(value) -> dict:
    return {"format": {"type": "const_string", "value": value}}


TOO_MANY = {"format": {"type": "or", "elements": [
    tag("<a>", {"type": "const_string", "value": "x"}, "</a>")] * (MAX_TAGS + 1)}}


@pytest.mark.parametrize("text, expected", [
    ("{not json", "is not valid JSON"),
    ("[1, 2]", "the structural tag must be an object, not a list"),
    ('{"type": "json_schema", "format": {}}', 'type must be "structural_tag", not \'json_schema\''),
    ("{}", 'needs a "format" object, or "structures" and "triggers"'),
    ('"\\ud800"', "unpaired UTF-16 surrogate"),
    ("[" * 100_000 + "]" * 100_000, "is nested too deeply to read"),
    ({"format": []}, "format must be an object, not a list"),
    ({"format": {}}, "format.type is missing"),
    ({"format": {"type": 3}}, "format.type must be a string, not a number"),
    ({"format": {"type": "text"}}, "format.type 'text' is not one of: const_string"),
    ({"format": {"type": "const_string"}}, "format.value is missing"),
    (const(None), "format.value must be a string, not null"),
    ({"format": {"type": "json_schema"}}, "format.json_schema is missing"),
    ({"format": json_content("{}")}, "format.json_schema must be a JSON schema (an object or a "
                                     "boolean), not a string"),
    ({"format": json_content({"type": "foo"})}, "format.json_schema: failed to compile JSON "
                                                 "schema: Invalid type: foo"),
    ({"format": {"type": "regex", "pattern": "(["}},
     "format.pattern: invalid regex \"([\" (in regex): regex parse error: ([ error: unclosed"),
    ({"format": {"type": "regex", "pattern": "a\\"}}, "format.pattern ends in a lone backslash"),
    ({"format": {"type": "regex"}}, "format.pattern is missing"),
    ({"format": {"type": "grammar", "grammar": "start: nothing_here"}},
     'format.grammar: at 1(8): unknown name: "nothing_here"'),
    ({"format": {"type": "grammar", "grammar": 'start: "a"\n}\nx: "b"'}}, "format.grammar: "),
    ({"format": {"type": "any_text", "excluded_str": [""]}},
     "format.excluded_str must be a list of non-empty strings"),
    ({"format": {"type": "any_text", "excluded_str": "</a>"}},
     "format.excluded_str must be a list of non-empty strings"),
    ({"format": {"type": "sequence", "elements": []}}, "format.elements must not be empty"),
    ({"format": {"type": "or"}}, "format.elements is missing"),
    ({"format": {"type": "or", "elements": [{"type": "nope"}]}},
     "format.elements[0].type 'nope' is not one of"),
    ({"format": {"type": "tag", "begin": "<a>", "end": "</a>"}}, "format.content is missing"),
    ({"format": {"type": "tag", "begin": 1, "content": {}, "end": ""}},
     "format.begin must be a string, not a number"),
    ({"format": {"type": "tag", "begin": "", "content": {}}}, "format.end is missing"),
    ({"format": {"type": "tag", "begin": "", "content": {"type": "any_text"}, "end": []}},
     "format.end must be a string, not a list"),
    (triggered([], "<a>"), "format.triggers must not be empty"),
    ({"format": {"type": "triggered_tags", "triggers": ["<"], "tags": []}},
     "format.tags must not be empty"),
    ({"format": {"type": "triggered_tags", "triggers": ["<"]}}, "format.tags is missing"),
    ({"format": {"type": "triggered_tags", "tags": [tag("<a>", const("x")["format"], "")]}},
     "format.triggers is missing"),
    (triggered(["<function="], "<tool=a>"),
     "format.tags[0].begin '<tool=a>' must start with exactly one of the triggers "
     "['<function=']; it starts with none of them"),
    (triggered(["<f", "<fn"], "<fn=a>"), "it starts with 2 of them"),
    (triggered(["<f", "<g"], "<f=a>"), "format.triggers[1] '<g' begins no tag"),
    (triggered([""], "<a>"), "format.triggers[0] must be a non-empty string"),
    (triggered([7], "<a>"), "format.triggers[0] must be a non-empty string"),
    ({"format": {**triggered(["<"], "<a>")["format"], "at_least_one": "yes"}},
     "format.at_least_one must be a boolean, not a string"),
    ({"format": {"type": "triggered_tags", "triggers": ["<"], "tags": ["<a>"]}},
     "format.tags[0] must be an object, not a string"),
    ({"format": {"type": "triggered_tags", "triggers": ["<"],
                 "tags": [{"type": "const_string", "value": "<a>"}]}},
     'format.tags[0].type must be "tag"'),
    ({"format": {"type": "tags_with_separator", "tags": [tag("<a>", json_content(EMPTY), "")]}},
     "format.separator is missing"),
    ({"format": {"type": "tags_with_separator", "separator": ",",
                 "tags": [tag("<a>", json_content(EMPTY), "")], "stop_after_first": 1}},
     "format.stop_after_first must be a boolean, not a number"),
    ({"type": "structural_tag", "triggers": ["<f"]}, "structures is missing"),
    ({"structures": [], "triggers": ["<f"]}, "structures must not be empty"),
    ({"structures": [{"begin": "<f>", "schema": EMPTY, "end": ""}]}, "triggers is missing"),
    ({"structures": [{"begin": "<f>", "end": ""}], "triggers": ["<f"]},
     "structures[0].schema is missing"),
    ({"structures": [{"schema": EMPTY, "end": ""}], "triggers": ["<f"]},
     "structures[0].begin is missing"),
    ({"structures": [{"begin": "<g>", "schema": EMPTY, "end": ""}], "triggers": ["<f"]},
     "structures[0].begin '<g>' must start with exactly one of the triggers"),
    ({"structures": ["<f>"], "triggers": ["<f"]}, "structures[0] must be an object"),
    (nested(MAX_DEPTH + 1), f"formats nest deeper than {MAX_DEPTH} levels"),
    (TOO_MANY, f"has more than {MAX_TAGS} tags"),
])
def test_bad_input_is_refused_with_the_field_and_the_reason(text, expected):
    with pytest.raises(StructuralTagError) as caught:
        structural_tag_to_lark(text if isinstance(text, str) else json.dumps(text))
    message = str(caught.value)
    assert expected in message
    assert "Traceback" not in message and "\n" not in message
    assert isinstance(caught.value, ValueError)


def test_a_non_string_is_refused():
    with pytest.raises(StructuralTagError, match="must be a JSON text, not bytes"):
        structural_tag_to_lark(b"{}")  # type: ignore[arg-type]
