"""Engine benchmark: ShardLM's in-process engine against transformers' `generate` on the same
random-weight checkpoint, in the same run, on the same device.

    python -m bench.engine_bench                 # ~100M-parameter Llama shape on CPU
    python -m bench.engine_bench --smoke         # tiny shape, seconds (CI runs this)

Prints a table and writes JSON (device, versions, date, config, figures) to bench/results/.
Decode figures exclude prefill: both sides are timed for a 1-token generation as well and that
time is subtracted, so the ratio compares steady-state decoding.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import tempfile
import time
from pathlib import Path

import torch

from worker.engine import DecodeItem, Engine, PrefillItem, StopParams
from worker.kv_cache import CacheConfig

SHAPES = {
    # ~125M parameters: a small Llama with grouped-query attention.
    "llama-100m": dict(vocab_size=32000, hidden_size=768, intermediate_size=2048,
                       num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2),
}


def build_model(folder: Path, shape: dict, dtype: torch.dtype) -> None:
    import transformers

    config = transformers.LlamaConfig(**shape, max_position_embeddings=4096, bos_token_id=1,
                                      eos_token_id=2, torch_dtype=str(dtype).split(".")[1])
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(dtype)
    model.save_pretrained(folder, safe_serialization=True)


def timed(fn, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def hf_decode_seconds(model, prompts: torch.Tensor, new_tokens: int, device) -> float:
    def run(n: int) -> None:
        with torch.no_grad():
            model.generate(prompts, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                           pad_token_id=0, eos_token_id=None)

    run(2)  # warm-up
    full = min(timed(lambda: run(new_tokens), device) for _ in range(2))
    prefill = min(timed(lambda: run(1), device) for _ in range(2))
    return full - prefill


def engine_decode_seconds(engine: Engine, prompts: torch.Tensor, new_tokens: int, device) -> float:
    batch, length = prompts.shape
    blocks_per_seq = -(-(length + new_tokens + 1) // engine.cache.block_size)
    tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(batch)]
    stop = StopParams(max_new_tokens=new_tokens, ignore_eos=True)

    def run(n: int) -> None:
        engine.reset()
        engine.prefill([PrefillItem(i, prompts[i].tolist(), 0, tables[i], stop=stop)
                        for i in range(batch)])
        if n > 1:
            for _ in engine.decode([DecodeItem(i, tables[i], n - 1) for i in range(batch)], n - 1):
                pass

    run(3)  # warm-up
    full = min(timed(lambda: run(new_tokens), device) for _ in range(2))
    prefill = min(timed(lambda: run(1), device) for _ in range(2))
    return full - prefill


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--shape", default="llama-100m", choices=sorted(SHAPES))
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--smoke", action="store_true", help="tiny shape and few tokens")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args(argv)
    if args.smoke:
        args.shape, args.new_tokens, args.batch_sizes = "tiny", 8, "1,4"
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("float32" if device.type == "cpu" else "bfloat16"))

    import transformers

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        build_model(folder, SHAPES[args.shape], dtype)
        reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
        params = sum(p.numel() for p in reference.parameters())
        batches = [int(b) for b in args.batch_sizes.split(",")]
        tokens_needed = max(batches) * (args.prompt_len + args.new_tokens + 32)
        engine = Engine.load(folder, dtype=dtype, device=device,
                             cache_config=CacheConfig(num_blocks=tokens_needed // 16 + 1))
        rows = []
        for batch in batches:
            prompts = torch.randint(3, SHAPES[args.shape]["vocab_size"], (batch, args.prompt_len))
            steps = args.new_tokens - 1
            ours = engine_decode_seconds(engine, prompts, args.new_tokens, device)
            theirs = hf_decode_seconds(reference, prompts.to(device), args.new_tokens, device)
            rows.append({
                "batch": batch,
                "shardlm_tokens_per_s": batch * steps / ours,
                "shardlm_ms_per_step": 1000 * ours / steps,
                "transformers_tokens_per_s": batch * steps / theirs,
                "transformers_ms_per_step": 1000 * theirs / steps,
                "speedup": theirs / ours,
            })
    result = {
        "benchmark": "engine_decode",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "python": platform.python_version()},
        "config": {"shape": args.shape, "parameters": params, "dtype": str(dtype),
                   "prompt_len": args.prompt_len, "new_tokens": args.new_tokens},
        "rows": rows,
    }
    print(f"engine decode, {args.shape} ({params / 1e6:.0f}M params, {dtype}), "
          f"{result['device']}, {result['threads']} threads")
    print(f"{'batch':>5} {'shardlm tok/s':>14} {'ms/step':>8} {'HF tok/s':>10} {'ms/step':>8} {'speedup':>8}")
    for r in rows:
        print(f"{r['batch']:>5} {r['shardlm_tokens_per_s']:>14.1f} {r['shardlm_ms_per_step']:>8.2f} "
              f"{r['transformers_tokens_per_s']:>10.1f} {r['transformers_ms_per_step']:>8.2f} "
              f"{r['speedup']:>7.2f}x")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    (out / f"engine-{args.device}-{args.shape}-{stamp}.json").write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
