"""Two ShardLM replicas behind the Shepherd Model Gateway (SMG, PyPI `smg`), on loopback.

`smg launch` routes OpenAI-style HTTP to the replicas' engine service over `grpc://` URLs and
fetches the tokenizer from them (GetTokenizer): it is given no model path. A chat completion
through SMG, streamed or not, gives the greedy text of ShardLM's own Generate for the same chat;
requests with one x-shardlm-session header reach one replica (SMG's sticky sessions); with one
replica stopped, SMG serves on from the other. Skipped where `smg` is not installed.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
from shardlm.gateway.v1 import gateway_pb2

from tests.gateway.smg_fixtures import SMG, chat_checkpoint, loaded_gateway, smg_router

pytestmark = pytest.mark.skipif(SMG is None, reason="the smg router (PyPI smg) is not installed")

CHAT = [{"role": "user", "content": "To be, or not to be"}]
MAX_TOKENS = 12


def _http(url: str, body: dict | None = None, timeout: float = 60,
          headers: dict | None = None):
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data,
                                     headers={"content-type": "application/json",
                                              **(headers or {})})
    return urllib.request.urlopen(request, timeout=timeout)


def _visible(text: str) -> str:
    """ShardLM's stream writer ends a text cut inside a character with U+FFFD; SMG's drops the
    incomplete bytes. The tiny random model often ends that way; the rest must match."""
    return text.rstrip("\ufffd")


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    model = chat_checkpoint(tmp_path_factory.mktemp("smg-e2e-llama"))
    gateways = [loaded_gateway(model) for _ in range(2)]
    yield gateways
    for gateway in gateways:
        if gateway.thread.is_alive():
            gateway.close()


@pytest.fixture(scope="module")
def router(replicas, tmp_path_factory):
    log = tmp_path_factory.mktemp("smg") / "smg.log"
    with smg_router([f"grpc://{g.address}" for g in replicas], log, "--policy", "round_robin",
                    "--sticky-sessions", "--routing-key-headers", "x-shardlm-session",
                    "--health-check-interval-secs", "1", "--health-failure-threshold", "1") as up:
        yield up


def _reference(gateway) -> str:
    reply = gateway.stub.Generate(gateway_pb2.GenerateRequest(
        messages={"messages": CHAT}, sampling={"temperature": 0},
        stop={"max_new_tokens": MAX_TOKENS}))
    return "".join(m.text for m in reply)


def _chat(base: str, model_id: str, headers: dict | None = None) -> dict:
    body = {"model": model_id, "messages": CHAT, "max_tokens": MAX_TOKENS, "temperature": 0}
    return json.load(_http(f"{base}/v1/chat/completions", body, headers=headers))


def _chat_streamed(base: str, model_id: str) -> str:
    body = {"model": model_id, "messages": CHAT, "max_tokens": MAX_TOKENS, "temperature": 0,
            "stream": True}
    parts = []
    with _http(f"{base}/v1/chat/completions", body) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[len("data:"):])["choices"]:
                parts.append(choice.get("delta", {}).get("content") or "")
    return "".join(parts)


def test_models_lists_the_replicas_model(router):
    _, model_id = router
    assert model_id == "smg-e2e-llama0"  # the checkpoint folder's name


def test_chat_through_smg_matches_shardlm(replicas, router):
    base, model_id = router
    expected = _visible(_reference(replicas[0]))
    assert expected
    for _ in range(2):  # round robin: both replicas answer
        reply = _chat(base, model_id)
        assert _visible(reply["choices"][0]["message"]["content"]) == expected
        assert reply["usage"]["completion_tokens"] <= MAX_TOKENS
    assert _visible(_chat_streamed(base, model_id)) == expected


def _generate_calls(gateway) -> float:
    return gateway.metrics.value("shardlm_requests_total", {"method": "Generate", "code": "OK"})


def test_a_session_header_keeps_a_conversation_on_one_replica(replicas, router):
    base, model_id = router
    for session in ("conversation-a", "conversation-b"):
        before = [_generate_calls(g) for g in replicas]
        for _ in range(3):
            _chat(base, model_id, headers={"x-shardlm-session": session})
        served = [_generate_calls(g) - b for g, b in zip(replicas, before, strict=True)]
        assert sorted(served) == [0, 3], (session, served)


def test_smg_serves_on_when_a_replica_stops(replicas, router):
    base, model_id = router
    expected = _visible(_reference(replicas[0]))
    replicas[1].close()
    for _ in range(4):
        reply = _chat(base, model_id)
        assert _visible(reply["choices"][0]["message"]["content"]) == expected
