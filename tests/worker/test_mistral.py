"""Mistral checkpoints (Hugging Face `MistralForCausalLM`): greedy tokens exact against
transformers in float32, without a sliding window and with one, where the served context is
capped at the window (worker/config.py says why that is exact)."""

from __future__ import annotations

import pytest

from shardlm_server.worker.config import parse_config
from shardlm_server.worker.engine import Engine, PrefillItem
from shardlm_server.worker.errors import CheckpointError, InvalidRequestError
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
    assert engine.cfg.max_position_embeddings == (window or MISTRAL["max_position_embeddings"])
    ids = prompt(21, engine.cfg.vocab_size, 4)
    new = (window or 64) - len(ids) - 1  # the whole context the engine serves, with a window
    assert greedy(engine, ids, new) == reference_greedy(reference, ids, new)


def test_a_windowed_model_refuses_a_context_past_its_window(mistral):
    window, engine, _ = mistral
    if window is None:
        pytest.skip("no window: the full context is served")
    engine.reset()
    with pytest.raises(InvalidRequestError, match=f"exceed the context of {window}"):
        engine.prefill([PrefillItem(0, prompt(window + 1, engine.cfg.vocab_size, 5), 0, TABLE)])


def test_a_window_that_covers_the_context_changes_nothing():
    raw = dict(MISTRAL, sliding_window=4096)
    assert parse_config(raw).max_position_embeddings == MISTRAL["max_position_embeddings"]


@pytest.mark.parametrize("window", [0, -4, 1.5, "4096", True])
def test_a_malformed_window_is_refused_by_name(window):
    with pytest.raises(CheckpointError, match="sliding_window must be a positive integer"):
        parse_config(dict(MISTRAL, sliding_window=window))
