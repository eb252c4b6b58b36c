"""Engine benchmark: ShardLM's in-process engine against transformers' `generate` on the same
random-weight checkpoint, in the same run, on the same device.

    python -m bench.engine_bench                 # ~100M-parameter Llama shape on CPU
    python -m bench.engine_bench --smoke         # tiny shape, seconds

Prints a table and writes JSON (device, versions, date, config, figures) to bench/results/.
Decode figures exclude prefill: both sides are timed for a 1-token generation as well and that
time is subtracted, so the ratio compares steady-state decoding. The timing helpers here are
shared with `python -m bench.run`, the full harness.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from bench.shapes import SHAPES, build_checkpoint, parameter_count
from shardlm_server.worker.engine import DecodeItem, Engine, EngineOptions, PrefillItem, StopParams
from shardlm_server.worker.errors import CacheCapacityError
from shardlm_server.worker.kv_cache import CacheConfig
from shardlm_server.worker.speculative import SpeculationConfig

OOM_ERRORS = (torch.OutOfMemoryError, CacheCapacityError)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device) -> float:
    """Wall seconds of `fn`, with the device drained before and after (so queued GPU work is
    neither missed nor charged to the next call)."""
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def best_of(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    return min(timed(fn, device) for _ in range(max(1, repeats)))


def random_prompts(batch: int, length: int, vocab: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, length), generator=gen)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()


def versions() -> dict:
    import grpc
    import transformers

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                cwd=Path(__file__).resolve().parent, text=True,
                                timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return {"torch": torch.__version__, "cuda": torch.version.cuda,
            "transformers": transformers.__version__, "grpcio": grpc.__version__,
            "python": platform.python_version(), "git_commit": commit or None}


# ----------------------------------------------------------------------------- transformers
def hf_generate(model, prompts: torch.Tensor, n: int, **kwargs) -> None:
    with torch.no_grad():
        model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=n,
                       min_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=None,
                       **kwargs)


def hf_decode_runs(model, prompts: torch.Tensor, new_tokens: int, device: torch.device,
                   repeats: int = 2, warmups: int = 1, **kwargs) -> tuple[list[float], list[float]]:
    """Timed `generate` runs of `new_tokens` tokens and of 1 token (prefill only)."""
    for _ in range(warmups):  # compiled paths need several warm-ups, for both lengths
        hf_generate(model, prompts, new_tokens, **kwargs)
        hf_generate(model, prompts, 1, **kwargs)
    full = [timed(lambda: hf_generate(model, prompts, new_tokens, **kwargs), device)
            for _ in range(repeats)]
    prefill = [timed(lambda: hf_generate(model, prompts, 1, **kwargs), device)
               for _ in range(repeats)]
    return full, prefill


def decode_seconds(runs: Callable[[int], tuple[list[float], list[float]]], attempts: int = 3) -> float:
    """Seconds of the decode steps alone: best full run minus best prefill-only run. `runs(i)` is
    attempt i; a difference that noise drove to <= 0 (tiny models) earns another attempt."""
    full: list[float] = []
    prefill: list[float] = []
    diff = 0.0
    for attempt in range(attempts):
        f, p = runs(attempt)
        full, prefill = full + f, prefill + p
        diff = min(full) - min(prefill)
        if diff > 0:
            break
    return max(diff, 1e-9)


def hf_decode_seconds(model, prompts: torch.Tensor, new_tokens: int, device: torch.device,
                      repeats: int = 2, warmups: int = 1, **kwargs) -> float:
    """Seconds of `new_tokens - 1` decode steps of `generate` (prefill subtracted)."""
    return decode_seconds(lambda i: hf_decode_runs(model, prompts, new_tokens, device, repeats,
                                                   warmups if i == 0 else 0, **kwargs))


def hf_prefill_seconds(model, prompt: torch.Tensor, device: torch.device, repeats: int = 2) -> float:
    """One forward over a [1, L] prompt that fills a fresh cache; only the last logits."""
    def run() -> None:
        with torch.no_grad():
            try:
                model(prompt, use_cache=True, logits_to_keep=1)
            except TypeError:  # older transformers
                model(prompt, use_cache=True)

    run()
    return best_of(run, device, repeats)


# ----------------------------------------------------------------------------- ShardLM
def blocks_per_sequence(engine: Engine, tokens: int) -> int:
    return -(-(tokens + 1) // engine.cache.block_size)


def load_engine(folder: Path, dtype: torch.dtype, device: torch.device, max_batch: int,
                seq_tokens: int, prefill_tokens: int, block_size: int = 16,
                options: EngineOptions | None = None) -> Engine:
    """An engine whose paged cache holds `max_batch` sequences of `seq_tokens` tokens (and one
    prefill of `prefill_tokens`): sized explicitly so a GPU run does not grab 90% of memory.
    It decodes one token per step (speculation off), so its step rates compare with llama.cpp's
    plain decoding (bench.speculation measures speculation)."""
    options = replace(options or EngineOptions(), speculation=SpeculationConfig("off"))
    per_seq = -(-(seq_tokens + 1) // block_size)
    blocks = max(max_batch * per_seq, -(-(prefill_tokens + 1) // block_size)) + 1
    return Engine.load(folder, dtype=dtype, device=device, options=options,
                       cache_config=CacheConfig(block_size=block_size, num_blocks=blocks))


def engine_decode_runs(engine: Engine, prompts: torch.Tensor, new_tokens: int,
                       device: torch.device, repeats: int = 2) -> tuple[list[float], list[float]]:
    """Timed engine runs (prefill + batched decode) of `new_tokens` tokens and of 1 token."""
    batch, length = prompts.shape
    per_seq = blocks_per_sequence(engine, length + new_tokens)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
    stop = StopParams(max_new_tokens=new_tokens)
    rows = prompts.tolist()

    def run(n: int) -> None:
        engine.reset()
        engine.prefill([PrefillItem(i, rows[i], 0, tables[i], stop=stop) for i in range(batch)])
        if n > 1:
            for _ in engine.decode([DecodeItem(i, tables[i], n - 1) for i in range(batch)], n - 1):
                pass

    run(3)  # warm-up
    full = [timed(lambda: run(new_tokens), device) for _ in range(repeats)]
    prefill = [timed(lambda: run(1), device) for _ in range(repeats)]
    engine.reset()
    return full, prefill


def engine_decode_seconds(engine: Engine, prompts: torch.Tensor, new_tokens: int,
                          device: torch.device, repeats: int = 2) -> float:
    """Seconds of `new_tokens - 1` batched decode steps (prefill subtracted)."""
    return decode_seconds(lambda _i: engine_decode_runs(engine, prompts, new_tokens, device,
                                                        repeats))


def engine_prefill_seconds(engine: Engine, prompt: torch.Tensor, device: torch.device,
                           repeats: int = 2) -> float:
    """One prefill of a [1, L] prompt (and the sampling of its first token)."""
    ids = prompt[0].tolist()
    table = list(range(blocks_per_sequence(engine, len(ids))))

    def run() -> None:
        engine.reset()
        engine.prefill([PrefillItem(0, ids, 0, table)])

    run()
    seconds = best_of(run, device, repeats)
    engine.reset()
    return seconds


def paired_decode_seconds(engine: Engine, model, prompts: torch.Tensor, new_tokens: int,
                          device: torch.device, rounds: int = 3) -> tuple[float, float]:
    """Decode seconds of ShardLM and of transformers on the same prompts, timed in alternation
    (`rounds` rounds of one run each), so that a busy neighbour on a shared machine slows both
    alike; each side keeps its best run."""
    runs: tuple[list[float], ...] = ([], [], [], [])  # ours full/prefill, theirs full/prefill
    for i in range(rounds):
        ours = engine_decode_runs(engine, prompts, new_tokens, device, 1)
        theirs = hf_decode_runs(model, prompts.to(device), new_tokens, device, 1,
                                warmups=int(i == 0), disable_compile=True)
        for acc, part in zip(runs, ours + theirs, strict=True):
            acc.extend(part)
    return (decode_seconds(lambda _i: (runs[0], runs[1]), attempts=1),
            decode_seconds(lambda _i: (runs[2], runs[3]), attempts=1))


def decode_row(batch: int, seconds: float, steps: int) -> dict:
    return {"batch": batch, "tokens_per_s": batch * steps / seconds,
            "ms_per_step": 1000 * seconds / steps}


# ----------------------------------------------------------------------------- standalone CLI
def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--shape", default="llama-100m", choices=sorted(SHAPES))
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=4,
                        help="alternating timed runs per side and batch (the best one counts)")
    parser.add_argument("--smoke", action="store_true", help="tiny shape and few tokens")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args(argv)
    if args.smoke:
        args.shape, args.new_tokens, args.batch_sizes, args.rounds = "tiny", 8, "1,4", 2
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("float32" if device.type == "cpu" else "bfloat16"))
    shape = SHAPES[args.shape]
    vocab = shape.config["vocab_size"]
    batches = [int(b) for b in args.batch_sizes.split(",")]
    steps = args.new_tokens - 1
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        reference = build_checkpoint(Path(tmp), shape, dtype, device)
        params = parameter_count(reference)
        engine = load_engine(Path(tmp), dtype, device, max(batches),
                             args.prompt_len + args.new_tokens, 0)
        for batch in batches:
            prompts = random_prompts(batch, args.prompt_len, vocab)
            ours, theirs = paired_decode_seconds(engine, reference, prompts, args.new_tokens,
                                                 device, args.rounds)
            a, b = decode_row(batch, ours, steps), decode_row(batch, theirs, steps)
            rows.append({"batch": batch,
                         "shardlm_tokens_per_s": a["tokens_per_s"],
                         "shardlm_ms_per_step": a["ms_per_step"],
                         "transformers_tokens_per_s": b["tokens_per_s"],
                         "transformers_ms_per_step": b["ms_per_step"],
                         "speedup": theirs / ours})
    result = {
        "benchmark": "engine_decode",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "device": device_name(device),
        "threads": torch.get_num_threads(),
        "versions": versions(),
        "config": {"shape": args.shape, "parameters": params, "dtype": str(dtype),
                   "prompt_len": args.prompt_len, "new_tokens": args.new_tokens},
        "rows": rows,
    }
    print(f"engine decode, {args.shape} ({params / 1e6:.0f}M params, {dtype}), "
          f"{result['device']}, {result['threads']} threads")
    print(f"{'batch':>5} {'shardlm tok/s':>14} {'ms/step':>8} {'HF tok/s':>10} {'ms/step':>8} {'speedup':>8}")
    for r in rows:
        print(f"{r['batch']:>5} {r['shardlm_tokens_per_s']:>14.1f} {r['shardlm_ms_per_step']:>8.2f} "
              f"{r['transformers_tokens_per_s']:>10.1f} {r['transformers_ms_per_step']:>8.2f} "
              f"{r['speedup']:>7.2f}x")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    (out / f"engine-{args.device}-{args.shape}-{stamp}.json").write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
