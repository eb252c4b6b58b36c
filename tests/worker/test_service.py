"""Real worker processes on loopback: tensor parallelism over gloo, streams, resets, failures."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from shardlm.common.v1 import common_pb2
from shardlm.errors import ShardLMError
from shardlm.worker.v1 import worker_pb2

from tests.worker.live_workers import LiveWorkers

BLOCKS = 8  # per sequence, block size 16: 128 tokens
KV = common_pb2.KvCacheConfig(block_size=16, num_blocks=64)
PROMPTS = [[5, 17, 99, 3, 250, 7, 8, 41], [300, 12], [9] * 21]


def table(i: int) -> list[int]:
    return list(range(i * BLOCKS, (i + 1) * BLOCKS))


@pytest.fixture(scope="module")
def groups():
    spawned: dict[int, LiveWorkers] = {}

    def get(world: int) -> LiveWorkers:
        if world not in spawned:
            spawned[world] = LiveWorkers(world)
        return spawned[world]

    yield get
    for g in spawned.values():
        g.close()


def prefill(group: LiveWorkers, request: worker_pb2.PrefillRequest) -> worker_pb2.PrefillResponse:
    """Same request to every rank, concurrently (they meet in collectives); rank 0's reply."""
    futures = [h.stub.Prefill.future(request, timeout=60) for h in group.handles]
    replies = [f.result() for f in futures]
    assert all(not r.tokens for r in replies[1:])  # other ranks only acknowledge
    return replies[0]


def decode(group: LiveWorkers, request: worker_pb2.DecodeRequest) -> list[worker_pb2.DecodeResponse]:
    streams = [h.stub.Decode(request, timeout=60) for h in group.handles]
    results: list = [None] * len(streams)
    import threading

    def drain(i):
        results[i] = list(streams[i])

    threads = [threading.Thread(target=drain, args=(i,)) for i in range(len(streams))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # Every rank runs the same steps; how many messages carry them depends on each rank's timing
    # (a CPU worker sends the steps done within its stream interval in one message).
    assert all(r[-1].step == results[0][-1].step for r in results)
    return results[0]


def greedy_run(group: LiveWorkers, model_dir) -> tuple[list[list[int]], np.ndarray]:
    group.load(str(model_dir), dtype=common_pb2.DTYPE_FLOAT32, kv_cache=KV)
    stop = common_pb2.StopConditions(max_new_tokens=10, ignore_eos=True)
    request = worker_pb2.PrefillRequest(
        sequences=[worker_pb2.PrefillSequence(sequence_id=i, token_ids=p, block_table=table(i),
                                              stop=stop, sample=True)
                   for i, p in enumerate(PROMPTS)],
        debug_taps=["logits"])
    reply = prefill(group, request)
    logits = np.frombuffer(reply.taps[0].data, dtype="<f4").reshape(reply.taps[0].shape)
    tokens = [[t.token_id] for t in reply.tokens]
    steps = decode(group, worker_pb2.DecodeRequest(
        sequences=[worker_pb2.DecodeSequence(sequence_id=i, block_table=table(i))
                   for i in range(len(PROMPTS))], num_steps=12))
    for step in steps:
        for t in step.tokens:
            tokens[t.sequence_id].append(t.token_id)
    return tokens, logits


@pytest.mark.parametrize("which", ["llama", "qwen2"])
def test_tp2_matches_tp1(groups, which, request):
    model_dir = request.getfixturevalue(f"{which}_dir")
    tokens1, logits1 = greedy_run(groups(1), model_dir)
    tokens2, logits2 = greedy_run(groups(2), model_dir)
    assert tokens1 == tokens2
    assert all(len(t) == 10 for t in tokens1)  # max_new_tokens counts the prefill token
    np.testing.assert_allclose(logits1, logits2, atol=1e-4, rtol=0)


def test_stream_stops_each_sequence_and_reset_frees_blocks(groups, llama_dir):
    group = groups(2)
    group.load(str(llama_dir), dtype=common_pb2.DTYPE_FLOAT32, kv_cache=KV)
    stops = [common_pb2.StopConditions(max_new_tokens=3, ignore_eos=True),
             common_pb2.StopConditions(max_new_tokens=6, ignore_eos=True)]
    reply = prefill(group, worker_pb2.PrefillRequest(sequences=[
        worker_pb2.PrefillSequence(sequence_id=i, token_ids=PROMPTS[i], block_table=table(i),
                                   stop=stops[i], sample=True) for i in range(2)]))
    assert [t.sequence_id for t in reply.tokens] == [0, 1]
    steps = decode(group, worker_pb2.DecodeRequest(sequences=[
        worker_pb2.DecodeSequence(sequence_id=i, block_table=table(i)) for i in range(2)],
        num_steps=10, stream_interval_ms=0))  # a message a step
    per_seq = {0: 0, 1: 0}
    for step in steps:
        for t in step.tokens:
            per_seq[t.sequence_id] += 1
    # Each stops at its max_new_tokens (the prefill sampled the first): 2 and 5 decode tokens.
    assert per_seq == {0: 2, 1: 5}
    assert len(steps) == 5  # the call ends once every sequence has finished
    info = group.handles[0].stub.GetInfo(worker_pb2.GetInfoRequest())
    assert (info.live_sequences, info.used_blocks) == (2, 2 * BLOCKS)
    for h in group.handles:
        h.stub.ResetCache(worker_pb2.ResetCacheRequest(all=True))
    info = group.handles[1].stub.GetInfo(worker_pb2.GetInfoRequest())
    assert (info.live_sequences, info.used_blocks, info.rank) == (0, 0, 1)


def test_a_stream_interval_sends_the_same_tokens_in_fewer_messages(groups, llama_dir):
    """Every rank holds its steps' messages for the interval; rank 0's tokens are the same,
    step after step, as with one message a step."""
    group = groups(2)
    group.load(str(llama_dir), dtype=common_pb2.DTYPE_FLOAT32, kv_cache=KV)
    stop = common_pb2.StopConditions(max_new_tokens=20, ignore_eos=True)
    runs = []
    for interval_ms in (0, 10_000, None):  # None: a CPU worker's default, 20 ms
        for h in group.handles:
            h.stub.ResetCache(worker_pb2.ResetCacheRequest(all=True))
        prefill(group, worker_pb2.PrefillRequest(sequences=[
            worker_pb2.PrefillSequence(sequence_id=i, token_ids=PROMPTS[i], block_table=table(i),
                                       stop=stop, sample=True) for i in range(2)]))
        runs.append(decode(group, worker_pb2.DecodeRequest(
            sequences=[worker_pb2.DecodeSequence(sequence_id=i, block_table=table(i))
                       for i in range(2)], num_steps=6, stream_interval_ms=interval_ms)))
    each_step, held, by_default = runs
    assert [m.step for m in each_step] == list(range(6)) and [m.step for m in held] == [5]
    tokens = [(t.sequence_id, t.token_id) for m in each_step for t in m.tokens]
    assert tokens == [(t.sequence_id, t.token_id) for t in held[0].tokens]
    assert tokens == [(t.sequence_id, t.token_id) for m in by_default for t in m.tokens]
    assert len(by_default) < 6 and by_default[-1].step == 5  # a tiny model's steps: < 20 ms


def test_bad_requests_get_statuses(groups, qwen2_dir):
    group = groups(1)
    stub = group.handles[0].stub
    group.load(str(qwen2_dir), dtype=common_pb2.DTYPE_FLOAT32, kv_cache=KV)
    with pytest.raises(grpc.RpcError) as err:
        stub.Prefill(worker_pb2.PrefillRequest(sequences=[worker_pb2.PrefillSequence(
            sequence_id=1, token_ids=[10**6], block_table=table(0), sample=True)]))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Decode(worker_pb2.DecodeRequest(sequences=[
            worker_pb2.DecodeSequence(sequence_id=77, block_table=table(0))], num_steps=2)))
    error = ShardLMError.from_rpc_error(err.value)
    assert (error.code, error.reason) == (grpc.StatusCode.NOT_FOUND, "SEQUENCE_NOT_CACHED")
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Load(worker_pb2.LoadRequest(model_path=str(qwen2_dir), rank=0, world_size=3)))
    error = ShardLMError.from_rpc_error(err.value)
    assert (error.code, error.reason) == (grpc.StatusCode.INVALID_ARGUMENT,
                                          "TENSOR_PARALLEL_MISMATCH")
    assert "not divisible" in error.message


def test_killed_peer_turns_into_an_error_not_a_hang(llama_dir):
    group = LiveWorkers(2)
    try:
        group.load(str(llama_dir), dtype=common_pb2.DTYPE_FLOAT32, kv_cache=KV,
                   comm_timeout_s=3.0)
        stop = common_pb2.StopConditions(max_new_tokens=500, ignore_eos=True)
        prefill(group, worker_pb2.PrefillRequest(sequences=[worker_pb2.PrefillSequence(
            sequence_id=0, token_ids=PROMPTS[0], block_table=table(0), stop=stop, sample=True)]))
        request = worker_pb2.DecodeRequest(
            sequences=[worker_pb2.DecodeSequence(sequence_id=0, block_table=table(0))],
            num_steps=100)
        survivor = group.handles[0].stub.Decode(request, timeout=60)
        doomed = group.handles[1].stub.Decode(request, timeout=60)  # started; its process dies
        next(survivor)
        group.handles[1].process.kill()
        # A hang would end at the call's 60 s deadline, as DEADLINE_EXCEEDED.
        with pytest.raises(grpc.RpcError) as err:
            for _ in survivor:
                pass
        error = ShardLMError.from_rpc_error(err.value)
        assert (error.code, error.reason) == (grpc.StatusCode.UNAVAILABLE, "PEER_FAILED")
        assert "RuntimeError" not in error.message  # no exception text leaks
        doomed.cancel()
    finally:
        group.close()


def test_debug_taps_agree_across_tensor_parallel_sizes(groups, qwen2_dir):
    names = ["layers.0.input_norm", "layers.0.q", "layers.0.k", "layers.0.v",
             "layers.1.attn_output", "layers.1.mlp_output", "logits"]
    request = worker_pb2.PrefillRequest(
        sequences=[worker_pb2.PrefillSequence(sequence_id=0, token_ids=PROMPTS[0],
                                              block_table=table(0), sample=True)],
        debug_taps=names)
    taps = {}
    for world in (1, 2):
        group = groups(world)
        group.load(str(qwen2_dir), dtype=common_pb2.DTYPE_FLOAT32, kv_cache=KV)
        reply = prefill(group, request)
        taps[world] = {t.name: np.frombuffer(t.data, "<f4").reshape(t.shape) for t in reply.taps}
    assert sorted(taps[1]) == sorted(names)
    for name in names:
        np.testing.assert_allclose(taps[1][name], taps[2][name], atol=1e-4, rtol=0, err_msg=name)
    assert taps[1]["layers.0.q"].shape == (len(PROMPTS[0]), 4 * 12)  # all heads, gathered
    with pytest.raises(grpc.RpcError) as err:
        groups(1).handles[0].stub.Prefill(worker_pb2.PrefillRequest(
            sequences=request.sequences, debug_taps=["layers.99.q"]))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
