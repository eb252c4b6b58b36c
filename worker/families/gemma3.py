"""Gemma 3 text models (`Gemma3ForCausalLM`, and the language model of a multimodal
`Gemma3ForConditionalGeneration`): what they add to the shared decoder.

- Interleaved attention: most layers attend over a sliding window with their own rope base
  (`rope_local_base_freq`, or `rope_parameters.sliding_attention`), every `sliding_window_pattern`
  -th layer (or where `layer_types` says "full_attention") attends globally with the global base
  and any rope scaling.
- RMS norms scale by (1 + w): the stored weights are read with 1 added (`norm_weight_offset`;
  llama.cpp's converter already adds it to a GGUF file's norms).
- Norms around both halves of a layer ("sandwich"): input, post-attention, pre-feedforward and
  post-feedforward norms, and per-head RMS norms on q and k as Qwen3 has.
- GELU (tanh approximation) gating, embeddings scaled by sqrt(hidden_size) in the serving dtype,
  scores scaled by query_pre_attn_scalar^-0.5, and optional final logit soft-capping.
"""

from __future__ import annotations

from typing import Any

from shardlm_server.worker.errors import CheckpointError

SLIDING, FULL = "sliding_attention", "full_attention"
DEFAULT_PATTERN = 6  # transformers' default: five windowed layers, then one global
DEFAULT_LOCAL_THETA = 10_000.0
DEFAULT_GLOBAL_THETA = 1_000_000.0


def _positive_int(raw: dict[str, Any], key: str, default: Any = None) -> int:
    value = raw.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise CheckpointError(f"config.json field '{key}' must be a positive integer, got "
                              f"{value!r}", field=key)
    return value


def layer_types(raw: dict[str, Any], num_layers: int) -> list[str]:
    """Each layer's attention kind, from `layer_types` or the older `sliding_window_pattern`."""
    types = raw.get("layer_types")
    if types is None:
        pattern = _positive_int(raw, "sliding_window_pattern", DEFAULT_PATTERN)
        return [SLIDING if (i + 1) % pattern else FULL for i in range(num_layers)]
    if (not isinstance(types, list) or len(types) != num_layers
            or any(t not in (SLIDING, FULL) for t in types)):
        raise CheckpointError(f"layer_types must list '{SLIDING}' or '{FULL}' for each of the "
                              f"{num_layers} layers", field="layer_types")
    return types


def _rope(raw: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(sliding, full) rope parameters: transformers 5's per-kind `rope_parameters`, or the older
    `rope_theta` / `rope_local_base_freq` / `rope_scaling` fields."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and (SLIDING in params or FULL in params):
        sliding = dict(params.get(SLIDING) or {})
        full = dict(params.get(FULL) or {})
    else:
        sliding = {"rope_theta": raw.get("rope_local_base_freq", DEFAULT_LOCAL_THETA)}
        full = dict(raw.get("rope_scaling") or {})
        full["rope_theta"] = raw.get("rope_theta", DEFAULT_GLOBAL_THETA)
    sliding.setdefault("rope_theta", DEFAULT_LOCAL_THETA)
    full.setdefault("rope_theta", DEFAULT_GLOBAL_THETA)
    if sliding.get("rope_type", sliding.get("type", "default")) != "default":
        raise CheckpointError("rope scaling on Gemma 3's sliding-window layers is not supported",
                              field="rope_parameters")
    return sliding, full


#: Gemma3TextConfig's defaults: the multimodal checkpoints (Gemma3ForConditionalGeneration: 4B and
#: up) state in their `text_config` only what differs from these.
TEXT_CONFIG_DEFAULTS = dict(
    vocab_size=262_208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
    num_attention_heads=8, num_key_value_heads=4, head_dim=256, max_position_embeddings=131_072,
    rms_norm_eps=1e-6, query_pre_attn_scalar=256, sliding_window=4096,
    rope_theta=DEFAULT_GLOBAL_THETA, rope_local_base_freq=DEFAULT_LOCAL_THETA,
    tie_word_embeddings=True, bos_token_id=2, eos_token_id=1,
)


def text_config(raw: dict[str, Any]) -> dict[str, Any]:
    """The config.json of a multimodal Gemma 3's language model, read as a Gemma3ForCausalLM's:
    its `text_config` over Gemma3TextConfig's defaults (the vision tower is not served)."""
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise CheckpointError("a Gemma3ForConditionalGeneration config.json needs a text_config "
                              "object", field="text_config")
    merged = {k: v for k, v in TEXT_CONFIG_DEFAULTS.items()
              if not (k in ("rope_theta", "rope_local_base_freq") and "rope_parameters" in text)}
    for key in ("eos_token_id", "bos_token_id", "tie_word_embeddings", "torch_dtype", "dtype"):
        if raw.get(key) is not None:
            merged[key] = raw[key]
    merged.update(text)
    merged["architectures"] = ["Gemma3ForCausalLM"]
    return merged


def gemma3_fields(raw: dict[str, Any], num_layers: int, hidden: int) -> dict[str, Any]:
    """The ModelConfig fields a Gemma 3 config.json sets beyond the shared ones."""
    if raw.get("attn_logit_softcapping") is not None:
        raise CheckpointError("attention logit soft-capping (attn_logit_softcapping) is not "
                              "supported",
                              field="attn_logit_softcapping")
    if raw.get("use_bidirectional_attention"):
        raise CheckpointError("bidirectional attention (use_bidirectional_attention) is not "
                              "supported: ShardLM serves decoders",
                              field="use_bidirectional_attention")
    act = raw.get("hidden_activation", raw.get("hidden_act", "gelu_pytorch_tanh"))
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise CheckpointError(f"hidden_activation '{act}' is not supported (only "
                              "gelu_pytorch_tanh)", field="hidden_activation")
    window = _positive_int(raw, "sliding_window", 4096)
    types = layer_types(raw, num_layers)
    sliding, full = _rope(raw)
    softcap = raw.get("final_logit_softcapping")
    if softcap is not None and (not isinstance(softcap, (int, float)) or softcap <= 0):
        raise CheckpointError(f"final_logit_softcapping must be positive or null, got "
                              f"{softcap!r}", field="final_logit_softcapping")
    scalar = raw.get("query_pre_attn_scalar", 256)
    if not isinstance(scalar, (int, float)) or scalar <= 0:
        raise CheckpointError(f"query_pre_attn_scalar must be positive, got {scalar!r}",
                              field="query_pre_attn_scalar")
    return dict(
        hidden_act="gelu_tanh",
        norm_weight_offset=1.0,
        sandwich_norms=True,
        qk_norm=True,
        embed_scale=hidden ** 0.5,
        attention_scale=float(scalar) ** -0.5,
        final_logit_softcapping=float(softcap) if softcap is not None else None,
        layer_windows=tuple(window if t == SLIDING else 0 for t in types),
        local_rope_theta=float(sliding["rope_theta"]),
        rope_theta=float(full["rope_theta"]),
        rope_scaling=full,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
        qkv_bias=bool(raw.get("attention_bias", False)),
        o_bias=bool(raw.get("attention_bias", False)),
    )
