"""The `shardlm` command: the SDK from the terminal, and the door to the server's commands.

    shardlm generate "PROMPT" [--address HOST:PORT] [--max-new-tokens N] [--temperature T] ...
    shardlm chat [--address HOST:PORT] ...   (one turn per line; /reset starts over; Ctrl-C
                                              stops a reply, Ctrl-C at the prompt or EOF ends)
    shardlm load DIR [--address HOST:PORT] [--dtype D]
    shardlm serve ...    the gateway and its workers (needs the server package)
    shardlm worker ...   one worker, for workers on other hosts (needs the server package)

The client commands import only this SDK. `serve` and `worker` are handed to the server's
modules, named in SERVER_COMMANDS and imported only when asked for.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
from collections.abc import Callable

from shardlm.client import Client
from shardlm.constants import DEFAULT_GATEWAY_ADDRESS, DTYPE_NAMES
from shardlm.errors import ShardLMError, UnavailableError

# subcommand -> (module whose main(argv) runs it, one-line help); argv is what follows the name.
SERVER_COMMANDS = {
    "serve": ("shardlm_server.gateway.serve.cli", "start the gateway and its workers, load a model, serve"),
    "worker": ("shardlm_server.worker.worker_server", "serve one worker (normally started by `serve`)"),
}
EXIT_BROKEN_PIPE = 141  # what a shell reports for a process ended by SIGPIPE


def _explain(error: ShardLMError, address: str) -> str:
    if isinstance(error, UnavailableError) and error.reason in ("UNAVAILABLE", ""):
        return f"no ShardLM gateway answers at {address} (start one with `shardlm serve`)"
    lines = [f"{error.code.name.lower().replace('_', ' ')}: {error.message}"]
    lines += [f"  {v.field}: {v.description}" for v in error.field_violations]
    if error.retry_after_s:
        lines.append(f"  retry in {error.retry_after_s:.1f}s")
    return "\n".join(lines)


def _sampling(args: argparse.Namespace) -> dict:
    return {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p,
            "seed": args.seed}


def generate(args: argparse.Namespace, client: Client) -> None:
    first = True
    for chunk in client.stream_generate(args.prompt, max_new_tokens=args.max_new_tokens,
                                        stop=args.stop or None, **_sampling(args)):
        sys.stdout.write((args.prompt if first else "") + chunk.text)
        sys.stdout.flush()
        first = False
    sys.stdout.write("\n")


def _reply(args: argparse.Namespace, client: Client, session: str) -> None:
    """Stream one reply; Ctrl-C stops the reply (the call is cancelled), not the chat."""
    # The reply's first token came with the turn's prefill.
    rest = None if args.max_new_tokens is None else args.max_new_tokens - 1
    chunks = client.stream_decode(session, max_new_tokens=rest, stop=args.stop or None)
    try:
        with contextlib.closing(chunks):
            for chunk in chunks:
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
    except KeyboardInterrupt:
        sys.stdout.write(" [stopped]")
    sys.stdout.write("\n")


def chat(args: argparse.Namespace, client: Client) -> None:
    """One session, one turn per line typed; `/reset` starts over, an empty line, EOF or Ctrl-C
    at the prompt ends."""
    session: str | None = None
    interactive = sys.stdin.isatty()
    try:
        while True:
            if interactive:
                sys.stdout.write("you> ")
                sys.stdout.flush()
            try:
                line = sys.stdin.readline()
            except KeyboardInterrupt:
                sys.stdout.write("\n")
                break
            if not line or not line.strip():
                break
            if line.strip() == "/reset":
                if session:
                    client.reset_cache(session)
                session = None
                print("(conversation reset)")
                continue
            try:
                turn = client.prefill([{"role": "user", "content": line.rstrip("\n")}],
                                      session_id=session, **_sampling(args))
            except KeyboardInterrupt:
                print(" [stopped]")
                continue
            session = turn.session_id
            sys.stdout.write("bot> " + turn.first_token.text)
            sys.stdout.flush()
            _reply(args, client, session)
    finally:
        if session:
            client.reset_cache(session)


def load(args: argparse.Namespace, client: Client) -> None:
    def bar(fraction: float, message: str) -> None:
        filled = int(fraction * 30)
        sys.stderr.write(f"\r[{'#' * filled}{'.' * (30 - filled)}] {fraction:4.0%} "
                         f"{message[:40]:<40}")
        sys.stderr.flush()

    info = client.load(args.model_path, dtype=args.dtype, progress=bar)
    sys.stderr.write("\n")
    kv = f"; {info.kv_cache.num_blocks} KV blocks" if info.kv_cache else ""
    if info.kv_cache_bytes:
        kv += f" ({_mib(info.kv_cache_bytes)} {info.kv_cache_dtype})"
    weights = f"; weights {_mib(info.weight_bytes)}" if info.weight_bytes else ""
    source = f"{info.format} {'/'.join(info.tensor_types)}".strip()
    print(f"loaded {info.architecture} ({info.num_layers} layers, vocab {info.vocab_size}, "
          f"tp {info.tensor_parallel_size}; {source} served as {info.dtype}){weights}{kv}"
          + (" per rank" if info.tensor_parallel_size > 1 and (weights or kv) else ""))


def _mib(size: int) -> str:
    return f"{size / 2**20:.1f} MiB"


CLIENT_COMMANDS: dict[str, Callable[[argparse.Namespace, Client], None]] = {
    "generate": generate, "chat": chat, "load": load}


def _connection_flags(p: argparse.ArgumentParser, token_help: str) -> None:
    p.add_argument("--address", default=DEFAULT_GATEWAY_ADDRESS, help="gateway address")
    p.add_argument("--auth-token", help=token_help)


def _sampling_flags(p: argparse.ArgumentParser) -> None:
    _connection_flags(p, "bearer token, when the gateway requires one")
    p.add_argument("--max-new-tokens", type=int,
                   help="tokens to generate at most; unset: the gateway's default "
                   "(its --default-max-new-tokens, 256 unless set otherwise)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", default=[], help="stop sequence (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shardlm", description="ShardLM: LLM serving over gRPC")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (_module, help_text) in SERVER_COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)  # parsed by the server's module
    g = sub.add_parser("generate", help="stream a completion from a running gateway")
    g.add_argument("prompt")
    _sampling_flags(g)
    c = sub.add_parser("chat", help="an interactive multi-turn session (one turn per line)")
    _sampling_flags(c)
    ld = sub.add_parser("load", help="load a model into a running gateway, with progress")
    ld.add_argument("model_path", help="a Hugging Face checkpoint folder or a .gguf file")
    _connection_flags(ld, "bearer token with the admin scope")
    ld.add_argument("--dtype", choices=DTYPE_NAMES)
    return parser


def run_server_command(name: str, argv: list[str]) -> int:
    module_name, _help = SERVER_COMMANDS[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            print(f"error: `shardlm {name}` needs the ShardLM server, and only the client is "
                  "installed", file=sys.stderr)
            return 2
        raise
    return module.main(argv)


def run_client(args: argparse.Namespace) -> int:
    try:
        with Client(args.address, auth_token=args.auth_token, max_retries=1) as client:
            CLIENT_COMMANDS[args.command](args, client)
    except ShardLMError as error:
        print(f"\nerror: {_explain(error, args.address)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


def _quiet_stdout() -> None:
    """The reader of stdout is gone (`| head`): point stdout at /dev/null, so that the flush at
    exit does not fail a second time."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in SERVER_COMMANDS:
        return run_server_command(argv[0], argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return run_client(args)
    except BrokenPipeError:
        _quiet_stdout()
        return EXIT_BROKEN_PIPE


if __name__ == "__main__":
    sys.exit(main())
