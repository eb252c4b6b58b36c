"""The full-stack half of `python -m bench.run --model FILE.gguf`: `shardlm serve` on the file
against llama.cpp's own server (`llama-server`, bench/llama_server.py) on the same file, each
through its own wire protocol (gRPC streaming Generate; HTTP /completion with server-sent events).

Per stream count N: llama-server starts with N parallel slots, each with room for one stream;
then rounds alternate between the two servers, each round N concurrent streaming clients with
fresh random token-id prompts (no prefix cache helps either side), greedy, ignore_eos, a fixed
number of new tokens. Each figure is the median over the rounds (bench.stack_bench.summarize per
round), total tokens/s with its spread. Without a GGUF file or a llama-server binary, ShardLM's
rows are measured alone and a line says why.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import torch

from bench import llama_server, stack_bench
from bench.serve_process import Server


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n, length), generator=gen).tolist()


def _median_row(rounds: list[dict]) -> dict:
    """Each figure's median over the rounds, and the total tokens/s spread [lowest, highest]."""
    row = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]
           if isinstance(rounds[0][key], int | float)}
    speeds = [r["tokens_per_s"] for r in rounds]
    row["tokens_per_s_spread"] = [min(speeds), max(speeds)]
    row["rounds"] = len(rounds)
    return row


def measure(model: Path, gguf: Path | None, *, cfg, dtype: str, threads: int,
            stream_counts: list[int], prompt_len: int, new_tokens: int, rounds: int,
            seed: int = 0) -> dict:
    """Both servers on the checkpoint, every stream count; see the module docstring."""
    exe = llama_server.binary()
    if gguf is None:
        llama_note = "not run: llama.cpp needs a GGUF file"
    elif exe is None:
        llama_note = f"not run: no llama-server binary (build one with `{llama_server.BUILD_HINT}`)"
    else:
        llama_note = None
    if llama_note:
        print(f"llama-server: {llama_note}", flush=True)
    shape = {"hidden_size": cfg.hidden_size, "num_attention_heads": cfg.num_heads,
             "head_dim": cfg.head_dim, "num_hidden_layers": cfg.num_layers,
             "num_key_value_heads": cfg.num_kv_heads}
    dtype_bytes = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    most = max(stream_counts)
    budget = stack_bench.kv_cache_mb(shape, dtype_bytes, most, prompt_len + new_tokens)
    slot_tokens = prompt_len + new_tokens + 16
    rows = []
    with Server(model, device="cpu", dtype=dtype, kv_cache_mb=budget,
                start_timeout_s=600.0) as shardlm:
        # Warm-up: the first requests after a load run slower per token.
        for i in range(2):
            stack_bench.run_round(shardlm.address, _prompts(1, prompt_len, cfg.vocab_size, -1 - i),
                                  new_tokens)
        stack_bench.run_round(shardlm.address, _prompts(most, prompt_len, cfg.vocab_size, -3), 8)
        for n in stream_counts:
            llama = None
            if not llama_note:
                try:
                    llama = llama_server.LlamaServer(exe, gguf, slots=n, slot_tokens=slot_tokens,
                                                     threads=threads)
                except RuntimeError as exc:  # it refuses the file: go on with ShardLM alone
                    llama_note = f"not run: llama-server did not start ({exc})"[:500]
                    print(f"llama-server: {llama_note}", flush=True)
            try:
                if llama is not None:
                    stack_bench.run_round(llama.address, _prompts(n, prompt_len, cfg.vocab_size,
                                                                  -4), 8, llama_server.stream)
                ours, theirs = [], []
                for r in range(rounds):
                    prompts = _prompts(n, prompt_len, cfg.vocab_size, seed + 1000 * n + r)
                    ours.append(stack_bench.summarize(
                        n, stack_bench.run_round(shardlm.address, prompts, new_tokens)))
                    if llama is not None:
                        theirs.append(stack_bench.summarize(n, stack_bench.run_round(
                            llama.address, prompts, new_tokens, llama_server.stream)))
            finally:
                if llama is not None:
                    llama.stop()
            rows.append({"streams": n, "shardlm": _median_row(ours),
                         "llama_cpp": _median_row(theirs) if theirs else None})
    version_file = exe.with_name("llama-server.version") if exe else None
    return {"llama_server": llama_note or {
                "binary": str(exe), "slots": "one per stream",
                "source": version_file.read_text().strip() if version_file and version_file.is_file()
                else "unknown"},
            "kv_cache_mb": budget, "prompt_len": prompt_len, "new_tokens": new_tokens,
            "rounds": rounds, "threads": threads, "rows": rows}


def targets(stack: dict) -> list[tuple[str, float | None, float]]:
    """(name, value, goal) for the issue's two full-stack targets that this run measured."""
    def ratio(n: int) -> float | None:
        row = next((r for r in stack["rows"] if r["streams"] == n), None)
        if row is None or not row["llama_cpp"]:
            return None
        return row["shardlm"]["tokens_per_s"] / row["llama_cpp"]["tokens_per_s"]

    counts = [r["streams"] for r in stack["rows"]]
    out = []
    if 1 in counts:
        out.append(("full stack, 1 stream vs llama-server (tok/s) >= 1.2x", ratio(1), 1.2))
    if 32 in counts:
        out.append(("full stack, 32 streams vs llama-server with 32 slots (total tok/s) >= 2x",
                    ratio(32), 2.0))
    return out


def print_rows(stack: dict) -> None:
    print(f"\n== full stack: {stack['prompt_len']}-token prompts, {stack['new_tokens']} new tokens, "
          f"median of {stack['rounds']} alternated rounds (spread of total tok/s)")
    if isinstance(stack["llama_server"], str):
        print(f"llama-server: {stack['llama_server']}")
    print(f"{'streams':>8}{'ShardLM tok/s':>16}{'llama-server':>16}{'ratio':>8}"
          f"{'TTFT p50 ms':>16}{'per-stream decode':>20}")

    def cell(row: dict | None, key: str, digits: int = 1) -> str:
        return "-" if not row else f"{row[key]:.{digits}f}"

    for r in stack["rows"]:
        ours, theirs = r["shardlm"], r["llama_cpp"]
        ratio = f"{ours['tokens_per_s'] / theirs['tokens_per_s']:.2f}x" if theirs else "-"
        lo, hi = ours["tokens_per_s_spread"]
        spread = f" ({lo:.0f}-{hi:.0f})"
        theirs_cell = cell(theirs, "tokens_per_s")
        if theirs:
            tlo, thi = theirs["tokens_per_s_spread"]
            theirs_cell += f" ({tlo:.0f}-{thi:.0f})"
        print(f"{r['streams']:>8}{cell(ours, 'tokens_per_s') + spread:>16}{theirs_cell:>16}"
              f"{ratio:>8}{cell(ours, 'ttft_p50_ms', 0) + ' | ' + cell(theirs, 'ttft_p50_ms', 0):>16}"
              f"{cell(ours, 'stream_decode_tokens_per_s') + ' | ' + cell(theirs, 'stream_decode_tokens_per_s'):>20}")
