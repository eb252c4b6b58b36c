"""Gemma 3 text checkpoints (Hugging Face `Gemma3ForCausalLM`, GGUF arch `gemma3`): windowed
layers interleaved with global ones, each kind with its own rope, (1 + w) norms around both halves
of a layer, GELU-tanh gating, scaled embeddings, a query_pre_attn_scalar that is not head_dim and
final logit soft-capping. Logits and greedy tokens exact against transformers in float32, with
prompts and generations far longer than the window, on one rank and on two; and the language
model of a multimodal Gemma3ForConditionalGeneration checkpoint."""

from __future__ import annotations

import pytest
import torch

from shardlm_server.worker.config import parse_config
from shardlm_server.worker.engine import Engine, PrefillItem
from shardlm_server.worker.errors import CheckpointError
from shardlm_server.worker.gguf.file import SUPPORTED_TYPES
from shardlm_server.worker.kv_cache import CacheConfig
from tests.checkpoints import GEMMA3, build_checkpoint, load_reference
from tests.gguf_files import GGUFSpec, T, every_type_once, write_gguf
from tests.worker.greedy_runs import greedy_tokens, prompt, reference_greedy, two_rank_tokens

TABLE = list(range(32))  # 512 tokens in blocks of 16


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("gemma3"), GEMMA3, seed=7)


@pytest.fixture(scope="module")
def gemma3(gemma3_dir):
    engine = Engine.load(gemma3_dir, dtype="float32",
                         cache_config=CacheConfig(block_size=16, num_blocks=len(TABLE)))
    return engine, load_reference(gemma3_dir)


def test_the_config_reads_what_gemma3_adds():
    cfg = parse_config(GEMMA3)
    assert cfg.layer_windows == (16, 0, 16)
    assert [cfg.rope_of(i)[0] for i in range(3)] == [10000.0, 1000000.0, 10000.0]
    assert cfg.rope_of(1)[1]["rope_type"] == "linear" and cfg.rope_of(0)[1] is None
    assert (cfg.hidden_act, cfg.norm_weight_offset, cfg.sandwich_norms, cfg.qk_norm) == (
        "gelu_tanh", 1.0, True, True)
    assert cfg.embed_scale == 8.0 and cfg.attention_scale == 24 ** -0.5
    assert cfg.final_logit_softcapping == 30.0 and cfg.tie_word_embeddings


def test_the_older_pattern_form_reads_the_same_layers():
    raw = {k: v for k, v in GEMMA3.items() if k not in ("layer_types", "rope_parameters")}
    raw.update(num_hidden_layers=7, sliding_window_pattern=3, rope_theta=5e5,
               rope_local_base_freq=1e4)
    cfg = parse_config(raw)
    assert cfg.layer_windows == (16, 16, 0, 16, 16, 0, 16)
    assert (cfg.rope_of(2)[0], cfg.rope_of(0)[0]) == (5e5, 1e4)


@pytest.mark.parametrize("change, field", [
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"hidden_activation": "relu"}, "hidden_activation"),
    ({"layer_types": ["sliding_attention"]}, "layer_types"),
    ({"sliding_window": 0}, "sliding_window"),
])
def test_what_is_not_served_is_refused_by_name(change, field):
    with pytest.raises(CheckpointError) as err:
        parse_config(dict(GEMMA3, **change))
    assert field in str(err.value)


def test_prefill_logits_equal_transformers(gemma3):
    engine, reference = gemma3
    engine.reset()
    ids = prompt(40, engine.cfg.vocab_size, 6)  # longer than the window of 16
    out = engine.prefill([PrefillItem(0, ids, 0, TABLE)], taps=["logits"])
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0, -1].float()
    torch.testing.assert_close(out.taps["logits"][0], expected, atol=1e-4, rtol=0)


def test_greedy_tokens_far_past_the_window_equal_transformers(gemma3):
    engine, reference = gemma3
    engine.reset()
    ids = prompt(21, engine.cfg.vocab_size, 7)
    assert greedy_tokens(engine, 0, ids, 80, TABLE) == reference_greedy(reference, ids, 80)


def test_a_prompt_continued_from_its_cached_prefix_gives_the_same_logits(gemma3):
    """The prefix cache and sessions: a prefill after 30 cached tokens equals a whole one."""
    engine, _ = gemma3
    ids = prompt(45, engine.cfg.vocab_size, 8)
    engine.reset()
    whole = engine.prefill([PrefillItem(0, ids, 0, TABLE)], taps=["logits"]).taps["logits"]
    engine.reset()
    engine.prefill([PrefillItem(0, ids[:30], 0, TABLE)])
    rest = engine.prefill([PrefillItem(0, ids[30:], 30, TABLE)], taps=["logits"]).taps["logits"]
    torch.testing.assert_close(rest, whole, atol=1e-5, rtol=0)


def test_two_ranks_serve_the_same_greedy_tokens(gemma3_dir, gemma3):
    _, reference = gemma3
    ids = prompt(23, GEMMA3["vocab_size"], 9)
    expected = reference_greedy(reference, ids, 12)
    assert two_rank_tokens(gemma3_dir, ids, 12) == expected


@pytest.fixture(scope="module")
def gemma3_gguf(tmp_path_factory):
    """A gemma3 GGUF file with every supported tensor type; seven layers, so llama.cpp's fixed
    pattern makes layer 5 the global one. head_dim 256: transformers reads the file's score
    scale from no key and takes its default query_pre_attn_scalar, 256."""
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("gemma3-gguf")
    types = [t for t in SUPPORTED_TYPES if t != T.F32] + [T.F32]
    spec = every_type_once(GGUFSpec("gemma3", layers=7, heads=2, kv_heads=1, key_length=256,
                                    sliding_window=16, rope_base=1e6, eps=1e-6, tied=True),
                           types)
    write_gguf(folder / "model.gguf", spec)
    engine = Engine.load(folder / "model.gguf", dtype="float32",
                         cache_config=CacheConfig(block_size=16, num_blocks=len(TABLE)))
    reference = AutoModelForCausalLM.from_pretrained(str(folder), gguf_file="model.gguf",
                                                     dtype=torch.float32)
    return engine, reference.eval()


def test_a_gguf_file_reads_gemma3_from_its_metadata(gemma3_gguf):
    engine, _ = gemma3_gguf
    cfg = engine.cfg
    assert cfg.architecture == "Gemma3ForCausalLM"
    assert cfg.layer_windows == (16, 16, 16, 16, 16, 0, 16)
    assert (cfg.head_dim, cfg.attention_scale, cfg.embed_scale) == (256, 256 ** -0.5, 16.0)
    assert cfg.norm_weight_offset == 0.0  # the file's norms already hold 1 + w
    assert (cfg.rope_of(0)[0], cfg.rope_of(5)[0]) == (10000.0, 1e6)


def test_gguf_logits_and_greedy_tokens_equal_transformers_on_the_same_file(gemma3_gguf):
    engine, reference = gemma3_gguf
    engine.reset()
    ids = prompt(29, engine.cfg.vocab_size, 3)
    out = engine.prefill([PrefillItem(0, ids, 0, TABLE)], taps=["logits"])
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0, -1].float()
    torch.testing.assert_close(out.taps["logits"][0], expected, atol=2e-4, rtol=1e-4)
    engine.reset()
    assert greedy_tokens(engine, 0, ids, 40, TABLE) == reference_greedy(reference, ids, 40)


def test_a_multimodal_config_is_read_over_gemma3_text_defaults():
    """Gemma 3 4B and up ship as Gemma3ForConditionalGeneration, whose text_config states only
    what differs from Gemma3TextConfig's defaults (here as in gemma-3-4b-it's config.json)."""
    cfg = parse_config({"architectures": ["Gemma3ForConditionalGeneration"], "eos_token_id": [1, 106],
                        "text_config": {"hidden_size": 2560, "intermediate_size": 10240,
                                        "num_hidden_layers": 34, "sliding_window": 1024,
                                        "rope_scaling": {"factor": 8.0, "rope_type": "linear"}},
                        "vision_config": {"hidden_size": 1152}})
    assert cfg.architecture == "Gemma3ForCausalLM"
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (8, 4, 256, 262_208)
    assert cfg.eos_token_ids == (1, 106) and cfg.tie_word_embeddings
    assert cfg.layer_windows[:6] == (1024,) * 5 + (0,)
    assert cfg.rope_of(5) == (1e6, {"factor": 8.0, "rope_type": "linear", "rope_theta": 1e6})
    assert cfg.rope_of(0) == (1e4, None)


def test_the_language_model_of_a_multimodal_checkpoint_equals_transformers(tmp_path):
    """Its vision tower is left unread; text-only greedy tokens equal transformers' multimodal
    model on the same folder."""
    import transformers

    text = {k: v for k, v in GEMMA3.items() if k != "architectures"}
    config = transformers.Gemma3Config(
        text_config=text, vision_config=dict(hidden_size=16, intermediate_size=32,
                                             num_hidden_layers=1, num_attention_heads=2,
                                             image_size=28, patch_size=14),
        mm_tokens_per_image=4, boi_token_index=1000, eoi_token_index=1001, image_token_index=1002)
    torch.manual_seed(11)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(tmp_path, safe_serialization=True)
    engine = Engine.load(tmp_path, dtype="float32",
                         cache_config=CacheConfig(block_size=16, num_blocks=len(TABLE)))
    reference = transformers.Gemma3ForConditionalGeneration.from_pretrained(
        tmp_path, dtype=torch.float32, attn_implementation="eager").eval()
    ids = prompt(30, GEMMA3["vocab_size"] - 8, 12)
    assert greedy_tokens(engine, 0, ids, 24, TABLE) == reference_greedy(reference, ids, 24)
