"""Phi-3 models (`Phi3ForCausalLM`: Phi-3-mini/medium, Phi-3.5-mini, Phi-4-mini): what they add to
the shared decoder.

- Fused projections: the checkpoint stores q, k and v as one `self_attn.qkv_proj` and the gate and
  up projections as one `mlp.gate_up_proj`; the readers serve their row ranges under the usual
  names (worker/fused.py), so a tensor-parallel rank gets its slice of each.
- Partial rotary: `partial_rotary_factor` (Phi-4-mini: 0.75) turns only the first
  int(head_dim * factor) dims of each head, as transformers computes it.
- LongRoPE (`rope_type` "longrope", or the older names "su" and "yarn", which transformers' Phi-3
  reads as longrope): per-frequency divisors, a short list for contexts up to
  `original_max_position_embeddings` and a long one beyond, and a scale on cos and sin
  (worker/rope.py). transformers switches the lists by the length of the sequence at hand, which
  a KV cache cannot follow (its keys were rotated with the list in force when they were written).
  ShardLM chooses once, from the context it serves: the long list where that context exceeds
  `original_max_position_embeddings`, the short one otherwise. Tokens equal transformers' for
  every sequence when the short list is served, and for sequences longer than the original
  context when the long one is; a shorter sequence on a long-context model differs from
  transformers' (which would rotate it with the short list), as it does in llama.cpp, which also
  chooses by the context it serves.
- A sliding window on every layer (`sliding_window`, e.g. 2047 on Phi-3-mini-4k), read as
  Mistral's is (worker/config.py) and served by the windowed attention kernels.
"""

from __future__ import annotations

import math
from typing import Any

from shardlm_server.worker.errors import CheckpointError
from shardlm_server.worker.rope import longrope_attention_factor

PHI3 = "Phi3ForCausalLM"
LONGROPE_NAMES = ("longrope", "su", "yarn")  # transformers' Phi3Config renames the last two
DEFAULT_ORIGINAL_CONTEXT = 4096  # Phi3Config's default original_max_position_embeddings


def _rotary_dim(raw: dict[str, Any], rope: dict[str, Any], head_dim: int) -> int:
    """Dims of each head that rotate. A GGUF file states them (`rotary_dim`, from
    phi3.rope.dimension_count); config.json states a factor, which transformers 5 keeps in
    rope_parameters and older configs at the top level."""
    rotary = raw.get("rotary_dim")
    if rotary is None:
        factor = rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
        if (not isinstance(factor, (int, float)) or isinstance(factor, bool)
                or not 0 < factor <= 1):
            raise CheckpointError(f"partial_rotary_factor must be a number in (0, 1], got "
                                  f"{factor!r}", field="partial_rotary_factor")
        rotary = int(head_dim * factor)
    if not isinstance(rotary, int) or rotary <= 0 or rotary % 2 or rotary > head_dim:
        raise CheckpointError(f"the rotary embedding must turn an even number of dims up to "
                              f"head_dim ({head_dim}), got {rotary!r}", field="partial_rotary_factor")
    return rotary


def _factors(scaling: dict[str, Any], key: str, rotary: int) -> list[float]:
    values = scaling.get(key)
    if (not isinstance(values, list) or len(values) != rotary // 2
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
                       for v in values)):
        raise CheckpointError(f"longrope rope_scaling needs '{key}': {rotary // 2} positive "
                              f"numbers, one per rotated frequency", field="rope_scaling")
    return [float(v) for v in values]


def _longrope(raw: dict[str, Any], scaling: Any, rotary: int,
              served_context: int) -> dict[str, Any] | None:
    """The rope scaling served, resolved: None (default rope) or longrope with its factor list
    chosen and its attention factor computed."""
    if scaling is None:
        return None
    if not isinstance(scaling, dict):
        raise CheckpointError("config.json rope_scaling must be an object", field="rope_scaling")
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return None
    if kind not in LONGROPE_NAMES:
        raise CheckpointError(f"rope_scaling type '{kind}' is not supported for Phi-3 "
                              "(supported: default, longrope)", field="rope_scaling")
    # Phi3Config's top-level original_max_position_embeddings wins over the scaling object's.
    original = raw.get("original_max_position_embeddings",
                       scaling.get("original_max_position_embeddings", DEFAULT_ORIGINAL_CONTEXT))
    if not isinstance(original, int) or isinstance(original, bool) or original <= 0:
        raise CheckpointError(f"original_max_position_embeddings must be a positive integer, "
                              f"got {original!r}", field="original_max_position_embeddings")
    for key in ("factor", "attention_factor"):
        value = scaling.get(key)
        if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)
                                  or not math.isfinite(value) or value < 0):
            raise CheckpointError(f"longrope '{key}' must be a non-negative number, got "
                                  f"{value!r}", field="rope_scaling")
    return {
        "rope_type": "longrope",
        "short_factor": _factors(scaling, "short_factor", rotary),
        "long_factor": _factors(scaling, "long_factor", rotary),
        "original_max_position_embeddings": original,
        # From the checkpoint's own context, not the served one: transformers' factor.
        "attention_factor": longrope_attention_factor(
            raw["max_position_embeddings"], original, scaling.get("factor"),
            scaling.get("attention_factor")),
        "long": served_context > original,  # see the module docstring
    }


def phi3_fields(raw: dict[str, Any], head_dim: int, served_context: int) -> dict[str, Any]:
    """The ModelConfig fields a Phi-3 config.json sets beyond the shared ones: its rotary dims
    and its rope scaling (validated here, not by worker.config: Phi-3 reads its own kinds).
    `served_context` is the context the engine serves (it picks LongRoPE's factor list)."""
    rope = raw.get("rope_parameters") if isinstance(raw.get("rope_parameters"), dict) else None
    rotary = _rotary_dim(raw, rope or {}, head_dim)
    scaling = rope if rope is not None else raw.get("rope_scaling")
    return {"partial_rotary_dim": rotary if rotary != head_dim else 0,
            "rope_scaling": _longrope(raw, scaling, rotary, served_context)}
