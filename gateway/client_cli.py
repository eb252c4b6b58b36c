"""`shardlm generate`, `shardlm chat` and `shardlm load`: the SDK from the terminal."""

from __future__ import annotations

import argparse
import sys

from shardlm import Client
from shardlm.errors import ShardLMError, UnavailableError


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


def chat(args: argparse.Namespace, client: Client) -> None:
    """One session, one turn per line typed; `/reset` starts over, an empty line or EOF ends."""
    session: str | None = None
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            sys.stdout.write("you> ")
            sys.stdout.flush()
        line = sys.stdin.readline()
        if not line or not line.strip():
            break
        if line.strip() == "/reset":
            if session:
                client.reset_cache(session)
            session = None
            continue
        turn = client.prefill([{"role": "user", "content": line.rstrip("\n")}],
                              session_id=session, **_sampling(args))
        session = turn.session_id
        sys.stdout.write("bot> " + turn.first_token.text)
        for chunk in client.stream_decode(session, max_new_tokens=args.max_new_tokens - 1,
                                          stop=args.stop or None):
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
        sys.stdout.write("\n")
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
    source = f"{info.format} {'/'.join(info.tensor_types)}".strip()
    print(f"loaded {info.architecture} ({info.num_layers} layers, vocab {info.vocab_size}, "
          f"tp {info.tensor_parallel_size}; {source} served as {info.dtype}){kv}")


def run_client(args: argparse.Namespace) -> int:
    commands = {"generate": generate, "chat": chat, "load": load}
    try:
        with Client(args.address, auth_token=args.auth_token, max_retries=1) as client:
            commands[args.command](args, client)
    except ShardLMError as error:
        print(f"\nerror: {_explain(error, args.address)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0
