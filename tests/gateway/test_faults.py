"""A worker killed mid-stream: the stream ends with UNAVAILABLE because the gateway noticed the
death (no timeout of the gateway or the workers expires before the stream's deadline), the
supervisor restarts the group and reloads the model, and a session continues from its history."""

from __future__ import annotations

import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from shardlm.common.v1 import common_pb2
from shardlm.errors import ShardLMError
from shardlm.gateway.v1 import gateway_pb2

from shardlm_server.gateway.api.runtime import Limits
from shardlm_server.gateway.config import LoadOptions
from shardlm_server.gateway.serve.supervisor import Supervisor
from shardlm_server.gateway.workers.processes import WorkerGroup
from tests.gateway.conftest import LiveGateway

# The stream's deadline, which only stops a hung test, is far shorter than every timeout that could
# end the stream without the death being noticed: a worker step's and a collective's.
STREAM_DEADLINE_S = 60
PATIENCE_S = 600


@pytest.fixture
def supervised(llama_dir):
    gateway = LiveGateway(2, Limits(step_timeout_s=PATIENCE_S),
                          load_options=LoadOptions(comm_timeout_s=PATIENCE_S))

    async def start():
        supervisor = Supervisor(gateway.runtime, lambda: WorkerGroup.spawn(2), backoff_s=0.2)
        supervisor.start()
        return supervisor

    supervisor = gateway.call(start())
    list(gateway.stub.Load(gateway_pb2.LoadRequest(
        model_path=str(llama_dir), dtype=common_pb2.DTYPE_FLOAT32,
        kv_cache=common_pb2.KvCacheConfig(num_blocks=128))))
    yield gateway
    gateway.call(supervisor.stop())
    gateway.close()


def serving(gateway) -> bool:
    health = health_pb2_grpc.HealthStub(gateway.channel)
    return health.Check(health_pb2.HealthCheckRequest()).status == \
        health_pb2.HealthCheckResponse.SERVING


def tokens(stream) -> list[int]:
    return [t for chunk in stream for t in chunk.token_ids]


def test_worker_killed_mid_stream_then_restart_and_session_continues(supervised):
    gateway, stub = supervised, supervised.stub
    first = stub.Prefill(gateway_pb2.PrefillRequest(
        token_ids=gateway_pb2.TokenIds(token_ids=[1, 9, 8, 7, 6, 5])))
    reply = tokens(stub.Decode(gateway_pb2.DecodeRequest(
        session_id=first.session_id,
        stop=common_pb2.StopConditions(max_new_tokens=6, ignore_eos=True))))
    history = [1, 9, 8, 7, 6, 5, first.first_token.token_id] + reply

    stream = stub.Generate(gateway_pb2.GenerateRequest(
        token_ids=gateway_pb2.TokenIds(token_ids=[1, 2, 3]),
        stop=common_pb2.StopConditions(max_new_tokens=400, ignore_eos=True)),
        timeout=STREAM_DEADLINE_S)
    next(stream)
    gateway.group.handles[1].process.kill()
    with pytest.raises(grpc.RpcError) as err:
        for _ in stream:
            pass
    error = ShardLMError.from_rpc_error(err.value)
    assert error.code == grpc.StatusCode.UNAVAILABLE
    assert not serving(gateway)

    deadline = time.monotonic() + 90
    while not serving(gateway) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert serving(gateway)
    assert gateway.metrics.value("shardlm_worker_restarts_total") == 1

    # The session's cache died with the workers; its history did not.
    more = tokens(stub.Decode(gateway_pb2.DecodeRequest(
        session_id=first.session_id,
        stop=common_pb2.StopConditions(max_new_tokens=5, ignore_eos=True))))
    fresh = tokens(stub.Generate(gateway_pb2.GenerateRequest(
        token_ids=gateway_pb2.TokenIds(token_ids=history),
        stop=common_pb2.StopConditions(max_new_tokens=5, ignore_eos=True))))
    assert more == fresh
