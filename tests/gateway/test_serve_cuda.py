"""`shardlm serve --device cuda` as users run it: a GPU worker behind the gateway, in bfloat16.

Streaming Generate, a two-turn session, cancellation and deadlines, and no KV block left held
afterwards (read from the Prometheus endpoint, as an operator would). Needs a GPU; selected by
`pytest -m cuda` (scripts/gpu_check.sh). The float32 end-to-end checks against transformers run
on the GPU too when SHARDLM_TEST_DEVICE=cuda (tests/gateway/conftest.py).
"""

from __future__ import annotations

import signal
import threading
import time
import urllib.request

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from shardlm.common.v1 import common_pb2
from shardlm.gateway.v1 import gateway_pb2, gateway_pb2_grpc

from shardlm_server.gateway.workers.processes import free_port
from tests.gateway.held_workers import HELD_CALL_DEADLINE_S, worker_pids, workers_held
from tests.gateway.test_serve import start_serve

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def greedy(max_new: int) -> dict:
    return dict(sampling=common_pb2.SamplingParams(),
                stop=common_pb2.StopConditions(max_new_tokens=max_new, ignore_eos=True))


def tokens(stream) -> tuple[list[int], list]:
    chunks = list(stream)
    return [t for c in chunks for t in c.token_ids], chunks


class Served:
    def __init__(self, model_dir) -> None:
        self.metrics_port = free_port()
        self.proc, self.address = start_serve(
            "--model", str(model_dir), "--device", "cuda", "--dtype", "bfloat16",
            "--metrics-port", str(self.metrics_port))
        self.channel = grpc.insecure_channel(self.address)
        self.stub = gateway_pb2_grpc.GatewayServiceStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    def metric(self, name: str) -> float:
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as reply:
            for line in reply.read().decode().splitlines():
                if line.startswith(name + " "):
                    return float(line.split()[1])
        raise AssertionError(f"{name} is not exported")

    def wait_blocks_free(self, timeout: float = 10.0) -> float:
        deadline = time.monotonic() + timeout
        while (used := self.metric("shardlm_kv_blocks_used")) and time.monotonic() < deadline:
            time.sleep(0.05)
        return used

    def close(self) -> int:
        self.channel.close()
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()


@pytest.fixture(scope="module")
def served(llama_dir):
    server = Served(llama_dir)
    yield server
    assert server.close() == 0


def test_streaming_generate_on_the_gpu(served):
    assert served.health.Check(health_pb2.HealthCheckRequest()).status == \
        health_pb2.HealthCheckResponse.SERVING
    request = gateway_pb2.GenerateRequest(text="To be, or not", **greedy(48))
    ids, chunks = tokens(served.stub.Generate(request))
    assert served.metric("shardlm_kv_blocks_total") > 0  # the gauges follow the scheduler's steps
    assert len(ids) == 48 and len(chunks) > 1  # streamed, not one reply
    assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert chunks[-1].usage.generated_tokens == 48
    assert "".join(c.text for c in chunks)
    assert tokens(served.stub.Generate(request))[0] == ids  # greedy replays the same graphs
    assert served.wait_blocks_free() == 0


def test_two_turn_session_on_the_gpu(served):
    stub = served.stub
    prompt = [1, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    first = stub.Prefill(gateway_pb2.PrefillRequest(token_ids=gateway_pb2.TokenIds(token_ids=prompt)))
    assert first.usage.prompt_tokens == len(prompt) and first.usage.cached_tokens == 0
    stop = common_pb2.StopConditions(max_new_tokens=8, ignore_eos=True)
    turn1 = tokens(stub.Decode(gateway_pb2.DecodeRequest(session_id=first.session_id, stop=stop)))[0]
    assert len(turn1) == 8
    second = stub.Prefill(gateway_pb2.PrefillRequest(
        session_id=first.session_id, token_ids=gateway_pb2.TokenIds(token_ids=[40, 41, 42])))
    history = len(prompt) + 1 + len(turn1) + 3
    assert second.usage.prompt_tokens == history
    assert second.usage.cached_tokens == history - 4  # the cache of turn 1 is reused
    turn2 = tokens(stub.Decode(gateway_pb2.DecodeRequest(session_id=first.session_id, stop=stop)))
    assert len(turn2[0]) == 8
    stub.ResetCache(gateway_pb2.ResetCacheRequest(session_ids=[first.session_id]))
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Decode(gateway_pb2.DecodeRequest(session_id=first.session_id)))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert served.wait_blocks_free() == 0


def test_cancelled_and_expired_streams_leave_no_kv_blocks(served):
    # As in test_e2e's deadline test: the workers are held still while the call runs, so the
    # deadline falls mid-generation however fast the GPU is.
    long = gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(token_ids=[1, 2, 3]),
                                       **greedy(500))
    errors: list = []

    def cancel_after_first_chunk(i: int) -> None:
        request = gateway_pb2.GenerateRequest(
            token_ids=gateway_pb2.TokenIds(token_ids=[1, 7 + i, 9]), **greedy(400))
        try:
            stream = served.stub.Generate(request)
            next(stream)
            stream.cancel()
        except grpc.RpcError as exc:  # pragma: no cover - reported below
            errors.append(exc.code())

    threads = [threading.Thread(target=cancel_after_first_chunk, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    with workers_held(worker_pids(served.proc.pid)), pytest.raises(grpc.RpcError) as err:
        list(served.stub.Generate(long, timeout=HELD_CALL_DEADLINE_S))
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert served.wait_blocks_free() == 0
    # The server is still whole: a fresh stream runs to its end.
    ids, chunks = tokens(served.stub.Generate(gateway_pb2.GenerateRequest(text="again",
                                                                          **greedy(16))))
    assert len(ids) == 16 and chunks[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert served.wait_blocks_free() == 0
