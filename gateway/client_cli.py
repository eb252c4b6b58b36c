"""`shardlm generate` and `shardlm load`: talk to a running gateway from the terminal."""

from __future__ import annotations

import argparse
import sys

import grpc
from shardlm.common.v1 import common_pb2
from shardlm.errors import ShardLMError
from shardlm.gateway.v1 import gateway_pb2, gateway_pb2_grpc

DTYPE_ENUMS = {"float32": common_pb2.DTYPE_FLOAT32, "bfloat16": common_pb2.DTYPE_BFLOAT16,
               "float16": common_pb2.DTYPE_FLOAT16}


def _explain(exc: grpc.RpcError, address: str) -> str:
    error = ShardLMError.from_rpc_error(exc)
    if error.code == grpc.StatusCode.UNAVAILABLE and error.reason == "UNAVAILABLE":
        return f"no ShardLM gateway answers at {address} (start one with `shardlm serve`)"
    lines = [f"{error.code.name.lower().replace('_', ' ')}: {error.message}"]
    lines += [f"  {v.field}: {v.description}" for v in error.field_violations]
    if error.retry_after_s:
        lines.append(f"  retry in {error.retry_after_s:.1f}s")
    return "\n".join(lines)


def generate(args: argparse.Namespace, stub) -> None:
    sampling = common_pb2.SamplingParams(temperature=args.temperature, top_k=args.top_k)
    if args.top_p is not None:
        sampling.top_p = args.top_p
    if args.seed is not None:
        sampling.seed = args.seed
    request = gateway_pb2.GenerateRequest(
        text=args.prompt, sampling=sampling,
        stop=common_pb2.StopConditions(max_new_tokens=args.max_new_tokens,
                                       stop_sequences=args.stop))
    for i, chunk in enumerate(stub.Generate(request)):
        sys.stdout.write(args.prompt + chunk.text if i == 0 else chunk.text)
        sys.stdout.flush()
    sys.stdout.write("\n")


def load(args: argparse.Namespace, stub) -> None:
    request = gateway_pb2.LoadRequest(model_path=args.model_path,
                                      dtype=DTYPE_ENUMS.get(args.dtype or "", 0))
    for event in stub.Load(request):
        if event.HasField("progress"):
            filled = int(event.progress.fraction * 30)
            sys.stderr.write(f"\r[{'#' * filled}{'.' * (30 - filled)}] "
                             f"{event.progress.fraction:4.0%} {event.progress.message[:40]:<40}")
            sys.stderr.flush()
        else:
            sys.stderr.write("\n")
            print(f"loaded {event.model.architecture} ({event.model.num_layers} layers, "
                  f"vocab {event.model.vocab_size}, tp {event.model.tensor_parallel_size}); "
                  f"{event.capacity.num_blocks} KV blocks of {event.capacity.block_size} tokens")


def run_client(args: argparse.Namespace) -> int:
    with grpc.insecure_channel(args.address) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        try:
            (generate if args.command == "generate" else load)(args, stub)
        except grpc.RpcError as exc:
            print(f"\nerror: {_explain(exc, args.address)}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            return 130
    return 0
