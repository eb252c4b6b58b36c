"""Llama 3.x GGUF files: llama.cpp's converter turns a checkpoint's "llama3" rope scaling into a
`rope_freqs.weight` tensor (one divisor per rotated frequency) and writes no rope.scaling.type.
transformers' GGUF loader ignores that tensor, so the reference is the file's Hugging Face twin
with the llama3 scaling in its config.json.
"""

from __future__ import annotations

import math

import pytest
import torch

from bench.random_gguf import llama3_divisors
from shardlm_server.worker.engine import Engine
from shardlm_server.worker.errors import CheckpointError
from shardlm_server.worker.kv_cache import CacheConfig
from tests.checkpoints import load_reference
from tests.gguf_files import GGUFSpec, T, hf_twin, write_gguf
from tests.worker.greedy_runs import (
    greedy_tokens,
    last_logits,
    prompt,
    reference_greedy,
    two_rank_tokens,
)

TABLE = list(range(32))  # 512 tokens
# Llama 3.1's scaling with an original context of 64, so that a 16-dim head has frequencies in
# all three of its bands (kept, divided by the factor, and blended between).
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
BASE = 500000.0
HEAD_DIM = 16


def spec(**overrides) -> GGUFSpec:
    fields = dict(hidden=64, intermediate=128, heads=4, kv_heads=2, rope_base=BASE, seed=11,
                  rope_freqs=llama3_divisors(HEAD_DIM, BASE, LLAMA3))
    return GGUFSpec("llama", **dict(fields, **overrides))


def load(path) -> Engine:
    return Engine.load(path, dtype="float32",
                       cache_config=CacheConfig(block_size=16, num_blocks=len(TABLE)))


@pytest.fixture(scope="module")
def llama3_gguf(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gguf-llama3")
    s = spec()
    originals = write_gguf(folder / "model.gguf", s)
    twin = hf_twin(folder / "hf", s, originals, {"rope_scaling": LLAMA3})
    plain = hf_twin(folder / "hf-plain", s, originals, {})
    return folder / "model.gguf", twin, plain


def test_the_divisors_are_read_as_the_files_rope(llama3_gguf):
    path, _, _ = llama3_gguf
    scaling = load(path).cfg.rope_scaling
    assert scaling["rope_type"] == "freq_factors"
    assert scaling["factors"] == pytest.approx(llama3_divisors(HEAD_DIM, BASE, LLAMA3), rel=1e-7)
    assert len(set(scaling["factors"])) > 2  # all three bands occur


def test_a_llama3_file_equals_its_hugging_face_twin(llama3_gguf):
    path, twin, plain = llama3_gguf
    engine, reference = load(path), load_reference(twin)
    ids = prompt(300, engine.cfg.vocab_size, 7)  # far past the original context of 64
    ours, expected = last_logits(engine, reference, ids, TABLE)
    with torch.no_grad():
        unscaled = load_reference(plain)(torch.tensor([ids])).logits[0, -1].float()
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=0)
    # The divisors matter here: the same weights with the default rope give other logits.
    assert (unscaled - expected).abs().max() > 1e-2
    engine.reset()
    assert greedy_tokens(engine, 0, ids, 32, TABLE) == reference_greedy(reference, ids, 32)
    assert two_rank_tokens(path, ids, 12) == reference_greedy(reference, ids, 12)


def test_a_linear_scaling_beside_the_divisors_divides_them_all(tmp_path):
    write_gguf(tmp_path / "m.gguf", spec(linear_rope=2.0, layers=1))
    scaling = load(tmp_path / "m.gguf").cfg.rope_scaling
    assert scaling["factors"] == pytest.approx(
        [2.0 * f for f in llama3_divisors(HEAD_DIM, BASE, LLAMA3)], rel=1e-7)


@pytest.mark.parametrize("divisors", [[1.0] * 5, [1.0] * 7 + [0.0], [1.0] * 7 + [math.nan]],
                         ids=["too-few", "zero", "nan"])
def test_divisors_that_do_not_fit_the_head_are_refused_by_name(tmp_path, divisors):
    write_gguf(tmp_path / "m.gguf", spec(rope_freqs=divisors, layers=1))
    with pytest.raises(CheckpointError, match="rope_freqs.weight") as info:
        load(tmp_path / "m.gguf")
    assert info.value.metadata.get("tensor") == "rope_freqs.weight"


def test_divisors_in_an_architecture_that_does_not_read_them_are_refused(tmp_path):
    write_gguf(tmp_path / "m.gguf", GGUFSpec("qwen2", layers=1, rope_freqs=[1.0] * 32,
                                             default_type=T.F32))
    with pytest.raises(CheckpointError, match="not read for architecture 'qwen2'"):
        load(tmp_path / "m.gguf")
