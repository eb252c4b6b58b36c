"""The GPU check's results: one bench JSON, a Markdown summary, and the output folder's layout.

    python scripts/gpu_summary.py merge-bench DIR --out bench.json
    python scripts/gpu_summary.py summary --out summary.md [--title T] [--env env.txt]
                                  [--steps steps.tsv] [--junit A.xml ...] [--bench bench.json]
    python scripts/gpu_summary.py layout DIR
    python scripts/gpu_summary.py synthetic-junit FILE | synthetic-bench DIR SHAPE

`summary` reads what scripts/gpu_check.sh wrote (environment, steps with their status and
seconds, pytest's junit XML, bench.run's JSON) and writes one Markdown page of tables: tests
passed / failed / skipped per part with the failures named, the build time, the key benchmark
figures and targets. `layout` checks that a folder can come back whole from the device tool
(at most 8 files, 16 MiB each, 64 MiB in all, two folders deep, plain names). The synthetic-*
commands write inputs of the real formats for the dry run, which runs everything else for real.

Standard library only.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

MAX_FILES, MAX_FILE_BYTES, MAX_TOTAL_BYTES, MAX_FOLDERS_DOWN = 8, 16 << 20, 64 << 20, 2
PLAIN_NAME = re.compile(r"[A-Za-z0-9._-]+")
FAILURES_LISTED = 25


# ----------------------------------------------------------------------------- inputs
def read_env(path: Path | None) -> dict[str, str]:
    if path is None or not path.exists():
        return {}
    facts = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        key, sep, value = line.partition(": ")
        if sep and key != "problem":
            facts[key] = value
    return facts


def read_steps(path: Path | None) -> list[tuple[str, str, str, str]]:
    """(name, status, seconds, share) per step: its share of the budget, in seconds."""
    if path is None or not path.exists():
        return []
    return [tuple((line.split("\t") + ["", "", ""])[:4])  # type: ignore[misc]
            for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def read_junit(path: Path) -> dict:
    """Counts and failures of one pytest junit XML (a missing or cut-off file says so)."""
    result = {"file": path.name, "passed": 0, "failed": 0, "errors": 0, "skipped": 0,
              "seconds": 0.0, "failures": [], "note": ""}
    if not path.exists():
        result["note"] = "no junit XML (the step did not run or was killed)"
        return result
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as exc:
        result["note"] = f"unreadable junit XML ({exc})"
        return result
    for suite in root.iter("testsuite"):
        result["seconds"] += float(suite.get("time") or 0)
    for case in root.iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}".strip(":")
        outcome = next((child for child in case if child.tag in ("failure", "error", "skipped")),
                       None)
        if outcome is None:
            result["passed"] += 1
        elif outcome.tag == "skipped":
            result["skipped"] += 1
        else:
            result["failed" if outcome.tag == "failure" else "errors"] += 1
            message = (outcome.get("message") or outcome.text or "").strip().splitlines()
            result["failures"].append((f"{path.name}: {name}",
                                       message[0][:200] if message else outcome.tag))
    return result


def merge_bench(directory: Path) -> dict:
    runs = []
    for path in sorted(directory.glob("run-*.json"), key=lambda p: p.stat().st_mtime):
        try:
            runs.append(json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError) as exc:
            runs.append({"file": path.name, "error": f"unreadable: {exc}"})
    return {"benchmark": "bench.run --device cuda, one run per shape", "runs": runs}


# ----------------------------------------------------------------------------- tables
def _fmt(value, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def _row(rows: list[dict] | None, key: str, value) -> dict:
    return next((r for r in rows or [] if r.get(key) == value and "tokens_per_s" in r), {})


def bench_rows(bench: dict) -> tuple[list[str], list[str]]:
    """One table line per shape, and one line per target."""
    lines, targets = [], []
    for run in bench.get("runs", []):
        if "error" in run:
            lines.append(f"| {run.get('file', '?')} | {run['error']} |" + " |" * 8)
            continue
        for r in run.get("results", []):
            engine, base = r.get("engine", {}), r.get("baselines", {})
            decode = engine.get("decode", [])
            best = max((d for d in decode if "tokens_per_s" in d),
                       key=lambda d: d["tokens_per_s"], default={})
            prefill = max(engine.get("prefill", []), key=lambda p: p["prompt_tokens"], default={})
            hf = _row(base.get("transformers", {}).get("decode"), "batch", 1)
            floor = base.get("roofline", {}).get("achieved", {}).get("shardlm", {})
            one = _row(r.get("stack", {}).get("rows"), "streams", 1)
            errors = [f"{k}: {v['error']}" for k, v in r.items()
                      if isinstance(v, dict) and "error" in v]
            if run.get("interrupted"):  # stopped at its time limit: the sections it finished
                asked = run.get("config", {}).get("sections", ["engine", "baselines", "stack"])
                errors.append("interrupted: " + ", ".join(k for k in asked if k not in r)
                              + " not run")
            one_1 = _row(decode, "batch", 1)
            lines.append(
                f"| {r['shape']} | {_fmt(one_1.get('tokens_per_s'))} "
                f"| {_fmt(one_1.get('ms_per_step'), '.2f')} "
                f"| {_fmt(engine.get('without_graphs_batch1', {}).get('tokens_per_s'))} "
                f"| {_fmt(best.get('tokens_per_s'))} (batch {best.get('batch', '-')}) "
                f"| {_fmt(prefill.get('tokens_per_s'), '.0f')} ({prefill.get('prompt_tokens', '-')}) "
                f"| {_fmt(hf.get('tokens_per_s'))} | {_fmt(floor.get('pct_of_floor'), '.0f')} "
                f"| {_fmt(one.get('stream_decode_tokens_per_s'))} / "
                f"{_fmt(one.get('ttft_p50_ms'))} ms | {'; '.join(errors)[:300] or '-'} |")
        for t in run.get("targets", []):
            verdict = {True: "PASS", False: "MISS", None: "not measured"}[t.get("pass")]
            value = t.get("value")
            shown = "-" if value is None else f"{value:.2f}{t.get('unit', '')}"
            targets.append(f"- {verdict}: {t['target']} ({t['shape']}): {shown}")
    return lines, targets


def summary(title: str, env: dict[str, str], steps: list[tuple[str, str, str, str]],
            junits: list[dict], bench: dict | None) -> str:
    out = [f"# {title}", ""]
    if env:
        out += ["| environment | |", "|---|---|"]
        out += [f"| {key} | {value} |" for key, value in env.items()]
        out.append("")
    if steps:
        out += ["| step | status | seconds | share of the budget (s) |", "|---|---|---|---|"]
        out += [f"| {name} | {status} | {seconds} | {share or '-'} |"
                for name, status, seconds, share in steps]
        out.append("")
    if junits:
        out += ["| tests | passed | failed | errors | skipped | seconds | note |",
                "|---|---|---|---|---|---|---|"]
        out += [f"| {j['file']} | {j['passed']} | {j['failed']} | {j['errors']} | {j['skipped']} "
                f"| {j['seconds']:.1f} | {j['note'] or '-'} |" for j in junits]
        failures = [f for j in junits for f in j["failures"]]
        if failures:
            out += ["", f"Failures ({len(failures)}):"]
            out += [f"- `{name}`: {message}" for name, message in failures[:FAILURES_LISTED]]
            if len(failures) > FAILURES_LISTED:
                out.append(f"- ... and {len(failures) - FAILURES_LISTED} more (see the XML)")
        out.append("")
    if bench is not None:
        lines, targets = bench_rows(bench)
        out += ["| shape | batch-1 tok/s | ms/token | batch 1 without graphs | best decode tok/s "
                "| prefill tok/s (tokens) | transformers batch 1 | % of bandwidth floor "
                "| full stack 1 stream tok/s / TTFT p50 | errors |",
                "|---|---|---|---|---|---|---|---|---|---|", *lines]
        if not lines:
            out.append("| (no shape finished) |" + " |" * 9)
        if targets:
            out += ["", "Targets:", *targets]
        out.append("")
    return "\n".join(out)


# ----------------------------------------------------------------------------- layout
def layout_problems(directory: Path) -> list[str]:
    """What would keep part of `directory` from coming back through the device tool."""
    files = [p for p in directory.rglob("*") if p.is_file() or p.is_symlink()]
    problems = []
    if len(files) > MAX_FILES:
        problems.append(f"{len(files)} files, at most {MAX_FILES} come back")
    total = 0
    for path in files:
        rel = path.relative_to(directory)
        if path.is_symlink():
            problems.append(f"{rel}: a link does not come back")
            continue
        size = path.stat().st_size
        total += size
        if size > MAX_FILE_BYTES:
            problems.append(f"{rel}: {size} bytes, over 16 MiB")
        if len(rel.parts) - 1 > MAX_FOLDERS_DOWN:
            problems.append(f"{rel}: more than {MAX_FOLDERS_DOWN} folders down")
        if not all(PLAIN_NAME.fullmatch(part) for part in rel.parts):
            problems.append(f"{rel}: names may hold only letters, digits, '.', '_' and '-'")
    if total > MAX_TOTAL_BYTES:
        problems.append(f"{total} bytes in all, over 64 MiB")
    return problems


# ----------------------------------------------------------------------------- dry run inputs
SYNTHETIC_JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="0" failures="1" skipped="1" tests="3" time="1.5">
<testcase classname="tests.worker.ops.test_ops" name="test_rms_norm[cuda]" time="0.1"/>
<testcase classname="tests.worker.test_cuda_engine" name="test_dry_run_failure" time="0.2">
<failure message="AssertionError: synthetic failure (dry run)">dry run</failure></testcase>
<testcase classname="tests.worker.test_comm" name="test_nccl_two_ranks" time="0.0">
<skipped message="needs 2 CUDA GPUs and CuPy"/></testcase>
</testsuite></testsuites>
"""


def synthetic_bench(shape: str) -> dict:
    return {"benchmark": "bench.run", "device": "dry run", "config": {"dtype": "bfloat16"},
            "results": [{"shape": shape, "engine": {
                "decode": [{"batch": 1, "tokens_per_s": 100.0, "ms_per_step": 10.0},
                           {"batch": 8, "tokens_per_s": 700.0, "ms_per_step": 11.4}],
                "prefill": [{"prompt_tokens": 512, "tokens_per_s": 5000.0, "ms": 102.4}],
                "without_graphs_batch1": {"batch": 1, "tokens_per_s": 50.0, "ms_per_step": 20.0}},
                "baselines": {"transformers": {"decode": [{"batch": 1, "tokens_per_s": 40.0,
                                                           "ms_per_step": 25.0}]},
                              "roofline": {"achieved": {"shardlm": {"pct_of_floor": 61.0}}}},
                "stack": {"rows": [{"streams": 1, "tokens_per_s": 90.0,
                                    "stream_decode_tokens_per_s": 90.0, "ttft_p50_ms": 12.5}]}}],
            "targets": [{"target": "batch-1 decode >= 1000 tok/s", "shape": shape, "value": 100.0,
                         "goal": 1000, "unit": " tok/s", "pass": False}]}


# ----------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("merge-bench")
    p.add_argument("dir", type=Path)
    p.add_argument("--out", type=Path, required=True)
    p = sub.add_parser("summary")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--title", default="ShardLM GPU check")
    p.add_argument("--env", type=Path)
    p.add_argument("--steps", type=Path)
    p.add_argument("--junit", type=Path, nargs="*", default=[])
    p.add_argument("--bench", type=Path)
    p = sub.add_parser("layout")
    p.add_argument("dir", type=Path)
    p = sub.add_parser("synthetic-junit")
    p.add_argument("file", type=Path)
    p = sub.add_parser("synthetic-bench")
    p.add_argument("dir", type=Path)
    p.add_argument("shape")
    args = parser.parse_args(argv)

    if args.command == "merge-bench":
        args.out.write_text(json.dumps(merge_bench(args.dir), indent=2), encoding="utf-8")
    elif args.command == "summary":
        bench = None
        if args.bench is not None and args.bench.exists():
            bench = json.loads(args.bench.read_text(encoding="utf-8"))
        text = summary(args.title, read_env(args.env), read_steps(args.steps),
                       [read_junit(j) for j in args.junit], bench)
        args.out.write_text(text, encoding="utf-8")
        print(text)
    elif args.command == "layout":
        problems = layout_problems(args.dir)
        for problem in problems:
            print(f"output layout: {problem}", file=sys.stderr)
        return 1 if problems else 0
    elif args.command == "synthetic-junit":
        args.file.write_text(SYNTHETIC_JUNIT, encoding="utf-8")
    else:
        args.dir.mkdir(parents=True, exist_ok=True)
        path = args.dir / f"run-cuda-{args.shape}-dryrun.json"
        path.write_text(json.dumps(synthetic_bench(args.shape), indent=2), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
