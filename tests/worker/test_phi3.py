"""Phi-3 checkpoints (Hugging Face `Phi3ForCausalLM`, GGUF `phi3`): fused qkv_proj / gate_up_proj
served as their parts, a sliding window, partial rotary and LongRoPE (Phi-4-mini), tied and untied
heads. Greedy tokens and logits exact against transformers in float32, on one rank and on two;
GGUF files written as llama.cpp's converter writes them, checked against transformers loading the
same file where it reads everything the file says, else against the Hugging Face folder holding
the same values."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from shardlm_server.worker.config import load_config, parse_config
from shardlm_server.worker.engine import Engine, PrefillItem
from shardlm_server.worker.errors import CheckpointError
from shardlm_server.worker.gguf.file import SUPPORTED_TYPES
from shardlm_server.worker.gguf.reader import GGUFCheckpointReader
from shardlm_server.worker.kv_cache import CacheConfig
from shardlm_server.worker.loader import load_checkpoint_config
from shardlm_server.worker.rope import cos_sin_cache
from shardlm_server.worker.safetensors_reader import SafetensorsReader
from tests.checkpoints import PHI3, PHI4_MINI, build_checkpoint, load_reference
from tests.gguf_files import GGUFSpec, T, every_type_once, hf_twin, write_gguf
from tests.worker.greedy_runs import (
    greedy_tokens,
    last_logits,
    prompt,
    reference_greedy,
    two_rank_tokens,
)

TABLE = list(range(32))  # 512 tokens
CPU = torch.device("cpu")
# PHI4_MINI with its whole served context inside the original one: the short factor list, and an
# attention factor the checkpoint states.
PHI4_MINI_SHORT = dict(PHI4_MINI, original_max_position_embeddings=512,
                       rope_scaling=dict(PHI4_MINI["rope_scaling"], attention_factor=1.125))
SPECS = {"phi3": PHI3, "phi4_mini": PHI4_MINI, "phi4_mini_short": PHI4_MINI_SHORT}
# Prompt lengths: past PHI4_MINI's original context (64), so transformers takes the long list too.
PROMPT = {"phi3": 21, "phi4_mini": 70, "phi4_mini_short": 21}


def load(path) -> Engine:
    return Engine.load(path, dtype="float32",
                       cache_config=CacheConfig(block_size=16, num_blocks=len(TABLE)))


@pytest.fixture(scope="module", params=list(SPECS))
def phi3_dir(request, tmp_path_factory):
    folder = build_checkpoint(tmp_path_factory.mktemp(request.param), SPECS[request.param], seed=9)
    return request.param, folder


@pytest.fixture(scope="module")
def phi3(phi3_dir):
    name, folder = phi3_dir
    return name, load(folder), load_reference(folder)


def test_the_config_names_what_phi3_adds(phi3_dir):
    name, folder = phi3_dir
    cfg = load_config(folder)
    assert cfg.architecture == "Phi3ForCausalLM" and cfg.head_dim == 16
    if name == "phi3":
        assert (cfg.rotary_dim, cfg.rope_scaling, cfg.tie_word_embeddings) == (16, None, False)
        assert cfg.layer_windows == (48, 48) and cfg.max_position_embeddings == 512
        return
    assert cfg.rotary_dim == 12 and cfg.tie_word_embeddings
    scaling = cfg.rope_scaling
    assert scaling["rope_type"] == "longrope" and scaling["long"] == (name == "phi4_mini")
    assert scaling["long_factor"] == PHI4_MINI["rope_scaling"]["long_factor"]
    # transformers' default: sqrt(1 + ln(512 / 64) / ln(64)); the short variant states its own.
    expected = math.sqrt(1 + math.log(8) / math.log(64)) if name == "phi4_mini" else 1.125
    assert scaling["attention_factor"] == pytest.approx(expected, rel=1e-12)


def test_prefill_logits_equal_transformers(phi3):
    name, engine, reference = phi3
    engine.reset()
    ids = prompt(PROMPT[name] + 8, engine.cfg.vocab_size, 6)
    out = engine.prefill([PrefillItem(0, ids, 0, TABLE)], taps=["logits"])
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0, -1].float()
    torch.testing.assert_close(out.taps["logits"][0], expected, atol=1e-4, rtol=0)


def test_64_greedy_tokens_equal_transformers(phi3):
    name, engine, reference = phi3
    engine.reset()
    ids = prompt(PROMPT[name], engine.cfg.vocab_size, 7)  # phi3: 85 tokens, past its window
    assert greedy_tokens(engine, 0, ids, 64, TABLE) == reference_greedy(reference, ids, 64)


def test_the_rope_tables_equal_transformers_rotary_embedding(phi3):
    """The served table against transformers' own rope function, over every position it serves
    in the same regime: the long list beyond the original context, the short one within it."""
    name, engine, reference = phi3
    cfg = engine.cfg
    long = bool(cfg.rope_scaling and cfg.rope_scaling["long"])
    positions = torch.arange(64 if long else 0, 512 if long else 64)[None]
    with torch.no_grad():
        cos, sin = reference.model.rotary_emb(torch.zeros(1, dtype=torch.float32), positions)
    ours = cos_sin_cache(cfg.rotary_dim, cfg.max_position_embeddings, cfg.rope_theta,
                         cfg.rope_scaling)[positions[0]]
    half = cfg.rotary_dim // 2
    torch.testing.assert_close(ours, torch.cat((cos[0, :, :half], sin[0, :, :half]), -1),
                               rtol=0, atol=0)


def test_a_rank_reads_its_slice_of_q_k_and_v(phi3_dir):
    _, folder = phi3_dir
    cfg = load_config(folder)
    reader = SafetensorsReader(folder, CPU, torch.float32)
    fused = reader.read("model.layers.1.self_attn.qkv_proj.weight",
                        (cfg.q_size + 2 * cfg.kv_size, cfg.hidden_size))
    q, k, v = fused.split([cfg.q_size, cfg.kv_size, cfg.kv_size])
    for part, rows in (("q", q), ("k", k), ("v", v)):
        name = f"model.layers.1.self_attn.{part}_proj.weight"
        half = reader.read(name, tuple(rows.shape), shard_dim=0, rank=1, world_size=2)
        torch.testing.assert_close(half, rows[rows.shape[0] // 2:], rtol=0, atol=0)
    up = reader.read("model.layers.0.mlp.up_proj.weight", (cfg.intermediate_size, cfg.hidden_size),
                     shard_dim=1, rank=0, world_size=2)
    gate_up = reader.read("model.layers.0.mlp.gate_up_proj.weight",
                          (2 * cfg.intermediate_size, cfg.hidden_size))
    torch.testing.assert_close(up, gate_up[cfg.intermediate_size:, :cfg.hidden_size // 2])


def test_two_ranks_serve_the_same_greedy_tokens(phi3_dir):
    name, folder = phi3_dir
    if name == "phi4_mini_short":
        pytest.skip("the same shapes as phi4_mini")
    reference = load_reference(folder)
    ids = prompt(PROMPT[name], SPECS[name]["vocab_size"], 8)
    assert two_rank_tokens(folder, ids, 12) == reference_greedy(reference, ids, 12)


@pytest.mark.parametrize("kind", ["dynamic", "llama3", "linear"])
def test_another_rope_scaling_is_refused_by_name(kind):
    raw = dict(PHI3, rope_scaling={"rope_type": kind, "factor": 2.0})
    with pytest.raises(CheckpointError, match=f"'{kind}' is not supported for Phi-3"):
        parse_config(raw)


def test_longrope_factor_lists_must_fit_the_rotated_dims():
    scaling = dict(PHI4_MINI["rope_scaling"], long_factor=[1.0] * 8)  # 8 lists for 12 dims
    with pytest.raises(CheckpointError, match="'long_factor': 6 positive numbers"):
        parse_config(dict(PHI4_MINI, rope_scaling=scaling))


# ----------------------------------------------------------------------------------- GGUF files
ALL_TYPES = [t for t in SUPPORTED_TYPES if t != T.F32] + [T.F32]
LONG = [1.0 + 0.35 * i for i in range(24)]  # 48 of 64 dims turn: 24 frequencies
SHORT = [1.0 + 0.05 * i for i in range(24)]


def phi4_gguf_spec(default_type=T.F32) -> GGUFSpec:
    """Phi-4-mini's shape as llama.cpp writes it: 48 of 64 dims rotated, LongRoPE with an
    original context of 64 (the long list served), tied embeddings, no window."""
    return GGUFSpec("phi3", tied=True, rope_base=250000.0, rotary_dim=48, original_context=64,
                    rope_factors=(LONG, SHORT),
                    attn_factor=math.sqrt(1 + math.log(8) / math.log(64)),
                    default_type=default_type, seed=4)


@pytest.fixture(scope="module")
def phi3_gguf(tmp_path_factory):
    """Phi-3-mini's shape in every supported tensor type, which transformers reads whole."""
    folder = tmp_path_factory.mktemp("gguf-phi3")
    spec = every_type_once(GGUFSpec("phi3", kv_heads=2), ALL_TYPES, offset=5)
    write_gguf(folder / "model.gguf", spec)
    return folder / "model.gguf"


@pytest.fixture(scope="module")
def phi4_gguf(tmp_path_factory):
    """A float32 Phi-4-mini-like file and its Hugging Face twin. transformers' GGUF loader reads
    neither partial rotary nor LongRoPE from a phi3 file, so the twin is the reference."""
    folder = tmp_path_factory.mktemp("gguf-phi4")
    spec = phi4_gguf_spec()
    originals = write_gguf(folder / "model.gguf", spec)
    twin = hf_twin(folder / "hf", spec, originals, dict(
        original_max_position_embeddings=64,
        rope_scaling={"rope_type": "longrope", "long_factor": LONG, "short_factor": SHORT}))
    return folder / "model.gguf", twin


def test_a_phi3_file_equals_transformers_on_the_same_file(phi3_gguf):
    from transformers import AutoModelForCausalLM

    engine = load(phi3_gguf)
    assert engine.cfg.architecture == "Phi3ForCausalLM" and not engine.cfg.tie_word_embeddings
    reference = AutoModelForCausalLM.from_pretrained(
        str(phi3_gguf.parent), gguf_file=phi3_gguf.name, dtype=torch.float32).eval()
    ids = prompt(29, engine.cfg.vocab_size, 3)
    out = engine.prefill([PrefillItem(0, ids, 0, TABLE)], taps=["logits"])
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0, -1].float()
    torch.testing.assert_close(out.taps["logits"][0], expected, atol=2e-4, rtol=1e-4)
    engine.reset()
    assert greedy_tokens(engine, 0, ids, 16, TABLE) == reference_greedy(reference, ids, 16)
    assert two_rank_tokens(phi3_gguf, ids, 12) == reference_greedy(reference, ids, 12)


def test_a_phi4_file_equals_its_hugging_face_twin(phi4_gguf):
    path, twin = phi4_gguf
    engine, reference = load(path), load_reference(twin)
    cfg, twin_cfg = engine.cfg, load_config(twin)
    assert (cfg.rotary_dim, cfg.tie_word_embeddings, cfg.layer_windows) == (48, True, ())
    scaling, expected = cfg.rope_scaling, twin_cfg.rope_scaling
    assert scaling["long"] and scaling["long_factor"] == pytest.approx(LONG)
    assert scaling["attention_factor"] == pytest.approx(expected["attention_factor"], rel=1e-7)
    ids = prompt(70, cfg.vocab_size, 5)  # past the original context: the long list both sides
    torch.testing.assert_close(*last_logits(engine, reference, ids, TABLE), atol=1e-4, rtol=0)
    engine.reset()
    assert greedy_tokens(engine, 0, ids, 64, TABLE) == reference_greedy(reference, ids, 64)
    assert two_rank_tokens(path, ids, 12) == reference_greedy(reference, ids, 12)


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_K, T.F16], ids=lambda t: t.name)
def test_a_rank_reads_its_rows_of_a_fused_gguf_tensor(tmp_path, qtype):
    spec = GGUFSpec("phi3", layers=1, default_type=qtype)
    write_gguf(tmp_path / "m.gguf", spec)
    reader = GGUFCheckpointReader(tmp_path / "m.gguf", CPU, torch.float32)
    cfg, h = reader.config, spec.hidden
    rows = {"q": cfg.q_size, "k": cfg.kv_size, "v": cfg.kv_size}
    fused = reader.read("model.layers.0.self_attn.qkv_proj.weight", (sum(rows.values()), h))
    start = 0
    for part, size in rows.items():
        name = f"model.layers.0.self_attn.{part}_proj.weight"
        torch.testing.assert_close(reader.read(name, (size, h), shard_dim=0, rank=1, world_size=2),
                                   fused[start + size // 2:start + size], rtol=0, atol=0)
        packed = reader.read_packed(name, (size, h), shard_dim=0, rank=1, world_size=2)
        if qtype == T.F16:
            assert packed is None
        else:
            stored = reader.file.tensors["blk.0.attn_qkv.weight"].data
            assert np.array_equal(packed.blocks.numpy(), stored[start + size // 2:start + size])
        start += size
    # A fused tensor whose parts were all read counts as used.
    parts = GGUFCheckpointReader(tmp_path / "m.gguf", CPU, torch.float32)
    for part, size in rows.items():
        parts.read(f"model.layers.0.self_attn.{part}_proj.weight", (size, h))
    parts.check_all_consumed(optional=lambda n: "qkv" not in n)


def test_the_rope_factor_tensors_are_configuration_not_leftovers(tmp_path):
    write_gguf(tmp_path / "m.gguf", phi4_gguf_spec())
    engine = load(tmp_path / "m.gguf")  # loading checks that every tensor was used
    assert engine.cfg.rope_scaling["short_factor"] == pytest.approx(SHORT)


def test_a_gguf_window_and_original_context_are_read(tmp_path):
    """phi3.attention.sliding_window windows every layer (0 is none); the original context of a
    file without rope factors changes nothing."""
    path = tmp_path / "m.gguf"
    write_gguf(path, GGUFSpec("phi3", layers=2, sliding_window=32, original_context=64))
    cfg = load_checkpoint_config(path)
    assert cfg.layer_windows == (32, 32) and cfg.rope_scaling is None and cfg.rotary_dim == 64
