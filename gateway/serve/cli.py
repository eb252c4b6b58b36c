"""`shardlm serve`: the server half of the `shardlm` command (the SDK's `shardlm.cli` hands
`serve` over here by module name).

    shardlm serve [--model DIR] [--tp N | --devices 0,1] [--device cpu|cuda] [--dtype D]
                  [--host H] [--port P] [--workers ADDR,ADDR] [--config FILE] ...

Every `serve` setting (gateway/config.py) can also come from a TOML or JSON file given with
--config (keys are the flag names with underscores) or an environment variable SHARDLM_<NAME>;
flags win over the file, the file over the environment. `python -m shardlm_server.gateway.serve.cli`
runs the whole `shardlm` command.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys


def _serve_parser(sub) -> None:
    from shardlm_server.gateway.serve.config_sources import add_serve_arguments

    p = sub.add_parser("serve", help="start the gateway and its workers, load a model, serve",
                       description="Settings come from flags, then the --config file, then "
                       "SHARDLM_<NAME> environment variables, then the defaults shown.")
    add_serve_arguments(p)


def main(argv: list[str] | None = None) -> int:
    """Run `shardlm serve` with `argv`, the arguments that follow `serve`."""
    parser = argparse.ArgumentParser(prog="shardlm")
    _serve_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["serve", *(sys.argv[1:] if argv is None else argv)])
    from shardlm_server.gateway.config import ConfigError
    from shardlm_server.gateway.serve.config_sources import from_args

    try:
        config = from_args(args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from shardlm_server.gateway.serve.lifecycle import serve

    try:
        return asyncio.run(serve(config))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    from shardlm.cli import main as shardlm_main

    sys.exit(shardlm_main())
