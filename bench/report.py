"""The printed tables of `bench.run` (the JSON it writes holds the same figures)."""

from __future__ import annotations

import json
from pathlib import Path


def write_json(path: Path | None, report: dict) -> None:
    """Write a benchmark's report as indented JSON to `path` (None: nothing), folders made."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {path}")


def get(rows: list[dict] | None, key: str, value, field: str = "tokens_per_s"):
    for r in rows or []:
        if r.get(key) == value and field in r:
            return r[field]
    return None


def _fmt(v, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def print_report(results: list[dict], goals: list[dict]) -> None:
    print("\n== 1. engine (in-process)")
    print(f"{'shape':<14} {'batch':>5} {'tok/s':>10} {'ms/step':>9}")
    for r in results:
        for row in r.get("engine", {}).get("decode", []):
            print(f"{r['shape']:<14} {row['batch']:>5} {_fmt(row.get('tokens_per_s')):>10} "
                  f"{_fmt(row.get('ms_per_step'), '.2f'):>9} {row.get('skipped', '')}")
        for row in r.get("engine", {}).get("prefill", []):
            print(f"{r['shape']:<14} prefill {row['prompt_tokens']} tokens: "
                  f"{row['tokens_per_s']:.0f} tok/s ({row['ms']:.1f} ms)")
        eager = r.get("engine", {}).get("without_graphs_batch1")
        if eager:
            print(f"{r['shape']:<14} batch 1 without CUDA graphs: {eager['tokens_per_s']:.1f} "
                  f"tok/s ({eager['ms_per_step']:.2f} ms/step)")
        if "error" in r.get("engine", {}):
            print(f"{r['shape']:<14} error: {r['engine']['error']}")
    print("\n== 2. baselines and the batch-1 roofline")
    print(f"{'shape':<14} {'impl':<24} {'batch':>5} {'tok/s':>10} {'ms/step':>9} {'ShardLM/it':>10}")
    for r in results:
        base, ours = r.get("baselines", {}), r.get("engine", {}).get("decode")
        if "error" in base:
            print(f"{r['shape']:<14} error: {base['error']}")
            continue
        rows = [("transformers eager", x) for x in base.get("transformers", {}).get("decode", [])]
        rows.append(("transformers compiled", dict(base.get("transformers_compiled", {}), batch=1)))
        for impl, row in rows:
            if "tokens_per_s" not in row:
                print(f"{r['shape']:<14} {impl:<24} {row['batch']:>5} n/a: "
                      f"{row.get('n/a') or row.get('skipped')}")
                continue
            mine = get(ours, "batch", row["batch"])
            print(f"{r['shape']:<14} {impl:<24} {row['batch']:>5} {row['tokens_per_s']:>10.1f} "
                  f"{row['ms_per_step']:>9.2f} {_fmt(mine and mine / row['tokens_per_s'], '.2f'):>9}x")
        for row in base.get("transformers", {}).get("prefill", []):
            print(f"{r['shape']:<14} transformers prefill {row['prompt_tokens']} tokens: "
                  f"{row['tokens_per_s']:.0f} tok/s ({row['ms']:.1f} ms)")
        roof = base.get("roofline")
        if roof:
            print(f"{r['shape']:<14} floor: {roof['weight_bytes'] / 1e9:.3f} GB of weights at "
                  f"{roof['bandwidth_gb_s']:.1f} GB/s ({roof['method']}) = "
                  f"{roof['floor_ms_per_token']:.2f} ms/token, {roof['floor_tokens_per_s']:.1f} tok/s")
            if "torch_gemv_gb_s" in roof:
                print(f"{'':<14} (torch's batch-1 GEMV over the same weights: "
                      f"{roof['torch_gemv_gb_s']:.1f} GB/s)")
            for impl, a in roof["achieved"].items():
                print(f"{'':<14} {impl:<24} {a['ms_per_token']:.2f} ms/token, "
                      f"{a['achieved_gb_s']:.1f} GB/s, {a['pct_of_floor']:.0f}% of floor")
    print("\n== 3. full stack (shardlm serve over gRPC, client-side timings)")
    print(f"{'shape':<14} {'streams':>7} {'TTFT p50':>9} {'p99':>8} {'ITL p50':>8} {'p99':>8} "
          f"{'total tok/s':>11} {'stream tok/s':>12} {'tok/chunk':>9}")
    for r in results:
        stack = r.get("stack", {})
        if "error" in stack:
            print(f"{r['shape']:<14} error: {stack['error']}")
        for row in stack.get("rows", []):
            print(f"{r['shape']:<14} {row['streams']:>7} {row['ttft_p50_ms']:>7.1f}ms "
                  f"{row['ttft_p99_ms']:>6.1f}ms {row['itl_p50_ms']:>6.1f}ms {row['itl_p99_ms']:>6.1f}ms "
                  f"{row['tokens_per_s']:>11.1f} {row['stream_decode_tokens_per_s']:>12.1f} "
                  f"{row['tokens_per_chunk']:>9.2f}")
        one = get(stack.get("rows"), "streams", 1, "in_process_tokens_per_s")
        if one:
            print(f"{r['shape']:<14} in-process batch 1, alternated with the 1-stream rounds: "
                  f"{one:.1f} tok/s")
    print("\n== 4. targets")
    for g in goals:
        verdict = "n/a " if g["pass"] is None else ("PASS" if g["pass"] else "MISS")
        value = "not measured" if g["value"] is None else (
            f"{g['value']:.2f}{g['unit']}" if g["unit"] == "x" else f"{g['value']:.1f}{g['unit']}")
        print(f"{verdict} {g['shape']}: {g['target']}: {value}")
