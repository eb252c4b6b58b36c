"""Full-stack benchmark: `shardlm serve` in a subprocess on a checkpoint folder, then N concurrent
streaming Generate clients over gRPC (token-id prompts, ignore_eos, a fixed max_new_tokens).

Everything is measured client-side, per chunk arrival: time to first token (request sent to the
first chunk with tokens), inter-chunk latency, total tokens/s (all streams' tokens over the wall
time from the first request to the last chunk) and each stream's decode rate (tokens after the
first over the time from the first chunk to the last), which is what compares with the engine's
in-process decode tokens/s. The gateway's own timings (final chunk) are kept beside them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.serve_process import Server


def grpc_stream(address: str, prompt: list[int], max_new_tokens: int,
                barrier: threading.Barrier | None) -> dict:
    """One streaming Generate: {"start", "arrivals": [(time, tokens)], "server": {timings}}."""
    import grpc
    from shardlm.common.v1 import common_pb2
    from shardlm.gateway.v1 import gateway_pb2, gateway_pb2_grpc

    # One connection per client, as separate clients would have.
    channel = grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
    try:
        grpc.channel_ready_future(channel).result(timeout=30)
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        request = gateway_pb2.GenerateRequest(
            token_ids=gateway_pb2.TokenIds(token_ids=prompt),
            stop=common_pb2.StopConditions(max_new_tokens=max_new_tokens, ignore_eos=True))
        if barrier is not None:
            barrier.wait()
        start = time.perf_counter()
        arrivals: list[tuple[float, int]] = []
        server: dict = {}
        for chunk in stub.Generate(request):
            now = time.perf_counter()
            if chunk.token_ids:
                arrivals.append((now, len(chunk.token_ids)))
            if chunk.finish_reason:
                t = chunk.timings
                server = {"ttft_s": t.time_to_first_token_seconds,
                          "tokens_per_s": t.tokens_per_second,
                          "mean_inter_token_s": t.mean_inter_token_seconds}
        return {"start": start, "arrivals": arrivals, "server": server}
    finally:
        channel.close()


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]); NaN for no values."""
    if not values:
        return float("nan")
    data = sorted(values)
    pos = (len(data) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def token_arrival(stream: dict, index: int) -> float:
    """When the stream's `index`-th token (from 1) arrived."""
    seen = 0
    for t, k in stream["arrivals"]:
        seen += k
        if seen >= index:
            return t
    raise ValueError(f"the stream has fewer than {index} tokens")


def summarize(n: int, streams: list[dict]) -> dict:
    ttft = [s["arrivals"][0][0] - s["start"] for s in streams if s["arrivals"]]
    gaps = [b[0] - a[0] for s in streams for a, b in zip(s["arrivals"], s["arrivals"][1:], strict=False)]
    tokens = sum(k for s in streams for _t, k in s["arrivals"])
    chunks = sum(len(s["arrivals"]) for s in streams)
    wall = max(s["arrivals"][-1][0] for s in streams if s["arrivals"]) - min(s["start"] for s in streams)
    decode_rates = []
    for s in streams:
        a = s["arrivals"]
        if len(a) > 1 and a[-1][0] > a[0][0]:
            decode_rates.append((sum(k for _t, k in a) - a[0][1]) / (a[-1][0] - a[0][0]))
    server = [s["server"] for s in streams if s["server"]]
    # How long a client waits for each of its tokens, from its request: a token the server
    # holds back to send with later ones counts as late as it arrives.
    waits = [t - s["start"] for s in streams for t, k in s["arrivals"] for _ in range(k)]
    sixteenth = [token_arrival(s, 16) - s["start"] for s in streams
                 if sum(k for _t, k in s["arrivals"]) >= 16]

    def mean(xs: list[float]) -> float:
        return sum(xs) / len(xs) if xs else float("nan")

    return {
        "streams": n, "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
        "ttft_p50_ms": 1000 * percentile(ttft, 50), "ttft_p99_ms": 1000 * percentile(ttft, 99),
        "itl_p50_ms": 1000 * percentile(gaps, 50), "itl_p99_ms": 1000 * percentile(gaps, 99),
        "tokens_per_chunk": tokens / max(chunks, 1),
        "token_wait_mean_ms": 1000 * mean(waits),
        "token_16_p50_ms": 1000 * percentile(sixteenth, 50),
        "stream_decode_tokens_per_s": mean(decode_rates),
        "server_ttft_mean_ms": 1000 * mean([s["ttft_s"] for s in server]),
        "server_stream_tokens_per_s_mean": mean([s["tokens_per_s"] for s in server]),
    }


Client = Callable[[str, list[int], int, "threading.Barrier | None"], dict]


def run_round(address: str, prompts: list[list[int]], max_new_tokens: int,
              client: Client = grpc_stream) -> list[dict]:
    """One concurrent stream per prompt, released together; each stream's record by `client`
    (ShardLM's gRPC by default, or bench.llama_server.stream)."""
    n = len(prompts)
    barrier = threading.Barrier(n)
    with ThreadPoolExecutor(max_workers=n) as pool:
        futures = [pool.submit(client, address, p, max_new_tokens, barrier) for p in prompts]
        return [f.result() for f in futures]


def kv_cache_mb(shape_config: dict, dtype_bytes: int, sequences: int, tokens: int) -> int:
    """A KV budget with room for `sequences` of `tokens` each, twice over (at least 64 MiB)."""
    c = shape_config
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    per_token = 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * head_dim * dtype_bytes
    return max(64, (2 * sequences * (tokens + 32) * per_token) >> 20)


def measure(model_dir: Path, *, device: str, dtype: str, shape_config: dict, dtype_bytes: int,
            stream_counts: list[int], prompt_len: int, max_new_tokens: int,
            repeats: int = 1, seed: int = 0,
            in_process: Callable[[], float] | None = None) -> dict:
    """Start the server, warm it up, run each stream count (best of `repeats` by total tokens/s;
    one stream, cheap and the base of both stack ratios, gets at least 3).

    `in_process()`, when given, times the in-process engine at batch 1 (tokens/s); it runs in
    alternation with the single-stream rounds, so that the overhead ratio compares two runs made
    under the same machine conditions (a shared machine's speed drifts over minutes)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    vocab = shape_config["vocab_size"]
    most = max(stream_counts)
    prompts = torch.randint(3, vocab, (most, prompt_len), generator=gen).tolist()
    budget = kv_cache_mb(shape_config, dtype_bytes, most, prompt_len + max_new_tokens)
    rows = []
    with Server(model_dir, device=device, dtype=dtype, kv_cache_mb=budget,
                start_timeout_s=600.0) as server:
        address, startup_s = server.address, server.startup_s
        # Warm-up: the first few requests after a load run several times slower per token (seen
        # on CPU), so three full single streams, then one short round of the largest size.
        for _ in range(3):
            run_round(address, prompts[:1], max_new_tokens)
        run_round(address, prompts[:most], 8)
        for n in stream_counts:
            best = None
            engine_best = 0.0
            for _ in range(max(3, repeats) if n == 1 else max(1, repeats)):
                row = summarize(n, run_round(address, prompts[:n], max_new_tokens))
                if best is None or row["tokens_per_s"] > best["tokens_per_s"]:
                    best = row
                if n == 1 and in_process is not None:
                    engine_best = max(engine_best, in_process())
            if engine_best:
                best = dict(best, in_process_tokens_per_s=engine_best)
            rows.append(best)
    return {"startup_s": startup_s, "kv_cache_mb": budget, "prompt_len": prompt_len,
            "max_new_tokens": max_new_tokens, "repeats": repeats, "rows": rows}
