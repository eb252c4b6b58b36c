"""What a speculative verify step costs on CPU, by the rows it computes, read against the
machine's float32 FMA peak.

    python -m bench.verify_steps                            # the default model, 1-8 rows
    python -m bench.verify_steps --model FILE --rows 1,2,3,5,8 --context 300 --rounds 5

One sequence with `--context` tokens cached feeds n new tokens (its pending token and n - 1
drafts) through the packed forward pass a verify step takes, every row's logits computed
(worker/speculative.py). A plain decode step of the same sequence (Engine.decode, speculation
off, sampling included) is timed beside it. Each round times every row count (median of
`--repeats` passes), rounds alternate the order. Printed: the median pass per row count with its
spread over the rounds, the cost of each row past the first (the slope from 2 rows on), and
the FMA bound of a row, 2 x the linear layers' parameters over the FMA peak measured in the
same run: a row's arithmetic at the peak. Each pass is also split into the weight kernels,
the attention and the rest (torch.profiler self-time shares of a few profiled passes, applied
to the unprofiled median, as bench.model_bench splits a decode step), with a slope for each,
so a row's cost can be read by where it goes. The draft planner (worker/drafting.py) verifies a draft
only where its expected tokens pay for its row, so this slope is what decides how many drafts
a step verifies at batch 1.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from bench import roofline
from bench.model_bench import ATTENTION_OPS, WEIGHT_OPS, linear_flops_per_token
from bench.quiet_profiler import quiet_profiler
from shardlm_server.worker.batch import build_packed_batch
from shardlm_server.worker.engine import (
    DecodeItem,
    Engine,
    EngineOptions,
    PrefillItem,
    StopParams,
)
from shardlm_server.worker.kv_cache import CacheConfig
from shardlm_server.worker.speculative import SpeculationConfig

BLOCK_SIZE = 16
PLAIN_STEPS = 16  # plain decode steps a plain timing averages
PROFILED_PASSES = 5  # passes a row count's split into weights / attention / rest profiles


def _engine(model: Path, context: int, rows: int) -> Engine:
    blocks = -(-(context + rows + PLAIN_STEPS + 1) // BLOCK_SIZE) + 1
    return Engine.load(model, dtype="float32", device=torch.device("cpu"),
                       options=EngineOptions(speculation=SpeculationConfig("off")),
                       cache_config=CacheConfig(block_size=BLOCK_SIZE, num_blocks=blocks,
                                                dtype=torch.float32))


class VerifyPasses:
    """Times verify passes of n rows and plain decode steps of one cached sequence."""

    def __init__(self, engine: Engine, context: int) -> None:
        self.engine = engine
        vocab = engine.cfg.vocab_size
        gen = torch.Generator().manual_seed(0)
        self.prompt = torch.randint(3, vocab, (context,), generator=gen).tolist()
        self.table = list(range(engine.cache.capacity.num_blocks))
        self._prefill()

    def _prefill(self) -> None:
        self.engine.reset()
        self.engine.prefill([PrefillItem(0, self.prompt, 0, self.table,
                                         stop=StopParams(max_new_tokens=PLAIN_STEPS + 1))])

    def _pass(self, rows: int):
        """A packed pass of `rows` new tokens after the context (their K/V lands past the
        sequence's length, where a refused draft's would), warmed once."""
        ids = [(7 * i + 11) % self.engine.cfg.vocab_size for i in range(rows)]
        batch = build_packed_batch([(ids, len(self.prompt))], [self.table], BLOCK_SIZE,
                                   self.engine.device, every_row=True)
        model, layers = self.engine.model, self.engine.cache.layers

        def run() -> None:
            model.forward(batch.input_ids, batch.meta, layers)

        run()  # scratch sized for `rows`
        return run

    def verify_seconds(self, rows: int, repeats: int) -> float:
        """Median seconds of one pass of `rows` rows."""
        run = self._pass(rows)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    def shares(self, rows: int) -> dict[str, float]:
        """The weight kernels', the attention's and the rest's shares of a pass of `rows`
        rows: profiler self times over PROFILED_PASSES passes."""
        from torch.profiler import ProfilerActivity, profile

        run = self._pass(rows)
        with quiet_profiler(), profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(PROFILED_PASSES):
                run()
        self_us = {e.key: e.self_cpu_time_total for e in prof.key_averages()}
        total = sum(self_us.values()) or 1.0
        weights = sum(v for k, v in self_us.items() if k in WEIGHT_OPS) / total
        attention = sum(v for k, v in self_us.items() if k in ATTENTION_OPS) / total
        return {"weights": weights, "attention": attention, "other": 1 - weights - attention}

    def plain_seconds(self) -> float:
        """Seconds of a plain decode step (sampling included): the median over PLAIN_STEPS
        steps of one call, each timed from the step before it, so the call's own setup (and its
        first step's) is left out, as in a long decode call."""
        self._prefill()
        times = []
        start = time.perf_counter()
        for _ in self.engine.decode([DecodeItem(0, self.table, PLAIN_STEPS)], PLAIN_STEPS):
            now = time.perf_counter()
            times.append(now - start)
            start = now
        self._prefill()
        return statistics.median(times[1:])


def slope(rows: list[int], seconds: list[float]) -> float:
    """Least-squares seconds per row over the row counts from 2 on (1 row hides its arithmetic
    under the weights' reads, so it is left out); 0 with fewer than two such counts."""
    points = [(r, s) for r, s in zip(rows, seconds, strict=True) if r >= 2]
    if len(points) < 2:
        return 0.0
    mean_r = statistics.fmean(r for r, _ in points)
    mean_s = statistics.fmean(s for _, s in points)
    num = sum((r - mean_r) * (s - mean_s) for r, s in points)
    den = sum((r - mean_r) ** 2 for r, _ in points)
    return num / den


def measure(model: Path, rows: list[int], context: int, rounds: int, repeats: int) -> dict:
    engine = _engine(model, context, max(rows))
    passes = VerifyPasses(engine, context)
    times: dict[int, list[float]] = {r: [] for r in rows}
    plain: list[float] = []
    for i in range(rounds):
        order = rows if i % 2 == 0 else rows[::-1]
        for r in order:
            times[r].append(passes.verify_seconds(r, repeats))
        plain.append(passes.plain_seconds())
    medians = [statistics.median(times[r]) for r in rows]
    parts = {r: passes.shares(r) for r in rows}
    split = {kind: [m * parts[r][kind] for r, m in zip(rows, medians, strict=True)]
             for kind in ("weights", "attention", "other")}
    peak = roofline.fma_peak_flops()
    flops = linear_flops_per_token(engine)
    per_row = slope(rows, medians)
    return {
        "model": str(model), "context": context, "rounds": rounds, "repeats": repeats,
        "threads": torch.get_num_threads(),
        "plain_step_ms": 1000 * statistics.median(plain),
        "plain_step_ms_spread": [1000 * min(plain), 1000 * max(plain)],
        "verify_ms": {str(r): 1000 * m for r, m in zip(rows, medians, strict=True)},
        "verify_ms_spread": {str(r): [1000 * min(times[r]), 1000 * max(times[r])] for r in rows},
        "per_row_ms": 1000 * per_row,
        "split_ms": {kind: {str(r): 1000 * v for r, v in zip(rows, values, strict=True)}
                     for kind, values in split.items()},
        "per_row_split_ms": {kind: 1000 * slope(rows, values) for kind, values in split.items()},
        "fma_peak_gflop_s": peak / 1e9,
        "linear_flops_per_row": flops,
        "fma_bound_per_row_ms": 1000 * flops / peak,
        "pct_of_fma_peak": 100 * (flops / peak) / per_row if per_row > 0 else None,
    }


def print_result(result: dict) -> None:
    print(f"plain decode step: {result['plain_step_ms']:.2f} ms "
          f"[{result['plain_step_ms_spread'][0]:.2f}-{result['plain_step_ms_spread'][1]:.2f}]")
    split = result["split_ms"]
    print("| rows | verify pass ms | spread | weight kernels | attention | rest |")
    print("|---|---|---|---|---|---|")
    for r, ms in result["verify_ms"].items():
        lo, hi = result["verify_ms_spread"][r]
        print(f"| {r} | {ms:.2f} | {lo:.2f}-{hi:.2f} | {split['weights'][r]:.2f} | "
              f"{split['attention'][r]:.2f} | {split['other'][r]:.2f} |")
    per = result["per_row_split_ms"]
    print(f"a row past the first by kind: weight kernels {per['weights']:.2f} ms, attention "
          f"{per['attention']:.2f} ms, rest {per['other']:.2f} ms")
    share = result["pct_of_fma_peak"]
    print(f"each row past the first: {result['per_row_ms']:.2f} ms; its arithmetic at the FMA "
          f"peak ({result['fma_peak_gflop_s']:.0f} GFLOP/s): {result['fma_bound_per_row_ms']:.2f} "
          f"ms" + (f" ({share:.0f}% of the peak)" if share is not None else ""))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="GGUF file or model folder (default: the "
                        "default model)")
    parser.add_argument("--rows", default="1,2,3,4,5,6,8", help="row counts, comma-separated")
    parser.add_argument("--context", type=int, default=300, help="tokens cached before the rows")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=9, help="passes a round's median takes")
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args()
    if args.model is None:
        from shardlm_server.gateway.serve.default_model import default_model_path
        args.model = default_model_path()
    try:
        rows = sorted({int(r) for r in args.rows.split(",")})
    except ValueError:
        parser.error(f"--rows takes comma-separated row counts, got {args.rows!r}")
    if not rows or rows[0] < 1:
        parser.error("--rows takes positive row counts")
    if min(args.rounds, args.repeats, args.context) < 1:
        parser.error("--rounds, --repeats and --context take positive counts")
    result = measure(args.model, rows, args.context, args.rounds, args.repeats)
    print_result(result)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
