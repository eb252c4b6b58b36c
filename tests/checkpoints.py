"""Tiny random Hugging Face checkpoints for tests, built with transformers in a temp folder.

Two families with the shapes that break naive code: a Llama with grouped-query attention, a
vocabulary that is no multiple of 64 and llama3 rope scaling, stored as a sharded checkpoint; and a
Qwen2 with q/k/v biases and tied embeddings. MISTRAL is Llama's shape with an explicit head_dim
and a sliding window (tests/worker/test_mistral.py); QWEN3 has per-head q/k norms and an
explicit head_dim (tests/worker/test_qwen3.py); GEMMA3 interleaves windowed and global layers with
their own ropes and has Gemma's norms, activation and scales (tests/worker/test_gemma3.py). Each
folder also gets a small byte-level BPE
tokenizer.json trained here, so the gateway can be tested on the same folders.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

TOKENIZER_TEXT = [
    "To be, or not to be, that is the question:",
    "Whether 'tis nobler in the mind to suffer",
    "The slings and arrows of outrageous fortune,",
    "Or to take arms against a sea of troubles",
    "ShardLM serves language models over gRPC.",
    "你好，世界。天气很好。🙂🚀 café naïve",
]

LLAMA = dict(
    architectures=["LlamaForCausalLM"],
    vocab_size=1000,
    hidden_size=64,
    intermediate_size=172,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    rope_scaling={
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    initializer_range=0.25,
)

QWEN2 = dict(
    architectures=["Qwen2ForCausalLM"],
    vocab_size=998,
    hidden_size=48,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
    initializer_range=0.25,
    use_sliding_window=False,
)


MISTRAL = dict(
    architectures=["MistralForCausalLM"],
    vocab_size=1003,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=32,  # not hidden_size / heads, as in Mistral Nemo
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    rope_theta=1000000.0,
    sliding_window=None,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    initializer_range=0.25,
)


QWEN3 = dict(
    architectures=["Qwen3ForCausalLM"],
    vocab_size=1002,  # even: the vocabulary is split over tensor-parallel ranks
    hidden_size=48,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,  # not hidden_size / heads (12), as in the Qwen3 models
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    attention_bias=False,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
    initializer_range=0.25,
    use_sliding_window=False,
)


GEMMA3 = dict(
    architectures=["Gemma3ForCausalLM"],
    vocab_size=1004,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    query_pre_attn_scalar=24,  # not head_dim, so a wrong score scale shows
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    sliding_window=16,  # shorter than the test prompts, so the window changes the result
    rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                     "full_attention": {"rope_type": "linear", "factor": 4.0,
                                        "rope_theta": 1000000.0}},
    final_logit_softcapping=30.0,
    hidden_activation="gelu_pytorch_tanh",
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    initializer_range=0.25,
)


# Phi-3 (tests/worker/test_phi3.py): fused qkv_proj and gate_up_proj, a sliding window shorter
# than the test sequences, an untied head. PHI4_MINI adds what Phi-4-mini has: a quarter of each
# head left unrotated, LongRoPE (its short / long factor lists and attention factor; an original
# context of 64 in a served 512, so the long list is served) and tied embeddings.
PHI3 = dict(
    architectures=["Phi3ForCausalLM"],
    vocab_size=1006,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    original_max_position_embeddings=512,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    sliding_window=48,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,  # Phi3Config's default (32000) lies outside the small vocabulary
    initializer_range=0.25,
)
PHI4_MINI = dict(
    PHI3,
    sliding_window=None,
    original_max_position_embeddings=64,
    partial_rotary_factor=0.75,  # head_dim 16: 12 dims turn, 6 frequencies
    rope_scaling={"rope_type": "longrope",
                  "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                  "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0]},
    rope_theta=250000.0,
    tie_word_embeddings=True,
)


def write_tokenizer(folder: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TOKENIZER_TEXT * 4, trainer=trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True}),
        encoding="utf-8",
    )


def build_checkpoint(folder: Path, spec: dict, *, shard: bool = False, seed: int = 0) -> Path:
    """Create a random model of `spec` in `folder` (HF format) and return the folder."""
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    cls_name = spec["architectures"][0]
    config_cls = {"LlamaForCausalLM": transformers.LlamaConfig,
                  "Qwen2ForCausalLM": transformers.Qwen2Config,
                  "MistralForCausalLM": transformers.MistralConfig,
                  "Qwen3ForCausalLM": transformers.Qwen3Config,
                  "Gemma3ForCausalLM": transformers.Gemma3TextConfig,
                  "Phi3ForCausalLM": transformers.Phi3Config}[cls_name]
    config = config_cls(**{k: v for k, v in spec.items() if k != "architectures"})
    model = getattr(transformers, cls_name)(config).eval()
    with torch.no_grad():  # norms start at 1; perturb them so a wrong norm weight shows
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
            elif name.endswith("bias"):
                param.normal_(0, 0.2)
    kwargs = {"max_shard_size": "200KB"} if shard else {}
    model.save_pretrained(folder, safe_serialization=True, **kwargs)
    write_tokenizer(folder, spec["vocab_size"])
    return folder


def load_reference(folder: Path):
    """The transformers model for `folder`, float32, eager attention: the correctness oracle."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    ).eval()
