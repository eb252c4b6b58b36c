"""Decode at depth (`python -m bench.run --model FILE.gguf --depth 4096`): batch-1 greedy decode
steps after a context of `depth` tokens, where each step reads the KV cache as well as the weights.

ShardLM's engine runs with a float32 KV cache (the float32 model's default) and a float16 one (what
llama.cpp keeps by default), llama.cpp in process (`llama-cpp-python`, `llama-bench -d` measures
the same thing) on the same file and threads; the three are timed in alternation, `rounds` rounds,
and the medians and spreads reported. With `--activation-precision` (the opt-in modes, e.g. int8)
the float16-cache engine is also timed in each mode in the same rounds: at depth the weights are
read by the mode's kernels and the cache by the same attention, so the row says how much of the
step the exact kernels' arithmetic holds back. The floor counts the step's weight bytes and its
KV bytes (the whole context, every layer, K and V) against the read bandwidth measured in the same
round (`roofline.round_shares`); the share is the median of the rounds' shares.
"""

from __future__ import annotations

import gc
import statistics
import time
from pathlib import Path

import torch

from bench import engine_bench as eb
from bench import llamacpp, roofline
from shardlm_server.worker.engine import (
    DecodeItem,
    Engine,
    EngineOptions,
    PrefillItem,
    StopParams,
)
from shardlm_server.worker.kv_cache import CacheConfig
from shardlm_server.worker.ops import activations
from shardlm_server.worker.speculative import SpeculationConfig

KV_DTYPES = ("float32", "float16")
MODE_KV = "float16"  # the cache the opt-in activation precisions are timed with
BLOCK_SIZE = 16


def _engine(path: Path, dtype: torch.dtype, kv_dtype: str, tokens: int) -> Engine:
    blocks = -(-tokens // BLOCK_SIZE) + 1
    return Engine.load(path, dtype=dtype, device=torch.device("cpu"),
                       options=EngineOptions(speculation=SpeculationConfig("off")),
                       cache_config=CacheConfig(block_size=BLOCK_SIZE, num_blocks=blocks,
                                                dtype=getattr(torch, kv_dtype)))


def _engine_step_seconds(engine: Engine, prompt: list[int], steps: int) -> float:
    """Seconds per decode step over `steps` steps after prefilling `prompt` (not timed)."""
    table = list(range(-(-(len(prompt) + steps + 1) // BLOCK_SIZE)))
    engine.reset()
    engine.prefill([PrefillItem(0, prompt, 0, table, stop=StopParams(max_new_tokens=steps + 1))])
    start = time.perf_counter()
    for _ in engine.decode([DecodeItem(0, table, steps)], steps):
        pass
    seconds = time.perf_counter() - start
    engine.reset()
    return seconds / steps


def _row(step_seconds: list[float], weight_bytes: int, kv_bytes: int,
         bandwidths: list[float]) -> dict:
    """Medians over the rounds; round i's floor is its bytes over round i's bandwidth."""
    step = statistics.median(step_seconds)
    floor = statistics.median((weight_bytes + kv_bytes) / bw for bw in bandwidths)
    shares = roofline.round_shares(weight_bytes + kv_bytes, bandwidths, step_seconds)
    return {"decode_tokens_per_s": 1 / step,
            "decode_tokens_per_s_spread": [1 / max(step_seconds), 1 / min(step_seconds)],
            "kv_bytes": kv_bytes, "floor_ms_per_token": 1000 * floor,
            "pct_of_floor": statistics.median(shares),
            "pct_of_floor_spread": [min(shares), max(shares)]}


def measure(path: Path, gguf: Path | None, dtype: torch.dtype, depth: int, steps: int,
            rounds: int, weight_bytes: int, modes: tuple[str, ...] = ()) -> dict:
    """Every figure of the depth section; see the module docstring. `modes`: the opt-in
    activation precisions also timed (float16 cache), each a row `shardlm_kv_float16_<mode>`."""
    threads = torch.get_num_threads()
    engines = {kv: _engine(path, dtype, kv, depth + steps + 1) for kv in KV_DTYPES}
    first = engines[KV_DTYPES[0]]
    prompt = eb.random_prompts(1, depth, first.cfg.vocab_size, seed=2)[0].tolist()
    # Bytes of the cache one step reads, at the middle step's context length.
    kv_tokens = depth + steps // 2
    kv_bytes = {kv: e.cache.capacity.bytes_per_block * kv_tokens // e.cache.capacity.block_size
                for kv, e in engines.items()}
    llama = None
    result: dict = {"depth": depth, "steps": steps}
    if gguf is not None and llamacpp.available():
        if (crash := llamacpp.crash_reason(gguf, threads)) is None:
            llama = llamacpp.LlamaCpp(gguf, threads, n_ctx=depth + steps + 16)
        else:
            result["llama_cpp_not_run"] = crash  # "llama_cpp" holds a row only
            print(f"llama.cpp at depth: not run: {crash}", flush=True)
    times: dict[str, list[float]] = {kv: [] for kv in KV_DTYPES}
    mode_times: dict[str, list[float]] = {mode: [] for mode in modes}
    theirs: list[float] = []
    bandwidths: list[float] = []
    for engine in engines.values():  # warm-up: the first steps at depth allocate scratch
        _engine_step_seconds(engine, prompt[:256], 4)
    for _ in range(rounds):
        bandwidths.append(roofline.read_bandwidth(repeats=4))
        for kv, engine in engines.items():
            times[kv].append(_engine_step_seconds(engine, prompt, steps))
        for mode in modes:
            with activations.using(mode):
                mode_times[mode].append(_engine_step_seconds(engines[MODE_KV], prompt, steps))
        if llama is not None:
            theirs.append(llama.decode_seconds(prompt, steps) / steps)
    for kv in KV_DTYPES:
        result[f"shardlm_kv_{kv}"] = _row(times[kv], weight_bytes, kv_bytes[kv], bandwidths)
    for mode in modes:
        result[f"shardlm_kv_{MODE_KV}_{mode}"] = _row(mode_times[mode], weight_bytes,
                                                      kv_bytes[MODE_KV], bandwidths)
    result["modes"] = list(modes)
    if llama is not None:
        # llama.cpp keeps a float16 cache of the same shape by default.
        result["llama_cpp"] = _row(theirs, weight_bytes, kv_bytes["float16"], bandwidths)
    result["bandwidth_gb_s"] = [bw / 1e9 for bw in bandwidths]
    del llama, engines
    gc.collect()
    return result


def targets(result: dict) -> list[tuple[str, float | None, float]]:
    """(name, value, goal) for the issue's depth targets: ShardLM's faster cache against
    llama.cpp, and that cache's bytes against the floor; the same two for each opt-in mode."""
    depth = result["depth"]
    theirs = result.get("llama_cpp")
    rows = [(f"{MODE_KV} KV", "", result[f"shardlm_kv_{MODE_KV}"])]
    rows += [(f"{MODE_KV} KV, {mode} mode", f" ({mode} mode)",
              result[f"shardlm_kv_{MODE_KV}_{mode}"]) for mode in result.get("modes", [])]
    out: list[tuple[str, float | None, float]] = []
    for cache, mode, row in rows:
        if theirs:
            out.append((f"decode at depth {depth} ({cache}) vs llama.cpp >= 1.3x",
                        row["decode_tokens_per_s"] / theirs["decode_tokens_per_s"], 1.3))
        out.append((f"decode at depth {depth}{mode}: weights + KV at >= 60% of the read floor",
                    row["pct_of_floor"] / 100, 0.6))
    return out


def print_rows(result: dict) -> None:
    print(f"decode at a {result['depth']}-token depth ({result['steps']} steps):")
    rows = [(f"ShardLM, {kv} KV", result[f"shardlm_kv_{kv}"]) for kv in KV_DTYPES]
    rows += [(f"ShardLM, {MODE_KV} KV, {mode}", result[f"shardlm_kv_{MODE_KV}_{mode}"])
             for mode in result.get("modes", [])]
    if "llama_cpp" in result:
        rows.append(("llama.cpp, float16 KV", result["llama_cpp"]))
    for label, r in rows:
        lo, hi = r["decode_tokens_per_s_spread"]
        low, high = r["pct_of_floor_spread"]
        print(f"  {label:<24}{r['decode_tokens_per_s']:>8.1f} tok/s ({lo:.1f}-{hi:.1f}); "
              f"KV {r['kv_bytes'] / 1e6:.0f} MB a step, floor {r['floor_ms_per_token']:.2f} ms "
              f"({r['pct_of_floor']:.0f}% of it, rounds {low:.0f}-{high:.0f}%)")
    bandwidths = result["bandwidth_gb_s"]
    print(f"  read bandwidth by round: {', '.join(f'{bw:.1f}' for bw in bandwidths)} GB/s")
