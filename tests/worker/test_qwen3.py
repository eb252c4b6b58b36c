"""Qwen3 checkpoints (Hugging Face `Qwen3ForCausalLM`): per-head RMS norms on the queries and keys
before the rotary embedding, an explicit head_dim, no q/k/v biases. Greedy tokens and logits exact
against transformers in float32, on one rank and on two (tensor parallelism); the CPU path runs
op by op, since the fused CPU blocks have no per-head norms."""

from __future__ import annotations

import pytest
import torch

from shardlm_server.worker.engine import Engine, PrefillItem
from shardlm_server.worker.kv_cache import CacheConfig
from tests.checkpoints import QWEN3, build_checkpoint, load_reference
from tests.worker.greedy_runs import greedy_tokens, prompt, reference_greedy, two_rank_tokens

TABLE = list(range(32))  # 512 tokens


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("qwen3"), QWEN3, seed=5)


@pytest.fixture(scope="module")
def qwen3(qwen3_dir):
    engine = Engine.load(qwen3_dir, dtype="float32",
                         cache_config=CacheConfig(block_size=16, num_blocks=len(TABLE)))
    return engine, load_reference(qwen3_dir)


def test_the_config_names_what_qwen3_adds(qwen3):
    engine, _ = qwen3
    cfg = engine.cfg
    assert (cfg.architecture, cfg.qk_norm, cfg.head_dim, cfg.qkv_bias) == (
        "Qwen3ForCausalLM", True, 16, False)
    assert engine.model.stack is None  # op by op on CPU


def test_prefill_logits_equal_transformers(qwen3):
    engine, reference = qwen3
    engine.reset()
    ids = prompt(29, engine.cfg.vocab_size, 6)
    out = engine.prefill([PrefillItem(0, ids, 0, TABLE)], taps=["logits"])
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0, -1].float()
    torch.testing.assert_close(out.taps["logits"][0], expected, atol=1e-4, rtol=0)


def test_64_greedy_tokens_equal_transformers(qwen3):
    engine, reference = qwen3
    engine.reset()
    ids = prompt(21, engine.cfg.vocab_size, 7)
    assert greedy_tokens(engine, 0, ids, 64, TABLE) == reference_greedy(reference, ids, 64)


def test_two_ranks_serve_the_same_greedy_tokens(qwen3_dir, qwen3):
    _, reference = qwen3
    ids = prompt(13, QWEN3["vocab_size"], 8)
    expected = reference_greedy(reference, ids, 12)
    assert two_rank_tokens(qwen3_dir, ids, 12) == expected
