"""Soak / load test of the whole stack: `shardlm serve` in a subprocess, then many concurrent
streaming Generate calls for a fixed time, a share of them cancelled or given a deadline that
runs out mid-stream.

    python -m bench.load_test --streams 200 --seconds 60 --cancel-fraction 0.3
    python -m bench.load_test --model DIR ...     # default: a tiny random Llama built here

Checks, each a failure of the run (exit status 1) when it does not hold:

* no call ends INTERNAL or UNKNOWN (client side) and the server counts none either;
* every completed call streamed exactly the greedy tokens the same prompt gave alone before the
  load (prefix of a 48-token ignore_eos run), and every cancelled or expired one a prefix of them;
* once the load ends, the KV cache is empty again (`shardlm_kv_blocks_used` from /metrics):
  every block is free or a cached prefix block that no sequence holds (the prefix cache keeps
  published blocks after their sequences end; `shardlm_prefix_cache_blocks` must equal
  `shardlm_prefix_cache_idle_blocks`);
* the gateway process's RSS at the end is within +10% of its RSS after warm-up (sampled once
  the first 20% of the run is over), so nothing grows with the number of calls served.

Cancelled and deadline-expired calls are expected; RESOURCE_EXHAUSTED (queue or cache full) is
allowed and counted. Prints a table and writes JSON to bench/results/. The CI form of this run
is tests/gateway/test_load.py.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import random
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from shardlm.common.v1 import common_pb2
from shardlm.gateway.v1 import gateway_pb2, gateway_pb2_grpc

from bench.serve_process import Server, metric_sum

REPO = Path(__file__).resolve().parents[1]
EXPECTED_TOKENS = 48
MIN_NEW_TOKENS = 4
WARMUP_FRACTION = 0.2
RSS_GROWTH_LIMIT = 0.10


# ----------------------------------------------------------------------------- the server
# ----------------------------------------------------------------------------- the load
@dataclass
class Prompt:
    name: str
    request: dict  # GenerateRequest fields for the prompt (token_ids or text)
    expected: list[int] = field(default_factory=list)


def make_prompts(vocab: int, seed: int = 0) -> list[Prompt]:
    rng = random.Random(seed)
    prompts = [Prompt(f"ids{n}", {"token_ids": gateway_pb2.TokenIds(
        token_ids=[rng.randrange(3, vocab) for _ in range(n)])}) for n in (1, 5, 17, 40)]
    prompts.append(Prompt("text", {"text": "To be, or not to be, that is the question:"}))
    prompts.append(Prompt("unicode", {"text": "你好，世界。天气很好。🙂 café"}))
    return prompts


def generate_request(prompt: Prompt, max_new: int) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(
        **prompt.request, sampling=common_pb2.SamplingParams(),
        stop=common_pb2.StopConditions(max_new_tokens=max_new, ignore_eos=True))


def precompute(address: str, prompts: list[Prompt]) -> None:
    """Each prompt alone, greedy, EXPECTED_TOKENS tokens: the reference for the load."""
    with grpc.insecure_channel(address) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        for p in prompts:
            chunks = list(stub.Generate(generate_request(p, EXPECTED_TOKENS), timeout=60))
            p.expected = [t for c in chunks for t in c.token_ids]
            assert len(p.expected) == EXPECTED_TOKENS, (p.name, len(p.expected))


@dataclass
class CallResult:
    prompt: str
    max_new: int
    plan: str  # "complete", "cancel" or "deadline"
    outcome: str  # "completed", "cancelled", "deadline", or a status code name
    tokens: int
    ttft_s: float | None
    problem: str = ""


@dataclass
class Pace:
    """Running mean of how long completed calls take, to aim deadlines at mid-stream."""

    seconds: float = 0.0
    tokens: int = 0

    def add(self, seconds: float, tokens: int) -> None:
        self.seconds += seconds
        self.tokens += tokens

    def call_seconds(self, max_new: int) -> float:
        return max_new * self.seconds / self.tokens if self.tokens else 1.0


async def one_call(stub, prompt: Prompt, rng: random.Random, cancel_fraction: float,
                   pace: Pace) -> CallResult:
    max_new = rng.randint(MIN_NEW_TOKENS, EXPECTED_TOKENS)
    plan, timeout, cancel_after = "complete", 120.0, -1
    if rng.random() < cancel_fraction:
        if rng.random() < 0.5:  # cancel before the first token or after some
            plan, cancel_after = "cancel", rng.randint(0, max_new - 1)
        else:  # a deadline that passes in the queue, mid-stream, or (now and then) not at all
            plan, timeout = "deadline", rng.uniform(0.02, 1.2) * pace.call_seconds(max_new)
    started = time.monotonic()
    call = stub.Generate(generate_request(prompt, max_new), timeout=timeout)
    ids: list[int] = []
    ttft = None
    last = None
    try:
        if cancel_after == 0:
            await asyncio.sleep(rng.uniform(0.0, 0.05))
            call.cancel()
        else:
            async for chunk in call:
                if chunk.token_ids and ttft is None:
                    ttft = time.monotonic() - started
                ids += chunk.token_ids
                last = chunk
                if 0 < cancel_after <= len(ids):
                    call.cancel()
                    break
        code = await call.code()
    except grpc.aio.AioRpcError as err:
        code = err.code()
    except asyncio.CancelledError:
        code = grpc.StatusCode.CANCELLED
    if plan == "cancel" and code in (grpc.StatusCode.CANCELLED, grpc.StatusCode.OK):
        outcome = "cancelled"  # OK: the call had ended on the server before the cancel
    elif plan == "deadline" and code == grpc.StatusCode.DEADLINE_EXCEEDED:
        outcome = "deadline"
    elif code != grpc.StatusCode.OK:
        outcome = code.name
    elif last is not None and last.finish_reason == common_pb2.FINISH_REASON_DEADLINE_EXCEEDED:
        outcome = "deadline"  # the server ended the stream early for the deadline
    else:
        outcome = "completed"
        pace.add(time.monotonic() - started, len(ids))
    result = CallResult(prompt.name, max_new, plan, outcome, len(ids), ttft)
    if ids != prompt.expected[: len(ids)]:
        result.problem = f"tokens {ids} are not a prefix of {prompt.expected}"
    elif outcome == "completed":
        if len(ids) != max_new:
            result.problem = f"{len(ids)} tokens for max_new_tokens {max_new}"
        elif last.finish_reason != common_pb2.FINISH_REASON_LENGTH:
            result.problem = f"finish_reason {last.finish_reason}"
    return result


async def run_streams(address: str, prompts: list[Prompt], *, streams: int, seconds: float,
                      cancel_fraction: float, seed: int, on_progress=None) -> tuple[
                          list[CallResult], float]:
    """`streams` concurrent callers, each starting a new call as soon as its last one ended,
    until `seconds` have passed (calls under way then run to their end)."""
    channels = [grpc.aio.insecure_channel(address, options=[
        ("grpc.use_local_subchannel_pool", 1)]) for _ in range(max(1, min(8, streams // 25)))]
    stubs = [gateway_pb2_grpc.GatewayServiceStub(c) for c in channels]
    results: list[CallResult] = []
    pace = Pace()
    start = time.monotonic()
    end = start + seconds

    async def caller(i: int) -> None:
        rng = random.Random(seed * 100_003 + i)
        stub = stubs[i % len(stubs)]
        await asyncio.sleep(rng.uniform(0, min(1.0, seconds / 10)))  # no thundering herd
        while time.monotonic() < end:
            results.append(await one_call(stub, rng.choice(prompts), rng, cancel_fraction,
                                          pace))

    async def progress() -> None:
        while on_progress is not None:
            await asyncio.sleep(0.25)
            on_progress(time.monotonic() - start)

    ticker = asyncio.ensure_future(progress())
    try:
        await asyncio.gather(*(caller(i) for i in range(streams)))
    finally:
        ticker.cancel()
        for c in channels:
            await c.close()
    return results, time.monotonic() - start


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


# ----------------------------------------------------------------------------- the run
@dataclass
class Report:
    streams: int
    seconds: float
    cancel_fraction: float
    calls: int = 0
    completed: int = 0
    cancelled: int = 0
    deadline: int = 0
    deadline_mid_stream: int = 0
    cancelled_mid_stream: int = 0
    resource_exhausted: int = 0
    other_codes: dict = field(default_factory=dict)
    tokens: int = 0
    wall_s: float = 0.0
    tokens_per_s: float = 0.0
    ttft_p50_s: float | None = None
    ttft_p99_s: float | None = None
    rss_warm_bytes: int = 0
    rss_end_bytes: int = 0
    rss_peak_bytes: int = 0
    rss_growth: float = 0.0
    workers_rss_end_bytes: int = 0
    kv_blocks_used_end: float = -1.0
    kv_blocks_total: float = 0.0
    prefix_cache_blocks_end: float = 0.0  # cached prefix blocks after the load...
    prefix_cache_idle_blocks_end: float = 0.0  # ...of which no sequence holds (must be all)
    prefix_cache_hit_tokens: float = 0.0
    server_codes: dict = field(default_factory=dict)
    preemptions: float = 0.0
    mismatches: list = field(default_factory=list)
    failures: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures


def run(model: Path, *, streams: int, seconds: float, cancel_fraction: float, seed: int = 0,
        kv_cache_mb: int = 64, tp: int = 1, log=print) -> Report:
    report = Report(streams, seconds, cancel_fraction)
    with Server(model, kv_cache_mb=kv_cache_mb, tp=tp) as server:
        with grpc.insecure_channel(server.address) as channel:
            info = gateway_pb2_grpc.GatewayServiceStub(channel).GetModelInfo(
                gateway_pb2.GetModelInfoRequest(), timeout=10)
        prompts = make_prompts(info.model.vocab_size, seed)
        precompute(server.address, prompts)
        log(f"gateway pid {server.pid} on {server.address}; {len(prompts)} prompts precomputed; "
            f"{streams} streams for {seconds:.0f} s")
        rss = {"warm": 0, "peak": 0}

        def sample(elapsed: float) -> None:
            value = server.rss_bytes()
            rss["peak"] = max(rss["peak"], value)
            if not rss["warm"] and elapsed >= WARMUP_FRACTION * seconds:
                rss["warm"] = value

        results, wall = asyncio.run(run_streams(
            server.address, prompts, streams=streams, seconds=seconds,
            cancel_fraction=cancel_fraction, seed=seed, on_progress=sample))
        report.wall_s = wall
        _settle_kv(server, report)
        report.rss_warm_bytes = rss["warm"] or server.rss_bytes()
        report.rss_end_bytes = server.rss_bytes()
        report.rss_peak_bytes = max(rss["peak"], report.rss_end_bytes)
        report.workers_rss_end_bytes = server.workers_rss_bytes()
        _still_correct(server.address, prompts[0], report)
        samples = server.metrics()
        report.server_codes = {
            code: metric_sum(samples, "shardlm_requests_total", code=code)
            for code in ("OK", "CANCELLED", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED",
                         "INTERNAL", "UNKNOWN", "UNAVAILABLE")}
        report.preemptions = metric_sum(samples, "shardlm_preemptions_total")
        report.kv_blocks_total = metric_sum(samples, "shardlm_kv_blocks_total")
        report.prefix_cache_hit_tokens = metric_sum(samples, "shardlm_prefix_cache_hit_tokens_total")
    _summarize(results, report)
    return report


def _settle_kv(server: Server, report: Report, timeout_s: float = 15.0) -> None:
    """The gauge follows the scheduler's iterations: give it a moment to reach zero."""
    deadline = time.monotonic() + timeout_s
    while True:
        samples = server.metrics()
        used = metric_sum(samples, "shardlm_kv_blocks_used")
        if used == 0 or time.monotonic() > deadline:
            report.kv_blocks_used_end = used
            report.prefix_cache_blocks_end = metric_sum(samples, "shardlm_prefix_cache_blocks")
            report.prefix_cache_idle_blocks_end = metric_sum(samples,
                                                             "shardlm_prefix_cache_idle_blocks")
            return
        time.sleep(0.1)


def _still_correct(address: str, prompt: Prompt, report: Report) -> None:
    with grpc.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                           timeout=10)
        if health.status != health_pb2.HealthCheckResponse.SERVING:
            report.failures.append(f"health {health.status} after the load")
        chunks = gateway_pb2_grpc.GatewayServiceStub(channel).Generate(
            generate_request(prompt, EXPECTED_TOKENS), timeout=60)
        if [t for c in chunks for t in c.token_ids] != prompt.expected:
            report.failures.append("greedy output changed after the load")


def _summarize(results: list[CallResult], r: Report) -> None:
    outcomes = Counter(c.outcome for c in results)
    r.calls = len(results)
    r.completed = outcomes.pop("completed", 0)
    r.cancelled = outcomes.pop("cancelled", 0)
    r.deadline = outcomes.pop("deadline", 0)
    r.resource_exhausted = outcomes.pop("RESOURCE_EXHAUSTED", 0)
    r.other_codes = dict(outcomes)
    r.deadline_mid_stream = sum(1 for c in results if c.outcome == "deadline" and c.tokens)
    r.cancelled_mid_stream = sum(1 for c in results if c.outcome == "cancelled" and c.tokens)
    r.tokens = sum(c.tokens for c in results)
    r.tokens_per_s = r.tokens / r.wall_s if r.wall_s else 0.0
    ttfts = [c.ttft_s for c in results if c.ttft_s is not None]
    r.ttft_p50_s, r.ttft_p99_s = percentile(ttfts, 50), percentile(ttfts, 99)
    r.mismatches = [asdict(c) for c in results if c.problem][:20]
    r.rss_growth = (r.rss_end_bytes - r.rss_warm_bytes) / r.rss_warm_bytes if r.rss_warm_bytes \
        else 0.0
    bad = {k: v for k, v in r.other_codes.items() if k in ("INTERNAL", "UNKNOWN")}
    if bad:
        r.failures.append(f"client saw {bad}")
    unexpected = {k: v for k, v in r.other_codes.items() if k not in ("INTERNAL", "UNKNOWN")}
    if unexpected:
        r.failures.append(f"unexpected final statuses {unexpected}")
    if r.server_codes.get("INTERNAL") or r.server_codes.get("UNKNOWN"):
        r.failures.append(f"server counted {r.server_codes}")
    problems = sum(1 for c in results if c.problem)
    if problems:
        r.failures.append(f"{problems} calls streamed wrong tokens, e.g. {r.mismatches[0]}")
    if r.completed == 0:
        r.failures.append("no call completed")
    if r.kv_blocks_used_end != 0:
        r.failures.append(f"{r.kv_blocks_used_end:.0f} KV blocks still used after the load")
    if r.prefix_cache_blocks_end != r.prefix_cache_idle_blocks_end:
        r.failures.append(f"{r.prefix_cache_blocks_end - r.prefix_cache_idle_blocks_end:.0f} "
                          "cached prefix blocks still held after the load")
    if r.rss_growth > RSS_GROWTH_LIMIT:
        r.failures.append(f"gateway RSS grew {r.rss_growth:+.1%} after warm-up "
                          f"({r.rss_warm_bytes >> 20} -> {r.rss_end_bytes >> 20} MiB)")


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.0f} ms"


def table(r: Report) -> str:
    rows = [
        ("streams", r.streams), ("seconds", f"{r.wall_s:.1f}"), ("calls", r.calls),
        ("completed", r.completed), ("cancelled", f"{r.cancelled} ({r.cancelled_mid_stream} "
                                                  "mid-stream)"),
        ("deadline", f"{r.deadline} ({r.deadline_mid_stream} mid-stream)"),
        ("resource_exhausted", r.resource_exhausted),
        ("other codes", r.other_codes or "none"),
        ("tokens streamed", r.tokens), ("tokens/s", f"{r.tokens_per_s:.0f}"),
        ("TTFT p50 / p99", f"{_ms(r.ttft_p50_s)} / {_ms(r.ttft_p99_s)}"),
        ("gateway RSS warm / end", f"{r.rss_warm_bytes / 2**20:.1f} / "
                                   f"{r.rss_end_bytes / 2**20:.1f} MiB ({r.rss_growth:+.1%})"),
        ("gateway RSS peak", f"{r.rss_peak_bytes / 2**20:.1f} MiB"),
        ("workers RSS end", f"{r.workers_rss_end_bytes / 2**20:.1f} MiB"),
        ("KV blocks used at end", f"{r.kv_blocks_used_end:.0f} of {r.kv_blocks_total:.0f}"),
        ("prefix cache at end", f"{r.prefix_cache_blocks_end:.0f} blocks, "
                                f"{r.prefix_cache_idle_blocks_end:.0f} idle"),
        ("prefix cache hit tokens", f"{r.prefix_cache_hit_tokens:.0f}"),
        ("preemptions", f"{r.preemptions:.0f}"),
        ("server statuses", {k: int(v) for k, v in r.server_codes.items() if v}),
        ("result", "PASS" if r.ok else "FAIL: " + "; ".join(r.failures)),
    ]
    width = max(len(k) for k, _v in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def tiny_model(folder: Path) -> Path:
    """The tests' tiny random Llama (grouped-query attention, byte-level BPE tokenizer)."""
    from tests.checkpoints import LLAMA, build_checkpoint

    return build_checkpoint(folder, LLAMA, shard=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=200)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--cancel-fraction", type=float, default=0.3)
    parser.add_argument("--model", type=Path, help="checkpoint folder (default: tiny random)")
    parser.add_argument("--kv-cache-mb", type=int, default=64)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="shardlm-load-") as tmp:
        model = args.model or tiny_model(Path(tmp) / "llama")
        report = run(model, streams=args.streams, seconds=args.seconds,
                     cancel_fraction=args.cancel_fraction, seed=args.seed,
                     kv_cache_mb=args.kv_cache_mb, tp=args.tp)
    print(table(report))
    args.out.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.UTC)
    path = args.out / f"load-{now:%Y%m%d-%H%M%S}.json"
    path.write_text(json.dumps({
        "benchmark": "gateway_load", "date": now.isoformat(timespec="seconds"),
        "machine": platform.machine(), "cpus": os.cpu_count(),
        "python": platform.python_version(), "grpc": grpc.__version__,
        "model": str(args.model or "tiny random Llama (tests/checkpoints.py)"),
        "config": {"streams": args.streams, "seconds": args.seconds,
                   "cancel_fraction": args.cancel_fraction, "kv_cache_mb": args.kv_cache_mb,
                   "tp": args.tp, "seed": args.seed},
        "report": asdict(report), "ok": report.ok}, indent=2) + "\n")
    print(f"wrote {path.relative_to(REPO) if path.is_relative_to(REPO) else path}")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
