#!/usr/bin/env python3
"""Container health check for ShardLM (the image has no grpc_health_probe).

    healthcheck.py ADDRESS            gateway: grpc.health.v1 Check is SERVING (a model is loaded)
    healthcheck.py ADDRESS --worker   worker: WorkerService.GetInfo answers
    healthcheck.py ADDRESS --tls-ca CA.pem [--tls-server-name NAME]   over TLS (a Kubernetes probe
                                      of a gateway serving TLS; kubelet's own gRPC probes cannot)

Exit status 0 when healthy, 1 otherwise (with the reason on stderr), as Docker expects.
"""

from __future__ import annotations

import argparse
import sys

import grpc


def check_gateway(channel: grpc.Channel, service: str, timeout: float) -> str | None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    reply = health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service=service), timeout=timeout)
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        return f"health status {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}"
    return None


def check_worker(channel: grpc.Channel, timeout: float) -> str | None:
    from shardlm.worker.v1 import worker_pb2, worker_pb2_grpc

    worker_pb2_grpc.WorkerServiceStub(channel).GetInfo(worker_pb2.GetInfoRequest(), timeout=timeout)
    return None


def _channel(args: argparse.Namespace) -> grpc.Channel:
    if not args.tls_ca:
        return grpc.insecure_channel(args.address)
    with open(args.tls_ca, "rb") as ca:
        credentials = grpc.ssl_channel_credentials(root_certificates=ca.read())
    options = ([("grpc.ssl_target_name_override", args.tls_server_name)]
               if args.tls_server_name else [])
    return grpc.secure_channel(args.address, credentials, options=options)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("address", help="host:port to check")
    parser.add_argument("--worker", action="store_true", help="check a worker, not the gateway")
    parser.add_argument("--service", default="", help="health service name (gateway; default '')")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds (default 3)")
    parser.add_argument("--tls-ca", help="PEM CA that signed the server's certificate: use TLS")
    parser.add_argument("--tls-server-name", help="name the certificate is checked against "
                        "(default: the host of ADDRESS)")
    args = parser.parse_args(argv)
    try:
        with _channel(args) as channel:
            problem = (check_worker(channel, args.timeout) if args.worker
                       else check_gateway(channel, args.service, args.timeout))
    except grpc.RpcError as exc:
        problem = f"{exc.code().name}: {exc.details()}"
    if problem:
        print(f"unhealthy: {args.address}: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
