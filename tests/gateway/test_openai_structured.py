"""Structured output and tool calls as OpenAI apps use them: the official `openai` client through
SMG to a gateway serving the real default model (SmolLM2-135M-Instruct). A response_format JSON
schema gives JSON that validates; regex and EBNF ride in the extra body; a forced tool call
(tool_choice "required" or a named function) comes back as `tool_calls` whose arguments validate
against the function's schema; "auto" leaves the model free. Skipped without smg or openai."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from tests.gateway.smg_fixtures import SMG, default_model_behind_smg

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.skipif(SMG is None, reason="the smg router (PyPI smg) is not installed")

ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city"]}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}},
        "required": ["zone"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Time now",
                                           "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    log = tmp_path_factory.mktemp("smg-openai") / "smg.log"
    with default_model_behind_smg(log) as (base, model_id):
        yield openai.OpenAI(base_url=f"{base}/v1", api_key="unused"), model_id


def chat(client, **kwargs):
    api, model_id = client
    return api.chat.completions.create(model=model_id, messages=ASK, temperature=0,
                                       max_tokens=kwargs.pop("max_tokens", 80), **kwargs)


def test_response_format_json_schema_validates(client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "sunny": {"type": "boolean"}},
              "required": ["city", "sunny"]}
    reply = chat(client, response_format={"type": "json_schema", "json_schema": {
        "name": "forecast", "schema": schema}})
    jsonschema.validate(json.loads(reply.choices[0].message.content), schema)
    assert reply.choices[0].finish_reason == "stop"
    streamed = chat(client, stream=True, response_format={"type": "json_schema", "json_schema": {
        "name": "forecast", "schema": schema}})
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == reply.choices[0].message.content


def test_json_object_regex_and_ebnf(client):
    reply = chat(client, response_format={"type": "json_object"})
    assert isinstance(json.loads(reply.choices[0].message.content), dict)
    reply = chat(client, extra_body={"regex": "(Sunny|Rainy|Cloudy), [0-9]{1,2} degrees"})
    assert re.fullmatch("(Sunny|Rainy|Cloudy), [0-9]{1,2} degrees",
                        reply.choices[0].message.content)
    reply = chat(client, extra_body={"ebnf": 'root ::= "yes" | "no" | "maybe"'})
    assert reply.choices[0].message.content in ("yes", "no", "maybe")


@pytest.mark.parametrize("tool_choice, name", [
    ("required", None),
    ({"type": "function", "function": {"name": "get_time"}}, "get_time"),
    ({"type": "function", "function": {"name": "get_weather"}}, "get_weather"),
])
def test_forced_tool_calls_validate(client, tool_choice, name):
    reply = chat(client, tools=TOOLS, tool_choice=tool_choice)
    calls = reply.choices[0].message.tool_calls
    assert calls, reply.choices[0].message.content
    for call in calls:
        assert call.function.name in SCHEMAS and (name is None or call.function.name == name)
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    assert reply.choices[0].finish_reason == "tool_calls"


def test_auto_tool_choice_leaves_the_model_free(client):
    reply = chat(client, tools=TOOLS, tool_choice="auto", max_tokens=24)
    message = reply.choices[0].message
    assert message.content or message.tool_calls
