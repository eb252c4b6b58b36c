"""Prefix-cache benchmark: the same workloads against a gateway with the prefix cache on and one
started with `--no-prefix-cache`, alternating between them in one run.

    python -m bench.prefix_bench                 # a generated checkpoint (shape `llama-34m`)
    python -m bench.prefix_bench --model DIR --rounds 3

Two scenarios, each measured cold (ResetCache of all before every round):

* shared system prompt: 64 Generate calls whose prompts are one 1,000-token system prompt and a
  distinct 50-token user turn, 8 in flight at a time, 16 new tokens each (greedy). Reported: TTFT
  p50 (client side, request sent to first token) and the total wall time; both modes' outputs must
  be identical.
* chat replay: one conversation of 8 turns replayed as stateless Generate calls, each resending
  the whole transcript (token ids: a 200-token system prompt, then per turn 60 user tokens and
  the previous replies of 32 tokens). Reported: prefill tokens the workers computed
  (`shardlm_prefill_batch_tokens_sum`) against the tokens actually new (the first call's prompt,
  then each call's new user turn).

Prints a table and writes JSON to bench/results/. Exits 1 when outputs differ or a target is
missed (TTFT p50 with the cache at most 1/4 of without, total time at most 1/2, chat-replay
prefill at most 1.2x the new tokens).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import random
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
from shardlm.common.v1 import common_pb2
from shardlm.gateway.v1 import gateway_pb2, gateway_pb2_grpc

from bench.serve_process import Server, metric_sum
from bench.shapes import Shape

REPO = Path(__file__).resolve().parents[1]
# A Llama of ~34M parameters (9.4M outside the embeddings; GQA 6/2, head_dim 64, a 32k
# vocabulary): prefill dominates as in real models, yet it runs on two CPU cores.
BENCH_SHAPE = Shape("llama-34m", "LlamaForCausalLM", dict(
    vocab_size=32000, hidden_size=384, intermediate_size=1024, num_hidden_layers=6,
    num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=4096,
    bos_token_id=1, eos_token_id=2, tie_word_embeddings=False),
    "Llama, GQA 6/2, 6 layers, hidden 384, vocab 32000 (~34M parameters)")
SYSTEM_TOKENS, USER_TOKENS, REQUESTS, CONCURRENCY, NEW_TOKENS = 1000, 50, 64, 8, 16
CHAT_SYSTEM, CHAT_TURNS, CHAT_USER, CHAT_REPLY = 200, 8, 60, 32
TARGETS = {"ttft_ratio": 0.25, "total_ratio": 0.5, "chat_prefill_ratio": 1.2}


def _random_tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


def _generate(stub, prompt: list[int], max_new: int) -> tuple[list[int], float, int]:
    """The call's tokens, its client-side TTFT and the prompt tokens it took from the cache."""
    request = gateway_pb2.GenerateRequest(
        token_ids=gateway_pb2.TokenIds(token_ids=prompt),
        stop=common_pb2.StopConditions(max_new_tokens=max_new, ignore_eos=True))
    start, ttft, ids, cached = time.perf_counter(), None, [], 0
    for chunk in stub.Generate(request, timeout=600):
        if chunk.token_ids and ttft is None:
            ttft = time.perf_counter() - start
        ids += list(chunk.token_ids)
        if chunk.finish_reason:
            cached = chunk.usage.cached_tokens
    return ids, ttft or 0.0, cached


def shared_system_prompt(server: Server, vocab: int, seed: int) -> dict:
    rng = random.Random(seed)
    system = [1, *_random_tokens(rng, SYSTEM_TOKENS - 1, vocab)]
    prompts = [system + _random_tokens(rng, USER_TOKENS, vocab) for _ in range(REQUESTS)]
    channel = grpc.insecure_channel(server.address)
    stub = gateway_pb2_grpc.GatewayServiceStub(channel)
    try:
        stub.ResetCache(gateway_pb2.ResetCacheRequest(all=True))
        start = time.perf_counter()
        with ThreadPoolExecutor(CONCURRENCY) as pool:
            results = list(pool.map(lambda p: _generate(stub, p, NEW_TOKENS), prompts))
        total = time.perf_counter() - start
    finally:
        channel.close()
    return {"ttft_p50_s": statistics.median(r[1] for r in results), "total_s": total,
            "cached_tokens": sum(r[2] for r in results), "outputs": [r[0] for r in results]}


def chat_replay(server: Server, vocab: int, seed: int) -> dict:
    rng = random.Random(seed + 1)
    transcript = [1, *_random_tokens(rng, CHAT_SYSTEM - 1, vocab)]
    channel = grpc.insecure_channel(server.address)
    stub = gateway_pb2_grpc.GatewayServiceStub(channel)
    new_tokens, replies = 0, []
    try:
        stub.ResetCache(gateway_pb2.ResetCacheRequest(all=True))
        before = metric_sum(server.metrics(), "shardlm_prefill_batch_tokens_sum")
        for turn in range(CHAT_TURNS):
            user = _random_tokens(rng, CHAT_USER, vocab)
            new_tokens += len(user) + (len(transcript) if turn == 0 else 0)
            transcript += user
            reply, _ttft, _cached = _generate(stub, transcript, CHAT_REPLY)
            replies.append(reply)
            transcript += reply
        computed = metric_sum(server.metrics(), "shardlm_prefill_batch_tokens_sum") - before
    finally:
        channel.close()
    return {"prefill_tokens": computed, "new_tokens": new_tokens,
            "prefill_ratio": computed / new_tokens, "outputs": replies}


def run(model: Path, *, rounds: int, seed: int, kv_cache_mb: int, log=print) -> dict:
    servers = {}
    try:
        for mode in ("off", "on"):
            servers[mode] = Server(model, kv_cache_mb=kv_cache_mb,
                                   extra=("--prefix-cache" if mode == "on" else "--no-prefix-cache",))
        with grpc.insecure_channel(servers["on"].address) as channel:
            vocab = gateway_pb2_grpc.GatewayServiceStub(channel).GetModelInfo(
                gateway_pb2.GetModelInfoRequest(), timeout=10).model.vocab_size
        runs: dict[str, list] = {"off": [], "on": []}
        for r in range(rounds):
            for mode in ("off", "on"):  # alternate, so drift in the machine's load hits both
                log(f"round {r + 1}/{rounds}: prefix cache {mode}")
                runs[mode].append({"shared": shared_system_prompt(servers[mode], vocab, seed + r),
                                   "chat": chat_replay(servers[mode], vocab, seed + r)})
    finally:
        for server in servers.values():
            server.stop()
    return summarize(runs)


def summarize(runs: dict[str, list]) -> dict:
    def median(mode: str, scenario: str, key: str) -> float:
        return statistics.median(run[scenario][key] for run in runs[mode])

    identical = all(a[s]["outputs"] == b[s]["outputs"] for a, b in zip(runs["off"], runs["on"],
                                                                       strict=True)
                    for s in ("shared", "chat"))
    result = {mode: {"ttft_p50_s": median(mode, "shared", "ttft_p50_s"),
                     "total_s": median(mode, "shared", "total_s"),
                     "cached_tokens": median(mode, "shared", "cached_tokens"),
                     "chat_prefill_tokens": median(mode, "chat", "prefill_tokens"),
                     "chat_new_tokens": median(mode, "chat", "new_tokens"),
                     "chat_prefill_ratio": median(mode, "chat", "prefill_ratio")}
              for mode in ("off", "on")}
    on, off = result["on"], result["off"]
    result["ttft_ratio"] = on["ttft_p50_s"] / off["ttft_p50_s"]
    result["total_ratio"] = on["total_s"] / off["total_s"]
    result["chat_prefill_ratio"] = on["chat_prefill_ratio"]
    result["outputs_identical"] = identical
    result["rounds"] = len(runs["on"])
    result["pass"] = identical and all(result[k] <= v for k, v in TARGETS.items())
    return result


def table(r: dict) -> str:
    on, off = r["on"], r["off"]
    rows = [
        ("", "cache off", "cache on", "on / off (target)"),
        ("shared prompt: TTFT p50", f"{off['ttft_p50_s'] * 1000:.0f} ms",
         f"{on['ttft_p50_s'] * 1000:.0f} ms", f"{r['ttft_ratio']:.2f} (<= 0.25)"),
        ("shared prompt: total time", f"{off['total_s']:.1f} s", f"{on['total_s']:.1f} s",
         f"{r['total_ratio']:.2f} (<= 0.50)"),
        ("shared prompt: cached prompt tokens", f"{off['cached_tokens']:.0f}",
         f"{on['cached_tokens']:.0f}", ""),
        ("chat replay: prefill tokens / new", f"{off['chat_prefill_tokens']:.0f} / "
         f"{off['chat_new_tokens']:.0f}", f"{on['chat_prefill_tokens']:.0f} / "
         f"{on['chat_new_tokens']:.0f}", f"{r['chat_prefill_ratio']:.2f}x new (<= 1.2x)"),
        ("outputs identical", "", "", "yes" if r["outputs_identical"] else "NO"),
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |"
             for row in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def bench_model(folder: Path) -> Path:
    import torch

    from bench.shapes import build_checkpoint

    build_checkpoint(folder, BENCH_SHAPE, torch.float32, torch.device("cpu"))
    return folder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path,
                        help=f"checkpoint folder (default: generated, {BENCH_SHAPE.note})")
    parser.add_argument("--rounds", type=int, default=1, help="off/on alternations (median)")
    parser.add_argument("--kv-cache-mb", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="shardlm-prefix-") as tmp:
        model = args.model or bench_model(Path(tmp) / "llama-34m")
        result = run(model, rounds=args.rounds, seed=args.seed, kv_cache_mb=args.kv_cache_mb)
    print(table(result))
    print("PASS" if result["pass"] else "FAIL")
    args.out.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.UTC)
    path = args.out / f"prefix-{now:%Y%m%d-%H%M%S}.json"
    path.write_text(json.dumps({
        "benchmark": "prefix_cache", "date": now.isoformat(timespec="seconds"),
        "machine": platform.machine(), "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "model": str(args.model or BENCH_SHAPE.note), **result}, indent=2), encoding="utf-8")
    print(f"wrote {path}")
    return 0 if result["pass"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
