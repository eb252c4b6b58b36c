"""`shardlm worker` / `python -m shardlm_server.worker`: serve the worker API on a TCP port or a unix socket.

Prints one line `READY <address>` on stdout once it accepts calls, so the gateway that started it
can wait for it. SIGTERM / SIGINT stop it gracefully (in-flight calls get a short grace period),
and so does the end of the gateway that started it (`--parent-pid`, see worker/parent_watch.py).
Started by hand on another host (`shardlm worker --host 0.0.0.0 --port 50061`), it serves until
stopped; `--advertise-host` / `--comm-port` set where its peers meet it when it is rank 0 of a CPU
group (README, "Multi-host").
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from concurrent import futures
from pathlib import Path

import grpc
from shardlm.constants import DEFAULT_HOST, MAX_WORKER_MESSAGE_BYTES, WORKER_KEEPALIVE_MS
from shardlm.worker.v1 import worker_pb2_grpc

from shardlm_server.worker.parent_watch import watch_parent
from shardlm_server.worker.rpc_errors import ErrorMappingInterceptor
from shardlm_server.worker.worker_servicer import WorkerServicer


def build_server(address: str, credentials: grpc.ServerCredentials | None = None,
                 servicer: WorkerServicer | None = None) -> tuple[grpc.Server, int]:
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="shardlm-worker"),
        interceptors=[ErrorMappingInterceptor()],
        options=[("grpc.max_send_message_length", MAX_WORKER_MESSAGE_BYTES),
                 ("grpc.max_receive_message_length", MAX_WORKER_MESSAGE_BYTES),
                 ("grpc.so_reuseport", 0),
                 # The gateway's keepalive pings (idle or not) are welcome, never "too many".
                 ("grpc.keepalive_permit_without_calls", 1),
                 ("grpc.http2.min_ping_interval_without_data_ms", WORKER_KEEPALIVE_MS // 2),
                 ("grpc.http2.max_ping_strikes", 0)],
    )
    worker_pb2_grpc.add_WorkerServiceServicer_to_server(servicer or WorkerServicer(), server)
    port = (server.add_secure_port(address, credentials) if credentials
            else server.add_insecure_port(address))
    if port == 0 and not address.startswith("unix:"):
        raise OSError(f"cannot listen on {address}")
    return server, port


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default=DEFAULT_HOST, help="interface to listen on")
    parser.add_argument("--port", type=int, default=0, help="TCP port (0 picks a free one)")
    parser.add_argument("--unix", default="", help="listen on this unix socket path instead")
    parser.add_argument("--advertise-host", default="",
                        help="as rank 0 on CPU: the address the other workers dial for the "
                             "rendezvous (default: the one the gateway dials this worker at)")
    parser.add_argument("--comm-port", type=int, default=0,
                        help="as rank 0 on CPU: the rendezvous port (default: a free one)")
    parser.add_argument("--tls-cert", help="PEM certificate: serve TLS (with --tls-key)")
    parser.add_argument("--tls-key", help="PEM private key of --tls-cert")
    parser.add_argument("--tls-client-ca", help="PEM CA: require client certificates (mTLS)")
    # Set by the gateway for the workers it starts: exit when that process is gone.
    parser.add_argument("--parent-pid", type=int, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    address = f"unix:{args.unix}" if args.unix else f"{args.host}:{args.port}"
    try:
        credentials = None
        if args.tls_cert or args.tls_key:
            ca = Path(args.tls_client_ca).read_bytes() if args.tls_client_ca else None
            credentials = grpc.ssl_server_credentials(
                [(Path(args.tls_key).read_bytes(), Path(args.tls_cert).read_bytes())],
                root_certificates=ca, require_client_auth=ca is not None)
        if not 0 <= args.comm_port < 65536:
            raise ValueError(f"--comm-port must be a port number, got {args.comm_port}")
        server, port = build_server(address, credentials,
                                    WorkerServicer(args.advertise_host, args.comm_port))
    except (OSError, RuntimeError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    server.start()
    shown = address if args.unix else f"{args.host}:{port}"
    print(f"READY {shown}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    if args.parent_pid:
        watch_parent(args.parent_pid, stop.set)
    stop.wait()
    server.stop(grace=5).wait()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shardlm worker", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))
