"""A gateway client for tests/gateway/test_multihost.py, run inside the gateway's network namespace
(`ip netns exec NS python -m tests.gateway.netns_client ...`), where the test process cannot dial.

    generate ADDRESS PROMPT_IDS MAX_NEW   one line per generated token id, then `END`, or
                                          `ERROR <code> <reason>` when the stream fails
    health ADDRESS                        SERVING / NOT_SERVING, or `ERROR <code>`

Greedy decoding, end-of-sequence ignored. Every line is flushed as soon as it is known.
"""

from __future__ import annotations

import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from shardlm.common.v1 import common_pb2
from shardlm.errors import ShardLMError
from shardlm.gateway.v1 import gateway_pb2, gateway_pb2_grpc


def say(line: str) -> None:
    print(line, flush=True)


def generate(address: str, prompt: str, max_new: str) -> None:
    with grpc.insecure_channel(address) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        request = gateway_pb2.GenerateRequest(
            token_ids=gateway_pb2.TokenIds(token_ids=[int(t) for t in prompt.split(",")]),
            sampling=common_pb2.SamplingParams(),
            stop=common_pb2.StopConditions(max_new_tokens=int(max_new), ignore_eos=True))
        try:
            for chunk in stub.Generate(request, timeout=300):
                for token in chunk.token_ids:
                    say(str(token))
        except grpc.RpcError as exc:
            error = ShardLMError.from_rpc_error(exc)
            say(f"ERROR {error.code.name} {error.reason or '-'}")
            return
    say("END")


def health(address: str) -> None:
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                               timeout=5)
        except grpc.RpcError as exc:
            say(f"ERROR {exc.code().name}")
            return
    say(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    {"generate": generate, "health": health}[command](*args)
