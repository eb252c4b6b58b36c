"""The int8 activation mode against the exact kernels, one layer per grouped layout, on CPU.

    python -m bench.int8_layers                          # the widest SIMD level the CPU has
    python -m bench.int8_layers --simd avx2 --rows 1,4,16,64,256
    python -m bench.int8_layers --no-vnni               # an AVX-512 CPU without VNNI's paths
    python -m bench.int8_layers --no-amx                # an AMX CPU on its VNNI kernels

One random weight per layout of `ops.activations.INT8_LAYOUTS` (`--shape N,K`, 4096 x 2048 by
default), regrouped as a model loads it: Q4_0, Q4_1, Q5_0 and Q5_1 from `gguf`'s quantizer, the
K-quants and i-quants from random quant bytes with a quantizer's scales (`tests.gguf_files`).
For each number of input rows the two modes alternate call by call in one process, `--rounds`
times; each cell is the best GOP/s (2 M N K over the fastest call) of exact / int8. Both modes
read the same weight, so where the layer does not fit in cache this reads memory as decode does.
"""

from __future__ import annotations

import argparse

import gguf
import numpy as np
import torch

from bench.ops_cpu_bench import best_us
from shardlm_server.worker import ops
from shardlm_server.worker.ops import activations
from shardlm_server.worker.quant import K_LAYOUTS, QuantizedWeight, regrouped, to_q4x8
from tests.gguf_files import random_k_blocks

#: The nibble layouts regrouped from a type `gguf` quantizes (the others: K_LAYOUTS' sources).
QUANTIZED = {"Q4x8": "Q4_1", "Q40x8": "Q4_0", "Q5x8": "Q5_0", "Q51x8": "Q5_1"}
SOURCES = {**{layout: qtype for qtype, (layout, _) in K_LAYOUTS.items()}, **QUANTIZED}


def layer(layout: str, n: int, k: int, seed: int = 0) -> QuantizedWeight:
    """A random n x k weight in `layout`, as the CPU kernels hold it."""
    qtype = SOURCES[layout]
    kind = gguf.GGMLQuantizationType[qtype]
    rng = np.random.default_rng(seed)
    if layout in QUANTIZED:
        values = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)
        blocks = gguf.quants.quantize(values, kind)
    else:
        blocks = random_k_blocks(n, k, kind, rng)
    weight = QuantizedWeight(qtype, torch.from_numpy(np.ascontiguousarray(blocks)), (n, k))
    return to_q4x8(weight) if layout in ("Q4x8", "Q40x8") else regrouped(weight)


def best_gops(weight: QuantizedWeight, rows: int, rounds: int, budget_s: float) -> dict:
    """The best GOP/s of each precision over `rounds` alternated turns."""
    n, k = weight.shape
    x = torch.randn(rows, k)
    best = {"exact": 0.0, "int8": 0.0}
    for _ in range(rounds):
        for precision in best:
            with activations.using(precision):
                us = best_us(lambda: ops.quant_linear(x, weight), budget_s, min_calls=5)
            best[precision] = max(best[precision], 2 * rows * n * k / us / 1e3)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--simd", default="widest", choices=("widest", *ops.SIMD_LEVELS),
                   help="cap the kernels' SIMD level (ops.set_cpu_simd)")
    p.add_argument("--no-vnni", action="store_true",
                   help="keep AVX-512 VNNI off where the CPU has it (ops.set_cpu_vnni)")
    p.add_argument("--no-amx", action="store_true",
                   help="keep the AMX tiles off where the CPU has them (ops.set_cpu_amx)")
    p.add_argument("--rows", default="1,4,16,64,256", help="input rows, comma-separated")
    p.add_argument("--shape", default="4096,2048", help="N,K of each layer")
    p.add_argument("--layouts", default=",".join(activations.INT8_LAYOUTS))
    p.add_argument("--rounds", type=int, default=2, help="alternated turns of the two modes")
    p.add_argument("--budget", type=float, default=0.2, help="seconds of timing per turn")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    a = p.parse_args()
    layouts = a.layouts.split(",")
    unknown = [name for name in layouts if name not in SOURCES]
    if unknown:
        p.error(f"unknown layout {', '.join(unknown)}; one of {', '.join(sorted(SOURCES))}")
    try:
        n, k = (int(v) for v in a.shape.split(","))
        rows = [int(r) for r in a.rows.split(",")]
    except ValueError:
        p.error("--shape takes N,K and --rows a comma-separated list, in whole numbers")
    torch.set_num_threads(a.threads)
    ops.set_cpu_simd(True if a.simd == "widest" else a.simd)
    ops.set_cpu_vnni(not a.no_vnni)
    ops.set_cpu_amx(not a.no_amx)
    vnni = (", VNNI off" if a.no_vnni else "") + (", AMX off" if a.no_amx else "")
    print(f"{n} x {k}, {a.threads} threads, SIMD {a.simd}{vnni}: GOP/s exact / int8 (int8 / exact)")
    print("| layout | " + " | ".join(f"M = {m}" for m in rows) + " |")
    print("|---|" + "---|" * len(rows))
    for layout in layouts:
        weight = layer(layout, n, k)
        cells = []
        for m in rows:
            g = best_gops(weight, m, a.rounds, a.budget)
            cells.append(f"{g['exact']:.0f} / {g['int8']:.0f} ({g['int8'] / g['exact']:.2f}x)")
        print(f"| {layout} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
