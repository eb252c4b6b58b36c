"""Memory benchmark: what a served model takes, against its file and llama.cpp's own server.

    python -m bench.memory                       # the default model, 8 sequences
    python -m bench.memory --sequences 8 --prompt-tokens 1500 --no-llama-server

Serves the model with `shardlm serve --max-running N` and the default KV cache (sized for N
sequences of the model's full context, see worker/kv_cache.py), runs N concurrent
greedy requests of `--prompt-tokens` prompt tokens and `--new-tokens` new ones to fill the cache
somewhat, then reads the worker's and the gateway's RSS (VmRSS), the weight and KV bytes the model
information reports, and checks the targets: worker RSS <= file size + KV bytes + 250 MB, gateway
RSS <= 150 MB. The same requests then go to llama-server (built by `make llama-server`; reported
unavailable otherwise) with the same context: `-c C -np N` (C the served context, split over
the slots, as llama-server does) and `-c N*C -np N` (each slot the full context, as ShardLM's
cache holds). Also shown: the RSS of a bare `python -c "import torch"`, the floor every worker
stands on. Prints a table; exits 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench import llama_server
from bench.serve_process import Server, _vm_rss

MB = 1_000_000
WORKER_SLACK_BYTES = 250 * MB
GATEWAY_LIMIT_BYTES = 150 * MB


def default_model() -> Path:
    from shardlm_server.gateway.serve.default_model import default_model_path

    return default_model_path()


def prompts(count: int, length: int, vocab: int) -> list[list[int]]:
    """Distinct token-id prompts (no shared prefix: each fills its own blocks)."""
    return [[(17 + 7919 * i + 104729 * j) % (vocab - 200) + 100 for j in range(length)]
            for i in range(count)]


def torch_floor_bytes() -> int:
    """VmRSS of a Python that has only imported torch."""
    code = ("import torch\nfor l in open('/proc/self/status'):\n"
            "    if l.startswith('VmRSS'): print(int(l.split()[1]) * 1024)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return int(out.stdout.strip())


def run_shardlm(model: Path, args: argparse.Namespace) -> dict:
    from shardlm.client import Client

    extra = ("--max-running", str(args.sequences), "--kv-cache-dtype", args.kv_cache_dtype)
    with Server(model, kv_cache_mb=args.kv_cache_mb, dtype=args.dtype, extra=extra) as server:
        client = Client(server.address)
        info = client.model_info()
        loaded = {"worker_loaded": server.workers_rss_bytes(), "gateway_loaded": server.rss_bytes()}
        work = prompts(args.sequences, min(args.prompt_tokens, info.max_context_length - 1
                                           - args.new_tokens), info.model.vocab_size)
        with ThreadPoolExecutor(args.sequences) as pool:
            done = list(pool.map(lambda p: client.generate(
                p, max_new_tokens=args.new_tokens, ignore_eos=True), work))
        assert all(len(c.token_ids) == args.new_tokens for c in done)
        client.close()
        return {**loaded, "worker": server.workers_rss_bytes(), "gateway": server.rss_bytes(),
                "weights": info.model.weight_bytes, "kv": info.model.kv_cache_bytes,
                "kv_dtype": info.model.kv_cache_dtype, "context": info.max_context_length,
                "work": work}


def run_llama(exe: Path, model: Path, slots: int, slot_tokens: int, work: list[list[int]],
              new_tokens: int, threads: int) -> dict:
    with llama_server.LlamaServer(exe, model, slots=slots, slot_tokens=slot_tokens,
                                  threads=threads) as server:
        loaded = _vm_rss(server.pid)
        fitting = [p[:max(1, slot_tokens - new_tokens - 1)] for p in work]
        barrier = threading.Barrier(len(fitting))
        threads_ = [threading.Thread(target=llama_server.stream,
                                     args=(server.address, p, new_tokens, barrier))
                    for p in fitting]
        for t in threads_:
            t.start()
        for t in threads_:
            t.join()
        rss = _vm_rss(server.pid)
        kv = [float(m.group(1)) for line in server.output
              if "KV" in line or "kv" in line
              for m in [re.search(r"size\s*=\s*([\d.]+)\s*MiB", line)] if m]
        return {"loaded": loaded, "rss": rss, "kv_mib": sum(kv) if kv else None,
                "prompt": len(fitting[0])}


def mb(value: float | None) -> str:
    return "-" if value is None else f"{value / MB:,.0f} MB"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="GGUF file; default: SmolLM2")
    parser.add_argument("--sequences", type=int, default=8, help="--max-running and requests")
    parser.add_argument("--prompt-tokens", type=int, default=1500)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--kv-cache-mb", type=int, default=0, help="0: the default cache")
    parser.add_argument("--threads", type=int, default=2, help="llama-server's -t")
    parser.add_argument("--no-llama-server", action="store_true")
    args = parser.parse_args()
    model = args.model or default_model()
    file_bytes = model.stat().st_size

    shard = run_shardlm(model, args)
    target = file_bytes + shard["kv"] + WORKER_SLACK_BYTES
    rows = [("model file", file_bytes, ""),
            ("weights held (ModelInfo.weight_bytes)", shard["weights"], ""),
            (f"KV cache ({shard['kv_dtype']}, {args.sequences} x {shard['context']} tokens)",
             shard["kv"], ""),
            ("python + torch import (floor)", torch_floor_bytes(), ""),
            ("worker RSS, loaded", shard["worker_loaded"], ""),
            (f"worker RSS after {args.sequences} requests", shard["worker"],
             "ok" if shard["worker"] <= target else "OVER"),
            ("target: file + KV + 250 MB", target, ""),
            ("gateway RSS, loaded", shard["gateway_loaded"], ""),
            (f"gateway RSS after {args.sequences} requests", shard["gateway"],
             "ok" if shard["gateway"] <= GATEWAY_LIMIT_BYTES else "OVER"),
            ("gateway target", GATEWAY_LIMIT_BYTES, "")]
    exe = None if args.no_llama_server else llama_server.binary()
    notes = []
    if exe is None:
        notes.append("llama-server: unavailable" + ("" if args.no_llama_server else
                                                    f" (build it: {llama_server.BUILD_HINT})"))
    else:
        context = shard["context"]
        for total in (context, context * args.sequences):
            slot = total // args.sequences
            run = run_llama(exe, model, args.sequences, slot, shard["work"], args.new_tokens,
                            args.threads)
            kv = "" if run["kv_mib"] is None else f"KV {run['kv_mib'] * 2**20 / MB:,.0f} MB"
            rows.append((f"llama-server -c {total} -np {args.sequences}, loaded",
                         run["loaded"], kv))
            rows.append((f"llama-server -c {total} -np {args.sequences}, after requests "
                         f"({run['prompt']}-token prompts)", run["rss"], ""))
    width = max(len(r[0]) for r in rows)
    print(f"{model.name}: {args.sequences} concurrent requests of {len(shard['work'][0])} prompt "
          f"+ {args.new_tokens} new tokens")
    for name, value, note in rows:
        print(f"  {name:<{width}}  {mb(value):>10}  {note}")
    for note in notes:
        print(f"  {note}")
    missed = shard["worker"] > target or shard["gateway"] > GATEWAY_LIMIT_BYTES
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
