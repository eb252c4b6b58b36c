"""Sampled decoding on CPU: the compiled sampler (`ops.sample_rows`) against the torch ops the
GPU path uses (a sort of the vocabulary and a random number per token), in alternation.

    python -m bench.sampling_bench                       # the default model, batches 1, 8, 32
    python -m bench.sampling_bench --batches 1 --rounds 5 --model FILE.gguf

Two tables. Per call: the median time to choose one token for each of B rows of the default
model's vocabulary (49,152 logits a row) with each sampling setting, the penalties included
(each row's history: a 300-token prompt). In process: `Engine.decode`
tokens/s at batch B (32-token prompts, 128 steps, speculation off) for greedy rows (the same
with either sampler) and for sampled ones, each sampler in turn; median [min-max] of the rounds.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from bench.engine_bench import load_engine
from shardlm_server.worker import sampling
from shardlm_server.worker.engine_types import DecodeItem, PrefillItem, StopParams
from shardlm_server.worker.sampling import SamplerSettings, SamplingRow, TokenHistory

SETTINGS = {
    "greedy": SamplerSettings(),
    "temperature 0.7": SamplerSettings(temperature=0.7),
    "0.7, top-p 0.9": SamplerSettings(temperature=0.7, top_p=0.9),
    "0.7, top-k 40": SamplerSettings(temperature=0.7, top_k=40),
    "top-p, rep. 1.1": SamplerSettings(temperature=0.7, top_p=0.9, repetition_penalty=1.1),
    "top-p, pres. 0.5": SamplerSettings(temperature=0.7, top_p=0.9, presence_penalty=0.5),
}
# Each sampler: how it draws and how it applies the penalties (what sample_on_device calls on
# CPU, swapped in turn).
SAMPLERS = {"torch ops": (sampling.sample_with_torch_ops, sampling.penalize_with_torch_ops),
            "compiled": (sampling.sample_on_cpu, sampling.penalize_on_cpu)}
PROMPT_TOKENS, STEPS = 32, 128


def per_call(batches: list[int], vocab: int, calls: int) -> None:
    print(f"\nper call, {vocab} logits a row: median ms")
    print(f"{'rows':>5} {'setting':18}" + "".join(f"{name:>12}" for name in SAMPLERS))
    gen = torch.Generator().manual_seed(0)
    for batch in batches:
        logits = torch.randn(batch, vocab, generator=gen) * 3
        for name, settings in SETTINGS.items():
            rows = [SamplingRow(settings, history=TokenHistory.from_prompt(
                list(range(100, 400)), vocab, torch.device("cpu"))) for _ in range(batch)]
            times: dict[str, list[float]] = {s: [] for s in SAMPLERS}
            for _ in range(calls):  # the samplers alternate call by call
                for sampler, (draw, penalize) in SAMPLERS.items():
                    start = time.perf_counter()
                    penalized = (penalize(logits, rows) if settings.uses_repetition_penalty
                                 or settings.uses_output_penalties else logits)
                    draw(penalized, rows).tolist()
                    times[sampler].append(time.perf_counter() - start)
            print(f"{batch:>5} {name:18}" + "".join(
                f"{statistics.median(t) * 1e3:12.3f}" for t in times.values()))


def decode_rate(engine, batch: int, settings: SamplerSettings) -> float:
    per_seq = -(-(PROMPT_TOKENS + STEPS + 2) // engine.cache.block_size)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
    engine.reset()
    engine.prefill([PrefillItem(i, [100 + 7 * i + j for j in range(PROMPT_TOKENS)], 0, tables[i],
                                sampling=settings, stop=StopParams(max_new_tokens=STEPS + 1))
                    for i in range(batch)])
    start = time.perf_counter()
    tokens = sum(len(step.tokens) for step in
                 engine.decode([DecodeItem(i, tables[i], STEPS) for i in range(batch)], STEPS))
    return tokens / (time.perf_counter() - start)


def in_process(model: Path, batches: list[int], rounds: int) -> None:
    print(f"\nin process ({model.name}, float32, {STEPS} steps): tokens/s, median [min-max]")
    print(f"{'batch':>5} {'setting':18} {'sampler':10} {'tok/s':>22}")
    for batch in batches:
        engine = load_engine(model, torch.float32, torch.device("cpu"), batch,
                             PROMPT_TOKENS + STEPS + 2, PROMPT_TOKENS * batch)
        rates: dict[tuple[str, str], list[float]] = {}
        for _ in range(rounds):
            for name, settings in SETTINGS.items():
                for sampler, (draw, penalize) in SAMPLERS.items():
                    if settings.greedy and sampler != "compiled":
                        continue  # greedy rows take the same argmax either way
                    sampling.sample_on_cpu, sampling.penalize_on_cpu = draw, penalize
                    try:
                        rates.setdefault((name, sampler), []).append(
                            decode_rate(engine, batch, settings))
                    finally:
                        sampling.sample_on_cpu, sampling.penalize_on_cpu = SAMPLERS["compiled"]
        for (name, sampler), r in rates.items():
            print(f"{batch:>5} {name:18} {sampler:10} {statistics.median(r):9.1f} "
                  f"[{min(r):.1f}-{max(r):.1f}]")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", type=Path, default=None, help="a GGUF file (default: the shipped one)")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--calls", type=int, default=50, help="timed calls per per-call case")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    if args.model is None:
        from shardlm_server.gateway.serve.default_model import default_model_path
        args.model = default_model_path()
    model = args.model
    per_call(batches, 49152, args.calls)
    in_process(model, batches, args.rounds)


if __name__ == "__main__":
    main()
