"""Session lifetime: idle expiry, LRU eviction under KV pressure and the invisible rebuild."""

from __future__ import annotations

import time

import grpc
import pytest
from shardlm.common.v1 import common_pb2
from shardlm.gateway.v1 import gateway_pb2

from shardlm_server.gateway.api.runtime import Limits
from tests.gateway.conftest import LiveGateway

BLOCKS = 12  # block size 16: room for three sessions of ~60 tokens, not four


@pytest.fixture(scope="module")
def small(llama_dir):
    gateway = LiveGateway(1, Limits(session_idle_timeout_s=2.0))
    list(gateway.stub.Load(gateway_pb2.LoadRequest(
        model_path=str(llama_dir), dtype=common_pb2.DTYPE_FLOAT32,
        kv_cache=common_pb2.KvCacheConfig(block_size=16, num_blocks=BLOCKS))))
    yield gateway
    gateway.close()


def ids(stream) -> list[int]:
    return [t for chunk in stream for t in chunk.token_ids]


def prefill(stub, tokens, session_id=""):
    return stub.Prefill(gateway_pb2.PrefillRequest(
        session_id=session_id, token_ids=gateway_pb2.TokenIds(token_ids=tokens)))


def decode(stub, session_id, n):
    return ids(stub.Decode(gateway_pb2.DecodeRequest(
        session_id=session_id, stop=common_pb2.StopConditions(max_new_tokens=n, ignore_eos=True))))


def test_lru_idle_session_is_evicted_and_rebuilt_invisibly(small):
    stub = small.stub
    prompts = [[1] + [10 * k + j for j in range(1, 50)] for k in range(1, 5)]
    sessions = [prefill(stub, p) for p in prompts[:3]]  # 3 x 4 blocks: the cache is full
    assert small.kv_used() == BLOCKS
    fourth = prefill(stub, prompts[3])  # evicts the least recently used idle session: the first
    assert fourth.usage.cached_tokens == 0
    history = prompts[0] + [sessions[0].first_token.token_id]
    reply = decode(stub, sessions[0].session_id, 4)  # rebuilt from its history, same answer
    fresh = ids(stub.Generate(gateway_pb2.GenerateRequest(
        token_ids=gateway_pb2.TokenIds(token_ids=history),
        stop=common_pb2.StopConditions(max_new_tokens=4, ignore_eos=True))))
    assert reply == fresh
    again = prefill(stub, [7, 8], sessions[0].session_id)
    assert again.usage.prompt_tokens == len(history) + 4 + 2
    assert again.usage.cached_tokens == len(history) + 3  # rebuilt cache is reused again
    stub.ResetCache(gateway_pb2.ResetCacheRequest(all=True))
    assert small.kv_used() == 0


def test_idle_sessions_expire(small):
    first = prefill(small.stub, [1, 2, 3, 4])
    time.sleep(3.5)
    with pytest.raises(grpc.RpcError) as err:
        decode(small.stub, first.session_id, 2)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert small.kv_used() == 0


def test_long_prompt_is_prefilled_in_chunks_with_the_same_result(llama_dir):
    gateway = LiveGateway(1, Limits(prefill_token_budget=32))
    try:
        list(gateway.stub.Load(gateway_pb2.LoadRequest(
            model_path=str(llama_dir), dtype=common_pb2.DTYPE_FLOAT32,
            kv_cache=common_pb2.KvCacheConfig(block_size=16, num_blocks=64))))
        prompt = [1] + [(7 * j) % 900 + 3 for j in range(150)]
        before = gateway.metrics.value("shardlm_prefill_batch_tokens_count")
        chunked = ids(gateway.stub.Generate(gateway_pb2.GenerateRequest(
            token_ids=gateway_pb2.TokenIds(token_ids=prompt),
            stop=common_pb2.StopConditions(max_new_tokens=6, ignore_eos=True))))
        assert gateway.metrics.value("shardlm_prefill_batch_tokens_count") - before >= 5
    finally:
        gateway.close()
    import torch

    from tests.checkpoints import load_reference

    with torch.no_grad():
        expected = load_reference(llama_dir).generate(
            torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=None,
            pad_token_id=0)[0, len(prompt):].tolist()
    assert chunked == expected
