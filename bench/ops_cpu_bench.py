"""Micro-benchmark of the compiled CPU ops at llama-100m decode shapes.

Times each torch.ops.shardlm.* op per call (microseconds) on preallocated
tensors, so only the kernel and the dispatcher are measured. The figure is the
fastest of many calls: on a small, shared machine the minimum is the most
stable estimate of what the kernel itself costs.

    python -m bench.ops_cpu_bench                      # print a table
    python -m bench.ops_cpu_bench --json before.json   # also save the results
    python -m bench.ops_cpu_bench --compare before.json  # before / after / speed-up

Shapes (llama-100m): hidden 768, 12 heads / 4 kv heads, head_dim 64,
intermediate 2048, block_size 16; batch 1 and 32; context 64 and 1024;
float32 and bfloat16. Prefill attention is timed for one sequence whose
prompt is the whole context, and a speculative verify step's attention as
VERIFY_ROWS new tokens (the pending one and 4 drafts) at the end of it (with
these 4 kv heads, 2 threads already have two tasks each, so that call is not
sliced over the keys; a model with fewer kv heads than twice the threads is:
`--heads 9 3`, SmolLM2's, shows that path).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable

import torch

from shardlm_server.worker import ops  # noqa: F401  (loads shardlm_server.worker._C, registers torch.ops.shardlm)

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, BLOCK = 768, 12, 4, 64, 2048, 16
EPS = 1e-5
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
VERIFY_ROWS = 5


def best_us(fn: Callable[[], None], budget_s: float, min_calls: int = 50) -> float:
    """Fastest single call in µs, over as many calls as fit in budget_s.

    Calls are timed one by one rather than in batches: on a shared two-core
    machine a batch almost always contains a call whose worker thread was
    preempted, while the fastest single call is what the kernel costs.
    """
    clock = time.perf_counter
    for _ in range(3):
        fn()  # warm up (thread pool, caches, lazy allocations)
    best = math.inf
    calls = 0
    deadline = clock() + budget_s
    while calls < min_calls or clock() < deadline:
        t0 = clock()
        fn()
        best = min(best, clock() - t0)
        calls += 1
    return best * 1e6


def paged_cache(num_seqs: int, ctx: int, dtype: torch.dtype):
    blocks_per_seq = math.ceil(ctx / BLOCK)
    num_blocks = num_seqs * blocks_per_seq
    shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, dtype=dtype)
    v_cache = torch.randn(shape, dtype=dtype)
    # Shuffled blocks, as after a while of serving.
    tables = torch.randperm(num_blocks, dtype=torch.int32).view(num_seqs, blocks_per_seq)
    return k_cache, v_cache, tables.contiguous()


def cases(batch: int, ctx: int, dtype: torch.dtype) -> dict[str, Callable[[], None]]:
    """name -> a closure that calls one op once; only ops that depend on ctx use it."""
    sl = torch.ops.shardlm
    x = torch.randn(batch, HIDDEN, dtype=dtype)
    res = torch.randn(batch, HIDDEN, dtype=dtype)
    w = torch.randn(HIDDEN, dtype=dtype)
    out = torch.empty_like(x)
    gate_up = torch.randn(batch, 2 * INTER, dtype=dtype)
    act = torch.empty(batch, INTER, dtype=dtype)
    # q, k, v as slices of the fused qkv projection, as in the model.
    qkv = torch.randn(batch, (HEADS + 2 * KV_HEADS) * HEAD_DIM, dtype=dtype)
    q = qkv[:, : HEADS * HEAD_DIM]
    k = qkv[:, HEADS * HEAD_DIM : (HEADS + KV_HEADS) * HEAD_DIM]
    v = qkv[:, (HEADS + KV_HEADS) * HEAD_DIM :]
    cos_sin = ops.compute_cos_sin_cache(HEAD_DIM, 4096, 10000.0)
    positions = torch.full((batch,), ctx - 1, dtype=torch.int64)
    k_cache, v_cache, tables = paged_cache(batch, ctx, dtype)
    slots = (tables[:, (ctx - 1) // BLOCK].long() * BLOCK + (ctx - 1) % BLOCK).contiguous()
    ctx_lens = torch.full((batch,), ctx, dtype=torch.int32)
    q3 = q.view(batch, HEADS, HEAD_DIM)
    k3, v3 = k.view(batch, KV_HEADS, HEAD_DIM), v.view(batch, KV_HEADS, HEAD_DIM)
    attn_out = torch.empty(batch, HEADS, HEAD_DIM, dtype=dtype)
    scale = HEAD_DIM**-0.5

    c = {
        "rms_norm": lambda: sl.rms_norm(out, x, w, EPS),
        # In place on the same tensors every call: values stay bounded (normalised).
        "fused_add_rms_norm": lambda: sl.fused_add_rms_norm(x, res, w, EPS),
        "silu_and_mul": lambda: sl.silu_and_mul(act, gate_up),
        "rotary_embedding": lambda: sl.rotary_embedding(positions, q, k, HEAD_DIM, cos_sin),
        "reshape_and_cache": lambda: sl.reshape_and_cache(k3, v3, k_cache, v_cache, slots),
        "attn_decode": lambda: sl.paged_attention_decode(
            attn_out, q3, k_cache, v_cache, tables, ctx_lens, scale, ctx
        ),
    }
    if batch == 1:  # one prompt of ctx tokens
        pq = torch.randn(ctx, HEADS, HEAD_DIM, dtype=dtype)
        pout = torch.empty_like(pq)
        qsl = torch.tensor([0, ctx], dtype=torch.int32)
        lens = torch.tensor([ctx], dtype=torch.int32)
        c["attn_prefill"] = lambda: sl.paged_attention_prefill(
            pout, pq, k_cache, v_cache, tables, qsl, lens, scale, ctx, ctx
        )
        vq = torch.randn(VERIFY_ROWS, HEADS, HEAD_DIM, dtype=dtype)
        vout = torch.empty_like(vq)
        vqsl = torch.tensor([0, VERIFY_ROWS], dtype=torch.int32)
        c["attn_verify"] = lambda: sl.paged_attention_prefill(
            vout, vq, k_cache, v_cache, tables, vqsl, lens, scale, VERIFY_ROWS, ctx
        )
    return c


# The rest do not depend on the context length.
CTX_OPS = {"attn_decode", "attn_prefill", "attn_verify"}


def run(budget_s: float, batches: list[int], ctxs: list[int], dtypes: list[str]) -> dict:
    results = {}
    for dname in dtypes:
        for batch in batches:
            for ctx in ctxs:
                for name, fn in cases(batch, ctx, DTYPES[dname]).items():
                    if name not in CTX_OPS and ctx != ctxs[0]:
                        continue
                    key = f"{name} {dname} b={batch}" + (f" ctx={ctx}" if name in CTX_OPS else "")
                    budget = budget_s * (4 if name == "attn_prefill" else 1)
                    results[key] = best_us(fn, budget)
                    print(f"  {key:<40} {results[key]:10.2f} us", flush=True)
    return results


def main() -> None:
    global HEADS, KV_HEADS
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--budget", type=float, default=0.3, help="seconds of timing per case")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    p.add_argument("--ctx", type=int, nargs="+", default=[64, 1024])
    p.add_argument("--dtype", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    p.add_argument("--heads", type=int, nargs=2, metavar=("QUERY", "KV"),
                   default=[HEADS, KV_HEADS], help="attention heads (default: llama-100m's)")
    p.add_argument("--json", help="save {case: µs} here")
    p.add_argument("--compare", help="earlier --json file to print a before/after table against")
    args = p.parse_args()
    HEADS, KV_HEADS = args.heads
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, best-of timing (µs/call)")
    results = run(args.budget, args.batch, args.ctx, args.dtype)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    if args.compare:
        with open(args.compare) as f:
            before = json.load(f)
        print(f"\n| {'case':<40} | {'before µs':>10} | {'after µs':>10} | {'speed-up':>8} |")
        print(f"|{'-' * 42}|{'-' * 11}:|{'-' * 11}:|{'-' * 9}:|")
        for key, after in results.items():
            b = before.get(key)
            if b is None:
                continue
            print(f"| {key:<40} | {b:10.2f} | {after:10.2f} | {b / after:7.2f}x |")


if __name__ == "__main__":
    main()
