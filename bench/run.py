"""The benchmark harness: one command, one run, every figure measured side by side.

    python -m bench.run --device cpu            # ~125M Llama, float32: several minutes on 2 cores
    python -m bench.run --device cuda           # Qwen2.5-0.5B, Llama-3.2-1B, Llama-3-8B, bf16
    python -m bench.run --device cpu --smoke    # tiny shape, few tokens, every section in seconds
    python -m bench.run --device cuda --shapes llama-3-8b --sections engine,baselines
    python -m bench.run --model FILE.gguf       # a real checkpoint against llama.cpp (CPU)
    python -m bench.run --model FILE.gguf --depth 4096 --sections engine,baselines

Per shape, on a random-weight checkpoint built on the device in a temp folder (nothing is
downloaded):
  1. engine     ShardLM's in-process engine: decode tokens/s by batch, prefill tokens/s.
  2. baselines  transformers `generate` (eager, no compile) at batch 1 and the largest batch; on
                GPU also its static cache + torch.compile path; the batch-1 roofline.
  3. stack      `shardlm serve` in a subprocess with N concurrent streaming gRPC clients.
  4. targets    PASS/MISS lines against the project's targets (printed, never asserted).
One JSON (device, versions, date, config, every figure) is written to --out.

With --model (a GGUF file or a checkpoint folder) the shapes are replaced by that checkpoint and
ShardLM is measured against llama.cpp on it instead: see bench/model_bench.py.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import signal
import tempfile
import traceback
from pathlib import Path

import torch

from bench import engine_bench as eb
from bench import model_bench, roofline, stack_bench
from bench.report import get, print_report
from bench.shapes import CPU_DEFAULT, GPU_DEFAULT, SHAPES, build_checkpoint, parameter_count
from shardlm_server.worker.decode_runner import GraphConfig
from shardlm_server.worker.engine import EngineOptions
from shardlm_server.worker.ops.activations import ACTIVATION_PRECISIONS

SECTIONS = ("engine", "baselines", "stack")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                   help="default: float32 on CPU, bfloat16 on GPU")
    p.add_argument("--shapes", nargs="+", help=f"any of {', '.join(SHAPES)} (comma or space)")
    p.add_argument("--model", help="a GGUF file or checkpoint folder: ShardLM against llama.cpp "
                   "on it (CPU), instead of the random shapes")
    p.add_argument("--depth", type=int, default=0,
                   help="--model: also batch-1 decode after a context of this many tokens "
                   "(e.g. 4096), ShardLM's float32 and float16 KV caches against llama.cpp, and "
                   "the float16 cache in each --activation-precision mode")
    p.add_argument("--activation-precision", default="exact",
                   help="--model: any of int8, int16 (comma-separated) also times ShardLM in "
                   "process with those activation precisions (the opt-in modes), in the same "
                   "rounds, each with its own top-1 agreement")
    p.add_argument("--agreement-tokens", type=int,
                   help="--model: teacher-forced text length for top-1 agreement (default 512)")
    p.add_argument("--smoke", action="store_true", help="tiny shape, few tokens, seconds")
    p.add_argument("--long", action="store_true", help="CPU: also a 2048-token prefill")
    p.add_argument("--batches", help="decode batch sizes (default CPU 1,8,32; GPU 1,8,32,64,128)")
    p.add_argument("--streams", help="concurrent clients (default CPU 1,8,32; GPU 1,8,32,64)")
    p.add_argument("--prompt-len", type=int, default=32, help="decode and stack prompt tokens")
    p.add_argument("--new-tokens", type=int, help="tokens per sequence (default CPU 64, GPU 128)")
    p.add_argument("--repeats", type=int, help="best of this many timed runs (default 2)")
    p.add_argument("--sections", default=",".join(SECTIONS), help="subset of engine,baselines,stack")
    p.add_argument("--out", default="bench/results", help="folder for the JSON result")
    p.add_argument("--no-cuda-graphs", action="store_true",
                   help="decode without CUDA graphs: the engine's options, and the stack's "
                   "`shardlm serve` setting (through SHARDLM_CUDA_GRAPHS)")
    args = p.parse_args(argv)
    gpu = args.device == "cuda"
    if args.smoke:
        args.shapes = args.shapes or ["tiny"]
        args.new_tokens = args.new_tokens or 16
        args.batches = args.batches or "1,4"
        args.streams = args.streams or "1,4"
        args.repeats = args.repeats or 1
        args.prefill_lens = [128]
    else:
        args.prefill_lens = [512, 2048] if gpu or args.long else [512]
    args.shapes = [s for item in (args.shapes or (GPU_DEFAULT if gpu else CPU_DEFAULT))
                   for s in item.split(",") if s]
    unknown = [s for s in args.shapes if s not in SHAPES]
    if unknown:
        p.error(f"unknown shape {unknown[0]}; known: {', '.join(SHAPES)}")
    args.batch_list = _ints(args.batches or ("1,8,32,64,128" if gpu else "1,8,32"))
    args.stream_list = _ints(args.streams or ("1,8,32,64" if gpu else "1,8,32"))
    args.new_tokens = args.new_tokens or (128 if gpu else 64)
    args.repeats = args.repeats or 2
    if args.model:
        if gpu:
            p.error("--model compares against llama.cpp on CPU; leave out --device cuda")
        if args.depth < 0:
            p.error("--depth must be a token count >= 0")
        if not Path(args.model).exists():
            p.error(f"--model {args.model}: no such file or folder")
        args.precisions = [x for x in args.activation_precision.split(",") if x]
        unknown = sorted(set(args.precisions) - set(ACTIVATION_PRECISIONS))
        if unknown:
            p.error(f"--activation-precision: {', '.join(unknown)} not among "
                    f"{', '.join(ACTIVATION_PRECISIONS)}")
        default_agreement = 64 if args.smoke else 512
        args.agreement_tokens = (default_agreement if args.agreement_tokens is None
                                 else args.agreement_tokens)
        args.dtype = args.dtype or "bfloat16"
    args.dtype = args.dtype or ("bfloat16" if gpu else "float32")
    args.section_list = [s for s in args.sections.split(",") if s]
    return args


def _ints(text: str) -> list[int]:
    return sorted({int(x) for x in text.split(",") if x})


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _error(exc: BaseException) -> dict:
    traceback.print_exc()
    return {"error": f"{type(exc).__name__}: {exc}".strip()[:500]}


# ----------------------------------------------------------------------------- sections
def load_engine(folder: Path, args, dtype, device):
    """The engine with the largest KV cache the batch list needs that fits; and those batches."""
    batches = list(args.batch_list)
    while batches:
        try:
            options = EngineOptions(graphs=GraphConfig(enabled=not args.no_cuda_graphs))
            return eb.load_engine(folder, dtype, device, batches[-1],
                                  args.prompt_len + args.new_tokens, max(args.prefill_lens),
                                  options=options), batches
        except eb.OOM_ERRORS:
            batches.pop()
            _free(device)
    raise RuntimeError("the engine's KV cache does not fit even for batch 1")


def engine_section(engine, fitting: list[int], args, shape, device) -> dict:
    vocab = shape.config["vocab_size"]
    steps = args.new_tokens - 1
    decode, prefill = [], []
    for batch in args.batch_list:
        if batch not in fitting:
            decode.append({"batch": batch, "skipped": "KV cache does not fit"})
            continue
        prompts = eb.random_prompts(batch, args.prompt_len, vocab)
        try:
            seconds = eb.engine_decode_seconds(engine, prompts, args.new_tokens, device, args.repeats)
            decode.append(eb.decode_row(batch, seconds, steps))
        except eb.OOM_ERRORS as exc:
            engine.reset()
            _free(device)
            decode.append({"batch": batch, "skipped": f"out of memory ({type(exc).__name__})"})
            break
    for length in args.prefill_lens:
        prompt = eb.random_prompts(1, length, vocab, seed=1)
        seconds = eb.engine_prefill_seconds(engine, prompt, device, args.repeats)
        prefill.append({"prompt_tokens": length, "tokens_per_s": length / seconds,
                        "ms": 1000 * seconds})
    section = {"decode": decode, "prefill": prefill,
               "cuda_graphs": engine.runner.graphs is not None}
    graphs = engine.runner.graphs
    if graphs is not None and 1 in fitting:
        # The same batch-1 decode with the graphs set aside (every step eager): what they are worth.
        engine.runner.graphs = None
        try:
            prompts = eb.random_prompts(1, args.prompt_len, vocab)
            seconds = eb.engine_decode_seconds(engine, prompts, args.new_tokens, device, args.repeats)
            section["without_graphs_batch1"] = eb.decode_row(1, seconds, steps)
        finally:
            engine.runner.graphs = graphs
    return section


def paired_batch1(engine, model, args, vocab: int, device) -> tuple[float, float]:
    """Batch-1 decode seconds of ShardLM and transformers, timed in alternation."""
    prompts = eb.random_prompts(1, args.prompt_len, vocab)
    return eb.paired_decode_seconds(engine, model, prompts, args.new_tokens, device,
                                    args.repeats + 1)


def _measured(rows: list[dict]) -> list[dict]:
    return [r for r in rows if "tokens_per_s" in r]


def baselines_section(model, args, shape, device, engine, section: dict | None) -> dict:
    vocab = shape.config["vocab_size"]
    steps = args.new_tokens - 1
    done = _measured(section["decode"]) if section else []
    largest = max([r["batch"] for r in done] or [max(args.batch_list)])
    eager: dict = {"attention": getattr(model.config, "_attn_implementation", None), "decode": []}
    if engine is not None:
        ours, theirs = paired_batch1(engine, model, args, vocab, device)
        eager["decode"].append(dict(eb.decode_row(1, theirs, steps), paired=True))
        for row in done:  # keep the engine's best batch-1 figure
            if row["batch"] == 1 and ours < row["ms_per_step"] * steps / 1000:
                row.update(eb.decode_row(1, ours, steps), paired=True)
    for batch in sorted({1, largest} - ({1} if engine is not None else set())):
        prompts = eb.random_prompts(batch, args.prompt_len, vocab).to(device)
        try:
            seconds = eb.hf_decode_seconds(model, prompts, args.new_tokens, device, args.repeats,
                                           disable_compile=True)
            eager["decode"].append(eb.decode_row(batch, seconds, steps))
        except eb.OOM_ERRORS as exc:
            _free(device)
            eager["decode"].append({"batch": batch, "skipped": f"out of memory ({exc})"[:200]})
    eager["prefill"] = []
    for length in args.prefill_lens:
        prompt = eb.random_prompts(1, length, vocab, seed=1).to(device)
        seconds = eb.hf_prefill_seconds(model, prompt, device, args.repeats)
        eager["prefill"].append({"prompt_tokens": length, "tokens_per_s": length / seconds,
                                 "ms": 1000 * seconds})
    roof = roofline.measure(model, device)
    compiled = compiled_baseline(model, args, vocab, device)
    ms = {"shardlm": next((r["ms_per_step"] for r in done if r["batch"] == 1), None),
          "transformers": next((r["ms_per_step"] for r in _measured(eager["decode"])
                                if r["batch"] == 1), None),
          "transformers_compiled": compiled.get("ms_per_step")}
    roof["achieved"] = {k: roofline.achieved(roof, v) for k, v in ms.items() if v}
    return {"transformers": eager, "transformers_compiled": compiled, "roofline": roof}


def compiled_baseline(model, args, vocab: int, device: torch.device) -> dict:
    """transformers' static KV cache + torch.compile (its own auto-compile in `generate`), batch 1."""
    if device.type != "cuda":
        return {"n/a": "GPU only (transformers auto-compiles generate on CUDA)"}
    try:
        from transformers import CompileConfig

        prompts = eb.random_prompts(1, args.prompt_len, vocab).to(device)
        seconds = eb.hf_decode_seconds(model, prompts, args.new_tokens, device, args.repeats,
                                       warmups=3, cache_implementation="static",
                                       compile_config=CompileConfig())
        if getattr(model, "_compiled_call", None) is None:
            return {"n/a": "transformers ran without compiling (its compile criteria unmet)"}
        return eb.decode_row(1, seconds, args.new_tokens - 1)
    except Exception as exc:  # noqa: BLE001 - any failure of the optional path is reported
        return {"n/a": f"{type(exc).__name__}: {exc}"[:300]}
    finally:
        torch._dynamo.reset()  # drop compiled graphs (and CUDA graph pools) with their references
        _free(device)


def stack_section(folder: Path, args, shape, dtype, device, engine=None) -> dict:
    in_process = None
    if engine is not None:  # batch-1 engine runs alternated with the single-stream rounds
        prompts = eb.random_prompts(1, args.prompt_len, shape.config["vocab_size"])

        def in_process() -> float:
            seconds = eb.engine_decode_seconds(engine, prompts, args.new_tokens, device, 1)
            return (args.new_tokens - 1) / seconds

    return stack_bench.measure(
        folder, device=device.type, dtype=args.dtype, shape_config=shape.config,
        dtype_bytes=torch.empty((), dtype=dtype).element_size(), stream_counts=args.stream_list,
        prompt_len=args.prompt_len, max_new_tokens=args.new_tokens, repeats=args.repeats,
        in_process=in_process)


def run_shape(name: str, args, dtype: torch.dtype, device: torch.device, result: dict) -> None:
    """Fills `result` section by section, so an interrupted run keeps the sections it finished."""
    shape = SHAPES[name]
    result.update({"shape": name, "architecture": shape.architecture, "note": shape.note})
    print(f"\n== {name}: building a random {shape.architecture} in {args.dtype} on {device}",
          flush=True)
    with tempfile.TemporaryDirectory(prefix="shardlm-bench-") as tmp:
        folder = Path(tmp)
        model = build_checkpoint(folder, shape, dtype, device)
        result["parameters"] = parameter_count(model)
        engine = None
        if "engine" in args.section_list:
            print("-- engine", flush=True)
            try:
                engine, fitting = load_engine(folder, args, dtype, device)
                result["engine"] = engine_section(engine, fitting, args, shape, device)
            except Exception as exc:  # noqa: BLE001 - keep going: report what failed
                result["engine"] = _error(exc)
        if "baselines" in args.section_list:
            print("-- baselines", flush=True)
            try:
                section = result["engine"] if "decode" in result.get("engine", {}) else None
                result["baselines"] = baselines_section(model, args, shape, device, engine, section)
            except Exception as exc:  # noqa: BLE001
                result["baselines"] = _error(exc)
        del model
        _free(device)
        if "stack" in args.section_list:
            print("-- stack", flush=True)
            try:
                result["stack"] = stack_section(folder, args, shape, dtype, device, engine)
            except Exception as exc:  # noqa: BLE001
                result["stack"] = _error(exc)
        del engine
        _free(device)


# ----------------------------------------------------------------------------- targets
def targets(results: list[dict], device: torch.device) -> list[dict]:
    out = []

    def add(name: str, shape: str, value, goal: float, unit: str = "x") -> None:
        out.append({"target": name, "shape": shape, "value": value, "goal": goal, "unit": unit,
                    "pass": None if value is None else value >= goal})

    def ratio(a, b):
        return a / b if a is not None and b else None

    for r in results:
        s = r["shape"]
        ours = r.get("engine", {}).get("decode")
        base = r.get("baselines", {})
        hf = base.get("transformers", {}).get("decode")
        stack = r.get("stack", {}).get("rows")
        if device.type == "cpu":
            add("batch-1 decode vs transformers >= 1.5x", s,
                ratio(get(ours, "batch", 1), get(hf, "batch", 1)), 1.5)
        counts = [row["streams"] for row in stack or []]
        most = 32 if 32 in counts or not counts else max(counts)  # smoke runs fewer
        add(f"{most} streams vs one stream (total tok/s) >= 4x", s,
            ratio(get(stack, "streams", most), get(stack, "streams", 1)), 4.0)
        # Against the engine runs alternated with the stack's (same machine conditions) when
        # there are any, else against the engine section's batch-1 figure.
        engine_1 = get(stack, "streams", 1, "in_process_tokens_per_s") or get(ours, "batch", 1)
        add("full stack 1 stream vs in-process batch 1 >= 90%", s,
            ratio(get(stack, "streams", 1, "stream_decode_tokens_per_s"), engine_1), 0.9)
        if device.type == "cuda":
            if s == "llama-3-8b":
                pct = base.get("roofline", {}).get("achieved", {}).get("shardlm", {})
                add("batch-1 decode >= 80% of the bandwidth floor", s,
                    pct.get("pct_of_floor", 100) / 100 if pct else None, 0.8)
            if s == "qwen2.5-0.5b":
                add("batch-1 decode >= 1000 tok/s", s, get(ours, "batch", 1), 1000, " tok/s")
            add("batch-64 decode vs transformers batch 1 >= 8x", s,
                ratio(get(ours, "batch", 64), get(hf, "batch", 1)), 8.0)
    return out


# ----------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available")
    if args.no_cuda_graphs:
        os.environ["SHARDLM_CUDA_GRAPHS"] = "0"  # the stack section's `shardlm serve` reads it
    dtype = getattr(torch, args.dtype)
    interrupted = False
    started = dt.datetime.now(dt.UTC)
    load_start = list(os.getloadavg())  # the machine may be shared: keep its load beside the figures
    if args.model:
        results = [model_bench.measure(args)]
        goals = model_bench.targets(results[0])
        model_bench.print_model_report(results[0], goals)
    else:
        # A run stopped by SIGINT (scripts/gpu_check.sh stops a step at its time limit so) still
        # writes the sections it finished, marked, and then exits 130 as an interrupted run does.
        # Python leaves SIGINT ignored when it started so, as a non-interactive shell starts its
        # background jobs: take it back, or such a run could not be stopped this way.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        results: list[dict] = []
        try:
            for name in args.shapes:
                results.append({})
                run_shape(name, args, dtype, device, results[-1])
        except KeyboardInterrupt:
            interrupted = True
            print("\ninterrupted: writing the sections finished so far", flush=True)
            results = [r for r in results if "shape" in r]
        goals = targets(results, device)
        print_report(results, goals)
    report = {
        "benchmark": "bench.run", "date": started.isoformat(timespec="seconds"),
        "duration_s": (dt.datetime.now(dt.UTC) - started).total_seconds(),
        "device": eb.device_name(device), "device_type": device.type,
        "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
        "load_average": {"start": load_start, "end": list(os.getloadavg())},
        "versions": eb.versions(),
        "config": {"model": args.model, "shapes": None if args.model else args.shapes, "dtype": args.dtype, "smoke": args.smoke,
                   "batches": args.batch_list, "streams": args.stream_list,
                   "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                   "prefill_lens": args.prefill_lens, "repeats": args.repeats,
                   "sections": args.section_list},
        "results": results, "targets": goals, "interrupted": interrupted,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = started.strftime("%Y%m%d-%H%M%S")
    what = Path(args.model).stem if args.model else "-".join(args.shapes)
    path = out / f"run-{args.device}-{what}-{stamp}.json"
    path.write_text(json.dumps(report, indent=2))
    print(f"\nwrote {path}")
    if interrupted:
        raise SystemExit(130)
    return report


if __name__ == "__main__":
    main()
