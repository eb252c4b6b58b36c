"""Checkpoint loading: every way a folder can be wrong gets a typed error that names it."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from shardlm_server.worker.config import parse_config
from shardlm_server.worker.engine import Engine
from shardlm_server.worker.errors import (
    CheckpointError,
    TensorParallelError,
    UnsupportedArchitectureError,
)
from shardlm_server.worker.kv_cache import CacheConfig, CacheMode
from tests.checkpoints import QWEN2


@pytest.fixture
def broken(tmp_path, qwen2_dir):
    folder = tmp_path / "broken"
    shutil.copytree(qwen2_dir, folder)
    return folder


def rewrite_config(folder, **changes):
    path = folder / "config.json"
    raw = json.loads(path.read_text())
    raw.update(changes)
    path.write_text(json.dumps(raw))


def rewrite_weights(folder, edit):
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))


def test_unsupported_architecture(broken):
    rewrite_config(broken, architectures=["GPT2LMHeadModel"])
    with pytest.raises(UnsupportedArchitectureError, match="GPT2LMHeadModel"):
        Engine.load(broken)


def test_missing_tensor_is_named(broken):
    rewrite_weights(broken, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match="model.layers.1.mlp.up_proj.weight"):
        Engine.load(broken)


def test_unexpected_tensor_is_named(broken):
    rewrite_weights(broken, lambda t: t.update({"model.extra.weight": torch.zeros(3)}))
    with pytest.raises(CheckpointError, match="model.extra.weight"):
        Engine.load(broken)


def test_shape_mismatch_is_named(broken):
    rewrite_config(broken, intermediate_size=QWEN2["intermediate_size"] + 2)
    with pytest.raises(CheckpointError, match=r"gate_proj.weight.*shape"):
        Engine.load(broken)


def test_unreadable_file(broken):
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="unreadable"):
        Engine.load(broken)


def test_pickle_only_checkpoint_is_refused(broken):
    (broken / "model.safetensors").unlink()
    (broken / "pytorch_model.bin").write_bytes(b"\x80\x04")
    with pytest.raises(CheckpointError, match="safetensors only"):
        Engine.load(broken)


def test_bad_config(broken):
    (broken / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json"):
        Engine.load(broken)
    with pytest.raises(CheckpointError, match="hidden_size"):
        parse_config({"architectures": ["LlamaForCausalLM"], "hidden_size": "64"})


def test_tensor_parallel_must_divide(qwen2_dir):
    class FakeTwoRanks:
        rank, world_size = 0, 3

        def all_reduce(self, t):
            pass

    with pytest.raises(TensorParallelError, match="not divisible"):
        Engine.load(qwen2_dir, comm=FakeTwoRanks())  # type: ignore[arg-type]


def test_dtypes_load(qwen2_dir):
    for dtype in ("bfloat16", "float16"):
        engine = Engine.load(qwen2_dir, dtype=dtype, cache_config=CacheConfig(num_blocks=8))
        assert engine.model.embed.weight.dtype == getattr(torch, dtype)
        assert engine.cache.layers[0][0].dtype == getattr(torch, dtype)


def test_cache_sizing_from_budget_and_static_mode(qwen2_dir):
    engine = Engine.load(qwen2_dir, cache_config=CacheConfig(memory_bytes=1 << 20, block_size=8))
    per_block = engine.capacity.bytes_per_block
    assert per_block == 2 * 2 * 8 * 2 * 12 * 4  # K+V, layers, block, kv heads, head dim, fp32
    assert engine.capacity.num_blocks == (1 << 20) // per_block
    static = CacheConfig(mode=CacheMode.STATIC, block_size=16, static_max_sequences=3,
                         static_max_sequence_length=100)
    capacity = engine.reconfigure(static)
    assert (capacity.num_blocks, capacity.max_sequences, capacity.max_sequence_length) == (21, 3, 100)
    assert engine.cache.layers[0][0].shape == (21, 16, 2, 12)
