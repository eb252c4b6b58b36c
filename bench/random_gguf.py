"""A bigger model to benchmark without downloading one: a GGUF file of Llama-3.2-1B's shape with
random weights and the default model's tokenizer.

    python -m bench.quantize --shape llama-3.2-1b      # writes it once, then Q4_0 and Q4_K_M
    python -m bench.run --model .bench/models/llama-3.2-1b-random.Q4_0.gguf --agreement-tokens 0

The shape is bench.shapes' `llama-3.2-1b` (16 layers, hidden 2048, GQA 32/8, MLP 8192, tied
embeddings), its llama3 rope scaling written as llama.cpp's converter writes it (the divisors of
`rope_freqs.weight`, `llama3_divisors`); the vocabulary is the default model's 49,152 tokens (its `tokenizer.*` keys are copied), so prompts
tokenize as for the default model. Weights are float16 normal(0, 0.02), norms 1: a file
`llama-quantize` turns into the types users download, for speed and bandwidth figures only (the
top-1 agreement of random weights means little; pass --agreement-tokens 0).
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from bench.shapes import SHAPES

RANDOM_SHAPES = ("llama-3.2-1b", "tiny")  # tiny: for tests and smoke runs
WEIGHT_STD = 0.02


def llama3_divisors(head_dim: int, base: float, scaling: dict) -> list[float]:
    """What llama.cpp's converter stores as `rope_freqs.weight` for a "llama3" rope scaling: each
    default frequency over its scaled one (1 for short wavelengths, the factor for long ones, a
    blend between), from the engine's own frequencies of both kinds."""
    from shardlm_server.worker.ops import rope_inv_freq

    return (rope_inv_freq(head_dim, base, None) / rope_inv_freq(head_dim, base, scaling)).tolist()


def _copy_tokenizer(source: Path, writer: gguf.GGUFWriter) -> int:
    """Copies every `tokenizer.*` key of `source` into `writer`; returns the vocabulary size."""
    reader = gguf.GGUFReader(source)
    vocab = 0
    for name, field in reader.fields.items():
        if not name.startswith("tokenizer."):
            continue
        kind, value = field.types[0], field.contents()
        if kind == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(name, value, kind, sub_type=field.types[1])
        else:
            writer.add_key_value(name, value, kind)
        if name == "tokenizer.ggml.tokens":
            vocab = len(value)
    if not vocab:
        raise ValueError(f"{source} has no tokenizer.ggml.tokens to copy")
    return vocab


def write_random_llama(path: Path, shape_name: str, tokenizer_source: Path, seed: int = 0) -> Path:
    """Writes the float16 GGUF described in the module docstring to `path` (through a partial
    file, so an interrupted run leaves nothing that looks finished)."""
    config = SHAPES[shape_name].config
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    partial = path.with_suffix(".partial")
    writer = gguf.GGUFWriter(str(partial), "llama")
    writer.add_name(f"{shape_name}-random")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(8192)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head_dim)
    base = float(config.get("rope_theta", 10000.0))
    writer.add_rope_freq_base(base)
    writer.add_layer_norm_rms_eps(float(config.get("rms_norm_eps", 1e-5)))
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    vocab = _copy_tokenizer(tokenizer_source, writer)
    writer.add_vocab_size(vocab)
    rng = np.random.default_rng(seed)
    shapes = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,)}
    for i in range(config["num_hidden_layers"]):
        b = f"blk.{i}"
        shapes.update({f"{b}.attn_norm.weight": (hidden,), f"{b}.ffn_norm.weight": (hidden,),
                       f"{b}.attn_q.weight": (heads * head_dim, hidden),
                       f"{b}.attn_k.weight": (kv_heads * head_dim, hidden),
                       f"{b}.attn_v.weight": (kv_heads * head_dim, hidden),
                       f"{b}.attn_output.weight": (hidden, heads * head_dim),
                       f"{b}.ffn_gate.weight": (inter, hidden), f"{b}.ffn_up.weight": (inter, hidden),
                       f"{b}.ffn_down.weight": (hidden, inter)})
    for name, dims in shapes.items():
        if len(dims) == 1:
            writer.add_tensor(name, np.ones(dims, dtype=np.float32))
        else:
            values = rng.standard_normal(dims, dtype=np.float32) * WEIGHT_STD
            writer.add_tensor(name, values.astype(np.float16))
    scaling = config.get("rope_scaling")
    if scaling and scaling.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight",
                          np.array(llama3_divisors(head_dim, base, scaling), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    partial.rename(path)
    return path
