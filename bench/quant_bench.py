"""Quantized weights kept packed (worker.quant) against dense ones, on CPU.

    python -m bench.quant_bench                   # the linear kernels at SmolLM2-135M shapes
    python -m bench.quant_bench --model FILE.gguf # also batch-1 decode and prefill of the model

Kernels: the fastest of many calls of one linear layer (weights streamed from memory, not
cache, for the large ones), as GB/s of weight bytes read at batch 1 and as GFLOP/s at a decode
batch (`--batch-rows`, 32) and a 512-row prefill: float32 and bfloat16 `skinny_linear` against
`quant_linear` on Q8_0, Q4_1 and Q4_1 regrouped as Q4x8 (what a model loads on CPU). `--simd
avx2,avx512` times each case at both SIMD levels in turn (a level the CPU lacks runs the next
narrower path), `--quants subnormal,converted` with the exact 4- to 6-bit kernels reading their
quants as subnormals and converting them (csrc/cpu/subnormal.h), in turn.

Model: the same GGUF file loaded twice in float32, blocks packed (`quantize=""`) and dequantized
at load (`quantize="none"`); decode tok/s over a fixed number of greedy steps after a short
prompt and prefill tok/s of a 512-token prompt, as medians of runs alternated between the two
(and the `--simd` levels and `--quants` settings), plus whether all chose the same greedy tokens.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.ops_cpu_bench import best_us
from shardlm_server.worker import ops
from shardlm_server.worker.quant import quantize, to_q4x8

# SmolLM2-135M: hidden 576, 9 heads / 3 kv heads of 64, intermediate 1536, vocab 49152.
SHAPES = {"qkv": (960, 576), "o_proj": (576, 576), "gate_up": (3072, 576),
          "down": (576, 1536), "lm_head": (49152, 576)}


QUANTS = {"auto": "auto", "subnormal": True, "converted": False}  # ops.set_cpu_subnormal_quants


def _use(level: str, quants: str) -> None:
    """The SIMD level and the exact 4- to 6-bit kernels' handling of quants (csrc/cpu/subnormal.h)
    for the calls that follow."""
    ops.set_cpu_simd(level)
    ops.set_cpu_subnormal_quants(QUANTS[quants])


def kernel_table(budget_s: float, batch_rows: int, prefill_rows: int,
                 levels: list[tuple[str, str]]) -> None:
    """One line per layer, weight kind, SIMD level and quants setting; the variants of a case are
    timed one after the other, so a slow spell of the machine hits them alike."""
    print(f"{'layer':10} {'N x K':>12} {'kind':>6} {'simd':>7} {'quants':>9} {'M=1 µs':>9} {'GB/s':>7} "
          f"{f'M={batch_rows} GFLOP/s':>15} {f'M={prefill_rows} ms':>10} {'GFLOP/s':>8}")
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k) / k**0.5
        q4 = quantize(w, "int4")
        variants = {"fp32": w, "bf16": w.bfloat16(), "Q8_0": quantize(w, "int8"), "Q4_1": q4,
                    "Q4x8": to_q4x8(q4)}
        for kind, weight in variants.items():
            dtype = torch.bfloat16 if kind == "bf16" else torch.float32
            nbytes = weight.nbytes if kind.startswith("Q") else weight.numel() * weight.itemsize
            x1 = torch.randn(1, k, dtype=dtype)
            xb = torch.randn(batch_rows, k, dtype=dtype)
            xm = torch.randn(prefill_rows, k, dtype=dtype)
            for level, quants in levels:
                _use(level, quants)
                us = best_us(lambda x1=x1, w=weight: ops.linear(x1, w), budget_s)
                batch_us = best_us(lambda xb=xb, w=weight: ops.linear(xb, w), budget_s,
                                   min_calls=3)
                ms = best_us(lambda xm=xm, w=weight: ops.linear(xm, w), budget_s,
                             min_calls=3) / 1e3
                gflops = 2 * prefill_rows * n * k / (ms * 1e6)
                print(f"{name:10} {f'{n}x{k}':>12} {kind:>6} {level:>7} {quants:>9} {us:9.1f} "
                      f"{nbytes / us / 1e3:7.1f} {2 * batch_rows * n * k / batch_us / 1e3:15.1f} "
                      f"{ms:10.2f} {gflops:8.1f}")
    _use(ops.SIMD_LEVELS[-1], "auto")


def _decode_run(engine, prompt: list[int], steps: int) -> tuple[float, list[int]]:
    from shardlm_server.worker.engine import DecodeItem, PrefillItem, StopParams

    engine.reset()
    blocks = list(range((len(prompt) + steps) // 16 + 2))
    out = engine.prefill([PrefillItem(0, prompt, 0, blocks,
                                      stop=StopParams(max_new_tokens=steps + 1))])
    tokens = [out.tokens[0].token.token_id]
    t0 = time.perf_counter()
    for step in engine.decode([DecodeItem(0, blocks, steps)], steps):
        tokens += [t.token.token_id for t in step.tokens]
    return steps / (time.perf_counter() - t0), tokens


def _prefill_run(engine, prompt: list[int]) -> float:
    from shardlm_server.worker.engine import PrefillItem, StopParams

    engine.reset()
    blocks = list(range(len(prompt) // 16 + 2))
    t0 = time.perf_counter()
    engine.prefill([PrefillItem(0, prompt, 0, blocks, stop=StopParams(max_new_tokens=1))])
    return len(prompt) / (time.perf_counter() - t0)


def model_table(path: str, steps: int, prefill_tokens: int, rounds: int,
                levels: list[tuple[str, str]]) -> None:
    from shardlm_server.worker.engine import Engine
    from shardlm_server.worker.kv_cache import CacheConfig

    cache = CacheConfig(block_size=16, num_blocks=max(64, prefill_tokens // 16 + 4))
    engines = {mode or "packed": Engine.load(path, dtype="float32", cache_config=cache,
                                             quantize=mode) for mode in ("", "none")}
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, 40000, (16,), generator=gen).tolist()
    long_prompt = torch.randint(100, 40000, (prefill_tokens,), generator=gen).tolist()
    variants = [(name, level) for name in engines for level in levels]
    decode = {v: [] for v in variants}
    prefill = {v: [] for v in variants}
    tokens = {}
    for _ in range(rounds):
        for name, level in variants:
            _use(*level)  # after Load, which sets the engine's own SIMD choice
            rate, tokens[name, level] = _decode_run(engines[name], prompt, steps)
            decode[name, level].append(rate)
            prefill[name, level].append(_prefill_run(engines[name], long_prompt))
    _use(ops.SIMD_LEVELS[-1], "auto")
    for v in variants:
        print(f"{v[0]:7} {' '.join(v[1]):17} decode {statistics.median(decode[v]):7.1f} tok/s "
              f"({min(decode[v]):.1f}-{max(decode[v]):.1f})   prefill({prefill_tokens}) "
              f"{statistics.median(prefill[v]):7.1f} tok/s")
    first = tokens[variants[0]]
    for v in variants[1:]:
        same = sum(a == b for a, b in zip(first, tokens[v], strict=True))
        print(f"greedy tokens of {v[0]} {' '.join(v[1])} equal to {variants[0][0]} "
              f"{' '.join(variants[0][1])}'s: "
              f"{same}/{len(first)}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    p.add_argument("--budget", type=float, default=0.3, help="seconds of timing per kernel case")
    p.add_argument("--batch-rows", type=int, default=32, help="rows of the decode-batch column")
    p.add_argument("--prefill-rows", type=int, default=512)
    p.add_argument("--model", help="a GGUF file to time end to end")
    p.add_argument("--steps", type=int, default=64, help="decode steps per model run")
    p.add_argument("--rounds", type=int, default=3, help="alternated model runs per variant")
    p.add_argument("--no-kernels", action="store_true", help="only the model")
    p.add_argument("--simd", default="widest",
                   help="comma-separated SIMD levels to time each kernel case at, in turn "
                        f"({', '.join(ops.SIMD_LEVELS)}; widest: the CPU's own)")
    p.add_argument("--quants", default="auto",
                   help="comma-separated handling of quants by the exact 4- to 6-bit kernels to "
                        "time each case with, in turn: subnormal, converted, or auto (what this "
                        "CPU's probe chose; csrc/cpu/subnormal.h)")
    args = p.parse_args()
    quants = [q.strip() for q in args.quants.split(",")]
    if unknown := [q for q in quants if q not in QUANTS]:
        p.error(f"--quants: unknown {', '.join(unknown)} (one of {', '.join(QUANTS)})")
    torch.set_num_threads(args.threads)
    levels = [(ops.SIMD_LEVELS[-1] if level.strip() == "widest" else level.strip(), q)
              for level in args.simd.split(",") for q in quants]
    if not args.no_kernels:
        kernel_table(args.budget, args.batch_rows, args.prefill_rows, levels)
    if args.model:
        model_table(args.model, args.steps, args.prefill_rows, args.rounds, levels)


if __name__ == "__main__":
    main()
