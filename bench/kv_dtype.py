"""How much a half-precision KV cache changes a float32 model's greedy tokens.

    python -m bench.kv_dtype                      # the default model
    python -m bench.kv_dtype --model PATH --tokens 2048 --prompts 8 --new-tokens 128

For each `--kv-cache-dtype` (float32, bfloat16, float16) the same float32 engine, with only its
cache's dtype changed, is measured two ways against the float32 cache:
- teacher-forced top-1 agreement: the README (tokenized with the model's tokenizer) scored at every
  position in one pass (bench/agreement.py); the cache is written, then read back, in its dtype;
- free-running greedy decode: chat prompts, `--new-tokens` each, through prefill and the decode
  loop; reported as the share of sequences identical to float32's and the mean length of the part
  that is identical before the first different token.
Also shown: the cache's bytes per token. Runs in-process on CPU; no timing is involved.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

from bench.agreement import agreement, engine_top1, text_ids
from shardlm_server.worker.engine import DecodeItem, Engine, PrefillItem, StopParams
from shardlm_server.worker.kv_cache import CacheConfig, bytes_per_block

KV_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
QUESTIONS = [
    "What is the capital of France?", "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.", "List three prime numbers above 100.",
    "Translate 'good morning' into Spanish and German.", "Why is the sky blue?",
    "Write a Python function that reverses a string.", "Summarize the plot of Hamlet briefly.",
    "What does HTTP stand for?", "Give me a recipe idea with eggs and spinach.",
    "How many legs does a spider have?", "Describe a cat to someone who has never seen one.",
]


def chat_prompts(model: Path, count: int) -> list[list[int]]:
    from shardlm_server.gateway.text.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(model)
    return [tok.encode_chat([{"role": "user", "content": q}])
            for q in (QUESTIONS * (count // len(QUESTIONS) + 1))[:count]]


def greedy(engine: Engine, ids: list[int], new: int) -> list[int]:
    engine.reset()
    table = list(range(-(-(len(ids) + new + 1) // engine.cache.block_size)))
    first = engine.prefill([PrefillItem(0, ids, 0, table,
                                        stop=StopParams(max_new_tokens=new))])
    tokens = [first.tokens[0].token.token_id]
    for step in engine.decode([DecodeItem(0, table, new - 1)], new - 1):
        tokens += [t.token.token_id for t in step.tokens]
    return tokens


def same_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main() -> None:
    from shardlm_server.gateway.serve.default_model import default_model_path

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="default: the default model")
    parser.add_argument("--tokens", type=int, default=2048, help="teacher-forced positions")
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--new-tokens", type=int, default=128)
    args = parser.parse_args()
    model = args.model or default_model_path()
    ids = text_ids(model, args.tokens)
    prompts = chat_prompts(model, args.prompts)
    blocks = -(-(max(args.tokens, max(map(len, prompts)) + args.new_tokens) + 1) // 16) + 1
    results: dict[str, tuple[torch.Tensor, list[list[int]], int]] = {}
    for name, dtype in KV_DTYPES.items():
        engine = Engine.load(model, dtype="float32",
                             cache_config=CacheConfig(block_size=16, num_blocks=blocks, dtype=dtype))
        cfg = engine.cfg
        per_token = bytes_per_block(cfg.num_layers, 1, cfg.num_kv_heads, cfg.head_dim, dtype)
        results[name] = (engine_top1(engine, ids), [greedy(engine, p, args.new_tokens)
                                                   for p in prompts], per_token)
        del engine
    top1, runs, _ = results["float32"]
    print(f"model: {model.name}; float32 weights and compute; {len(ids)} teacher-forced positions; "
          f"{len(prompts)} chat prompts x {args.new_tokens} greedy tokens")
    print(f"{'KV cache':<10} {'bytes/token':>12} {'top-1 agreement':>16} {'identical seqs':>15} "
          f"{'mean same prefix':>17} {'min':>5}")
    for name, (ours, seqs, per_token) in results.items():
        prefixes = [same_prefix(a, b) for a, b in zip(seqs, runs, strict=True)]
        identical = sum(p == args.new_tokens for p in prefixes)
        print(f"{name:<10} {per_token:>12,} {agreement(ours, top1):>15.2%} "
              f"{identical:>7}/{len(seqs):<7} {statistics.mean(prefixes):>17.1f} "
              f"{min(prefixes):>5}")


if __name__ == "__main__":
    main()
