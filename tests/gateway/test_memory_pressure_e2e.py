"""Random concurrent loads in a KV cache too small for them at once, end to end: a gateway over
real workers (one, and two in tensor parallel) on a tiny float32 checkpoint with 4-token blocks.

Calls, Generates and two-turn sessions, share a prompt prefix (the prefix cache attaches it),
each fits the cache alone, some sample with a seed, some have penalties and some Generates are
cancelled by their client part-way. Together they preempt one
another and are recomputed; each call's tokens must be the tokens it gives alone (a cancelled
one's, a beginning of them), and when all are done no block is held."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from shardlm.common.v1 import common_pb2
from shardlm.gateway.v1 import gateway_pb2

from shardlm_server.gateway.api.runtime import Limits
from tests.gateway.conftest import LiveGateway

BLOCK, BLOCKS = 4, 24


def stream(live: LiveGateway, prompt: list[int], sampling: common_pb2.SamplingParams,
           max_new: int, cancel_after: int | None = None) -> list[int]:
    """A Generate's tokens; with `cancel_after`, the client cancels it once it has that many."""
    call = live.stub.Generate(gateway_pb2.GenerateRequest(
        token_ids=gateway_pb2.TokenIds(token_ids=prompt), sampling=sampling,
        stop=common_pb2.StopConditions(max_new_tokens=max_new, ignore_eos=True)))
    tokens: list[int] = []
    try:
        for chunk in call:
            tokens += list(chunk.token_ids)
            if cancel_after is not None and len(tokens) >= cancel_after:
                call.cancel()
                break
    except grpc.RpcError as error:
        if error.code() != grpc.StatusCode.CANCELLED:
            raise
    return tokens


def converse(live: LiveGateway, prompt: list[int], sampling: common_pb2.SamplingParams,
             max_new: int, _cancel_after: int | None = None) -> list[int]:
    """A session of two turns (the prompt's halves), each a Prefill and a Decode of about half
    of `max_new` tokens; its tokens. Between the turns it is idle, its cache evictable."""
    half, tokens = len(prompt) // 2, []
    session = ""
    for turn, new in ((prompt[:half], max_new // 2), (prompt[half:], max_new - max_new // 2 - 2)):
        reply = live.stub.Prefill(gateway_pb2.PrefillRequest(
            session_id=session, token_ids=gateway_pb2.TokenIds(token_ids=turn),
            sampling=sampling if not session else None))
        session = reply.session_id
        tokens.append(reply.first_token.token_id)
        for chunk in live.stub.Decode(gateway_pb2.DecodeRequest(
                session_id=session,
                stop=common_pb2.StopConditions(max_new_tokens=new, ignore_eos=True))):
            tokens += list(chunk.token_ids)
    live.stub.ResetCache(gateway_pb2.ResetCacheRequest(session_ids=[session]))
    return tokens


def random_calls(seed: int) -> list[tuple]:
    """Each call: how it runs (a Generate or a session), prompt, sampling, max_new_tokens and
    when its client cancels it (None: never)."""
    rng = random.Random(seed)
    shared = [1] + [rng.randrange(3, 990) for _ in range(rng.randint(2, 9))]
    calls = []
    for i in range(6):
        prompt = shared + [rng.randrange(3, 990) for _ in range(rng.randint(1, 6))]
        max_new = rng.randint(8, BLOCKS * BLOCK - len(prompt) - 2)
        sampling = common_pb2.SamplingParams()
        if rng.random() < 0.5:
            sampling.MergeFrom(common_pb2.SamplingParams(temperature=0.9, top_k=50,
                                                         seed=seed * 10 + i))
        if rng.random() < 0.5:  # counted over the tokens generated so far, recomputed or not
            sampling.MergeFrom(common_pb2.SamplingParams(
                frequency_penalty=1.5, presence_penalty=0.5, repetition_penalty=1.2))
        run = stream if rng.random() < 0.7 else converse
        cancel_after = (rng.randint(1, max_new - 1) if run is stream and rng.random() < 0.3
                        else None)
        calls.append((run, prompt, sampling, max_new, cancel_after))
    return calls


@pytest.mark.parametrize("workers", [1, 2])
def test_random_loads_under_memory_pressure_give_each_call_its_own_tokens(llama_dir, workers):
    live = LiveGateway(workers, Limits())
    try:
        list(live.stub.Load(gateway_pb2.LoadRequest(
            model_path=str(llama_dir), dtype=common_pb2.DTYPE_FLOAT32,
            kv_cache=common_pb2.KvCacheConfig(block_size=BLOCK, num_blocks=BLOCKS))))
        preempted = 0.0
        for seed in range(3):
            calls = random_calls(seed)
            alone = [run(live, prompt, sampling, max_new)
                     for run, prompt, sampling, max_new, _ in calls]
            before = live.metrics.value("shardlm_preemptions_total")
            with ThreadPoolExecutor(len(calls)) as pool:
                together = list(pool.map(lambda call: call[0](live, *call[1:]), calls))
            preempted += live.metrics.value("shardlm_preemptions_total") - before
            for (*_, max_new, cancel_after), own, got in zip(calls, alone, together,
                                                             strict=True):
                assert len(own) == max_new
                assert got == own[:len(got)]
                assert len(got) == max_new or cancel_after is not None
        assert preempted > 0  # the loads did press on the cache
        assert live.kv_used() == 0
    finally:
        live.close()
