"""The `shardlm` command.

    shardlm serve [--model DIR] [--tp N | --devices 0,1] [--device cpu|cuda] [--dtype D]
                  [--host H] [--port P] [--workers ADDR,ADDR] [--config FILE] ...
    shardlm worker [--host H] [--port P | --unix PATH]
    shardlm generate "PROMPT" [--address HOST:PORT] [--max-new-tokens N] [--temperature T] ...
    shardlm chat [--address HOST:PORT] ...        (one turn per line; /reset starts over)
    shardlm load DIR [--address HOST:PORT] [--dtype D]

Every `serve` setting (gateway/config.py) can also come from a TOML or JSON file given with
--config (keys are the flag names with underscores) or an environment variable SHARDLM_<NAME>;
flags win over the file, the file over the environment.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from shardlm.constants import DTYPE_NAMES


def _serve_parser(sub) -> None:
    from gateway.config_sources import add_serve_arguments

    p = sub.add_parser("serve", help="start the gateway and its workers, load a model, serve",
                       description="Settings come from flags, then the --config file, then "
                       "SHARDLM_<NAME> environment variables, then the defaults shown.")
    add_serve_arguments(p)


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
    ld.add_argument("model_path")
    ld.add_argument("--address", default="127.0.0.1:50051")
    ld.add_argument("--auth-token", help="bearer token with the admin scope")
    ld.add_argument("--dtype", choices=DTYPE_NAMES)
    w = sub.add_parser("worker", help="serve one worker (normally started by `serve`)")
    from worker.server import add_arguments

    add_arguments(w)


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
    from gateway.config import ConfigError
    from gateway.config_sources import from_args

    try:
        config = from_args(args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from gateway.serve import serve

    try:
        return asyncio.run(serve(config))
    except KeyboardInterrupt:
        return 130


def install_stop_handlers(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)


if __name__ == "__main__":
    sys.exit(main())
