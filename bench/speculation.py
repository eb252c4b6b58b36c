"""Speculative decoding through the full stack: `shardlm serve --speculation ngram` against
`--speculation off`, on three workloads of chat requests, greedy, over gRPC.

    python -m bench.speculation                       # the default model, batch 1 and 32 streams
    python -m bench.speculation --model FILE.gguf --rounds 5 --streams 1,32 --json out.json

Workloads (bench/speculation_prompts.py): code editing (rewrite a given function with a small
change), grounded answers that quote a given passage, and open chat. Both servers run at once
(each `serve` with its own workers); only one is sent work at a time, and the rounds alternate
between them, the order flipped every round. Per workload and stream count, each side's
tokens/s: every generated token over the round's wall time (first request sent to last chunk),
median and [min-max] over the rounds, and their ratio; the drafts verified and accepted (the
final chunk's usage); and whether both sides produced the same text for every prompt (greedy
decoding with drafts must equal greedy decoding without).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.serve_process import Server
from bench.speculation_prompts import WORKLOADS


def generate(address: str, prompt: str, max_new_tokens: int) -> dict:
    """One streamed greedy chat Generate: its text, tokens, drafts and timing."""
    import grpc
    from shardlm.common.v1 import common_pb2
    from shardlm.gateway.v1 import gateway_pb2, gateway_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        request = gateway_pb2.GenerateRequest(
            messages=gateway_pb2.ChatMessages(messages=[
                gateway_pb2.ChatMessage(role="user", content=prompt)]),
            sampling=common_pb2.SamplingParams(),
            stop=common_pb2.StopConditions(max_new_tokens=max_new_tokens))
        text, usage = [], None
        start = time.perf_counter()
        for chunk in stub.Generate(request, timeout=600):
            text.append(chunk.text)
            if chunk.HasField("usage"):
                usage = chunk.usage
        end = time.perf_counter()
    assert usage is not None
    return {"text": "".join(text), "tokens": usage.generated_tokens, "start": start, "end": end,
            "drafts": usage.draft_tokens, "accepted": usage.accepted_draft_tokens}


def run_round(address: str, prompts: list[str], streams: int, max_new_tokens: int) -> dict:
    """`streams` == 1: the prompts one after another; else `streams` concurrent requests, the
    prompts repeated to fill them."""
    if streams == 1:
        results = [generate(address, p, max_new_tokens) for p in prompts]
    else:
        batch = [prompts[i % len(prompts)] for i in range(streams)]
        with ThreadPoolExecutor(max_workers=streams) as pool:
            results = list(pool.map(lambda p: generate(address, p, max_new_tokens), batch))
    wall = max(r["end"] for r in results) - min(r["start"] for r in results)
    tokens = sum(r["tokens"] for r in results)
    return {"tokens_per_s": tokens / wall, "tokens": tokens,
            "drafts": sum(r["drafts"] for r in results),
            "accepted": sum(r["accepted"] for r in results),
            "texts": [r["text"] for r in results]}


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def measure(servers: dict[str, Server], streams: int, rounds: int, max_new_tokens: int) -> list:
    rows = []
    for name, prompts in WORKLOADS.items():
        runs: dict[str, list[dict]] = {side: [] for side in servers}
        for r in range(rounds):
            order = list(servers) if r % 2 == 0 else list(reversed(servers))
            for side in order:
                runs[side].append(run_round(servers[side].address, prompts, streams,
                                            max_new_tokens))
        on, off = runs["ngram"], runs["off"]
        rate_on = spread([x["tokens_per_s"] for x in on])
        rate_off = spread([x["tokens_per_s"] for x in off])
        drafts = sum(x["drafts"] for x in on)
        rows.append({
            "workload": name, "streams": streams, "ngram": rate_on, "off": rate_off,
            "ratio": rate_on["median"] / rate_off["median"],
            "ratios": [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(on, off, strict=True)],
            "acceptance": sum(x["accepted"] for x in on) / drafts if drafts else 0.0,
            "accepted_per_token": (sum(x["accepted"] for x in on) / sum(x["tokens"] for x in on)),
            "identical": all(a["texts"] == b["texts"] for a, b in zip(on, off, strict=True)),
        })
        print(format_row(rows[-1]), flush=True)
    return rows


def format_row(row: dict) -> str:
    def rate(s: dict) -> str:
        return f"{s['median']:7.1f} [{s['min']:.1f}-{s['max']:.1f}]"
    return (f"{row['workload']:<10} {row['streams']:>3}  ngram {rate(row['ngram'])}  "
            f"off {rate(row['off'])}  {row['ratio']:.2f}x  accepted {row['acceptance']:.0%} of "
            f"drafts, {row['accepted_per_token']:.0%} of tokens  identical: {row['identical']}")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m bench.speculation", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="GGUF file or folder (default: the default model)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="float32")
    p.add_argument("--streams", default="1,32", help="concurrent requests per round")
    p.add_argument("--rounds", type=int, default=3, help="rounds per side (alternated)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--kv-cache-mb", type=int, default=512)
    p.add_argument("--json", type=Path, help="write the report here")
    args = p.parse_args(argv)
    if args.model is None:
        from shardlm_server.gateway.serve.default_model import default_model_path
        args.model = default_model_path()
    stream_counts = [int(s) for s in args.streams.split(",") if s]
    report: dict = {"benchmark": "bench.speculation",
                    "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
                    "model": str(args.model), "device": args.device, "dtype": args.dtype,
                    "machine": platform.machine(), "processor": platform.processor(),
                    "config": {"streams": stream_counts, "rounds": args.rounds,
                               "max_new_tokens": args.max_new_tokens,
                               "prompts": {k: len(v) for k, v in WORKLOADS.items()}}}
    servers: dict[str, Server] = {}
    try:
        for side in ("ngram", "off"):
            servers[side] = Server(args.model, device=args.device, dtype=args.dtype,
                                   kv_cache_mb=args.kv_cache_mb, start_timeout_s=600.0,
                                   extra=("--speculation", side))
        for server in servers.values():  # warm-up: the first requests after a load run slower
            run_round(server.address, WORKLOADS["chat"][:2], 1, 16)
        report["rows"] = [row for n in stream_counts
                          for row in measure(servers, n, args.rounds, args.max_new_tokens)]
    finally:
        for server in servers.values():
            server.stop()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return report


if __name__ == "__main__":
    main()
