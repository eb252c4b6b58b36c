"""`python -m bench.run --model FILE.gguf|DIR`: ShardLM against llama.cpp on a real checkpoint.

On the same file and the same thread count, in alternation (a shared machine drifts, so each
round runs both engines back to back and the medians are reported):
  * batch-1 greedy decode after a short prompt, and one 512-token prefill; ShardLM's decode
    batches (--batches, best of --repeats);
  * ShardLM's decode step split into weight-streaming kernels, attention and everything else
    (torch.profiler self times over a few steps, scaled to the unprofiled step time);
  * the GB/s ShardLM streams against the read bandwidth measured in every round (bench.roofline);
  * with --depth N, batch-1 decode after an N-token context, KV bytes counted in the floor
    (bench.depth_bench), with each --activation-precision mode as well;
  * with --activation-precision int8 and/or int16, ShardLM's decode and prefill also with those
    activation precisions (the opt-in modes), timed in the same rounds, each with its own top-1
    agreement;
  * teacher-forced top-1 agreement of both engines with the float32 reference (bench.agreement);
  * the full stack, 1/8/32 concurrent streams: `shardlm serve` against llama.cpp's `llama-server`
    with as many parallel slots (bench.model_stack; the "stack" section).
llama.cpp runs through `llama-cpp-python` (bench/llamacpp.py); without it, or for a folder of
safetensors, only ShardLM's columns are measured and a line says why.
"""

from __future__ import annotations

import gc
import statistics
from pathlib import Path

import torch
from shardlm.gguf_header import find_gguf

from bench import agreement, depth_bench, llamacpp, model_stack, roofline
from bench import engine_bench as eb
from bench.quiet_profiler import quiet_profiler
from shardlm_server.worker import ops
from shardlm_server.worker.engine import Engine
from shardlm_server.worker.ops import activations

# Profiler names: the ops, and the scopes the fused CPU blocks open around the same kernels.
WEIGHT_OPS = ("shardlm::skinny_linear", "shardlm::quant_linear", "shardlm::linear", "aten::addmm",
              "aten::mm", "aten::linear")
ATTENTION_OPS = ("shardlm::paged_attention_decode", "shardlm::paged_attention_prefill",
                 "shardlm::reshape_and_cache", "shardlm::rotary_embedding", "shardlm::attention")


def _linears(engine: Engine) -> list:
    """Every linear layer of the model and the lm_head."""
    model = engine.model
    return [model.lm_head] + [linear for layer in model.layers
                              for linear in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)]


def weight_bytes(engine: Engine) -> int:
    """Bytes one batch-1 decode step must read: every linear layer's weights and the lm_head."""
    return sum(linear.weight.nbytes for linear in _linears(engine))


def linear_flops_per_token(engine: Engine) -> int:
    """2 x the parameters of the linear layers and the lm_head: a token's matrix FLOPs."""
    return sum(2 * lin.weight.shape[0] * lin.weight.shape[1] for lin in _linears(engine))


def step_breakdown(engine: Engine, prompt: torch.Tensor, steps: int, step_ms: float) -> dict:
    """Per-step milliseconds in weight kernels, attention and the rest: torch.profiler self
    times of `steps` decode steps alone (the prompt's prefill runs before the profiler starts),
    as shares applied to the unprofiled step time."""
    from torch.profiler import ProfilerActivity, profile

    ids = prompt[0].tolist()
    table = list(range(eb.blocks_per_sequence(engine, len(ids) + steps + 1)))
    engine.reset()
    engine.prefill([eb.PrefillItem(0, ids, 0, table, stop=eb.StopParams(max_new_tokens=steps + 1))])
    with quiet_profiler(), profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in engine.decode([eb.DecodeItem(0, table, steps)], steps):
            pass
    engine.reset()
    delta = {e.key: e.self_cpu_time_total for e in prof.key_averages()}
    total = sum(delta.values())
    weights = sum(v for k, v in delta.items() if k in WEIGHT_OPS)
    attention = sum(v for k, v in delta.items() if k in ATTENTION_OPS)
    w_ms, a_ms = step_ms * weights / total, step_ms * attention / total
    return {"weights_ms": w_ms, "attention_ms": a_ms, "other_ms": step_ms - w_ms - a_ms,
            "method": "torch.profiler self-time shares of the decode steps of a profiled run "
                      "(its prefill outside the profiler), applied to the unprofiled step time"}


def _median(values: list[float]) -> float:
    return statistics.median(values)


def _spread(values: list[float]) -> list[float]:
    """[lowest, highest] of the alternated rounds, printed beside each median."""
    return [min(values), max(values)]


def _rates(decode_s: list[float], prefill_s: list[float], prefill_len: int) -> dict:
    """One engine's decode and prefill figures from its rounds' seconds (a decode step's, a
    prefill's): medians and their spreads."""
    step_ms = 1000 * _median(decode_s)
    return {"decode_tokens_per_s": 1000 / step_ms, "decode_ms_per_step": step_ms,
            "decode_tokens_per_s_spread": _spread([1 / s for s in decode_s]),
            "prefill_tokens": prefill_len, "prefill_tokens_per_s": prefill_len / _median(prefill_s),
            "prefill_tokens_per_s_spread": _spread([prefill_len / s for s in prefill_s])}


def measure(args) -> dict:
    """Every figure for the checkpoint at args.model; see the module docstring."""
    path = Path(args.model)
    gguf = find_gguf(path)
    cpu = torch.device("cpu")
    threads = torch.get_num_threads()
    dtype = getattr(torch, args.dtype)
    prefill_len = max(args.prefill_lens)
    result: dict = {"model": str(path), "format": "gguf" if gguf else "safetensors",
                    "dtype": args.dtype, "threads": threads,
                    # which exact CPU kernels ran (csrc/cpu/subnormal.h): a CPU property
                    "subnormal_quants": ops.cpu_subnormal_quants_active()}
    engine = eb.load_engine(path, dtype, cpu, max(args.batch_list),
                            args.prompt_len + args.new_tokens,
                            max(prefill_len, args.agreement_tokens))
    vocab = engine.cfg.vocab_size
    llama = None
    if gguf is None:
        result["llama_cpp"] = "not run: llama.cpp needs a GGUF file"
    elif not llamacpp.available():
        result["llama_cpp"] = f"not run: llama-cpp-python is not installed ({llamacpp.INSTALL_HINT})"
    elif (crash := llamacpp.crash_reason(gguf, threads)) is not None:
        result["llama_cpp"] = f"not run: {crash}"
    else:
        try:
            llama = llamacpp.LlamaCpp(gguf, threads, n_ctx=max(prefill_len, args.prompt_len +
                                                                 args.new_tokens) + 16)
            result["llama_cpp"] = {"version": llamacpp.version()}
        except (ValueError, RuntimeError) as exc:  # llama.cpp refuses the file
            result["llama_cpp"] = f"not run: llama.cpp could not load the file ({exc})"
    if isinstance(result["llama_cpp"], str):
        print(f"llama.cpp: {result['llama_cpp']}", flush=True)

    steps = args.new_tokens - 1
    prompt = eb.random_prompts(1, args.prompt_len, vocab)
    long_prompt = eb.random_prompts(1, prefill_len, vocab, seed=1)
    ours_dec, ours_pre, theirs_dec, theirs_pre = [], [], [], []
    modes = [m for m in args.precisions if m != "exact"]  # the opt-in precisions, in order
    mode_dec: dict[str, list[float]] = {m: [] for m in modes}
    mode_pre: dict[str, list[float]] = {m: [] for m in modes}
    bandwidths: list[float] = []  # each round's read bandwidth (roofline.round_shares)
    eb.engine_decode_seconds(engine, prompt, 4, cpu, 1)  # warm-up
    for _ in range(args.repeats + 1):
        bandwidths.append(roofline.read_bandwidth(repeats=4))
        ours_dec.append(eb.engine_decode_seconds(engine, prompt, args.new_tokens, cpu, 1) / steps)
        ours_pre.append(eb.engine_prefill_seconds(engine, long_prompt, cpu, 1))
        for mode in modes:
            with activations.using(mode):
                mode_dec[mode].append(
                    eb.engine_decode_seconds(engine, prompt, args.new_tokens, cpu, 1) / steps)
                mode_pre[mode].append(eb.engine_prefill_seconds(engine, long_prompt, cpu, 1))
        if llama is not None:
            theirs_dec.append(llama.decode_seconds(prompt[0].tolist(), steps) / steps)
            theirs_pre.append(llama.prefill_seconds(long_prompt[0].tolist()))
    result["shardlm"] = _rates(ours_dec, ours_pre, prefill_len)
    step_ms = result["shardlm"]["decode_ms_per_step"]
    result["shardlm"]["breakdown"] = step_breakdown(engine, prompt, min(steps, 48), step_ms)
    for mode in modes:
        result[f"shardlm_{mode}"] = _rates(mode_dec[mode], mode_pre[mode], prefill_len)
    # Decode batches (ShardLM alone: llama.cpp's batches are measured through its server).
    result["shardlm"]["decode_batches"] = [
        eb.decode_row(b, eb.engine_decode_seconds(
            engine, eb.random_prompts(b, args.prompt_len, vocab), args.new_tokens, cpu,
            args.repeats), steps)
        for b in args.batch_list if b > 1]
    if llama is not None:
        result["llama_cpp"].update(_rates(theirs_dec, theirs_pre, prefill_len))
    # Let go of llama.cpp's in-process context (and its thread pool) before the servers run:
    # kept alive through the full stack, it slowed the ShardLM rounds of this 2-core machine
    # (one stream through the stack at half its speed), not the llama-server ones.
    llama_ran = llama is not None
    del llama
    gc.collect()

    nbytes = weight_bytes(engine)
    bandwidth = _median(bandwidths)
    floor_ms = 1000 * nbytes / bandwidth
    result["roofline"] = {"weight_bytes": nbytes, "bandwidth_gb_s": bandwidth / 1e9,
                          "bandwidth_gb_s_rounds": [bw / 1e9 for bw in bandwidths],
                          "floor_ms_per_token": floor_ms,
                          "achieved_gb_s": nbytes / (step_ms / 1000) / 1e9,
                          "pct_of_floor": _median(roofline.round_shares(nbytes, bandwidths, ours_dec))}
    for mode in modes:
        mode_ms = result[f"shardlm_{mode}"]["decode_ms_per_step"]
        result[f"shardlm_{mode}"].update({
            "achieved_gb_s": nbytes / (mode_ms / 1000) / 1e9,
            "pct_of_floor": _median(roofline.round_shares(nbytes, bandwidths, mode_dec[mode]))})

    flops = linear_flops_per_token(engine)
    peak = roofline.fma_peak_flops()
    rates = {"shardlm": result["shardlm"]["prefill_tokens_per_s"]}
    for mode in modes:
        rates[f"shardlm_{mode}"] = result[f"shardlm_{mode}"]["prefill_tokens_per_s"]
    if isinstance(result["llama_cpp"], dict):
        rates["llama_cpp"] = result["llama_cpp"]["prefill_tokens_per_s"]
    result["compute"] = {"fma_peak_gflops": peak / 1e9, "flops_per_token": flops,
                         "prefill_gflops": {k: v * flops / 1e9 for k, v in rates.items()}}

    if args.depth:
        print(f"-- decode at a {args.depth}-token depth", flush=True)
        result["depth"] = depth_bench.measure(path, gguf, dtype, args.depth, steps,
                                              args.repeats + 1, nbytes, tuple(modes))

    if "stack" in args.section_list:
        print("-- full stack", flush=True)
        try:
            result["stack"] = model_stack.measure(
                path, gguf, cfg=engine.cfg, dtype=args.dtype, threads=threads,
                stream_counts=args.stream_list, prompt_len=args.prompt_len,
                new_tokens=args.new_tokens, rounds=args.repeats + 1)
        except Exception as exc:  # noqa: BLE001 - keep the in-process figures: report what failed
            result["stack"] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
            print(f"full stack: {result['stack']['error']}", flush=True)

    if args.agreement_tokens:
        ids = agreement.text_ids(path, args.agreement_tokens)
        ours = agreement.engine_top1(engine, ids)
        ours_modes = {}
        for mode in modes:
            with activations.using(mode):
                ours_modes[mode] = agreement.engine_top1(engine, ids)
        del engine
        reference_engine = eb.load_engine(path, torch.float32, cpu, 1, 1, len(ids))
        reference = agreement.engine_top1(reference_engine, ids)
        del reference_engine
        result["agreement"] = {"tokens": len(ids), "shardlm": agreement.agreement(ours, reference)}
        for mode, top1 in ours_modes.items():
            result["agreement"][f"shardlm_{mode}"] = agreement.agreement(top1, reference)
        if llama_ran:
            scorer = llamacpp.LlamaCpp(gguf, threads, n_ctx=len(ids) + 16, logits_all=True)
            result["agreement"]["llama_cpp"] = agreement.agreement(scorer.top1(ids), reference)
    return result


def targets(result: dict) -> list[dict]:
    """The issue's CPU targets that this run measures, as PASS/MISS lines (never asserted)."""
    out = []
    ours, theirs = result["shardlm"], result["llama_cpp"]

    def add(name: str, value, goal: float) -> None:
        out.append({"target": name, "value": value, "goal": goal,
                    "pass": None if value is None else value >= goal})

    if isinstance(theirs, dict):
        add("batch-1 decode vs llama.cpp in-process >= 1.3x",
            ours["decode_tokens_per_s"] / theirs["decode_tokens_per_s"], 1.3)
        add("prefill vs llama.cpp >= 2x",
            ours["prefill_tokens_per_s"] / theirs["prefill_tokens_per_s"], 2.0)
    if result.get("agreement"):
        add("top-1 agreement with float32 >= 99.5%", result["agreement"]["shardlm"], 0.995)
    fast = result.get("shardlm_int8")
    if fast:
        if isinstance(theirs, dict):
            add("int8 activations: prefill vs llama.cpp >= 1.5x",
                fast["prefill_tokens_per_s"] / theirs["prefill_tokens_per_s"], 1.5)
            add("int8 activations: batch-1 decode vs llama.cpp >= 1.0x",
                fast["decode_tokens_per_s"] / theirs["decode_tokens_per_s"], 1.0)
        add("int8 activations: batch-1 decode >= 90% of the read floor",
            fast["pct_of_floor"] / 100, 0.9)
    near = result.get("shardlm_int16")
    if near:  # the near-exact precision against the exact engine's own targets
        if isinstance(theirs, dict):
            add("int16 activations: prefill vs llama.cpp >= 2x",
                near["prefill_tokens_per_s"] / theirs["prefill_tokens_per_s"], 2.0)
        if result.get("agreement"):
            add("int16 activations: top-1 agreement with float32 >= 99.5%",
                result["agreement"]["shardlm_int16"], 0.995)
    if "depth" in result:
        for name, value, goal in depth_bench.targets(result["depth"]):
            add(name, value, goal)
    if "rows" in result.get("stack", {}):
        for name, value, goal in model_stack.targets(result["stack"]):
            add(name, value, goal)
    if result["format"] == "safetensors" and result["dtype"] == "bfloat16":
        add("bfloat16 batch-1 decode >= 75% of the read-bandwidth floor",
            result["roofline"]["pct_of_floor"] / 100, 0.75)
    return out


def print_model_report(result: dict, goals: list[dict]) -> None:
    ours, theirs = result["shardlm"], result["llama_cpp"]
    print(f"\n== {result['model']} ({result['format']}, ShardLM {result['dtype']}, "
          f"{result['threads']} threads)")
    print(f"{'':<28}{'ShardLM':>12}{'llama.cpp':>12}{'ratio':>8}   spread ShardLM | llama.cpp")

    def row(label: str, key: str, source: dict = ours) -> None:
        mine = source[key]
        other = theirs.get(key) if isinstance(theirs, dict) else None
        ratio = f"{mine / other:>7.2f}x" if other else ""
        spreads = [source.get(f"{key}_spread"),
                   theirs.get(f"{key}_spread") if isinstance(theirs, dict) else None]
        spread = " | ".join(f"{lo:.1f}-{hi:.1f}" for lo, hi in filter(None, spreads))
        print(f"{label:<28}{mine:>12.1f}{other if other else float('nan'):>12.1f}{ratio:>8}   "
              f"{spread}")

    row("batch-1 decode tok/s", "decode_tokens_per_s")
    row(f"{ours['prefill_tokens']}-token prefill tok/s", "prefill_tokens_per_s")
    modes = [k.removeprefix("shardlm_") for k in result if k.startswith("shardlm_")]
    for mode in modes:
        row(f"{mode} activations: decode", "decode_tokens_per_s", result[f"shardlm_{mode}"])
        row(f"{mode} activations: prefill", "prefill_tokens_per_s", result[f"shardlm_{mode}"])
    batches = ours.get("decode_batches") or []
    if batches:
        print("ShardLM decode batches: " + ", ".join(
            f"{r['batch']}: {r['tokens_per_s']:.0f} tok/s ({r['ms_per_step']:.1f} ms/step)"
            for r in batches))
    b = ours.get("breakdown") or {}
    if b:
        kernels = "subnormal" if result.get("subnormal_quants") else "converted"
        print(f"decode step {ours['decode_ms_per_step']:.2f} ms: weight kernels "
              f"{b['weights_ms']:.2f} (quants {kernels}), attention {b['attention_ms']:.2f}, "
              f"everything else {b['other_ms']:.2f}")
    r = result["roofline"]
    print(f"weights {r['weight_bytes'] / 1e6:.0f} MB; read bandwidth {r['bandwidth_gb_s']:.1f} GB/s "
          f"(median of the rounds') -> floor {r['floor_ms_per_token']:.2f} ms/token; ShardLM streams "
          f"{r['achieved_gb_s']:.1f} GB/s ({r['pct_of_floor']:.0f}% of the floor)")
    for mode in modes:
        fast = result[f"shardlm_{mode}"]
        print(f"with {mode} activations ShardLM streams {fast['achieved_gb_s']:.1f} GB/s "
              f"({fast['pct_of_floor']:.0f}% of the floor)")
    c = result["compute"]
    print(f"prefill GFLOP/s (linear layers) against the float32 FMA peak of "
          f"{c['fma_peak_gflops']:.0f}: " + ", ".join(
              f"{name} {g:.0f} ({100 * g / c['fma_peak_gflops']:.0f}%)"
              for name, g in c["prefill_gflops"].items()))
    a = result.get("agreement")
    if a:
        line = f"top-1 agreement with float32 over {a['tokens']} tokens: ShardLM {100 * a['shardlm']:.1f}%"
        for mode in modes:
            line += f", ShardLM with {mode} activations {100 * a[f'shardlm_{mode}']:.1f}%"
        if "llama_cpp" in a:
            line += f", llama.cpp {100 * a['llama_cpp']:.1f}%"
        print(line)
    if "depth" in result:
        depth_bench.print_rows(result["depth"])
    if "rows" in result.get("stack", {}):
        model_stack.print_rows(result["stack"])
    print("\n== targets")
    for t in goals:
        verdict = "n/a " if t["pass"] is None else ("PASS" if t["pass"] else "MISS")
        value = "-" if t["value"] is None else f"{t['value']:.3f}"
        print(f"{verdict} {t['target']}: {value} (goal {t['goal']})")
