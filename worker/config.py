"""Model configuration read from a Hugging Face `config.json`.

Only the fields the engine needs are kept, validated once here so the rest of the code can trust
them. The supported families (Llama, Mistral, Qwen2, Qwen3, Gemma 3, Phi-3) share one decoder
shape; the differences are flags (Qwen3's: an RMS norm over each query and key head before the
rotary embedding, and biases only where `attention_bias` says). A family with more to say reads
it in its own module of worker/families/.

Mistral is Llama's shape with an optional sliding window on every layer: a query attends to the
`sliding_window` latest keys only (itself included), served at the full context by the windowed
attention kernels. Gemma 3 (worker/families/gemma3.py) windows some layers and not others.
Phi-3 (worker/families/phi3.py) windows every layer as Mistral does (e.g. 2047 on Phi-3-mini-4k).

Phi-3's LongRoPE has a short and a long list of rope factors, which transformers switches by the
length of each sequence. A KV cache holds keys rotated when they were written, so ShardLM chooses
one list for good, from the context it serves (`max_position_embeddings`): the long list where
that context exceeds `original_max_position_embeddings`, the short one otherwise. Tokens equal
transformers' wherever both use the same list: every sequence when the short list is served,
sequences longer than the original context when the long one is.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardlm_server.worker.errors import CheckpointError, UnsupportedArchitectureError
from shardlm_server.worker.families.gemma3 import gemma3_fields, text_config
from shardlm_server.worker.families.phi3 import PHI3, phi3_fields

MULTIMODAL_GEMMA3 = "Gemma3ForConditionalGeneration"  # served as its language model
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM",
    "Gemma3ForCausalLM", MULTIMODAL_GEMMA3, PHI3)


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    tie_word_embeddings: bool
    qkv_bias: bool  # q/k/v projections carry a bias (Qwen2 always; Llama with attention_bias)
    o_bias: bool  # Llama's attention_bias also adds one to o_proj; Qwen2's o_proj never has one
    mlp_bias: bool
    torch_dtype: str | None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    bos_token_id: int | None = None
    qk_norm: bool = False  # Qwen3: per-head RMS norms on q and k (weights [head_dim])
    # Gemma 3 (worker/families/gemma3.py) and what other families may share with it:
    hidden_act: str = "silu"  # the MLP's gate activation: "silu" or "gelu_tanh"
    norm_weight_offset: float = 0.0  # added to stored RMS norm weights: (1 + w) norms
    sandwich_norms: bool = False  # norms after attention and the MLP too, before the residual add
    embed_scale: float = 1.0  # embeddings multiplied by this (in the serving dtype)
    attention_scale: float | None = None  # score scale; None: head_dim ** -0.5
    final_logit_softcapping: float | None = None  # logits = c * tanh(logits / c)
    layer_windows: tuple[int, ...] = ()  # per layer: sliding window in keys, 0 = global
    local_rope_theta: float | None = None  # rope base of windowed layers (no scaling); None: same
    partial_rotary_dim: int = 0  # Phi-3: dims of each head the rotary embedding turns; 0: all

    def window(self, layer: int) -> int:
        """Layer `layer`'s sliding window (keys a query sees, itself included); 0: all keys."""
        return self.layer_windows[layer] if self.layer_windows else 0

    def rope_of(self, layer: int) -> tuple[float, dict[str, Any] | None]:
        """Layer `layer`'s rope base and scaling."""
        if self.local_rope_theta is not None and self.window(layer):
            return self.local_rope_theta, None
        return self.rope_theta, self.rope_scaling

    @property
    def rotary_dim(self) -> int:
        """Dims of each head the rotary embedding turns (the first ones)."""
        return self.partial_rotary_dim or self.head_dim

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def _require(raw: dict[str, Any], key: str, kind: type) -> Any:
    if key not in raw:
        raise CheckpointError(f"config.json lacks required field '{key}'", field=key)
    value = raw[key]
    if kind is float and isinstance(value, int):
        value = float(value)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise CheckpointError(
            f"config.json field '{key}' must be {kind.__name__}, got {type(value).__name__}",
            field=key,
        )
    if kind is int and value <= 0:
        raise CheckpointError(f"config.json field '{key}' must be positive, got {value}", field=key)
    return value


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    if isinstance(value, list) and all(isinstance(v, int) for v in value):
        return tuple(value)
    raise CheckpointError(f"config.json eos_token_id has an unexpected form: {value!r}")


#: The rope scaling kinds served, with the numeric fields each needs.
ROPE_SCALING_KEYS = {
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "linear": ("factor",),
}


def _validate_rope_scaling(rope_scaling: Any) -> dict[str, Any] | None:
    if rope_scaling is None:
        return None
    if not isinstance(rope_scaling, dict):
        raise CheckpointError("config.json rope_scaling must be an object")
    kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
    if kind in (None, "default"):
        return None
    if kind not in ROPE_SCALING_KEYS:
        raise CheckpointError(
            f"rope_scaling type '{kind}' is not supported (supported: default, "
            f"{', '.join(ROPE_SCALING_KEYS)})", field="rope_scaling")
    for key in ROPE_SCALING_KEYS[kind]:
        if not isinstance(rope_scaling.get(key), (int, float)):
            raise CheckpointError(f"{kind} rope_scaling lacks numeric '{key}'", field="rope_scaling")
    return dict(rope_scaling, rope_type=kind)


def parse_config(raw: dict[str, Any]) -> ModelConfig:
    """Validate a config.json dict and return the engine's view of it."""
    archs = raw.get("architectures") or []
    if MULTIMODAL_GEMMA3 in archs:  # its language model; the reader drops the vision tower
        raw, archs = text_config(raw), ["Gemma3ForCausalLM"]
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise UnsupportedArchitectureError(
            f"architecture {archs or '(none)'} is not supported; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}",
            architecture=",".join(map(str, archs)),
        )
    hidden = _require(raw, "hidden_size", int)
    num_heads = _require(raw, "num_attention_heads", int)
    num_kv_heads = raw.get("num_key_value_heads") or num_heads
    if not isinstance(num_kv_heads, int) or num_kv_heads <= 0 or num_heads % num_kv_heads:
        raise CheckpointError(
            f"num_key_value_heads ({num_kv_heads}) must divide num_attention_heads ({num_heads})"
        )
    head_dim = raw.get("head_dim") or hidden // num_heads
    if not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 2:
        raise CheckpointError(f"head_dim must be a positive even integer, got {head_dim}")
    if head_dim > 256:
        raise CheckpointError(f"head_dim {head_dim} is above the supported maximum of 256")
    is_qwen2 = arch == "Qwen2ForCausalLM"
    is_gemma3 = arch == "Gemma3ForCausalLM"
    if not is_gemma3 and raw.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"hidden_act '{raw.get('hidden_act')}' is not supported (only silu)")
    if raw.get("use_sliding_window"):
        raise CheckpointError("sliding-window attention is not supported", field="use_sliding_window")
    max_positions = _require(raw, "max_position_embeddings", int)
    window = raw.get("sliding_window") if arch in ("MistralForCausalLM", PHI3) else None
    if window is not None:
        if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
            raise CheckpointError(f"sliding_window must be a positive integer or null, got "
                                  f"{window!r}", field="sliding_window")
    # A window that covers the whole context changes nothing: such a model runs unwindowed.
    mistral_windows = ((window,) * _require(raw, "num_hidden_layers", int)
                       if window and window < max_positions else ())
    # transformers >= 5 writes rope_theta and the scaling under one `rope_parameters` object.
    rope = raw.get("rope_parameters") if isinstance(raw.get("rope_parameters"), dict) else None
    rope_theta = (rope or {}).get("rope_theta", raw.get("rope_theta", 10000.0))
    rope_scaling = rope if rope is not None else raw.get("rope_scaling")
    num_layers = _require(raw, "num_hidden_layers", int)
    fields: dict[str, Any] = dict(
        architecture=arch,
        vocab_size=_require(raw, "vocab_size", int),
        hidden_size=hidden,
        intermediate_size=_require(raw, "intermediate_size", int),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_positions,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_theta),
        rope_scaling=rope_scaling,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=True if is_qwen2 else bool(raw.get("attention_bias", False)),
        o_bias=False if is_qwen2 else bool(raw.get("attention_bias", False)),
        mlp_bias=False if is_qwen2 else bool(raw.get("mlp_bias", False)),
        torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
        eos_token_ids=_eos_ids(raw.get("eos_token_id")),
        bos_token_id=raw.get("bos_token_id") if isinstance(raw.get("bos_token_id"), int) else None,
        qk_norm=arch == "Qwen3ForCausalLM",
        layer_windows=mistral_windows,
    )
    if is_gemma3:
        fields.update(gemma3_fields(raw, num_layers, hidden))
    if arch == PHI3:  # its rope kinds and partial rotary are its own (worker/families/phi3.py)
        fields.update(phi3_fields(raw, head_dim, max_positions))
    else:
        fields["rope_scaling"] = _validate_rope_scaling(fields["rope_scaling"])
    return ModelConfig(**fields)


def load_config(model_dir: str | Path) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise CheckpointError(f"no config.json in model folder '{model_dir}'") from exc
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"config.json in '{model_dir}' is unreadable: {exc}") from exc
    if not isinstance(raw, dict):
        raise CheckpointError("config.json must hold a JSON object")
    return parse_config(raw)
