"""Greedy runs for the engine's parity tests: a random prompt, the engine's greedy tokens over a
prefill and one multi-step decode, the greedy tokens of a gateway serving a folder over two
tensor-parallel ranks, and transformers' greedy tokens for the same prompt."""

from __future__ import annotations

import torch
from shardlm.common.v1 import common_pb2
from shardlm.gateway.v1 import gateway_pb2

from shardlm_server.gateway.api.runtime import Limits
from shardlm_server.worker.engine import DecodeItem, Engine, PrefillItem, StopParams
from tests.gateway.conftest import LiveGateway


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


def last_logits(engine: Engine, reference, ids: list[int],
                block_table: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits after `ids`: the engine's (one prefill) and transformers' `reference`'s."""
    out = engine.prefill([PrefillItem(0, ids, 0, block_table)], taps=["logits"])
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0, -1].float()
    return out.taps["logits"][0], expected


def reference_greedy(reference, ids: list[int], n: int) -> list[int]:
    """transformers' n greedy tokens after `ids`, with no end token."""
    with torch.no_grad():
        return reference.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()


def two_rank_tokens(path, ids: list[int], n: int) -> list[int]:
    """n greedy tokens after `ids` from a gateway serving `path` over two ranks, in float32."""
    gateway = LiveGateway(2, Limits())
    try:
        events = list(gateway.stub.Load(gateway_pb2.LoadRequest(
            model_path=str(path), dtype=common_pb2.DTYPE_FLOAT32)))
        assert events[-1].model.tensor_parallel_size == 2
        chunks = gateway.stub.Generate(gateway_pb2.GenerateRequest(
            token_ids=gateway_pb2.TokenIds(token_ids=ids), sampling=common_pb2.SamplingParams(),
            stop=common_pb2.StopConditions(max_new_tokens=n, ignore_eos=True)))
        return [i for c in chunks for i in c.token_ids]
    finally:
        gateway.close()
