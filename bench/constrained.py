"""Constrained decoding: JSON Schema output validity, grammar compile time, decode overhead.

Against `shardlm serve` (a subprocess, as the other benches start it), over gRPC:

    python -m bench.constrained                          # the default model (SmolLM2-135M-Instruct)
    python -m bench.constrained --model DIR|FILE.gguf --device cuda --max-new-tokens 256 \\
        --concurrency 32 --rounds 3 --json out.json

1. validity  every schema of bench/json_schemas/, one greedy Generate each (chat `messages`: the
             case's prompt and the schema as text; `constraint.json_schema`; --concurrency in
             flight): the output parsed with json.loads and validated with jsonschema (Draft
             2020-12; `format` checked only for the formats llguidance enforces), finish reasons
             counted (GRAMMAR_COMPLETE, LENGTH, ...), each failure printed with its schema's name.
2. compile   per schema, in this process, llguidance on the served model's tokenizer: the time of
             `LLMatcher(tokenizer, grammar_from_json_schema(generation_schema(schema)))` (the
             server's reading of a schema) plus its first token mask
             (median of 3); p50 / p99 / max over the corpus.
3. overhead  the same prompts with and without a constraint, at batch 1 (sequential requests) and
             at --concurrency concurrent streams, in alternated rounds (--rounds each side, the
             order flipped every round). Both sides generate exactly --max-new-tokens tokens: the
             unconstrained side with ignore_eos, the constrained side under a schema that cannot
             be complete sooner (an array of at least --max-new-tokens inventory records).
             Reported per side, median and [min-max] over the rounds: each stream's decode tok/s
             (client side: tokens after the first chunk over the time from the first chunk to the
             last; leaves out prefill and grammar compilation) and total tok/s (every generated
             token over the round's wall time, first request sent to last chunk); TTFT p50.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import statistics
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import jsonschema
from jsonschema.exceptions import best_match
from shardlm.common.v1 import common_pb2
from shardlm.gateway.v1 import gateway_pb2, gateway_pb2_grpc

from bench.json_schemas import SCHEMAS, SchemaCase
from bench.report import write_json
from bench.serve_process import Server
from bench.stack_bench import percentile, summarize

# The `format`s llguidance enforces (others it rejects); jsonschema checks those it has a checker
# for without extra packages (date, email, ipv4, ipv6, uuid here). llguidance's `date` allows
# 02-29 in any year, so a leap-day miss is told apart from a structural one ("format" below).
ENFORCED_FORMATS = ("date", "date-time", "time", "duration", "email", "hostname", "ipv4", "ipv6",
                    "uuid", "uri")
_FORMATS = jsonschema.FormatChecker(formats=())
_FORMATS.checkers = {name: check for name, check in
                     jsonschema.Draft202012Validator.FORMAT_CHECKER.checkers.items()
                     if name in ENFORCED_FORMATS}
OUTCOMES = ("valid", "format", "invalid", "unparsable", "rpc_error")
OVERHEAD_ITEMS = [("ABC-1234", "steel bolts", 120), ("KLM-2210", "hex nuts", 800),
                  ("PQR-0042", "wood screws", 35), ("XYZ-9001", "wall plugs", 0)]


def user_message(case: SchemaCase) -> str:
    """The prompt both validity and overhead requests send: the ask, then the schema as text."""
    return (f"{case.prompt}\n\nAnswer with JSON only, matching this JSON Schema:\n"
            f"{json.dumps(case.schema)}")


def check_output(text: str, schema: dict) -> tuple[str, str]:
    """(outcome, detail): "valid"; "format" (valid but for an enforced `format`, such as a 02-29
    in a year that has none); "invalid" (parses, breaks the schema); "unparsable"."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        return "unparsable", f"{exc.msg} at char {exc.pos}: ...{text[max(0, exc.pos - 30):][:60]!r}"
    for outcome, checker in (("invalid", None), ("format", _FORMATS)):
        validator = jsonschema.Draft202012Validator(schema, format_checker=checker)
        error = best_match(validator.iter_errors(value))
        if error is not None:
            return outcome, f"at /{'/'.join(map(str, error.absolute_path))}: {error.message[:200]}"
    return "valid", ""


def spread(values: list[float]) -> dict:
    """Median and [min, max] of per-round figures."""
    if not values:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "n": len(values)}


def overhead_case(max_new_tokens: int, stream: int) -> SchemaCase:
    """An inventory list that cannot be complete within `max_new_tokens` tokens (every record
    takes several), so the constrained side always runs the full length."""
    sku, name, qty = OVERHEAD_ITEMS[stream % len(OVERHEAD_ITEMS)]
    record = {"type": "object",
              "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                             "name": {"type": "string", "minLength": 1, "maxLength": 24},
                             "qty": {"type": "integer", "minimum": 0, "maximum": 9999},
                             "in_stock": {"type": "boolean"}},
              "required": ["sku", "name", "qty", "in_stock"], "additionalProperties": False}
    return SchemaCase(
        "inventory_overhead",
        f"List warehouse inventory records (request {stream}): start with {sku}, {name}, "
        f"quantity {qty}, then continue with further hardware items.",
        {"type": "object",
         "properties": {"records": {"type": "array", "minItems": max_new_tokens,
                                    "items": record}},
         "required": ["records"], "additionalProperties": False})


def request(case: SchemaCase, max_new_tokens: int, constrained: bool,
            ignore_eos: bool = False) -> gateway_pb2.GenerateRequest:
    message = gateway_pb2.ChatMessage(role="user", content=user_message(case))
    return gateway_pb2.GenerateRequest(
        messages=gateway_pb2.ChatMessages(messages=[message]),
        sampling=common_pb2.SamplingParams(temperature=0.0),
        stop=common_pb2.StopConditions(max_new_tokens=max_new_tokens, ignore_eos=ignore_eos),
        constraint=common_pb2.Constraint(json_schema=json.dumps(case.schema))
        if constrained else None)


def generate(stub, req: gateway_pb2.GenerateRequest, timeout_s: float = 900.0) -> dict:
    """One streaming Generate: text, tokens, finish reason and constraint kind, and the record
    bench.stack_bench.summarize reads ("start", "arrivals": [(time, tokens)], "server")."""
    out = {"text": "", "tokens": 0, "finish": "", "kind": "", "error": "", "server": {},
           "start": time.perf_counter(), "arrivals": []}
    parts = []
    try:
        for chunk in stub.Generate(req, timeout=timeout_s):
            if chunk.token_ids:
                out["arrivals"].append((time.perf_counter(), len(chunk.token_ids)))
            parts.append(chunk.text)
            if chunk.finish_reason:
                out["finish"] = common_pb2.FinishReason.Name(chunk.finish_reason).removeprefix(
                    "FINISH_REASON_")
                out["kind"] = chunk.usage.constraint_kind
                t = chunk.timings
                out["server"] = {"ttft_s": t.time_to_first_token_seconds,
                                 "tokens_per_s": t.tokens_per_second,
                                 "mean_inter_token_s": t.mean_inter_token_seconds}
    except grpc.RpcError as err:
        out["error"] = f"{err.code().name}: {err.details()}"[:300]
    out["text"] = "".join(parts)
    out["tokens"] = sum(k for _t, k in out["arrivals"])
    return out


# ----------------------------------------------------------------------------- 1. validity
def validity(address: str, cases: list[SchemaCase], max_new_tokens: int, concurrency: int) -> dict:
    with grpc.insecure_channel(address) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)

        def one(case: SchemaCase) -> dict:
            r = generate(stub, request(case, max_new_tokens, constrained=True))
            outcome, detail = ("rpc_error", r["error"]) if r["error"] else check_output(
                r["text"], case.schema)
            return {"name": case.name, "outcome": outcome, "detail": detail,
                    "finish": r["finish"] or "-", "tokens": r["tokens"],
                    "constraint_kind": r["kind"], "text": r["text"][:2000]}

        with ThreadPoolExecutor(max(1, concurrency)) as pool:
            rows = list(pool.map(one, cases))
    outcomes = Counter(r["outcome"] for r in rows)
    return {"schemas": len(rows), "outcomes": {k: outcomes.get(k, 0) for k in OUTCOMES},
            "parsed": sum(outcomes[k] for k in ("valid", "format", "invalid")),
            "finish_reasons": dict(Counter(r["finish"] for r in rows).most_common()),
            "kind_not_reported": sum(1 for r in rows
                                     if r["outcome"] != "rpc_error"
                                     and r["constraint_kind"] != "json_schema"),
            "tokens_p50": percentile([r["tokens"] for r in rows], 50),
            "tokens_max": max((r["tokens"] for r in rows), default=0), "cases": rows}


# ----------------------------------------------------------------------------- 2. compile
def ll_tokenizer(model: Path, vocab_size: int, eos_ids: list[int]):
    import llguidance

    from shardlm_server.gateway.text.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(model)
    return llguidance.LLTokenizer(tok._backend.to_str(), n_vocab=max(vocab_size, tok.vocab_size),
                                  eos_token=list(eos_ids or tok.eos_token_ids))


def compile_times(lt, cases: list[SchemaCase], repeats: int = 3) -> dict:
    """Per schema, the median over `repeats` of grammar + matcher construction + first mask."""
    from llguidance import LLMatcher

    from shardlm_server.gateway.constraints.json_schema import generation_schema

    def once(schema: dict) -> tuple[float, str]:
        start = time.perf_counter()  # the grammar the gateway makes (gateway/constraints)
        matcher = LLMatcher(lt, LLMatcher.grammar_from_json_schema(generation_schema(schema)))
        matcher.compute_bitmask()
        return time.perf_counter() - start, matcher.get_error() if matcher.is_error() else ""

    once({"type": "object"})  # warm-up: the tokenizer's first use builds its tables
    rows = []
    for case in cases:
        runs = [once(case.schema) for _ in range(repeats)]
        rows.append({"name": case.name, "ms": 1000 * statistics.median(s for s, _e in runs),
                     "error": runs[0][1]})
    ms = [r["ms"] for r in rows]
    slowest = max(rows, key=lambda r: r["ms"])
    return {"p50_ms": percentile(ms, 50), "p99_ms": percentile(ms, 99), "max_ms": slowest["ms"],
            "slowest": slowest["name"], "errors": [r for r in rows if r["error"]],
            "repeats": repeats, "cases": rows}


# ----------------------------------------------------------------------------- 3. overhead
def overhead(address: str, *, max_new_tokens: int, concurrency: int, rounds: int,
             sequential: int, log=print) -> dict:
    channels = [grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
                for _ in range(max(1, concurrency))]
    stubs = [gateway_pb2_grpc.GatewayServiceStub(c) for c in channels]
    cases = [overhead_case(max_new_tokens, i) for i in range(max(concurrency, sequential))]

    def one(i: int, constrained: bool, tokens: int) -> dict:
        return generate(stubs[i % len(stubs)], request(cases[i], tokens, constrained,
                                                       ignore_eos=not constrained))

    def run(batch: int, constrained: bool, tokens: int = max_new_tokens) -> list[dict]:
        if batch == 1:
            return [one(i, constrained, tokens) for i in range(sequential)]
        with ThreadPoolExecutor(batch) as pool:
            return list(pool.map(lambda i: one(i, constrained, tokens), range(batch)))

    result = {}
    try:
        for c in channels:
            grpc.channel_ready_future(c).result(timeout=30)
        for batch in sorted({1, concurrency}):
            for constrained in (False, True):  # warm-up, short
                run(batch, constrained, 16)
            sides: dict[str, list] = {"unconstrained": [], "constrained": []}
            for r in range(rounds):
                order = ("unconstrained", "constrained")
                for side in order if r % 2 == 0 else order[::-1]:
                    log(f"overhead: batch {batch}, round {r + 1}/{rounds}, {side}")
                    sides[side].append(run(batch, side == "constrained"))
            result[str(batch)] = _overhead_row(batch, sides, max_new_tokens)
    finally:
        for c in channels:
            c.close()
    return {"max_new_tokens": max_new_tokens, "rounds": rounds, "sequential_requests": sequential,
            "batches": result}


def _overhead_row(batch: int, sides: dict[str, list], max_new_tokens: int) -> dict:
    row: dict = {}
    for side, runs in sides.items():
        ok = [[s for s in streams if s["arrivals"] and not s["error"]] for streams in runs]
        figures = [summarize(batch, streams) for streams in ok if streams]
        streams = [s for r in runs for s in r]
        row[side] = {
            "stream_decode_tokens_per_s": spread([f["stream_decode_tokens_per_s"] for f in figures]),
            "total_tokens_per_s": spread([f["tokens_per_s"] for f in figures]),
            "ttft_p50_ms": spread([f["ttft_p50_ms"] for f in figures])["median"],
            "streams": len(streams), "errors": sorted({s["error"] for s in streams if s["error"]}),
            "not_full_length": sum(1 for s in streams if s["tokens"] != max_new_tokens),
            "finish_reasons": dict(Counter(s["finish"] or "-" for s in streams))}
    for key in ("stream_decode_tokens_per_s", "total_tokens_per_s"):
        a, b = row["constrained"][key]["median"], row["unconstrained"][key]["median"]
        row[f"ratio_{key}"] = a / b if a and b else None
    return row


# ----------------------------------------------------------------------------- report
def _f(v, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def print_report(report: dict) -> None:
    v = report.get("validity")
    if v:
        print(f"\n== 1. validity: {v['schemas']} schemas, greedy, max_new_tokens "
              f"{report['config']['max_new_tokens']} (json.loads, then jsonschema Draft 2020-12)")
        print("  ".join(f"{k} {n}" for k, n in v["outcomes"].items()))
        print("finish reasons: " + ", ".join(f"{k} {n}" for k, n in v["finish_reasons"].items()))
        print(f"generated tokens p50 {_f(v['tokens_p50'], '.0f')}, max {v['tokens_max']}; "
              f"usage.constraint_kind missing on {v['kind_not_reported']}")
        for r in v["cases"]:
            if r["outcome"] != "valid":
                print(f"  {r['outcome']:<10} {r['name']:<24} {r['finish']:<16} {r['tokens']:>4} "
                      f"tok  {r['detail']}")
    c = report.get("compile")
    if c:
        print(f"\n== 2. grammar compile (llguidance in-process: matcher + first mask, median of "
              f"{c['repeats']})")
        print(f"p50 {c['p50_ms']:.2f} ms  p99 {c['p99_ms']:.2f} ms  max {c['max_ms']:.2f} ms "
              f"({c['slowest']})")
        for r in c["errors"]:
            print(f"  error {r['name']}: {r['error'][:200]}")
    o = report.get("overhead")
    if o:
        print(f"\n== 3. overhead: {o['max_new_tokens']} tokens per request, median [min-max] of "
              f"{o['rounds']} alternated rounds per side; batch 1 = {o['sequential_requests']} "
              "sequential requests")
        print("unconstrained: ignore_eos; constrained: a schema that cannot end sooner (both run the "
              "full length)\ndecode tok/s = per stream, client side, after the first chunk; "
              "total tok/s = all tokens / round wall time (with prefill and compile)")
        print(f"{'batch':>5} {'side':<14} {'decode tok/s':>24} {'total tok/s':>24} "
              f"{'TTFT p50':>9}  finish reasons")
        for batch, row in o["batches"].items():
            for side in ("unconstrained", "constrained"):
                s = row[side]
                cells = [f"{_f(x['median'])} [{_f(x['min'], '.0f')}-{_f(x['max'], '.0f')}]"
                         for x in (s["stream_decode_tokens_per_s"], s["total_tokens_per_s"])]
                print(f"{batch:>5} {side:<14} {cells[0]:>24} {cells[1]:>24} "
                      f"{_f(s['ttft_p50_ms'], '.0f'):>7}ms  {s['finish_reasons']}"
                      + (f"  errors {s['errors']}" if s["errors"] else ""))
            print(f"{batch:>5} {'ratio c/u':<14} "
                  f"{_f(row['ratio_stream_decode_tokens_per_s'], '.3f'):>24} "
                  f"{_f(row['ratio_total_tokens_per_s'], '.3f'):>24}")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, help="checkpoint folder or GGUF file (default: the "
                   "default model of `shardlm serve`)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", help="default: float32 on CPU, bfloat16 on GPU")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=32,
                   help="validity requests in flight; the overhead's larger batch")
    p.add_argument("--rounds", type=int, default=3, help="overhead rounds per side")
    p.add_argument("--sequential", type=int, default=4, help="batch-1 requests per round")
    p.add_argument("--kv-cache-mb", type=int, default=2048)
    p.add_argument("--sections", default="validity,compile,overhead")
    p.add_argument("--limit", type=int, help="only the first N schemas (a quick look)")
    p.add_argument("--json", type=Path, help="write the report here")
    args = p.parse_args(argv)
    if args.model is None:
        from shardlm_server.gateway.serve.default_model import default_model_path
        args.model = default_model_path()
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    sections = [s for s in args.sections.split(",") if s]
    if not set(sections) <= {"validity", "compile", "overhead"}:
        p.error(f"--sections {args.sections}: a subset of validity,compile,overhead")
    cases = SCHEMAS[: args.limit] if args.limit else SCHEMAS
    started = dt.datetime.now(dt.UTC)
    report: dict = {"benchmark": "bench.constrained", "date": started.isoformat(timespec="seconds"),
                    "model": str(args.model), "device": args.device, "dtype": dtype,
                    "machine": platform.machine(), "python": platform.python_version(),
                    "grpc": grpc.__version__,
                    "config": {"max_new_tokens": args.max_new_tokens,
                               "concurrency": args.concurrency, "rounds": args.rounds,
                               "sequential": args.sequential, "kv_cache_mb": args.kv_cache_mb,
                               "schemas": len(cases), "sections": sections}}
    with Server(args.model, device=args.device, dtype=dtype, kv_cache_mb=args.kv_cache_mb,
                start_timeout_s=600.0) as server:
        with grpc.insecure_channel(server.address) as channel:
            info = gateway_pb2_grpc.GatewayServiceStub(channel).GetModelInfo(
                gateway_pb2.GetModelInfoRequest(), timeout=30)
        if args.max_new_tokens > info.max_new_tokens_limit:
            raise SystemExit(f"--max-new-tokens {args.max_new_tokens} is above the server's "
                             f"limit {info.max_new_tokens_limit}")
        report["startup_s"] = server.startup_s
        print(f"serving {info.model.architecture} from {args.model} on {server.address} "
              f"({server.startup_s:.1f} s to start)", flush=True)
        if "validity" in sections:
            report["validity"] = validity(server.address, cases, args.max_new_tokens,
                                          args.concurrency)
        if "compile" in sections:
            lt = ll_tokenizer(args.model, info.model.vocab_size, list(info.model.eos_token_ids))
            report["compile"] = compile_times(lt, cases)
        if "overhead" in sections:
            report["overhead"] = overhead(server.address, max_new_tokens=args.max_new_tokens,
                                          concurrency=args.concurrency, rounds=args.rounds,
                                          sequential=args.sequential)
    report["duration_s"] = (dt.datetime.now(dt.UTC) - started).total_seconds()
    print_report(report)
    write_json(args.json, report)
    return report


if __name__ == "__main__":
    main()
