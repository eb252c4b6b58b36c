"""Length limits and required fields as clients see them, through a real gateway and worker:
the finish reason at the context, limits that agree with each other, and empty identifiers."""

from __future__ import annotations

import grpc
import pytest
from shardlm.common.v1 import common_pb2
from shardlm.errors import ShardLMError
from shardlm.gateway.v1 import gateway_pb2

KV = common_pb2.KvCacheConfig(block_size=16, num_blocks=256)
CONTEXT = 512  # the test checkpoints' max_position_embeddings
CONTEXT_LENGTH = common_pb2.FINISH_REASON_CONTEXT_LENGTH


@pytest.fixture(scope="module")
def stub(live, llama_dir):
    list(live.stub.Load(gateway_pb2.LoadRequest(
        model_path=str(llama_dir), dtype=common_pb2.DTYPE_FLOAT32, kv_cache=KV)))
    return live.stub


def stream(chunks) -> tuple[list[int], gateway_pb2.DecodeResponse]:
    ids, last = [], None
    for chunk in chunks:
        ids += list(chunk.token_ids)
        last = chunk
    return ids, last


def decode(stub, session_id: str, max_new: int):
    return stream(stub.Decode(gateway_pb2.DecodeRequest(
        session_id=session_id,
        stop=common_pb2.StopConditions(max_new_tokens=max_new, ignore_eos=True))))


def rpc_error(call) -> ShardLMError:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return ShardLMError.from_rpc_error(err.value)


def prompt(n: int) -> gateway_pb2.TokenIds:
    return gateway_pb2.TokenIds(token_ids=[1] + [(11 * j) % 900 + 3 for j in range(n - 1)])


# ----------------------------------------------------------------------------- the context
def test_decode_past_the_context_finishes_with_context_length(stub):
    first = stub.Prefill(gateway_pb2.PrefillRequest(token_ids=prompt(500)))
    ids, last = decode(stub, first.session_id, 100)  # 501 tokens in the session, 11 fit
    assert len(ids) == CONTEXT - 501
    assert last.finish_reason == CONTEXT_LENGTH
    ids, last = decode(stub, first.session_id, 5)  # the context is full: nothing, at once
    assert ids == [] and last.finish_reason == CONTEXT_LENGTH
    stub.ResetCache(gateway_pb2.ResetCacheRequest(session_ids=[first.session_id]))


def test_chat_turn_past_the_context_finishes_with_context_length(stub):
    content = "the quick brown fox " * 200
    while True:  # a conversation that renders to a little under the context
        messages = gateway_pb2.ChatMessages(
            messages=[gateway_pb2.ChatMessage(role="user", content=content)])
        rendered = len(stub.Tokenize(gateway_pb2.TokenizeRequest(messages=messages)).token_ids)
        if rendered < CONTEXT - 20:
            break
        content = content[: len(content) * 9 // 10]
    first = stub.Prefill(gateway_pb2.PrefillRequest(messages=messages))
    ids, last = decode(stub, first.session_id, 100)
    assert rendered + 1 + len(ids) == CONTEXT
    assert last.finish_reason == CONTEXT_LENGTH
    stub.ResetCache(gateway_pb2.ResetCacheRequest(session_ids=[first.session_id]))


def test_generate_with_the_default_budget_finishes_at_the_context(stub):
    ids, last = stream(stub.Generate(gateway_pb2.GenerateRequest(
        token_ids=prompt(500), stop=common_pb2.StopConditions(ignore_eos=True))))
    assert len(ids) == CONTEXT - 500
    assert last.finish_reason == CONTEXT_LENGTH


def test_generate_that_fits_still_finishes_with_length(stub):
    ids, last = stream(stub.Generate(gateway_pb2.GenerateRequest(
        token_ids=prompt(500), stop=common_pb2.StopConditions(max_new_tokens=12,
                                                              ignore_eos=True))))
    assert len(ids) == 12 and last.finish_reason == common_pb2.FINISH_REASON_LENGTH


# ----------------------------------------------------------------------------- the limits agree
def test_advertised_max_new_tokens_fits_the_context(stub):
    info = stub.GetModelInfo(gateway_pb2.GetModelInfoRequest())
    assert info.max_context_length == CONTEXT
    assert info.max_new_tokens_limit == CONTEXT - 1  # the server's cap (4096) cannot be reached
    ids, last = stream(stub.Generate(gateway_pb2.GenerateRequest(
        token_ids=prompt(1), stop=common_pb2.StopConditions(
            max_new_tokens=info.max_new_tokens_limit, ignore_eos=True))))
    assert len(ids) == info.max_new_tokens_limit
    assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH


@pytest.mark.parametrize("rpc", ["Generate", "Decode"])
def test_max_new_tokens_beyond_the_context_names_the_field(stub, rpc):
    stop = common_pb2.StopConditions(max_new_tokens=600)
    if rpc == "Generate":
        request = gateway_pb2.GenerateRequest(token_ids=prompt(2), stop=stop)
    else:
        session = stub.Prefill(gateway_pb2.PrefillRequest(token_ids=prompt(2))).session_id
        request = gateway_pb2.DecodeRequest(session_id=session, stop=stop)
    error = rpc_error(lambda: list(getattr(stub, rpc)(request)))
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT
    assert error.reason == "INVALID_FIELD"  # not PROMPT_TOO_LONG: the prompt is fine
    violation = next(v for v in error.field_violations if v.field == "stop.max_new_tokens")
    assert str(CONTEXT - 1) in violation.description


# ----------------------------------------------------------------------------- empty identifiers
def test_decode_without_session_id_is_invalid_argument(stub):
    error = rpc_error(lambda: list(stub.Decode(gateway_pb2.DecodeRequest())))
    assert (error.code, error.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_FIELD")
    assert [v.field for v in error.field_violations] == ["session_id"]


def test_empty_reset_cache_says_what_is_missing(stub):
    error = rpc_error(lambda: stub.ResetCache(gateway_pb2.ResetCacheRequest()))
    assert (error.code, error.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_FIELD")
    [violation] = error.field_violations
    assert violation.field == "session_ids" and "not both" not in violation.description
    both = rpc_error(lambda: stub.ResetCache(gateway_pb2.ResetCacheRequest(
        session_ids=["x"], all=True)))
    assert "not both" in both.field_violations[0].description


def test_a_turn_refused_as_too_long_leaves_the_session_as_it_was(stub):
    first = stub.Prefill(gateway_pb2.PrefillRequest(token_ids=prompt(10)))
    error = rpc_error(lambda: stub.Prefill(gateway_pb2.PrefillRequest(
        session_id=first.session_id, token_ids=prompt(CONTEXT))))
    assert error.reason == "PROMPT_TOO_LONG"
    again = stub.Prefill(gateway_pb2.PrefillRequest(
        session_id=first.session_id, token_ids=gateway_pb2.TokenIds(token_ids=[7, 8])))
    assert again.usage.prompt_tokens == 10 + 1 + 2  # the refused turn is not in the history
    stub.ResetCache(gateway_pb2.ResetCacheRequest(session_ids=[first.session_id]))
