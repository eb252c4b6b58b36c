"""End to end over gRPC: gateway + worker process, against transformers on the same checkpoint."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from shardlm.common.v1 import common_pb2
from shardlm.errors import ShardLMError
from shardlm.gateway.v1 import gateway_pb2

from shardlm_server.gateway.text.tokenizer import Tokenizer
from tests.checkpoints import load_reference
from tests.gateway.held_workers import HELD_CALL_DEADLINE_S, workers_held

KV = common_pb2.KvCacheConfig(block_size=16, num_blocks=256)


def greedy(max_new: int, **stop) -> dict:
    return dict(sampling=common_pb2.SamplingParams(),
                stop=common_pb2.StopConditions(max_new_tokens=max_new, ignore_eos=True, **stop))


def collect(stream) -> tuple[list[int], str, gateway_pb2.GenerateResponse]:
    ids, text, last = [], "", None
    for chunk in stream:
        ids += list(chunk.token_ids)
        text += chunk.text
        last = chunk
    return ids, text, last


@pytest.fixture(scope="module")
def loaded(live, llama_dir):
    health = health_pb2_grpc.HealthStub(live.channel)
    status = health.Check(health_pb2.HealthCheckRequest()).status
    assert status == health_pb2.HealthCheckResponse.NOT_SERVING
    with pytest.raises(grpc.RpcError) as err:
        live.stub.Tokenize(gateway_pb2.TokenizeRequest(text="hi"))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    events = list(live.stub.Load(gateway_pb2.LoadRequest(
        model_path=str(llama_dir), dtype=common_pb2.DTYPE_FLOAT32, kv_cache=KV)))
    assert events[-1].HasField("model") and events[-1].capacity.num_blocks == 256
    assert any(e.HasField("progress") for e in events)
    status = health.Check(health_pb2.HealthCheckRequest()).status
    assert status == health_pb2.HealthCheckResponse.SERVING
    return Tokenizer.from_pretrained(llama_dir), load_reference(llama_dir)


def test_greedy_generate_matches_transformers(live, loaded):
    _tok, reference = loaded
    prompt = [1, 45, 300, 22, 7, 999, 31]
    ids, _text, last = collect(live.stub.Generate(gateway_pb2.GenerateRequest(
        token_ids=gateway_pb2.TokenIds(token_ids=prompt), **greedy(24))))
    with torch.no_grad():
        expected = reference.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                                      eos_token_id=None, pad_token_id=0)[0, len(prompt):]
    assert ids == expected.tolist()
    assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert last.usage.prompt_tokens == len(prompt) and last.usage.generated_tokens == 24
    assert last.timings.time_to_first_token_seconds > 0 and last.timings.tokens_per_second > 0
    assert live.kv_used() == 0


def test_concurrent_streams_are_batched_and_correct(live, loaded):
    prompts = [[1, 10 + i, 20 + 2 * i, 30] for i in range(16)]
    alone = [collect(live.stub.Generate(gateway_pb2.GenerateRequest(
        token_ids=gateway_pb2.TokenIds(token_ids=p), **greedy(12))))[0] for p in prompts[:3]]
    before = live.metrics.value("shardlm_decode_batch_size_sequences_sum")
    calls_before = live.metrics.value("shardlm_decode_batch_size_sequences_count")
    results: list = [None] * 16

    def run(i):
        results[i] = collect(live.stub.Generate(gateway_pb2.GenerateRequest(
            token_ids=gateway_pb2.TokenIds(token_ids=prompts[i]), **greedy(12))))[0]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(len(r) == 12 for r in results)
    assert results[:3] == alone
    summed = live.metrics.value("shardlm_decode_batch_size_sequences_sum") - before
    calls = live.metrics.value("shardlm_decode_batch_size_sequences_count") - calls_before
    assert summed / calls > 1.5  # sequences shared decode steps
    assert live.kv_used() == 0


def test_two_turn_session_reuses_cache_and_equals_fresh_prefill(live, loaded):
    stub = live.stub
    first = stub.Prefill(gateway_pb2.PrefillRequest(
        token_ids=gateway_pb2.TokenIds(token_ids=[1, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14])))
    assert first.usage.cached_tokens == 0 and first.usage.prompt_tokens == 11
    turn1 = [first.first_token.token_id] + collect(stub.Decode(gateway_pb2.DecodeRequest(
        session_id=first.session_id, stop=common_pb2.StopConditions(max_new_tokens=8,
                                                                    ignore_eos=True))))[0]
    second = stub.Prefill(gateway_pb2.PrefillRequest(
        session_id=first.session_id, token_ids=gateway_pb2.TokenIds(token_ids=[40, 41, 42])))
    history = [1, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14] + turn1 + [40, 41, 42]
    assert second.usage.prompt_tokens == len(history)
    assert second.usage.cached_tokens == len(history) - 4  # all but the last reply token + turn
    turn2 = [second.first_token.token_id] + collect(stub.Decode(gateway_pb2.DecodeRequest(
        session_id=first.session_id, stop=common_pb2.StopConditions(max_new_tokens=6,
                                                                    ignore_eos=True))))[0]
    fresh = collect(stub.Generate(gateway_pb2.GenerateRequest(
        token_ids=gateway_pb2.TokenIds(token_ids=history), **greedy(7))))[0]
    assert turn2 == fresh
    stub.ResetCache(gateway_pb2.ResetCacheRequest(session_ids=[first.session_id]))
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Decode(gateway_pb2.DecodeRequest(session_id=first.session_id)))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert live.kv_used() == 0


def test_cancel_and_deadline_free_blocks(live, loaded):
    request = gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(token_ids=[1, 2, 3]),
                                          **greedy(400))
    stream = live.stub.Generate(request)
    next(stream)
    stream.cancel()
    # The deadline falls mid-generation for certain: the gateway admits the request (its blocks
    # are reserved) while the worker is held still, so no token comes before the deadline.
    long_request = gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(token_ids=[1, 2, 3]),
                                               **greedy(500))
    with workers_held([h.process.pid for h in live.group.handles]), \
            pytest.raises(grpc.RpcError) as err:
        list(live.stub.Generate(long_request, timeout=HELD_CALL_DEADLINE_S))
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    deadline = time.monotonic() + 10
    while live.kv_used() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert live.kv_used() == 0


def test_stop_sequence_and_streamed_text(live, loaded):
    tok, _ref = loaded
    prompt = "你好，世界。天气很好。🙂"
    ids, text, last = collect(live.stub.Generate(gateway_pb2.GenerateRequest(
        text=prompt, **greedy(40))))
    assert text == tok.decode(ids)
    cut = text[len(text) // 2:][:3]
    if cut and "\ufffd" not in cut:
        _ids, stopped, last = collect(live.stub.Generate(gateway_pb2.GenerateRequest(
            text=prompt, **greedy(40, stop_sequences=[cut]))))
        assert stopped == text[: text.index(cut)]
        assert last.finish_reason == common_pb2.FINISH_REASON_STOP_SEQUENCE


def rich(err: grpc.RpcError) -> ShardLMError:
    return ShardLMError.from_rpc_error(err)


@pytest.mark.parametrize("request_kwargs,field,reason", [
    (dict(text="hi", sampling=common_pb2.SamplingParams(temperature=-1)),
     "sampling.temperature", "INVALID_FIELD"),
    (dict(text="hi", sampling=common_pb2.SamplingParams(top_p=1.5)), "sampling.top_p",
     "INVALID_FIELD"),
    (dict(text=""), "text", "EMPTY_PROMPT"),
    (dict(messages=gateway_pb2.ChatMessages(messages=[gateway_pb2.ChatMessage(
        role="wizard", content="x")])), "messages.messages[0].role", "INVALID_FIELD"),
    (dict(token_ids=gateway_pb2.TokenIds(token_ids=[5, 100000])), "token_ids.token_ids[1]",
     "TOKEN_OUT_OF_VOCABULARY"),
    (dict(text="hi", stop=common_pb2.StopConditions(max_new_tokens=10**6)),
     "stop.max_new_tokens", "INVALID_FIELD"),
    (dict(token_ids=gateway_pb2.TokenIds(token_ids=[5] * 500),
          stop=common_pb2.StopConditions(max_new_tokens=100)), "prompt", "PROMPT_TOO_LONG"),
])
def test_validation_errors(live, loaded, request_kwargs, field, reason):
    with pytest.raises(grpc.RpcError) as err:
        list(live.stub.Generate(gateway_pb2.GenerateRequest(**request_kwargs)))
    error = rich(err.value)
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT
    assert error.reason == reason
    assert field in [v.field for v in error.field_violations]
    if reason == "PROMPT_TOO_LONG":
        assert error.metadata["prompt_tokens"] == "500"
        assert error.metadata["max_context_length"] == "512"


def test_unknown_session_and_busy(live, loaded):
    with pytest.raises(grpc.RpcError) as err:
        list(live.stub.Decode(gateway_pb2.DecodeRequest(session_id="nope")))
    error = rich(err.value)
    assert (error.code, error.reason) == (grpc.StatusCode.NOT_FOUND, "SESSION_NOT_FOUND")
    assert error.resource == ("shardlm.session", "nope")


def test_session_survives_a_cancelled_decode_and_a_reset_ends_its_stream(live, loaded):
    stub = live.stub
    prompt = [1, 70, 71, 72, 73]
    # Everything is greedy, so the session's whole future is this one sequence.
    whole = collect(stub.Generate(gateway_pb2.GenerateRequest(
        token_ids=gateway_pb2.TokenIds(token_ids=prompt), **greedy(200))))[0]
    first = stub.Prefill(gateway_pb2.PrefillRequest(
        token_ids=gateway_pb2.TokenIds(token_ids=prompt)))
    stream = stub.Decode(gateway_pb2.DecodeRequest(
        session_id=first.session_id,
        stop=common_pb2.StopConditions(max_new_tokens=300, ignore_eos=True)))
    seen = list(next(stream).token_ids) + list(next(stream).token_ids)
    stream.cancel()
    # (a chunk may carry several tokens: CPU workers send a few fast steps to a message)
    assert [first.first_token.token_id] + seen == whole[:1 + len(seen)]
    time.sleep(0.3)  # the scheduler parks the session before the next step
    # The session keeps what the server sent before it saw the cancel (a client may not have
    # read all of it): the next Decode continues the same sequence from exactly that point.
    more = collect(stub.Decode(gateway_pb2.DecodeRequest(
        session_id=first.session_id,
        stop=common_pb2.StopConditions(max_new_tokens=5, ignore_eos=True))))[0]
    starts = [j for j in range(1 + len(seen), len(whole) - 4) if whole[j:j + 5] == more]
    assert starts, (more, whole)
    stream = stub.Decode(gateway_pb2.DecodeRequest(
        session_id=first.session_id,
        stop=common_pb2.StopConditions(max_new_tokens=400, ignore_eos=True)))
    next(stream)
    stub.ResetCache(gateway_pb2.ResetCacheRequest(session_ids=[first.session_id]))
    last = list(stream)[-1]
    assert last.finish_reason == common_pb2.FINISH_REASON_CANCELLED
    deadline = time.monotonic() + 5
    while live.kv_used() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert live.kv_used() == 0
