"""Rotary embedding tables ([max_position, rotary_dim] = [cos | sin] per position) for every rope
kind the engine serves.

`ops.compute_cos_sin_cache` computes the default, llama3 and linear kinds; LongRoPE (Phi-3-128k,
Phi-3.5, Phi-4-mini) is computed here, operation for operation as transformers 5 does
(`_compute_longrope_parameters` and `Phi3RotaryEmbedding.forward`), so a float32 model's rotations
equal transformers' bit for bit:

    inv_freq = 1 / (factors * base ** (arange(0, rotary_dim, 2) / rotary_dim))
    cos, sin = cos(p * inv_freq) * attention_factor, sin(p * inv_freq) * attention_factor

`factors` is one of the checkpoint's two lists (worker/families/phi3.py says which is served).

"freq_factors" (a Llama 3.x GGUF file's `rope_freqs.weight`, worker/gguf/rope_tensors.py) is the
same division with one list and no attention factor: llama.cpp's rendering of the "llama3" kind.

A table narrower than head_dim (partial rotary, e.g. Phi-4-mini's 3/4) is computed for its
`rotary_dim` dims only, exactly as transformers computes it for `int(head_dim * factor)`:
`ops.rotary_embedding` turns the first rotary_dim dims of each head and leaves the rest.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from shardlm_server.worker import ops


def divided_inv_freq(rotary_dim: int, base: float, factors: list[float]) -> torch.Tensor:
    """The default inverse frequencies, each divided by its factor (LongRoPE's list, or a GGUF
    file's rope_freqs)."""
    ext_factors = torch.tensor(factors, dtype=torch.float32)
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    return 1.0 / (ext_factors * base**exponents)


def longrope_attention_factor(max_positions: int, original: int, factor: float | None = None,
                              attention_factor: float | None = None) -> float:
    """The scale LongRoPE applies to cos and sin: `attention_factor` where the checkpoint states
    it, else sqrt(1 + ln(factor) / ln(original)) for a context extended by `factor` (by default
    max_positions / original, as Phi-3 configs imply it), 1 where nothing is extended."""
    if attention_factor is not None:
        return float(attention_factor)
    if factor is None:
        factor = max_positions / original
    if factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(factor) / math.log(original))


def cos_sin_cache(rotary_dim: int, max_position: int, base: float,
                  rope_scaling: dict[str, Any] | None) -> torch.Tensor:
    """float32 [max_position, rotary_dim] = [cos | sin] of position * inv_freq, on CPU."""
    kind = (rope_scaling or {}).get("rope_type")
    if kind == "freq_factors":
        inv_freq, scale = divided_inv_freq(rotary_dim, base, rope_scaling["factors"]), 1.0
    elif kind == "longrope":
        factors = rope_scaling["long_factor" if rope_scaling["long"] else "short_factor"]
        inv_freq = divided_inv_freq(rotary_dim, base, factors)
        scale = rope_scaling["attention_factor"]  # a Python float, applied in float32 as transformers
    else:
        return ops.compute_cos_sin_cache(rotary_dim, max_position, base, rope_scaling)
    positions = torch.arange(max_position, dtype=torch.int64).float()
    freqs = torch.outer(positions, inv_freq)
    return torch.cat((freqs.cos() * scale, freqs.sin() * scale), dim=-1).float().contiguous()
