"""llama.cpp's tensor names and row order, mapped back to ShardLM's (the Hugging Face names).

llama.cpp's converter renames every tensor and, for the Llama architecture, reorders the rows of
the query and key projections within each head (its rotary embedding pairs neighbouring features,
Hugging Face's pairs the two halves of a head). `hf_rows` gives the row order that undoes it.
"""

from __future__ import annotations

import re

import numpy as np

_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",  # Qwen3's per-head norms
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma 3 names its norms after where they sit: its ffn_norm is the pre-feedforward norm, and it
# has output norms after attention and the MLP (worker/families/gemma3.py).
_GEMMA3_BLOCK = dict(_BLOCK, ffn_norm="pre_feedforward_layernorm",
                     post_attention_norm="post_attention_layernorm",
                     post_ffw_norm="post_feedforward_layernorm")
# phi3 keeps Hugging Face's fused tensors: q, k and v rows in attn_qkv, gate and up rows in
# ffn_up; the readers serve their parts (worker/fused.py).
_PHI3_BLOCK = dict(_BLOCK, attn_qkv="self_attn.qkv_proj", ffn_up="mlp.gate_up_proj")
_BLOCK_BY_ARCHITECTURE = {"gemma3": _GEMMA3_BLOCK, "phi3": _PHI3_BLOCK}
_BLOCK_NAME = re.compile(r"blk\.(\d+)\.([a-z_]+)\.(weight|bias)")
# Architectures whose converter permutes the Q/K rows (Qwen2 and Qwen3 keep Hugging Face's order).
PERMUTED_ARCHITECTURES = ("llama",)


def shardlm_name(gguf_name: str, architecture: str = "llama") -> str | None:
    """ShardLM's name for a llama.cpp tensor name of a file of `architecture`, or None for a
    tensor ShardLM has no use for."""
    if gguf_name in _GLOBAL:
        return _GLOBAL[gguf_name]
    block = _BLOCK_BY_ARCHITECTURE.get(architecture, _BLOCK)
    match = _BLOCK_NAME.fullmatch(gguf_name)
    if match and match.group(2) in block:
        layer, part, kind = match.groups()
        return f"model.layers.{layer}.{block[part]}.{kind}"
    return None


def is_rotary_permuted(name: str, architecture: str) -> bool:
    """Whether the rows of ShardLM tensor `name` are stored in llama.cpp's rotary order."""
    return architecture in PERMUTED_ARCHITECTURES and (
        ".self_attn.q_proj." in name or ".self_attn.k_proj." in name)


def hf_rows(num_heads: int, head_dim: int) -> np.ndarray:
    """Indices such that `gguf_rows[hf_rows(...)]` is Hugging Face's row order for `num_heads`
    whole heads. llama.cpp stores head row (i, j) at i*2+j, i < head_dim/2, j < 2; Hugging Face
    stores it at j*head_dim/2+i."""
    return np.arange(num_heads * head_dim).reshape(num_heads, head_dim // 2, 2).transpose(
        0, 2, 1).reshape(-1)
