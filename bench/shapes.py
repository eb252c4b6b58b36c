"""Model shapes for the benchmarks, with sizes taken from the models' published config.json files,
and the random-weight checkpoints built from them (nothing is downloaded).

A checkpoint folder gets the safetensors weights, config.json, generation_config.json and a
word-level tokenizer.json covering the whole vocabulary (token i is the word `t<i>`), which is all
`shardlm serve` needs to serve it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

_LLAMA3_COMMON = dict(vocab_size=128256, rope_theta=500000.0, rms_norm_eps=1e-5,
                      bos_token_id=128000, eos_token_id=128001)


@dataclass(frozen=True)
class Shape:
    name: str
    architecture: str  # LlamaForCausalLM or Qwen2ForCausalLM
    config: dict = field(default_factory=dict)
    note: str = ""


SHAPES: dict[str, Shape] = {s.name: s for s in (
    # Qwen/Qwen2.5-0.5B: 24 layers, GQA 14/2, q/k/v biases, tied embeddings.
    Shape("qwen2.5-0.5b", "Qwen2ForCausalLM", dict(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
        use_sliding_window=False, bos_token_id=151643, eos_token_id=151643),
        "Qwen2.5-0.5B (config.json of Qwen/Qwen2.5-0.5B)"),
    # meta-llama/Llama-3.2-1B: 16 layers, GQA 32/8, llama3 rope scaling, tied embeddings.
    Shape("llama-3.2-1b", "LlamaForCausalLM", dict(
        _LLAMA3_COMMON, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64,
        max_position_embeddings=131072, tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
        "Llama-3.2-1B (config.json of meta-llama/Llama-3.2-1B)"),
    # meta-llama/Meta-Llama-3-8B: 32 layers, GQA 32/8, untied embeddings.
    Shape("llama-3-8b", "LlamaForCausalLM", dict(
        _LLAMA3_COMMON, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
        tie_word_embeddings=False),
        "Llama-3-8B (config.json of meta-llama/Meta-Llama-3-8B)"),
    # ~125M parameters: a small Llama with grouped-query attention (the CPU benchmark).
    Shape("llama-100m", "LlamaForCausalLM", dict(
        vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
        num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=4096,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False),
        "small Llama, GQA 12/4, ~125M parameters"),
    # For --smoke: every code path in seconds.
    Shape("tiny", "LlamaForCausalLM", dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
        "tiny Llama 3 for smoke runs"),
)}

GPU_DEFAULT = ["qwen2.5-0.5b", "llama-3.2-1b", "llama-3-8b"]
CPU_DEFAULT = ["llama-100m"]
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def hf_config(shape: Shape, dtype: torch.dtype):
    import transformers

    cls = {"LlamaForCausalLM": transformers.LlamaConfig,
           "Qwen2ForCausalLM": transformers.Qwen2Config}[shape.architecture]
    config = cls(**shape.config)
    config.architectures = [shape.architecture]
    config.dtype = DTYPE_NAMES[dtype]
    return config


def build_model(shape: Shape, dtype: torch.dtype, device: torch.device, seed: int = 0):
    """The transformers model of `shape` with random weights, created directly on `device` in
    `dtype` (no float32 copy on the host first)."""
    import transformers

    torch.manual_seed(seed)
    config = hf_config(shape, dtype)
    cls = getattr(transformers, shape.architecture)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def write_tokenizer(folder: Path, vocab_size: int) -> None:
    """A word-level tokenizer with one word per id: fast to build at any vocabulary size."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": False}),
                                                  encoding="utf-8")


def build_checkpoint(folder: Path, shape: Shape, dtype: torch.dtype, device: torch.device):
    """Build the random model on `device`, save it to `folder` (HF layout) and return it, so the
    caller can use the same weights as the transformers baseline without loading them again."""
    folder.mkdir(parents=True, exist_ok=True)
    model = build_model(shape, dtype, device)
    # Small shards: only one shard's worth of a GPU model is on the host at any time.
    model.save_pretrained(folder, safe_serialization=True, max_shard_size="2GB")
    write_tokenizer(folder, shape.config["vocab_size"])
    return model


def weight_bytes(model) -> int:
    """Bytes of weights one decode step reads: every parameter once, except an untied input
    embedding, of which a step only gathers a few rows."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    emb, out = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    if emb is not out:
        total -= emb.numel() * emb.element_size()
    return total


def parameter_count(model) -> int:
    return sum(p.numel() for p in model.parameters())
