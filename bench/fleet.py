"""Cache-aware routing across a fleet: two ShardLM replicas behind two SMG routers, requests
alternating between the routers, as a highly available deployment runs them.

    python -m bench.fleet                          # the default model, both cache sizes
    python -m bench.fleet --rounds 2 --json out.json

Workload (bench/fleet_prompts.py): six ~400-token system prompts x six user questions, shuffled,
`--in-flight` requests at a time through the `openai` client (streamed chat completions, greedy),
request i to router i % 2. Each configuration starts fresh replicas and routers:

- round_robin: SMG's round robin (what a cache-blind router computes);
- cache_aware, events off: SMG's cache-aware policy on its own approximate tree (the replicas run
  `--no-kv-events`, so each router sees only the half of the traffic it routed itself);
- cache_aware, events on: the same policy on the replicas' KV events, which both routers receive.

Prompt tokens computed: what the replicas prefilled (their Prometheus prompt tokens less those the
prefix cache served), summed over the fleet; the ratio is to round robin's at the same cache
size. TTFT p50: first streamed token, as the client sees it. Outputs: whether every request's text
equals round robin's (greedy decoding must not depend on where a request ran). The second cache
size (`--small-kv-cache-mb`) holds fewer blocks than the workload's prompts need, so the caches
evict and the routers must learn it from `removed` events. Rounds repeat the whole sequence with
another shuffle; figures are medians with [min-max].
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import shutil
import statistics
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.fleet_prompts import TOPICS, workload
from bench.report import write_json
from bench.serve_process import Server, ServerProcess, free_port, metric_sum

CONFIGS = (("round_robin", "round_robin", True), ("cache_aware, events off", "cache_aware", False),
           ("cache_aware, events on", "cache_aware", True))


class Router(ServerProcess):
    """`smg launch` on loopback in front of `workers` (gRPC engine ports)."""

    def __init__(self, workers: list[str], policy: str, start_timeout_s: float = 120.0) -> None:
        exe = shutil.which("smg", path=str(Path(sys.executable).parent)) or shutil.which("smg")
        if exe is None:
            raise SystemExit("no smg router: install the test extras (`make install`)")
        self.port, self.metrics_port = free_port(), free_port()
        super().__init__([exe, "launch", "--host", "127.0.0.1", "--port", str(self.port),
                          "--worker-urls", *workers, "--policy", policy,
                          "--prometheus-port", str(self.metrics_port), "--log-level", "warn"])
        self.base = f"http://127.0.0.1:{self.port}/v1"
        self.model = ""
        self.wait_until(self._listed, start_timeout_s, "smg")

    def _listed(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.base}/models", timeout=5) as reply:
                models = json.load(reply)["data"]
        except (OSError, ValueError, KeyError):
            return False
        self.model = models[0]["id"] if models else ""
        return bool(self.model) and self._answers()

    def _answers(self) -> bool:
        """Whether a one-token chat goes through (SMG lists the model before it has fetched the
        tokenizer, and answers 503 until then)."""
        body = json.dumps({"model": self.model, "max_tokens": 1,
                           "messages": [{"role": "user", "content": "Hi"}]}).encode()
        request = urllib.request.Request(f"{self.base}/chat/completions", body,
                                         {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=30):
                return True
        except OSError:
            return False


def chat(client, model: str, system: str, question: str, max_tokens: int) -> dict:
    start = time.perf_counter()
    first, text = None, []
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "system", "content": system},
                               {"role": "user", "content": question}],
        max_tokens=max_tokens, temperature=0, stream=True)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            text.append(chunk.choices[0].delta.content)
    return {"ttft_s": (first or time.perf_counter()) - start, "text": "".join(text)}


def computed_prompt_tokens(replicas: list[Server]) -> list[float]:
    out = []
    for r in replicas:
        m = r.metrics()
        out.append(metric_sum(m, "shardlm_prompt_tokens_total")
                   - metric_sum(m, "shardlm_cached_prompt_tokens_total"))
    return out


def run_config(model: Path, policy: str, events: bool, kv_cache_mb: int, requests: list,
               in_flight: int, max_tokens: int) -> dict:
    from openai import OpenAI

    extra = () if events else ("--no-kv-events",)
    ports = [free_port(), free_port()]
    replicas = [Server(model, kv_cache_mb=kv_cache_mb, extra=("--smg-port", str(p), *extra))
                for p in ports]
    routers: list[Router] = []
    try:
        workers = [f"grpc://127.0.0.1:{p}" for p in ports]
        routers = [Router(workers, policy) for _ in range(2)]
        clients = [OpenAI(base_url=r.base, api_key="none", max_retries=0) for r in routers]
        before = computed_prompt_tokens(replicas)
        blocks = metric_sum(replicas[0].metrics(), "shardlm_kv_blocks_total")
        start = time.perf_counter()
        with ThreadPoolExecutor(in_flight) as pool:
            results = list(pool.map(
                lambda ir: chat(clients[ir[0] % 2], routers[ir[0] % 2].model, *ir[1], max_tokens),
                enumerate(requests)))
        wall = time.perf_counter() - start
        after = computed_prompt_tokens(replicas)
    finally:
        for process in [*routers, *replicas]:
            process.stop()
    per_replica = [a - b for a, b in zip(after, before, strict=True)]
    return {"computed_prompt_tokens": sum(per_replica), "per_replica": per_replica,
            "ttft_p50_ms": 1000 * statistics.median(r["ttft_s"] for r in results),
            "wall_s": wall, "kv_cache_tokens": blocks * 16, "texts": [r["text"] for r in results]}


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m bench.fleet", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="GGUF file or folder (default: the default model)")
    p.add_argument("--rounds", type=int, default=1, help="repeats, each with another shuffle")
    p.add_argument("--in-flight", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--kv-cache-mb", type=int, default=256)
    p.add_argument("--small-kv-cache-mb", type=int, default=112,
                   help="the second cache size, too small for every prompt (0: skip it)")
    p.add_argument("--json", type=Path, help="write the report here")
    args = p.parse_args(argv)
    if args.model is None:
        from shardlm_server.gateway.serve.default_model import default_model_path
        args.model = default_model_path()
    sizes = [s for s in (args.kv_cache_mb, args.small_kv_cache_mb) if s]
    report: dict = {"benchmark": "bench.fleet",
                    "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
                    "model": str(args.model), "machine": platform.machine(),
                    "processor": platform.processor(),
                    "config": {"rounds": args.rounds, "in_flight": args.in_flight,
                               "max_tokens": args.max_tokens, "prompts": len(TOPICS)},
                    "rows": []}
    runs: dict = {}
    for round_index in range(args.rounds):
        requests = workload(seed=round_index)
        for mb in sizes:
            for name, policy, events in CONFIGS:
                run = run_config(args.model, policy, events, mb, requests, args.in_flight,
                                 args.max_tokens)
                runs.setdefault((mb, name), []).append(run)
                base = runs[(mb, CONFIGS[0][0])][round_index]
                run["ratio"] = run["computed_prompt_tokens"] / base["computed_prompt_tokens"]
                run["same_outputs"] = sum(a == b for a, b in zip(run["texts"], base["texts"],
                                                                  strict=True))
                print(f"round {round_index + 1} kv {mb} MB ({run['kv_cache_tokens']:.0f} tokens) "
                      f"{name:<24} computed {run['computed_prompt_tokens']:>7.0f} "
                      f"({run['ratio']:.2f}x) per replica {run['per_replica']} TTFT p50 "
                      f"{run['ttft_p50_ms']:.0f} ms, outputs same {run['same_outputs']}/"
                      f"{len(requests)}", flush=True)
    print(f"\n{'kv cache':>10} {'routing':<24} {'prompt tokens computed':>24} {'vs round robin':>18}"
          f" {'TTFT p50 ms':>12} {'same outputs':>13}")
    for (mb, name), rs in runs.items():
        row = {"kv_cache_mb": mb, "kv_cache_tokens": rs[0]["kv_cache_tokens"], "routing": name,
               "computed_prompt_tokens": spread([r["computed_prompt_tokens"] for r in rs]),
               "ratio": spread([r["ratio"] for r in rs]),
               "ttft_p50_ms": spread([r["ttft_p50_ms"] for r in rs]),
               "same_outputs": sum(r["same_outputs"] for r in rs),
               "requests": sum(len(r["texts"]) for r in rs)}
        report["rows"].append(row)
        c, q, t = row["computed_prompt_tokens"], row["ratio"], row["ttft_p50_ms"]
        print(f"{mb:>7} MB {name:<24} {c['median']:>10.0f} [{c['min']:.0f}-{c['max']:.0f}] "
              f"{q['median']:>8.2f}x [{q['min']:.2f}-{q['max']:.2f}] {t['median']:>12.0f} "
              f"{row['same_outputs']:>6}/{row['requests']}")
    write_json(args.json, report)
    return report


if __name__ == "__main__":
    main()
