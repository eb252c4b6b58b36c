"""The Python SDK (shardlm.client) against a live gateway over a real worker process, plus an
in-process fake gateway for what a healthy server cannot show: retries, auth metadata and TLS."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import time
from concurrent import futures
from types import MappingProxyType, SimpleNamespace

import grpc
import jsonschema
import pytest
from shardlm.client import AsyncClient, ChatMessage, Client, Usage, _common, _sync, _types
from shardlm.client import constraints as cs
from shardlm.common.v1 import common_pb2
from shardlm.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
    ShardLMError,
    UnavailableError,
)
from shardlm.gateway.v1 import gateway_pb2, gateway_pb2_grpc

from shardlm_server.gateway.api.runtime import Limits
from tests.gateway.conftest import LiveGateway

KV = common_pb2.KvCacheConfig(block_size=16, num_blocks=128)
PROMPT = [1, 45, 300, 22, 7, 999, 31]
SCHEMA = {"type": "object", "properties": {"word": {"type": "string", "maxLength": 5},
                                           "ok": {"type": "boolean"}},
          "required": ["word", "ok"], "additionalProperties": False}
WORDS = "( (to|be)){2}"


@pytest.fixture(scope="module")
def server():
    gateway = LiveGateway(1, Limits(session_idle_timeout_s=600))
    yield gateway
    gateway.close()


@pytest.fixture(scope="module")
def client(server):
    with Client(server.address, timeout=60) as sdk:
        yield sdk


@pytest.fixture(scope="module")
def loaded(client, llama_dir):
    assert client.health() is False  # NOT_SERVING until a model is loaded
    assert client.model_info().loaded is False
    with pytest.raises(FailedPreconditionError) as err:
        client.tokenize("hi")
    assert err.value.reason == "MODEL_NOT_LOADED"
    events: list[tuple[float, str]] = []
    info = client.load(llama_dir, dtype="float32", kv_cache=KV,
                       progress=lambda fraction, text: events.append((fraction, text)))
    assert events and all(0.0 <= fraction <= 1.0 for fraction, _ in events)
    assert info.architecture == "LlamaForCausalLM" and info.dtype == "float32"
    assert info.kv_cache is not None and info.kv_cache.num_blocks == 128
    assert info.eos_token_ids == [2] and info.bos_token_id == 1
    return info


def test_sync_stream_joins_to_collected_completion(client, loaded):
    chunks = list(client.stream_generate(PROMPT, max_new_tokens=12, ignore_eos=True))
    whole = client.generate(PROMPT, max_new_tokens=12, ignore_eos=True)
    assert [c.finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1].finish_reason == whole.finish_reason == "length"
    assert [t for c in chunks for t in c.token_ids] == whole.token_ids and len(whole.token_ids) == 12
    assert "".join(c.text for c in chunks) == whole.text
    assert whole.usage.prompt_tokens == len(PROMPT) and whole.usage.generated_tokens == 12
    assert chunks[-1].usage == whole.usage and whole.timings.total_seconds > 0
    text = client.generate("To be, or not to be", max_new_tokens=5, ignore_eos=True)
    assert text.usage.prompt_tokens == len(client.tokenize("To be, or not to be"))


def test_closing_a_stream_cancels_generation(server, client, loaded):
    def cancelled() -> float:
        return server.metrics.value("shardlm_requests_total",
                                    {"method": "Generate", "code": "CANCELLED"})

    before = cancelled()
    stream = client.stream_generate(PROMPT, max_new_tokens=400, ignore_eos=True)
    assert next(stream).token_ids
    stream.close()
    deadline = time.monotonic() + 10
    while (cancelled() == before or server.kv_used()) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert cancelled() == before + 1 and server.kv_used() == 0


def test_async_client_streams_like_the_sync_one(server, client, loaded):
    expected = client.generate(PROMPT, max_new_tokens=10, ignore_eos=True)

    async def run():
        async with AsyncClient(server.address, timeout=60) as sdk:
            assert await sdk.health() is True
            chunks = [c async for c in sdk.stream_generate(PROMPT, max_new_tokens=10,
                                                           ignore_eos=True)]
            whole = await sdk.generate(PROMPT, max_new_tokens=10, ignore_eos=True)
            with pytest.raises(InvalidArgumentError) as err:
                await sdk.generate(PROMPT, temperature=-1.0)
            first = await sdk.prefill(PROMPT)
            turn = [c async for c in sdk.stream_decode(first.session_id, max_new_tokens=9,
                                                       ignore_eos=True)]
            assert await sdk.reset_cache([first.session_id]) == 1
            return chunks, whole, err.value, [first.first_token.id] + [
                t for c in turn for t in c.token_ids], await sdk.tokenize("To be")

    chunks, whole, error, session_ids, tokens = asyncio.run(run())
    assert [t for c in chunks for t in c.token_ids] == whole.token_ids == expected.token_ids
    assert "".join(c.text for c in chunks) == whole.text == expected.text
    assert "sampling.temperature" in [v.field for v in error.field_violations]
    assert session_ids == expected.token_ids  # prefill + decode continues greedily alike
    assert tokens == client.tokenize("To be")


def test_invalid_sampling_raises_typed_error_with_field(client, loaded):
    with pytest.raises(InvalidArgumentError) as err:
        client.generate("hello", temperature=-1.0)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling.temperature" in [v.field for v in err.value.field_violations]
    with pytest.raises(InvalidArgumentError) as err:  # caught client-side: uint64 field
        client.stream_generate("hello", seed=-1)
    assert [v.field for v in err.value.field_violations] == ["sampling.seed"]


def test_two_turn_session_reuses_cache_then_reset(client, loaded):
    first = client.prefill([1, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14])
    assert first.usage.cached_tokens == 0 and first.usage.prompt_tokens == 11
    turn1 = client.decode(first.session_id, max_new_tokens=8, ignore_eos=True)
    assert len(turn1.token_ids) == 8 and turn1.finish_reason == "length"
    second = client.prefill([40, 41, 42], session_id=first.session_id)
    assert second.session_id == first.session_id
    assert second.usage.cached_tokens > 0
    chunks = list(client.stream_decode(first.session_id, max_new_tokens=6, ignore_eos=True))
    turn2 = [second.first_token.id] + [t for c in chunks for t in c.token_ids]
    history = [1, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, first.first_token.id, *turn1.token_ids,
               40, 41, 42]
    assert turn2 == client.generate(history, max_new_tokens=7, ignore_eos=True).token_ids
    assert client.reset_cache(first.session_id) == 1
    with pytest.raises(NotFoundError) as err:
        client.decode(first.session_id, max_new_tokens=2)
    assert err.value.reason == "SESSION_NOT_FOUND"


def test_logprobs_tokenize_and_model_info(client, loaded):
    out = client.generate(PROMPT, max_new_tokens=4, ignore_eos=True, logprobs=True,
                          top_logprobs=3)
    assert [lp.chosen.token_id for lp in out.logprobs] == out.token_ids
    assert all(len(lp.top) == 3 and lp.top[0].token_id == lp.chosen.token_id
               for lp in out.logprobs)  # greedy: the chosen token is the most likely one
    ids = client.tokenize("To be, or not to be")
    assert isinstance(ids, list) and len(ids.tokens) == len(ids) and ids[0] == 1
    assert client.tokenize("To be, or not to be", add_special_tokens=False) == ids[1:]
    info = client.model_info()
    assert info.loaded and info.model is not None and info.model.vocab_size == 1000
    assert info.max_context_length > 0 and info.max_new_tokens_limit > 0 and info.server_version


def test_load_report(client, loaded):
    client.generate(PROMPT, max_new_tokens=4, ignore_eos=True)
    report = client.load_report()
    assert report.loaded and report.block_size > 0 and report.max_running_sequences > 0
    assert report.kv_blocks_used + report.kv_blocks_free == report.kv_blocks_total == 128
    assert report.generated_tokens_per_second > 0  # four tokens in the last seconds
    assert 0 <= report.prefix_cache_hit_rate <= 1 and report.waiting_uncached_prompt_tokens == 0


def test_tokenize_gives_each_tokens_bytes(client, loaded):
    text = "héllo, wörld"
    tokens = client.tokenize(text, add_special_tokens=False)
    assert len(tokens.token_bytes) == len(tokens) == len(tokens.texts)
    assert b"".join(tokens.token_bytes).decode() == text


# ---------------------------------------------------------------------- constrained decoding
def test_constrained_generate_sync(client, loaded):
    out = client.generate(PROMPT, max_new_tokens=32, constraint=cs.choice(["yes", "no"]))
    assert out.text in ("yes", "no") and out.finish_reason == "grammar_complete"
    assert out.usage.constraint_kind == "choice"
    chunks = list(client.stream_generate(PROMPT, max_new_tokens=64,
                                         constraint=cs.json_schema(SCHEMA)))
    assert chunks[-1].finish_reason == "grammar_complete"
    assert chunks[-1].usage is not None and chunks[-1].usage.constraint_kind == "json_schema"
    jsonschema.validate(json.loads("".join(c.text for c in chunks)), SCHEMA)
    plain = client.generate(PROMPT, max_new_tokens=4, ignore_eos=True)
    assert plain.usage.constraint_kind == "" and plain.finish_reason == "length"
    with pytest.raises(InvalidArgumentError) as err:
        client.generate(PROMPT, constraint=cs.regex("a(b"))
    assert err.value.reason == "INVALID_CONSTRAINT"
    assert [v.field for v in err.value.field_violations] == ["constraint.regex"]


def test_a_session_turn_keeps_its_constraint_sync(client, loaded):
    choices = ["sea of troubles", "slings and arrows"]
    first = client.prefill(PROMPT, constraint=cs.choice(choices), temperature=0.0)
    assert first.usage.constraint_kind == "choice"
    text = first.first_token.text
    for _ in range(20):  # one token per call: the turn's constraint goes on where it stopped
        step = client.decode(first.session_id, max_new_tokens=1)
        text += step.text
        if step.finish_reason == "grammar_complete":
            break
    assert text in choices and step.usage.constraint_kind == "choice"
    # A Decode's constraint replaces the turn's; an empty Constraint removes it.
    chunks = list(client.stream_decode(first.session_id, constraint=cs.regex(WORDS)))
    assert re.fullmatch(WORDS, "".join(c.text for c in chunks))
    assert chunks[-1].finish_reason == "grammar_complete"
    free = client.decode(first.session_id, max_new_tokens=3, ignore_eos=True,
                         constraint=common_pb2.Constraint())
    assert free.finish_reason == "length" and free.usage.constraint_kind == ""
    assert client.reset_cache(first.session_id) == 1


def test_constrained_calls_async(server, loaded):
    choices = ["sea of troubles", "slings and arrows"]

    async def run():
        async with AsyncClient(server.address, timeout=60) as sdk:
            out = await sdk.generate(PROMPT, max_new_tokens=32,
                                     constraint=cs.choice(["yes", "no"]))
            chunks = [c async for c in sdk.stream_generate(
                PROMPT, max_new_tokens=64, constraint=cs.json_schema(json.dumps(SCHEMA)))]
            first = await sdk.prefill(PROMPT, constraint=cs.choice(choices))
            turn = [c async for c in sdk.stream_decode(first.session_id, max_new_tokens=40)]
            again = await sdk.decode(first.session_id, constraint=cs.grammar(
                'root ::= " to" | " be"'))  # GBNF
            free = await sdk.decode(first.session_id, max_new_tokens=2, ignore_eos=True,
                                    constraint=cs.unconstrained())
            await sdk.reset_cache(first.session_id)
            return out, chunks, first, turn, again, free

    out, chunks, first, turn, again, free = asyncio.run(run())
    assert out.text in ("yes", "no") and out.finish_reason == "grammar_complete"
    assert out.usage.constraint_kind == "choice"
    jsonschema.validate(json.loads("".join(c.text for c in chunks)), SCHEMA)
    assert chunks[-1].usage is not None and chunks[-1].usage.constraint_kind == "json_schema"
    assert first.first_token.text + "".join(c.text for c in turn) in choices
    assert turn[-1].finish_reason == "grammar_complete"
    assert again.text in (" to", " be") and again.usage.constraint_kind == "grammar"
    assert free.finish_reason == "length" and free.usage.constraint_kind == ""


def test_constraint_constructors_build_the_proto():
    C = common_pb2.Constraint
    assert cs.json_schema(SCHEMA) == C(json_schema=json.dumps(SCHEMA))
    assert json.loads(cs.json_schema(MappingProxyType({"type": "string"})).json_schema) == {
        "type": "string"}
    assert cs.json_schema('{"type":"integer"}') == C(json_schema='{"type":"integer"}')  # as is
    assert cs.json_schema(True) == C(json_schema="true")
    assert cs.json_object() == C(json_object=True)
    assert cs.regex("[0-9]+") == C(regex="[0-9]+")
    assert cs.grammar('root ::= "a"') == C(grammar='root ::= "a"')
    assert cs.choice(("yes", "no")) == C(choice=common_pb2.ChoiceConstraint(choices=["yes", "no"]))
    tag = {"type": "structural_tag", "triggers": ["<f"], "structures": []}
    assert json.loads(cs.structural_tag(tag).structural_tag) == tag
    assert cs.structural_tag('{"format": {}}') == C(structural_tag='{"format": {}}')
    assert cs.unconstrained() == C() and cs.unconstrained().WhichOneof("kind") is None
    for kind, built in [("json_schema", cs.json_schema(False)), ("json_object", cs.json_object()),
                        ("regex", cs.regex("x")), ("grammar", cs.grammar("start: \"x\"")),
                        ("choice", cs.choice(["x"])), ("structural_tag", cs.structural_tag("{}"))]:
        assert built.WhichOneof("kind") == kind
    with pytest.raises(TypeError):
        cs.choice("yes")  # a bare string is not a list of choices
    with pytest.raises(TypeError):
        cs.json_schema(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        cs.structural_tag(True)  # type: ignore[arg-type]


def test_requests_carry_the_constraint():
    stop = _common.stop_conditions(4, None, None, False)
    choice = cs.choice(["a", "b"])
    request = _common.generate_request("hi", None, stop, None, choice)
    assert request.HasField("constraint") and request.constraint == choice
    assert not _common.generate_request("hi", None, stop, None).HasField("constraint")
    prefill = _common.prefill_request("hi", None, None, {}, cs.json_object())
    assert prefill.constraint.json_object and prefill.constraint.WhichOneof("kind")
    assert not _common.prefill_request("hi", None, None, {}).HasField("constraint")
    # Decode: None leaves the field unset (the turn's constraint continues); an empty
    # Constraint is sent as set (it removes the session's constraint).
    assert not _common.decode_request("s", stop, {}, None).HasField("constraint")
    decode = _common.decode_request("s", stop, {}, common_pb2.Constraint())
    assert decode.HasField("constraint") and decode.constraint.WhichOneof("kind") is None
    assert _common.decode_request("s", stop, {}, cs.regex("x")).constraint.regex == "x"
    with pytest.raises(TypeError, match="constraints"):
        _common.generate_request("hi", None, stop, None,
                                 {"regex": "x"})  # type: ignore[arg-type]
    with Client("127.0.0.1:1") as sdk, pytest.raises(TypeError):
        sdk.stream_generate("hi", constraint={"choice": ["a"]})  # type: ignore[arg-type]


def test_usage_and_finish_reason_of_a_constrained_generation():
    usage = common_pb2.Usage(prompt_tokens=3, generated_tokens=2, constraint_kind="regex")
    assert _types.usage_of(usage) == Usage(3, 0, 2, "regex")
    assert Usage().constraint_kind == ""
    assert _types.finish_reason(common_pb2.FINISH_REASON_GRAMMAR_COMPLETE) == "grammar_complete"
    chunk = _types.chunk_of(gateway_pb2.DecodeResponse(
        token_ids=[4], text="x", finish_reason=common_pb2.FINISH_REASON_GRAMMAR_COMPLETE,
        usage=usage))
    assert chunk.finish_reason == "grammar_complete" and chunk.usage == Usage(3, 0, 2, "regex")


def test_chat_messages_are_accepted_as_dicts_or_dataclasses():
    request = _common.tokenize_request(
        [ChatMessage("system", "be brief"), {"role": "user", "content": "hi"}], None)
    assert [(m.role, m.content) for m in request.messages.messages] == [
        ("system", "be brief"), ("user", "hi")]
    with pytest.raises(InvalidArgumentError) as err:
        _common.tokenize_request([{"role": "user"}], None)
    assert err.value.field_violations[0].field == "messages[0].content"


def test_unreachable_address_raises_unavailable_after_retries(monkeypatch):
    waits: list[float] = []
    monkeypatch.setattr(_sync, "time", SimpleNamespace(sleep=waits.append))
    with Client("127.0.0.1:1", max_retries=2, retry_backoff=0.01) as sdk:
        with pytest.raises(UnavailableError):
            sdk.tokenize("hi")
        assert len(waits) == 2 and all(0 < w <= 0.02 for w in waits)
        waits.clear()
        with pytest.raises(UnavailableError):
            sdk.prefill("hi")  # the connection failed: nothing was done, so retried too
        assert len(waits) == 2


# ---------------------------------------------------------------------------- fake gateway
def _unavailable(reason: str = "WORKER_UNAVAILABLE", retry: float | None = 0.01) -> ShardLMError:
    return UnavailableError("try later", reason=reason, retry_after_s=retry)


class FakeGateway(gateway_pb2_grpc.GatewayServiceServicer):
    """Scripted failures: each method pops the next error of its list before answering."""

    def __init__(self) -> None:
        self.fail: dict[str, list[ShardLMError]] = {}
        self.fail_mid_stream: ShardLMError | None = None
        self.calls: dict[str, int] = {}
        self.auth: list[str | None] = []

    def _enter(self, name, context):
        self.calls[name] = self.calls.get(name, 0) + 1
        self.auth.append(dict(context.invocation_metadata()).get("authorization"))
        if self.fail.get(name):
            context.abort_with_status(self.fail[name].pop(0).to_grpc_status())

    def Tokenize(self, request, context):
        self._enter("Tokenize", context)
        return gateway_pb2.TokenizeResponse(token_ids=[7, 8], tokens=["a", "b"])

    def Prefill(self, request, context):
        self._enter("Prefill", context)
        return gateway_pb2.PrefillResponse(session_id="s1")

    def Generate(self, request, context):
        self._enter("Generate", context)
        yield gateway_pb2.GenerateResponse(token_ids=[5], text="x")
        if self.fail_mid_stream is not None:
            context.abort_with_status(self.fail_mid_stream.to_grpc_status())
        yield gateway_pb2.GenerateResponse(token_ids=[6], text="y",
                                           finish_reason=common_pb2.FINISH_REASON_LENGTH)


@pytest.fixture
def fake():
    servicer = FakeGateway()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    gateway_pb2_grpc.add_GatewayServiceServicer_to_server(servicer, server)
    servicer.port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer
    server.stop(0)


def test_retry_rules_on_a_scripted_server(fake, monkeypatch):
    waits: list[float] = []
    monkeypatch.setattr(_sync, "time", SimpleNamespace(sleep=waits.append))
    with Client(f"127.0.0.1:{fake.port}", retry_backoff=0.01, auth_token="tok") as sdk:
        fake.fail["Tokenize"] = [_unavailable(retry=0.25), _unavailable(retry=0.25)]
        assert sdk.tokenize("x") == [7, 8] and fake.calls["Tokenize"] == 3
        assert waits == [0.25, 0.25]  # RetryInfo's delay won over the client's own backoff
        assert set(fake.auth) == {"Bearer tok"}
        fake.fail["Generate"] = [_unavailable()]  # before the first chunk: retried
        assert sdk.generate("x").text == "xy" and fake.calls["Generate"] == 2
        fake.fail_mid_stream = _unavailable()  # after a chunk: never retried
        stream = sdk.stream_generate("x")
        assert next(stream).text == "x"
        with pytest.raises(UnavailableError):
            next(stream)
        assert fake.calls["Generate"] == 3
        fake.fail["Prefill"] = [_unavailable()]  # stateful and the server acted: not retried
        with pytest.raises(UnavailableError):
            sdk.prefill("x")
        fake.fail["Prefill"] = [_unavailable("DRAINING")]  # draining did nothing: retried
        assert sdk.prefill("x").session_id == "s1" and fake.calls["Prefill"] == 3
        fake.fail["Tokenize"] = [ResourceExhaustedError("full", reason="QUEUE_FULL")]
        with pytest.raises(ResourceExhaustedError):  # no RetryInfo: waiting is not advised
            sdk.tokenize("x")


def test_async_retry_rules_on_a_scripted_server(fake):
    async def run():
        async with AsyncClient(f"127.0.0.1:{fake.port}", retry_backoff=0.01) as sdk:
            fake.fail["Tokenize"] = [_unavailable(retry=None)]
            assert await sdk.tokenize("x") == [7, 8]
            fake.fail_mid_stream = _unavailable()
            texts = []
            with pytest.raises(UnavailableError):
                async for chunk in sdk.stream_generate("x"):
                    texts.append(chunk.text)
            return texts

    assert asyncio.run(run()) == ["x"]
    assert fake.calls == {"Tokenize": 2, "Generate": 1} and fake.auth == [None] * 3


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_tls_with_bearer_token(tmp_path):
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost",
                    "-keyout", str(tmp_path / "key.pem"), "-out", str(tmp_path / "cert.pem")],
                   check=True, capture_output=True)
    key, cert = (tmp_path / "key.pem").read_bytes(), (tmp_path / "cert.pem").read_bytes()
    servicer = FakeGateway()
    server = grpc.server(futures.ThreadPoolExecutor(2))
    gateway_pb2_grpc.add_GatewayServiceServicer_to_server(servicer, server)
    port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials([(key, cert)]))
    server.start()
    try:
        name = [("grpc.ssl_target_name_override", "localhost")]
        with Client(f"127.0.0.1:{port}", root_certificates=cert, auth_token="s3cret",
                    options=name) as sdk:
            assert sdk.tokenize("x") == [7, 8]
        assert servicer.auth == ["Bearer s3cret"]
        with Client(f"127.0.0.1:{port}", max_retries=0) as plain:  # plaintext to a TLS port
            with pytest.raises(UnavailableError):
                plain.tokenize("x")
    finally:
        server.stop(0)
