"""Teacher-forced top-1 agreement with a float32 reference over one fixed text.

Every engine is fed the same token ids (the text, tokenized once) and scores every position in one
pass; at each position its most likely next token is compared with the reference's. The reference
is ShardLM's float32 engine on the same checkpoint (a GGUF's blocks dequantized to float32), so the
figure measures what an engine's arithmetic (dtype, quantized kernels) loses, not the checkpoint.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from shardlm_server.worker.batch import build_prefill_batch
from shardlm_server.worker.engine import Engine

REPO = Path(__file__).resolve().parents[1]


def text_ids(model_path: Path, tokens: int) -> list[int]:
    """`tokens` ids of the repository's README (plain English and code), tokenized with the
    checkpoint's own tokenizer, repeated if it is shorter."""
    from shardlm_server.gateway.text.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(model_path)  # a GGUF file's, or a Hugging Face folder's
    ids = tok.encode((REPO / "README.md").read_text(encoding="utf-8"), add_special_tokens=False)
    while len(ids) < tokens:
        ids = ids + ids
    return ids[:tokens]


@torch.inference_mode()
def engine_top1(engine: Engine, ids: list[int]) -> torch.Tensor:
    """ShardLM's argmax next token at every position of `ids`, in one prefill pass."""
    engine.reset()
    blocks = -(-(len(ids) + 1) // engine.cache.block_size)
    batch = build_prefill_batch([(ids, 0, len(ids))], [list(range(blocks))],
                                engine.cache.block_size, engine.device)
    every = torch.arange(len(ids), dtype=torch.int64, device=engine.device)
    meta = dataclasses.replace(batch.meta, logits_indices=every)
    logits = engine.model.forward(batch.input_ids, meta, engine.cache.layers)
    engine.reset()
    return logits.argmax(-1).cpu()


def agreement(top1: torch.Tensor, reference: torch.Tensor) -> float:
    """Share of positions where both pick the same next token."""
    n = min(len(top1), len(reference))
    return float((top1[:n] == reference[:n]).float().mean())
