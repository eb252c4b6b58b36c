"""Speculative decoding through the full stack: `shardlm serve --speculation ngram` against
`--speculation off`, on three workloads of chat requests, greedy, over gRPC.

    python -m bench.speculation                       # the default model, batch 1 and 32 streams
    python -m bench.speculation --model FILE.gguf --rounds 5 --streams 1,32 --json out.json
    python -m bench.speculation --llama-server        # also llama-server, ngram on and off

Workloads (bench/speculation_prompts.py): code editing (rewrite a given function with a small
change), grounded answers that quote a given passage, and open chat. Both servers run at once
(each `serve` with its own workers); only one is sent work at a time, and the rounds alternate
between them, the order flipped every round. Per workload and stream count, each side's
tokens/s: every generated token over the round's wall time (first request sent to last chunk),
median and [min-max] over the rounds, and their ratio; the drafts verified and accepted (the
final chunk's usage); and whether both sides produced the same text for every prompt (greedy
decoding with drafts must equal greedy decoding without).

With --llama-server (GGUF models; `make llama-server` builds it), two llama-servers on the same
file join the rounds: one with llama.cpp's own n-gram speculation (`--spec-type ngram-simple`,
its defaults) and one without, N slots, the same threads. They get the same prompts as token ids
(ShardLM's Tokenize renders the chat), greedy, ending at EOS or the same token limit; the report
sets ShardLM with speculation against llama-server with it, and both without.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench import llama_server
from bench.report import write_json
from bench.serve_process import Server
from bench.speculation_prompts import WORKLOADS

SHARDLM_SIDES = ("ngram", "off")
LLAMA_SIDES = {"llama_ngram": ("--spec-type", "ngram-simple"), "llama_off": ()}


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


def llama_generate(address: str, token_ids: list[int], max_new_tokens: int) -> dict:
    """One streamed greedy completion from llama-server, in generate()'s shape."""
    r = llama_server.stream(address, token_ids, max_new_tokens, None, ignore_eos=False)
    end = r["arrivals"][-1][0] if r["arrivals"] else r["start"]
    return {"text": r["text"], "tokens": sum(k for _t, k in r["arrivals"]), "start": r["start"],
            "end": end, "drafts": 0, "accepted": 0}


def tokenize_chats(address: str, prompts: list[str]) -> list[list[int]]:
    """Each prompt as one user message, rendered and tokenized by ShardLM."""
    import grpc
    from shardlm.gateway.v1 import gateway_pb2, gateway_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        return [list(stub.Tokenize(gateway_pb2.TokenizeRequest(messages=gateway_pb2.ChatMessages(
            messages=[gateway_pb2.ChatMessage(role="user", content=p)]))).token_ids)
            for p in prompts]


def run_round(call, prompts: list, streams: int, max_new_tokens: int) -> dict:
    """`call(prompt, max_new_tokens)` for each prompt: `streams` == 1, one after another; else
    `streams` concurrent requests, the prompts repeated to fill them."""
    if streams == 1:
        results = [call(p, max_new_tokens) for p in prompts]
    else:
        batch = [prompts[i % len(prompts)] for i in range(streams)]
        with ThreadPoolExecutor(max_workers=streams) as pool:
            results = list(pool.map(lambda p: call(p, max_new_tokens), batch))
    wall = max(r["end"] for r in results) - min(r["start"] for r in results)
    tokens = sum(r["tokens"] for r in results)
    return {"tokens_per_s": tokens / wall, "tokens": tokens,
            "drafts": sum(r["drafts"] for r in results),
            "accepted": sum(r["accepted"] for r in results),
            "texts": [r["text"] for r in results]}


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


class Side:
    """One server under test: how to send it a workload's prompts."""

    def __init__(self, name: str, address: str, llama: bool) -> None:
        self.name, self.address, self.llama = name, address, llama
        self._tokens: dict[str, list[list[int]]] = {}

    def prompts(self, workload: str, texts: list[str], shardlm_address: str) -> list:
        if not self.llama:
            return texts
        if workload not in self._tokens:
            self._tokens[workload] = tokenize_chats(shardlm_address, texts)
        return self._tokens[workload]

    def call(self, prompt, max_new_tokens: int) -> dict:
        if self.llama:
            return llama_generate(self.address, prompt, max_new_tokens)
        return generate(self.address, prompt, max_new_tokens)


def measure(sides: list[Side], streams: int, rounds: int, max_new_tokens: int,
            workloads: list[str]) -> list:
    shardlm = sides[0].address
    rows = []
    for name in workloads:
        texts = WORKLOADS[name]
        runs: dict[str, list[dict]] = {side.name: [] for side in sides}
        for r in range(rounds):
            for side in sides if r % 2 == 0 else list(reversed(sides)):
                runs[side.name].append(run_round(side.call, side.prompts(name, texts, shardlm),
                                                 streams, max_new_tokens))
        on, off = runs["ngram"], runs["off"]
        rates = {side: spread([x["tokens_per_s"] for x in runs[side]]) for side in runs}
        drafts = sum(x["drafts"] for x in on)
        row = {
            "workload": name, "streams": streams, **rates,
            "ratio": rates["ngram"]["median"] / rates["off"]["median"],
            "ratios": [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(on, off, strict=True)],
            "acceptance": sum(x["accepted"] for x in on) / drafts if drafts else 0.0,
            "accepted_per_token": (sum(x["accepted"] for x in on) / sum(x["tokens"] for x in on)),
            "identical": all(a["texts"] == b["texts"] for a, b in zip(on, off, strict=True)),
        }
        for ours, theirs in (("ngram", "llama_ngram"), ("off", "llama_off")):
            if theirs in runs:
                row[f"{ours}_vs_llama"] = rates[ours]["median"] / rates[theirs]["median"]
                row[f"{ours}_vs_llama_ratios"] = [
                    a["tokens_per_s"] / b["tokens_per_s"]
                    for a, b in zip(runs[ours], runs[theirs], strict=True)]
        rows.append(row)
        print(format_row(row), flush=True)
    return rows


def format_row(row: dict) -> str:
    def rate(s: dict) -> str:
        return f"{s['median']:7.1f} [{s['min']:.1f}-{s['max']:.1f}]"
    line = (f"{row['workload']:<10} {row['streams']:>3}  ngram {rate(row['ngram'])}  "
            f"off {rate(row['off'])}  {row['ratio']:.2f}x  accepted {row['acceptance']:.0%} of "
            f"drafts, {row['accepted_per_token']:.0%} of tokens  identical: {row['identical']}")
    if "llama_ngram" in row:
        line += (f"\n{'':<14} llama-server ngram {rate(row['llama_ngram'])}  off "
                 f"{rate(row['llama_off'])}  ShardLM/llama-server: ngram "
                 f"{row['ngram_vs_llama']:.2f}x, off {row['off_vs_llama']:.2f}x")
    return line


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m bench.speculation", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="GGUF file or folder (default: the default model)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="float32")
    p.add_argument("--streams", default="1,32", help="concurrent requests per round")
    p.add_argument("--rounds", type=int, default=3, help="rounds per side (alternated)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--workloads", default=",".join(WORKLOADS),
                   help=f"comma-separated, of {', '.join(WORKLOADS)}")
    p.add_argument("--kv-cache-mb", type=int, default=512)
    p.add_argument("--llama-server", action="store_true",
                   help="also llama-server on the same GGUF file, its n-gram speculation on and off")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="llama-server's threads (ShardLM's CPU worker uses every core)")
    p.add_argument("--json", type=Path, help="write the report here")
    args = p.parse_args(argv)
    if args.model is None:
        from shardlm_server.gateway.serve.default_model import default_model_path
        args.model = default_model_path()
    stream_counts = [int(s) for s in args.streams.split(",") if s]
    workloads = [w for w in args.workloads.split(",") if w]
    if unknown := [w for w in workloads if w not in WORKLOADS]:
        p.error(f"unknown workload {unknown[0]!r} (one of {', '.join(WORKLOADS)})")
    report: dict = {"benchmark": "bench.speculation",
                    "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
                    "model": str(args.model), "device": args.device, "dtype": args.dtype,
                    "machine": platform.machine(), "processor": platform.processor(),
                    "config": {"streams": stream_counts, "rounds": args.rounds,
                               "max_new_tokens": args.max_new_tokens,
                               "prompts": {k: len(WORKLOADS[k]) for k in workloads}}}
    servers: list = []
    sides: list[Side] = []
    try:
        for name in SHARDLM_SIDES:
            servers.append(Server(args.model, device=args.device, dtype=args.dtype,
                                  kv_cache_mb=args.kv_cache_mb, start_timeout_s=600.0,
                                  extra=("--speculation", name)))
            sides.append(Side(name, servers[-1].address, llama=False))
        if args.llama_server:
            exe = llama_server.binary()
            if exe is None:
                raise SystemExit(f"no llama-server: build it with `{llama_server.BUILD_HINT}`")
            report["llama_server"] = {"binary": str(exe), "threads": args.threads,
                                      "speculation": " ".join(LLAMA_SIDES["llama_ngram"])}
            for name, extra in LLAMA_SIDES.items():
                servers.append(llama_server.LlamaServer(
                    exe, args.model, slots=max(stream_counts), threads=args.threads,
                    slot_tokens=1024 + args.max_new_tokens, extra=extra))
                sides.append(Side(name, servers[-1].address, llama=True))
        for side in sides:  # warm-up: the first requests after a load run slower
            run_round(side.call, side.prompts("chat", WORKLOADS["chat"], sides[0].address)[:2],
                      1, 16)
        report["rows"] = [row for n in stream_counts
                          for row in measure(sides, n, args.rounds, args.max_new_tokens, workloads)]
    finally:
        for server in servers:
            server.stop()
    write_json(args.json, report)
    return report


if __name__ == "__main__":
    main()
