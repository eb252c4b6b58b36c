"""The batch-1 decode floor: one decode step must read every weight once, so no engine can take
less than weight bytes / memory bandwidth per token.

* GPU: the bandwidth is measured as a device-to-device copy (bytes read + bytes written over
  CUDA-event time), the usual practical ceiling of HBM.
* CPU: a decode step only reads its weights, so the bandwidth is that of a streaming read with
  every thread: a float32 sum over a buffer far larger than the caches, best of several passes.
  (An earlier version measured torch's own batch-1 GEMV, which BLAS runs on one thread for
  float32: ShardLM's skinny_linear streams faster than that, so it was no floor.) The batch-1
  GEMV over the model's linear layers is still reported beside it, as what torch achieves.

Achieved GB/s of an engine = weight bytes / its batch-1 step time; % of floor = floor / step.

Prefill is compute bound instead: on CPU it is read against the float32 FMA peak of all threads,
measured by the compiled ops (independent FMA chains on registers, the widest SIMD path).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from bench.engine_bench import best_of, sync
from bench.shapes import weight_bytes


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, iters: int = 20) -> float:
    """Bytes per second of a device-to-device copy (read + write both counted)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):  # warm-up
        dst.copy_(src)
    sync(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        dst.copy_(src)
    end.record()
    end.synchronize()
    seconds = start.elapsed_time(end) / 1000 / iters
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / seconds


def gemv_pass_seconds(model, device: torch.device, repeats: int = 10) -> tuple[float, int]:
    """Best time of one batch-1 pass over every nn.Linear of `model`, and the bytes it reads."""
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    inputs = {}
    for m in linears:
        key = (m.in_features, m.weight.dtype)
        if key not in inputs:
            inputs[key] = torch.randn(1, m.in_features, device=device).to(m.weight.dtype)
    nbytes = sum(m.weight.numel() * m.weight.element_size() for m in linears)

    def one_pass() -> None:
        with torch.no_grad():
            for m in linears:
                F.linear(inputs[(m.in_features, m.weight.dtype)], m.weight, m.bias)

    one_pass()
    return best_of(one_pass, device, repeats), nbytes


def read_bandwidth(nbytes: int = 512 << 20, repeats: int = 8) -> float:
    """Bytes per second of a streaming read on CPU with every thread (a float32 sum)."""
    buffer = torch.ones(nbytes // 4, dtype=torch.float32)
    buffer.sum()  # touch every page first
    seconds = best_of(lambda: buffer.sum(), torch.device("cpu"), repeats)
    return nbytes / seconds


def round_shares(nbytes: int, bandwidths: list[float], step_seconds: list[float]) -> list[float]:
    """Percent of the floor each round reached: `nbytes` at that round's read bandwidth over its
    step. The bandwidth is measured in every round beside the engines because a shared host's
    moves with the neighbours' load (29-60 GB/s within one session on the 2-core VM, from one
    second to the next in one process); a single measure would set every round against one
    moment's figure."""
    return [100 * nbytes / bw / s for bw, s in zip(bandwidths, step_seconds, strict=True)]


def fma_peak_flops(iterations: int = 20_000_000, repeats: int = 3) -> float:
    """FLOP/s of float32 FMAs on every thread of this CPU (the best of a few runs)."""
    from shardlm_server.worker.ops.native import library

    return max(library.cpu_fma_peak(iterations) for _ in range(repeats))


def measure(model, device: torch.device) -> dict:
    """The floor for `model` (a transformers model holding the benchmark's weights) on `device`."""
    total = weight_bytes(model)
    extra = {}
    if device.type == "cuda":
        bandwidth = copy_bandwidth(device)
        method = "device-to-device copy"
    else:
        bandwidth = read_bandwidth()
        method = "streaming read, all threads"
        seconds, linear_bytes = gemv_pass_seconds(model, device)
        extra["torch_gemv_gb_s"] = linear_bytes / seconds / 1e9
    floor_s = total / bandwidth
    return {"method": method, "weight_bytes": total, "bandwidth_gb_s": bandwidth / 1e9,
            "floor_ms_per_token": 1000 * floor_s, "floor_tokens_per_s": 1 / floor_s, **extra}


def achieved(roof: dict, ms_per_token: float) -> dict:
    """GB/s an engine streams at `ms_per_token` (batch 1), and the share of the floor it reaches."""
    return {"ms_per_token": ms_per_token,
            "achieved_gb_s": roof["weight_bytes"] / (ms_per_token / 1000) / 1e9,
            "pct_of_floor": 100 * roof["floor_ms_per_token"] / ms_per_token}
