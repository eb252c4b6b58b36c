"""The stack's overhead: `shardlm serve` (gateway, gRPC, worker process) against the engine in
process, on the same file, prompts and lengths, in alternated rounds.

    python -m bench.stack_overhead                    # the default model, 1 and 32 streams
    python -m bench.stack_overhead --model FILE.gguf --rounds 5 --streams 1,32 --json out.json
    python -m bench.stack_overhead --stream-interval-ms 0,20   # a stack for each, alternated

Each round runs, for every stream count N, three sides back to back (each first, middle and last
in turn): the engine in a child process (`Engine.prefill` of N token-id prompts, then one decode
call until every sequence has its tokens, as `bench.engine_bench` times it); a worker process
alone, driven over its gRPC API from this process as the gateway drives it (a Prefill, then
Decode calls of the gateway's default --max-decode-steps), which splits the stack's cost into the
worker's side of its link and the rest; and the full stack (N concurrent streaming Generate
clients over gRPC, `bench.stack_bench`'s client). Every figure is total tokens/s: every generated
token over the wall time from the first prompt to the last token, so all include the prefill.
Speculation is off on every side (bench.speculation measures it). With several
--stream-interval-ms values, a stack (and a run of the lone worker) for each joins the rounds,
so the intervals are compared against the same engine runs.

The engine and the lone worker live in their own processes, idle (blocked on a pipe, or waiting
for a call) while another side runs, so no side's threads spin beside another's. While the stack runs, the CPU time of the gateway and of
the worker process is read from /proc and printed per generated token: on a CPU host every
millisecond the gateway spends per token is taken from the compute threads' cores.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.report import write_json
from bench.serve_process import REPO, Server, _children
from bench.stack_bench import run_round, summarize

PROMPT_TOKENS = 32
VOCAB_FLOOR = 3  # prompt ids start here (past the usual special tokens)


def prompts(count: int, vocab: int, seed: int = 0) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    return torch.randint(VOCAB_FLOOR, vocab, (count, PROMPT_TOKENS), generator=gen).tolist()


# ----------------------------------------------------------------------------- the engine side
def engine_host(model: Path, dtype: str, max_batch: int, new_tokens: int) -> None:
    """The child process: loads the engine, then answers each line "N" on stdin with one timed
    run at batch N (a JSON line on stdout) until stdin closes."""
    import torch

    from bench.engine_bench import load_engine, timed
    from shardlm_server.worker.engine_types import DecodeItem, PrefillItem, StopParams

    device = torch.device("cpu")
    engine = load_engine(model, getattr(torch, dtype), device, max_batch,
                         PROMPT_TOKENS + new_tokens + 1, max_batch * PROMPT_TOKENS)
    rows = prompts(max_batch, engine.cfg.vocab_size)
    per_seq = -(-(PROMPT_TOKENS + new_tokens + 2) // engine.cache.block_size)
    stop = StopParams(max_new_tokens=new_tokens)

    def run(batch: int) -> None:
        engine.reset()
        tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
        engine.prefill([PrefillItem(i, rows[i], 0, tables[i], stop=stop) for i in range(batch)])
        items = [DecodeItem(i, tables[i], new_tokens - 1) for i in range(batch)]
        for _ in engine.decode(items, new_tokens - 1):
            pass

    run(1)  # warm-up
    print(json.dumps({"ready": True, "vocab": engine.cfg.vocab_size}), flush=True)
    for line in sys.stdin:
        batch = int(line)
        seconds = timed(lambda b=batch: run(b), device)
        print(json.dumps({"tokens_per_s": batch * new_tokens / seconds}), flush=True)


class EngineProcess:
    """The engine host in a child process."""

    def __init__(self, model: Path, dtype: str, max_batch: int, new_tokens: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.stack_overhead", "--engine-host", "--model", str(model),
             "--dtype", dtype, "--max-batch", str(max_batch), "--new-tokens", str(new_tokens)],
            cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.new_tokens = new_tokens
        self.vocab = int(self._reply()["vocab"])

    def _reply(self) -> dict:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the engine host exited ({self.proc.wait()})")
        return json.loads(line)

    def run(self, batch: int) -> dict:
        """One timed run at `batch`: its tokens/s and the process's CPU ms per token."""
        assert self.proc.stdin is not None
        before = cpu_seconds(self.proc.pid)
        self.proc.stdin.write(f"{batch}\n")
        self.proc.stdin.flush()
        rate = float(self._reply()["tokens_per_s"])
        seconds = cpu_seconds(self.proc.pid) - before
        tokens = batch * self.new_tokens
        return {"tokens_per_s": rate, "cpu_ms_per_token": 1000 * seconds / tokens}

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(60)


# ----------------------------------------------------------------------------- the worker side
class WorkerProcess:
    """`python -m shardlm_server.worker` alone, driven over its gRPC API as the gateway drives it
    (Prefill of the batch, then Decode calls of the gateway's default --max-decode-steps) by a
    Python client in this process: the engine plus the worker's side of the gRPC link, without
    the gateway, its batch loop or the client's stream."""

    def __init__(self, model: Path, dtype: str, max_batch: int, new_tokens: int) -> None:
        import grpc
        from shardlm.common.v1 import common_pb2
        from shardlm.constants import DEFAULT_BLOCK_SIZE, dtype_enum_name
        from shardlm.worker.v1 import worker_pb2, worker_pb2_grpc

        from shardlm_server.gateway.config import default
        from shardlm_server.gateway.workers.processes import CPU_SPIN_COUNT

        self.pb, self.common = worker_pb2, common_pb2
        self.steps_per_call = int(default("max_decode_steps"))
        self.new_tokens = new_tokens
        # The gateway's environment for the workers it starts (gateway/workers/processes.py).
        env = dict(os.environ, PYTHONUNBUFFERED="1", GOMP_SPINCOUNT=str(CPU_SPIN_COUNT))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "shardlm_server.worker", "--port", "0"], cwd=REPO,
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True, env=env)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("READY "):
            raise RuntimeError(f"the worker did not start ({self.proc.wait()})")
        self.channel = grpc.insecure_channel(line.split()[1])
        self.stub = worker_pb2_grpc.WorkerServiceStub(self.channel)
        self.per_seq = -(-(PROMPT_TOKENS + new_tokens + 2) // DEFAULT_BLOCK_SIZE)
        for _ in self.stub.Load(worker_pb2.LoadRequest(
                model_path=str(model), dtype=common_pb2.Dtype.Value(dtype_enum_name(dtype)),
                device="cpu", rank=0, world_size=1,
                kv_cache=common_pb2.KvCacheConfig(num_blocks=max_batch * self.per_seq),
                engine=worker_pb2.EngineOptions(speculation="off"))):
            pass

    def run(self, batch: list[list[int]], stream_interval_ms: int | None) -> dict:
        """One timed run: every sequence's tokens/s over the wall time (prefill included), and
        the worker process's CPU ms per token."""
        pb, stop = self.pb, self.common.StopConditions(max_new_tokens=self.new_tokens,
                                                       ignore_eos=True)
        tables = [list(range(i * self.per_seq, (i + 1) * self.per_seq)) for i in range(len(batch))]
        self.stub.ResetCache(pb.ResetCacheRequest(all=True))
        before = cpu_seconds(self.proc.pid)
        start = time.perf_counter()
        self.stub.Prefill(pb.PrefillRequest(sequences=[
            pb.PrefillSequence(sequence_id=i, token_ids=p, block_table=tables[i], sample=True,
                               stop=stop) for i, p in enumerate(batch)]))
        left = self.new_tokens - 1
        while left > 0:
            steps = min(left, self.steps_per_call)
            for _ in self.stub.Decode(pb.DecodeRequest(
                    num_steps=steps, stream_interval_ms=stream_interval_ms, sequences=[
                    pb.DecodeSequence(sequence_id=i, block_table=tables[i], max_steps=steps,
                                      stop=stop) for i in range(len(batch))])):
                pass
            left -= steps
        seconds = time.perf_counter() - start
        tokens = len(batch) * self.new_tokens
        return {"tokens_per_s": tokens / seconds,
                "cpu_ms_per_token": 1000 * (cpu_seconds(self.proc.pid) - before) / tokens}

    def close(self) -> None:
        self.channel.close()
        self.proc.terminate()
        self.proc.wait(30)


# ----------------------------------------------------------------------------- the stack side
def cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds of a process (all its threads, live ones)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def stack_round(server: Server, batch: list[list[int]], new_tokens: int) -> dict:
    workers = _children(server.pid)
    before = [cpu_seconds(server.pid), sum(cpu_seconds(w) for w in workers)]
    row = summarize(len(batch), run_round(server.address, batch, new_tokens))
    after = [cpu_seconds(server.pid), sum(cpu_seconds(w) for w in workers)]
    per_token = [1000 * (a - b) / row["tokens"] for a, b in zip(after, before, strict=True)]
    return {"tokens_per_s": row["tokens_per_s"], "ttft_p50_ms": row["ttft_p50_ms"],
            "token_wait_mean_ms": row["token_wait_mean_ms"],
            "token_16_p50_ms": row["token_16_p50_ms"],
            "gateway_cpu_ms_per_token": per_token[0], "worker_cpu_ms_per_token": per_token[1]}


# ----------------------------------------------------------------------------- the report
def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def measure(engine: EngineProcess, worker: WorkerProcess, servers: dict[int | None, Server],
            stream_counts: list[int], rounds: int, new_tokens: int) -> list[dict]:
    """`servers`: a stack for each --stream-interval-ms compared (None: the serve default); the
    lone worker runs at each interval too."""
    batch = prompts(max(stream_counts), engine.vocab)
    sides = [("engine", 0)] + [(kind, ms) for ms in servers for kind in ("worker", "stack")]
    runs: dict[int, dict[tuple, list]] = {n: {side: [] for side in sides} for n in stream_counts}
    for r in range(rounds):
        for n in stream_counts:
            first = r % len(sides)  # each side first, then later, in turn
            for side in sides[first:] + sides[:first]:
                kind, ms = side
                if kind == "engine":
                    runs[n][side].append(engine.run(n))
                elif kind == "worker":
                    runs[n][side].append(worker.run(batch[:n], ms))
                else:
                    runs[n][side].append(stack_round(servers[ms], batch[:n], new_tokens))
            print(f"round {r + 1}: {n:>3} streams  " + "  ".join(
                f"{kind}{f'@{interval_name(ms)}' if kind != 'engine' and len(servers) > 1 else ''} "
                f"{runs[n][(kind, ms)][-1]['tokens_per_s']:7.1f}" for kind, ms in sides)
                + " tok/s", flush=True)
    rows = []
    for n in stream_counts:
        eng = runs[n][("engine", 0)]
        for ms in servers:
            alone, stack = runs[n][("worker", ms)], runs[n][("stack", ms)]
            rows.append({
                "streams": n, "stream_interval_ms": ms,
                "engine": spread([e["tokens_per_s"] for e in eng]),
                "worker": spread([w["tokens_per_s"] for w in alone]),
                "worker_ratio": spread([w["tokens_per_s"] / e["tokens_per_s"]
                                        for w, e in zip(alone, eng, strict=True)]),
                "stack": spread([s["tokens_per_s"] for s in stack]),
                "ratio": spread([s["tokens_per_s"] / e["tokens_per_s"]
                                 for s, e in zip(stack, eng, strict=True)]),
                "engine_cpu_ms_per_token": statistics.median(e["cpu_ms_per_token"] for e in eng),
                "ttft_p50_ms": statistics.median(s["ttft_p50_ms"] for s in stack),
                "token_16_p50_ms": statistics.median(s["token_16_p50_ms"] for s in stack),
                "token_wait_mean_ms": statistics.median(s["token_wait_mean_ms"] for s in stack),
                "gateway_cpu_ms_per_token": statistics.median(
                    s["gateway_cpu_ms_per_token"] for s in stack),
                "worker_cpu_ms_per_token": statistics.median(
                    s["worker_cpu_ms_per_token"] for s in stack)})
    return rows


def interval_name(ms: int | None) -> str:
    return "default" if ms is None else f"{ms}ms"


def format_rows(rows: list[dict]) -> str:
    def rate(s: dict) -> str:
        return f"{s['median']:.1f} [{s['min']:.1f}-{s['max']:.1f}]"
    def share(s: dict) -> str:
        return f"**{s['median']:.0%}** [{s['min']:.0%}-{s['max']:.0%}]"
    lines = ["| streams | stream interval | engine in process, tok/s | "
             "worker over gRPC / engine | full stack, tok/s | stack / engine | TTFT p50, ms | "
             "16th token, ms | mean wait for a token, ms | CPU ms/token: engine | gateway | "
             "worker |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(
            f"| {row['streams']} | {interval_name(row['stream_interval_ms'])} | "
            f"{rate(row['engine'])} | "
            f"{share(row['worker_ratio'])} | "
            f"{rate(row['stack'])} | {share(row['ratio'])} | "
            f"{row['ttft_p50_ms']:.0f} | {row['token_16_p50_ms']:.0f} | "
            f"{row['token_wait_mean_ms']:.0f} | {row['engine_cpu_ms_per_token']:.2f} | "
            f"{row['gateway_cpu_ms_per_token']:.2f} | "
            f"{row['worker_cpu_ms_per_token']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict | None:
    p = argparse.ArgumentParser(prog="python -m bench.stack_overhead", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="GGUF file or folder (default: the default model)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--streams", default="1,32", help="stream counts (engine batch sizes)")
    p.add_argument("--rounds", type=int, default=5, help="alternated rounds")
    p.add_argument("--new-tokens", type=int, default=256, help="tokens generated per stream")
    p.add_argument("--stream-interval-ms", default="default",
                   help="the stacks' --stream-interval-ms, comma-separated, 'default' for the "
                        "serve default: a stack for each, alternated with the rest (the lone "
                        "worker runs at each too)")
    p.add_argument("--json", type=Path, help="write the report here")
    p.add_argument("--engine-host", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--max-batch", type=int, default=32, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.model is None:
        from shardlm_server.gateway.serve.default_model import default_model_path
        args.model = default_model_path()
    if args.engine_host:
        engine_host(args.model, args.dtype, args.max_batch, args.new_tokens)
        return None
    stream_counts = [int(s) for s in args.streams.split(",") if s]
    intervals = [None if s == "default" else int(s) for s in args.stream_interval_ms.split(",")
                 if s]
    report: dict = {"benchmark": "bench.stack_overhead",
                    "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
                    "model": str(args.model), "dtype": args.dtype,
                    "machine": platform.machine(), "processor": platform.processor(),
                    "cpus": os.cpu_count(),
                    "config": {"streams": stream_counts, "rounds": args.rounds,
                               "stream_intervals_ms": intervals,
                               "new_tokens": args.new_tokens, "prompt_tokens": PROMPT_TOKENS}}
    most = max(stream_counts)
    # A KV cache with room for every stream's prompt and tokens, twice over.
    kv_mb = max(256, most * (PROMPT_TOKENS + args.new_tokens) * 2 * 96 // 1024)
    engine = EngineProcess(args.model, args.dtype, most, args.new_tokens)
    worker = None
    servers: dict[int | None, Server] = {}
    try:
        worker = WorkerProcess(args.model, args.dtype, most, args.new_tokens)
        for ms in intervals:
            flag = () if ms is None else ("--stream-interval-ms", str(ms))
            servers[ms] = Server(args.model, dtype=args.dtype, kv_cache_mb=kv_mb,
                                 start_timeout_s=600.0, extra=("--speculation", "off", *flag))
        warm = prompts(most, engine.vocab)
        for server in servers.values():
            for _ in range(2):  # the first requests after a load run slower
                run_round(server.address, warm[:1], 64)
            run_round(server.address, warm, 8)
        report["rows"] = measure(engine, worker, servers, stream_counts, args.rounds,
                                 args.new_tokens)
    finally:
        engine.close()
        if worker is not None:
            worker.close()
        for server in servers.values():
            server.stop()
    print(format_rows(report["rows"]))
    write_json(args.json, report)
    return report


if __name__ == "__main__":
    main()
