"""Mistral checkpoints (Hugging Face `MistralForCausalLM`): greedy tokens exact against
transformers in float32, without a sliding window and with one, generating far past the window
at the full context (the fused CPU blocks window every layer)."""

from __future__ import annotations

import pytest
import torch

from shardlm_server.worker.config import parse_config
from shardlm_server.worker.engine import Engine, PrefillItem
from shardlm_server.worker.errors import CheckpointError
from shardlm_server.worker.kv_cache import CacheConfig
from tests.checkpoints import MISTRAL, build_checkpoint, load_reference
from tests.worker.greedy_runs import greedy_tokens, prompt, reference_greedy

BLOCK = 16
WINDOW = 48
TABLE = list(range(32))  # 512 tokens


def greedy(engine: Engine, ids: list[int], n: int) -> list[int]:
    return greedy_tokens(engine, 0, ids, n, TABLE)


@pytest.fixture(scope="module", params=[None, WINDOW], ids=["no_window", "window"])
def mistral(request, tmp_path_factory):
    folder = build_checkpoint(tmp_path_factory.mktemp("mistral"),
                              dict(MISTRAL, sliding_window=request.param), seed=3)
    engine = Engine.load(folder, dtype="float32",
                         cache_config=CacheConfig(block_size=BLOCK, num_blocks=len(TABLE)))
    return request.param, engine, load_reference(folder)


def test_greedy_tokens_equal_transformers(mistral):
    window, engine, reference = mistral
    assert engine.cfg.architecture == "MistralForCausalLM"
    assert engine.cfg.head_dim == 32
    assert engine.cfg.max_position_embeddings == MISTRAL["max_position_embeddings"]
    assert engine.cfg.layer_windows == ((window,) * 2 if window else ())
    assert engine.model.stack is not None  # windowed or not, the fused CPU blocks serve it
    engine.reset()
    ids = prompt(21, engine.cfg.vocab_size, 4)
    assert greedy(engine, ids, 100) == reference_greedy(reference, ids, 100)


def test_a_long_prompt_past_the_window_gives_transformers_logits(mistral):
    window, engine, reference = mistral
    engine.reset()
    ids = prompt(3 * WINDOW + 5, engine.cfg.vocab_size, 5)
    out = engine.prefill([PrefillItem(0, ids, 0, TABLE)], taps=["logits"])
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0, -1].float()
    torch.testing.assert_close(out.taps["logits"][0], expected, atol=1e-4, rtol=0)


def test_a_window_that_covers_the_context_changes_nothing():
    assert parse_config(dict(MISTRAL, sliding_window=4096)).layer_windows == ()


@pytest.mark.parametrize("window", [0, -4, 1.5, "4096", True])
def test_a_malformed_window_is_refused_by_name(window):
    with pytest.raises(CheckpointError, match="sliding_window must be a positive integer"):
        parse_config(dict(MISTRAL, sliding_window=window))
