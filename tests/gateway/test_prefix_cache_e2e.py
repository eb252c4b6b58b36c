"""The prefix cache end to end: a gateway with bearer auth over a real worker, on a tiny float32
checkpoint with 4-token blocks. Output with a cache hit equals output without (greedy and seeded,
prefixes of every length around block boundaries, Generate and sessions); identities do not
share blocks unless the scope is global; a salt separates, a bypass neither reads nor writes;
ResetCache of all empties the cache."""

from __future__ import annotations

import dataclasses

import grpc
import pytest
from shardlm.common.v1 import common_pb2
from shardlm.errors import ShardLMError
from shardlm.gateway.v1 import gateway_pb2

from shardlm_server.gateway.api.auth import load_tokens
from shardlm_server.gateway.api.runtime import Limits
from tests.gateway.conftest import LiveGateway

BLOCK = 4
KV = common_pb2.KvCacheConfig(block_size=BLOCK, num_blocks=512)
ALICE, BOB, ADMIN = "alicetoken", "bobtoken", "admintoken"
GREEDY = common_pb2.SamplingParams()
SEEDED = common_pb2.SamplingParams(temperature=0.9, top_k=50, seed=11)


def md(token: str) -> tuple:
    return (("authorization", f"Bearer {token}"),)


@pytest.fixture(scope="module")
def gateway(llama_dir, tmp_path_factory):
    tokens = tmp_path_factory.mktemp("auth") / "tokens"
    tokens.write_text(f"{ADMIN} ops admin\n{ALICE} alice\n{BOB} bob\n")
    live = LiveGateway(1, Limits(), auth_tokens=load_tokens(tokens))
    list(live.stub.Load(gateway_pb2.LoadRequest(model_path=str(llama_dir), kv_cache=KV,
                                                dtype=common_pb2.DTYPE_FLOAT32),
                        metadata=md(ADMIN)))
    yield live
    live.close()


def generate(live, prompt: list[int], *, token: str = ALICE, sampling=GREEDY, n: int = 8,
             **options) -> tuple[list[int], gateway_pb2.GenerateResponse]:
    ids, last = [], None
    for chunk in live.stub.Generate(gateway_pb2.GenerateRequest(
            token_ids=gateway_pb2.TokenIds(token_ids=prompt), sampling=sampling,
            stop=common_pb2.StopConditions(max_new_tokens=n, ignore_eos=True),
            prefix_cache=gateway_pb2.PrefixCacheOptions(**options)), metadata=md(token)):
        ids += list(chunk.token_ids)
        last = chunk
    return ids, last


def cached(live, prompt: list[int], token: str = ALICE, **options) -> int:
    return generate(live, prompt, token=token, n=1, **options)[1].usage.cached_tokens


def prefix(start: int, length: int) -> list[int]:
    return [1] + [(start + 37 * i) % 997 + 3 for i in range(length - 1)]


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_hit_gives_the_same_output_at_every_prefix_length(gateway, sampling):
    base = prefix(11 if sampling is GREEDY else 13, 3 * BLOCK + 2)
    for shared in (1, 3, 4, 5, 7, 8, 9, 11, 12, 13, 14):
        warm, prompt = base[:shared] + [500, 501], base[:shared] + [600 + shared, 7, 8]
        generate(gateway, warm, sampling=sampling)
        alone, _ = generate(gateway, prompt, sampling=sampling, bypass=True)
        reused, last = generate(gateway, prompt, sampling=sampling)
        assert reused == alone, shared
        assert last.usage.cached_tokens == shared // BLOCK * BLOCK, shared
        assert last.usage.prompt_tokens == len(prompt)
    assert gateway.kv_used() == 0


def test_a_repeated_prompt_is_served_from_the_cache_but_its_last_token(gateway):
    prompt = prefix(23, 2 * BLOCK)
    first, last = generate(gateway, prompt)
    again, last = generate(gateway, prompt)
    assert again == first and last.usage.cached_tokens == BLOCK  # the last block is recomputed
    prompt = prefix(23, 2 * BLOCK + 1)
    generate(gateway, prompt)
    assert cached(gateway, prompt) == 2 * BLOCK


def test_sessions_reuse_cached_prefixes_and_decode_the_same(gateway):
    system = prefix(31, 3 * BLOCK)
    generate(gateway, system + [42])

    def session(**options) -> tuple[list[int], int]:
        reply = gateway.stub.Prefill(gateway_pb2.PrefillRequest(
            token_ids=gateway_pb2.TokenIds(token_ids=system + [77, 78]),
            prefix_cache=gateway_pb2.PrefixCacheOptions(**options)), metadata=md(ALICE))
        ids, usage = [reply.first_token.token_id], None
        for chunk in gateway.stub.Decode(gateway_pb2.DecodeRequest(
                session_id=reply.session_id,
                stop=common_pb2.StopConditions(max_new_tokens=6, ignore_eos=True)),
                metadata=md(ALICE)):
            ids += list(chunk.token_ids)
            usage = chunk.usage
        gateway.stub.ResetCache(gateway_pb2.ResetCacheRequest(session_ids=[reply.session_id]),
                                metadata=md(ALICE))
        assert usage.cached_tokens == usage.prompt_tokens - 1  # the session's own cache
        return ids, reply.usage.cached_tokens

    alone, none = session(bypass=True)
    reused, hit = session()
    assert reused == alone and (none, hit) == (0, 3 * BLOCK)


def test_a_session_keeps_the_prefix_cache_options_it_started_with(gateway):
    reply = gateway.stub.Prefill(gateway_pb2.PrefillRequest(
        token_ids=gateway_pb2.TokenIds(token_ids=[1, 5, 6]),
        prefix_cache=gateway_pb2.PrefixCacheOptions(salt="a")), metadata=md(ALICE))
    gateway.stub.Prefill(gateway_pb2.PrefillRequest(
        session_id=reply.session_id, token_ids=gateway_pb2.TokenIds(token_ids=[7]),
        prefix_cache=gateway_pb2.PrefixCacheOptions(salt="a")), metadata=md(ALICE))
    with pytest.raises(grpc.RpcError) as err:
        gateway.stub.Prefill(gateway_pb2.PrefillRequest(
            session_id=reply.session_id, token_ids=gateway_pb2.TokenIds(token_ids=[8]),
            prefix_cache=gateway_pb2.PrefixCacheOptions(salt="b")), metadata=md(ALICE))
    error = ShardLMError.from_rpc_error(err.value)
    assert (error.code, error.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_FIELD")
    with pytest.raises(grpc.RpcError) as err:
        generate(gateway, [1, 2], salt="x" * 257)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    gateway.stub.ResetCache(gateway_pb2.ResetCacheRequest(session_ids=[reply.session_id]),
                            metadata=md(ALICE))


def test_identities_share_nothing_unless_the_scope_is_global(gateway):
    prompt = prefix(41, 3 * BLOCK + 1)
    generate(gateway, prompt, token=ALICE)
    assert cached(gateway, prompt, token=BOB) == 0
    assert cached(gateway, prompt, token=ALICE) == 3 * BLOCK
    runtime = gateway.runtime
    limits = runtime.limits
    runtime.limits = dataclasses.replace(limits, prefix_cache_scope="global")  # as the flag sets it
    try:
        generate(gateway, prompt, token=ALICE)
        assert cached(gateway, prompt, token=BOB) == 3 * BLOCK
        info = gateway.stub.GetModelInfo(gateway_pb2.GetModelInfoRequest(), metadata=md(BOB))
        assert info.prefix_cache.scope == gateway_pb2.PREFIX_CACHE_SCOPE_GLOBAL
    finally:
        runtime.limits = limits


def test_a_salt_separates_and_a_bypass_neither_reads_nor_writes(gateway):
    prompt = prefix(53, 2 * BLOCK + 1)
    generate(gateway, prompt, salt="tenant-a")
    assert cached(gateway, prompt) == 0
    assert cached(gateway, prompt, salt="tenant-b") == 0
    assert cached(gateway, prompt, salt="tenant-a") == 2 * BLOCK
    assert cached(gateway, prompt, bypass=True) == 0
    fresh = prefix(59, 2 * BLOCK + 1)
    generate(gateway, fresh, bypass=True)
    assert cached(gateway, fresh) == 0


def test_reset_cache_of_all_empties_the_prefix_cache(gateway):
    prompt = prefix(61, 3 * BLOCK + 1)
    lookups = gateway.metrics.value("shardlm_prefix_cache_lookups_total")
    generate(gateway, prompt)
    info = gateway.stub.GetModelInfo(gateway_pb2.GetModelInfoRequest(), metadata=md(ALICE))
    assert info.prefix_cache.enabled and info.prefix_cache.cached_blocks >= 3
    assert info.prefix_cache.idle_blocks == info.prefix_cache.cached_blocks
    assert info.prefix_cache.scope == gateway_pb2.PREFIX_CACHE_SCOPE_IDENTITY
    gateway.stub.ResetCache(gateway_pb2.ResetCacheRequest(all=True), metadata=md(ADMIN))
    info = gateway.stub.GetModelInfo(gateway_pb2.GetModelInfoRequest(), metadata=md(ALICE))
    assert info.prefix_cache.cached_blocks == 0
    assert cached(gateway, prompt) == 0
    assert gateway.metrics.value("shardlm_prefix_cache_lookups_total") == lookups + 2
    assert gateway.metrics.value("shardlm_prefix_cache_hit_tokens_total") > 0


def test_tensor_parallel_ranks_share_the_same_cached_blocks(llama_dir):
    live = LiveGateway(2, Limits())
    try:
        list(live.stub.Load(gateway_pb2.LoadRequest(model_path=str(llama_dir), kv_cache=KV,
                                                    dtype=common_pb2.DTYPE_FLOAT32)))
        system = prefix(71, 2 * BLOCK + 3)
        generate(live, system + [5], token="")
        for turn, sampling in enumerate((GREEDY, SEEDED)):
            prompt = system + [6 + turn, 7]
            alone, _ = generate(live, prompt, token="", sampling=sampling, bypass=True)
            reused, last = generate(live, prompt, token="", sampling=sampling)
            assert reused == alone and last.usage.cached_tokens == 2 * BLOCK
    finally:
        live.close()
