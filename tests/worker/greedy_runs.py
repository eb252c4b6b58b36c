"""Greedy runs for the engine's parity tests: a random prompt, the engine's greedy tokens over a
prefill and one multi-step decode, and transformers' greedy tokens for the same prompt."""

from __future__ import annotations

import torch

from shardlm_server.worker.engine import DecodeItem, Engine, PrefillItem, StopParams


def prompt(length: int, vocab: int, seed: int) -> list[int]:
    """`length` random token ids, clear of the special ids 0-2."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (length,), generator=g).tolist()


def greedy_tokens(engine: Engine, seq: int, ids: list[int], n: int,
                  block_table: list[int]) -> list[int]:
    """The engine's n + 1 greedy tokens after `ids` (the prefill's, then n decode steps)."""
    stop = StopParams(max_new_tokens=n)
    first = engine.prefill([PrefillItem(seq, ids, 0, block_table, stop=stop)])
    tokens = [first.tokens[0].token.token_id]
    for step in engine.decode([DecodeItem(seq, block_table, n)], n):
        tokens += [t.token.token_id for t in step.tokens]
    return tokens


def reference_greedy(reference, ids: list[int], n: int) -> list[int]:
    """transformers' n greedy tokens after `ids`, with no end token."""
    with torch.no_grad():
        return reference.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
