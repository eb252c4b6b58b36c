"""GGUF checkpoints in the engine: small files written here with every supported tensor type, both
architectures, tied and untied heads and llama.cpp's Q/K permutation, checked against transformers
loading the same file (`gguf_file=`); slicing, and the errors for files ShardLM cannot serve."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from shardlm_server.worker import gridquant
from shardlm_server.worker.engine import DecodeItem, Engine, PrefillItem, StopParams
from shardlm_server.worker.errors import CheckpointError, UnsupportedArchitectureError
from shardlm_server.worker.gguf.file import SUPPORTED_TYPES
from shardlm_server.worker.gguf.reader import GGUFCheckpointReader
from shardlm_server.worker.kv_cache import CacheConfig
from shardlm_server.worker.loader import checkpoint_format, load_checkpoint_config
from tests.gguf_files import (
    QUANTIZABLE,
    GGUFSpec,
    T,
    copy_with_unsupported_type,
    every_type_once,
    write_gguf,
)
from tests.worker.greedy_runs import reference_greedy

ALL_TYPES = [t for t in SUPPORTED_TYPES if t != T.F32] + [T.F32]
BLOCKS = list(range(16))


def _spec(arch: str) -> GGUFSpec:
    # 3 layers: 22 matrices or more, so that each file holds every supported type
    if arch == "llama":  # grouped-query attention, untied head, permuted Q/K
        return every_type_once(GGUFSpec("llama", layers=3, tied=False), ALL_TYPES)
    if arch == "qwen3":  # per-head q/k norms, no biases, untied head; head_dim 128, because
        # transformers reads no key_length from the file and takes Qwen3's default
        return every_type_once(GGUFSpec("qwen3", layers=3, heads=2, kv_heads=1, rope_base=1e6,
                                        eps=1e-6), ALL_TYPES, offset=11)
    return every_type_once(GGUFSpec("qwen2", layers=3, tied=True, bias=True, rope_base=1e6,
                                    eps=1e-6), ALL_TYPES, offset=7)


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def gguf_model(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"gguf-{request.param}")
    spec = _spec(request.param)
    write_gguf(folder / "model.gguf", spec)
    return folder, spec


@pytest.fixture(scope="module")
def loaded(gguf_model):
    from transformers import AutoModelForCausalLM

    folder, spec = gguf_model
    engine = Engine.load(folder / "model.gguf", dtype="float32",
                         cache_config=CacheConfig(block_size=16, num_blocks=64))
    reference = AutoModelForCausalLM.from_pretrained(str(folder), gguf_file="model.gguf",
                                                     dtype=torch.float32)
    return engine, reference.eval(), spec


def test_the_files_cover_every_supported_type_and_both_heads():
    llama, qwen2 = _spec("llama"), _spec("qwen2")
    used = set(llama.types.values()) | set(qwen2.types.values())
    assert used == set(SUPPORTED_TYPES)
    assert not llama.tied and qwen2.tied


def test_config_comes_from_the_metadata(loaded):
    engine, reference, spec = loaded
    cfg = engine.cfg
    assert cfg.architecture == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                "qwen3": "Qwen3ForCausalLM"}[spec.arch]
    assert cfg.qk_norm == (spec.arch == "qwen3")
    assert (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size) == (
        spec.layers, spec.hidden, spec.intermediate)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (spec.heads, spec.kv_heads,
                                                                spec.head_dim)
    assert cfg.max_position_embeddings == spec.context
    assert cfg.rope_theta == pytest.approx(spec.rope_base)
    assert cfg.rms_norm_eps == pytest.approx(spec.eps)
    assert cfg.tie_word_embeddings == spec.tied
    assert cfg.vocab_size == reference.config.vocab_size
    assert engine.eos_token_ids == (2,) and cfg.bos_token_id == 1
    assert engine.source.format == "gguf"
    assert set(engine.source.tensor_types) == {t.name for t in SUPPORTED_TYPES}


def test_logits_and_greedy_tokens_equal_transformers_on_the_same_file(loaded):
    engine, reference, _ = loaded
    engine.reset()
    ids = torch.randint(3, engine.cfg.vocab_size, (29,),
                        generator=torch.Generator().manual_seed(3)).tolist()
    n = 16
    stop = StopParams(max_new_tokens=n)
    out = engine.prefill([PrefillItem(0, ids, 0, BLOCKS, stop=stop)], taps=["logits"])
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0, -1].float()
    torch.testing.assert_close(out.taps["logits"][0], expected, atol=2e-4, rtol=1e-4)
    ours = [out.tokens[0].token.token_id]
    for step in engine.decode([DecodeItem(0, BLOCKS, n)], n):
        ours += [t.token.token_id for t in step.tokens]
    assert ours == reference_greedy(reference, ids, n)


def test_llama_cpp_q_k_permutation_is_undone(tmp_path):
    spec = GGUFSpec("llama", layers=1, default_type=T.F32)
    originals = write_gguf(tmp_path / "m.gguf", spec)
    reader = GGUFCheckpointReader(tmp_path / "m.gguf", torch.device("cpu"), torch.float32)
    for part, rows in (("q", spec.heads * 64), ("k", spec.kv_heads * 64)):
        got = reader.read(f"model.layers.0.self_attn.{part}_proj.weight", (rows, spec.hidden))
        torch.testing.assert_close(got, torch.from_numpy(originals[f"blk.0.attn_{part}.weight"]),
                                   rtol=0, atol=0)
        # A rank's slice holds whole heads, in Hugging Face's order too.
        half = reader.read(f"model.layers.0.self_attn.{part}_proj.weight", (rows, spec.hidden),
                           shard_dim=0, rank=1, world_size=2)
        torch.testing.assert_close(half, got[rows // 2:], rtol=0, atol=0)


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q5_1, T.Q4_K, T.Q6_K, T.BF16, T.F16], ids=lambda t: t.name)
def test_a_rank_reads_only_its_slice(tmp_path, qtype):
    spec = GGUFSpec("qwen2", layers=1, default_type=qtype, bias=True)
    write_gguf(tmp_path / "m.gguf", spec)
    reader = GGUFCheckpointReader(tmp_path / "m.gguf", torch.device("cpu"), torch.float32)
    name, shape = "model.layers.0.mlp.down_proj.weight", (spec.hidden, spec.intermediate)
    full = reader.read(name, shape)
    for world in (2, 16):  # 16 ranks split the input features inside a 32- or 256-wide block
        for dim in (0, 1):
            parts = [reader.read(name, shape, shard_dim=dim, rank=r, world_size=world)
                     for r in range(world)]
            torch.testing.assert_close(torch.cat(parts, dim=dim), full, rtol=0, atol=0)
    packed = reader.read_packed(name, shape, shard_dim=1, rank=1, world_size=2)
    if qtype in (T.F16, T.BF16):
        assert packed is None
    else:
        assert packed.qtype == qtype.name and packed.shape == (spec.hidden, spec.intermediate // 2)
        assert packed.blocks.dtype == torch.uint8 and packed.blocks.shape[0] == spec.hidden
    assert reader.read_packed(name, shape, shard_dim=1, rank=1, world_size=16) is None or \
        qtype in (T.Q4_0, T.Q5_1)  # 512/16 = 32 columns: whole blocks only for 32-wide blocks


def test_quantizable_types_round_trip_close_to_the_original(tmp_path):
    for qtype in QUANTIZABLE:
        spec = GGUFSpec("qwen2", layers=1, default_type=qtype, bias=True)
        originals = write_gguf(tmp_path / f"{qtype.name}.gguf", spec)
        reader = GGUFCheckpointReader(tmp_path / f"{qtype.name}.gguf", torch.device("cpu"),
                                      torch.float32)
        got = reader.read("model.layers.0.mlp.up_proj.weight", (spec.intermediate, spec.hidden))
        want = torch.from_numpy(originals["blk.0.ffn_up.weight"])
        assert (got - want).abs().max() < 0.1 * want.abs().max(), qtype.name


@pytest.mark.parametrize("qtype", [T[name] for name in gridquant.TYPES], ids=lambda t: t.name)
def test_grid_i_quants_stay_packed_and_equal_their_dequantized_model(tmp_path, qtype):
    """Every matrix of the type (256-wide rows in groups of 8) is held in its table layout
    (worker/gridquant.py), not dequantized, and the logits are the dense model's."""
    write_gguf(tmp_path / "m.gguf", GGUFSpec("llama", layers=2, default_type=qtype))
    cache = CacheConfig(block_size=16, num_blocks=16)
    packed = Engine.load(tmp_path / "m.gguf", dtype="float32", cache_config=cache)
    layer = packed.model.layers[0]
    layouts = {lin.weight.qtype for lin in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)}
    assert layouts == {gridquant.TYPES[qtype.name].layout}
    dense = Engine.load(tmp_path / "m.gguf", dtype="float32", cache_config=cache,
                        quantize="none")
    ids = list(range(5, 40))
    logits = [engine.prefill([PrefillItem(0, ids, 0, BLOCKS[:4])], taps=["logits"])
              .taps["logits"][0] for engine in (packed, dense)]
    torch.testing.assert_close(logits[0], logits[1], atol=1e-4, rtol=1e-4)


def test_a_folder_holding_one_gguf_file_is_a_gguf_checkpoint(gguf_model, tmp_path):
    folder, _ = gguf_model
    assert checkpoint_format(folder) == "gguf" and checkpoint_format(folder / "model.gguf") == "gguf"
    shutil.copy(folder / "model.gguf", tmp_path / "b.gguf")
    shutil.copy(folder / "model.gguf", tmp_path / "a.gguf")
    with pytest.raises(CheckpointError, match="several GGUF files"):
        load_checkpoint_config(tmp_path)


# ------------------------------------------------------------------------- files ShardLM refuses
@pytest.fixture(scope="module")
def good_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("good") / "m.gguf"
    write_gguf(path, GGUFSpec("llama", layers=1, default_type=T.Q8_0))
    return path


def test_truncated_file_is_a_checkpoint_error(good_file, tmp_path):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good_file.read_bytes()[: good_file.stat().st_size - 5000])
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        load_checkpoint_config(cut)


def test_corrupt_file_is_a_checkpoint_error(good_file, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUX" + good_file.read_bytes()[4:])
    with pytest.raises(CheckpointError, match="not a readable GGUF"):
        load_checkpoint_config(bad)
    noise = tmp_path / "noise.gguf"
    noise.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    with pytest.raises(CheckpointError):
        load_checkpoint_config(noise)


def test_unknown_architecture_is_named(tmp_path):
    write_gguf(tmp_path / "m.gguf", GGUFSpec("mamba", layers=1))
    with pytest.raises(UnsupportedArchitectureError, match="'mamba' is not supported"):
        load_checkpoint_config(tmp_path / "m.gguf")


def test_unsupported_tensor_type_is_named(tmp_path):
    write_gguf(tmp_path / "ok.gguf", GGUFSpec("llama", layers=1))
    copy_with_unsupported_type(tmp_path / "ok.gguf", tmp_path / "m.gguf", "blk.0.ffn_up.weight")
    with pytest.raises(CheckpointError, match="blk.0.ffn_up.weight.*TQ2_0"):
        load_checkpoint_config(tmp_path / "m.gguf")


def test_a_safetensors_checkpoint_reports_its_format_and_dtypes(llama_dir):
    from shardlm.common.v1 import common_pb2

    from shardlm_server.worker.convert import model_info_to_proto

    engine = Engine.load(llama_dir, dtype="float32",
                         cache_config=CacheConfig(block_size=16, num_blocks=8))
    info = model_info_to_proto(engine)
    assert engine.source.format == "safetensors"
    assert info.format == common_pb2.CHECKPOINT_FORMAT_SAFETENSORS
    assert list(info.tensor_types) == ["F32"]
