"""Model configuration read from a Hugging Face `config.json`.

Only the fields the engine needs are kept, validated once here so the rest of the code can trust
them. The supported families (Llama, Qwen2, Qwen3, Mistral) share one decoder shape; the
differences are flags (Qwen3's: an RMS norm over each query and key head before the rotary
embedding, and biases only where `attention_bias` says).

Mistral is Llama's shape with an optional sliding window: a query attends to the `sliding_window`
latest keys only. Until the attention kernels window, such a checkpoint is served with its context
capped at the window, where windowed and full causal attention are the same computation (a query
at position p < W sees every key 0..p either way), so its tokens are exact; one without a window,
or whose window covers its whole context, is served at its full context.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardlm_server.worker.errors import CheckpointError, UnsupportedArchitectureError

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM")


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


def _validate_rope_scaling(rope_scaling: Any) -> dict[str, Any] | None:
    if rope_scaling is None:
        return None
    if not isinstance(rope_scaling, dict):
        raise CheckpointError("config.json rope_scaling must be an object")
    kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
    if kind in (None, "default"):
        return None
    if kind != "llama3":
        raise CheckpointError(
            f"rope_scaling type '{kind}' is not supported (supported: default, llama3)",
            field="rope_scaling",
        )
    for key in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
        if not isinstance(rope_scaling.get(key), (int, float)):
            raise CheckpointError(f"llama3 rope_scaling lacks numeric '{key}'", field="rope_scaling")
    return dict(rope_scaling, rope_type="llama3")


def parse_config(raw: dict[str, Any]) -> ModelConfig:
    """Validate a config.json dict and return the engine's view of it."""
    archs = raw.get("architectures") or []
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
    if raw.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"hidden_act '{raw.get('hidden_act')}' is not supported (only silu)")
    if raw.get("use_sliding_window"):
        raise CheckpointError("sliding-window attention is not supported", field="use_sliding_window")
    max_positions = _require(raw, "max_position_embeddings", int)
    window = raw.get("sliding_window") if arch == "MistralForCausalLM" else None
    if window is not None:
        if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
            raise CheckpointError(f"sliding_window must be a positive integer or null, got "
                                  f"{window!r}", field="sliding_window")
        max_positions = min(max_positions, window)  # see the module docstring
    # transformers >= 5 writes rope_theta and the scaling under one `rope_parameters` object.
    rope = raw.get("rope_parameters") if isinstance(raw.get("rope_parameters"), dict) else None
    rope_theta = (rope or {}).get("rope_theta", raw.get("rope_theta", 10000.0))
    rope_scaling = rope if rope is not None else raw.get("rope_scaling")
    return ModelConfig(
        architecture=arch,
        vocab_size=_require(raw, "vocab_size", int),
        hidden_size=hidden,
        intermediate_size=_require(raw, "intermediate_size", int),
        num_layers=_require(raw, "num_hidden_layers", int),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_positions,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_theta),
        rope_scaling=_validate_rope_scaling(rope_scaling),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=True if is_qwen2 else bool(raw.get("attention_bias", False)),
        o_bias=False if is_qwen2 else bool(raw.get("attention_bias", False)),
        mlp_bias=False if is_qwen2 else bool(raw.get("mlp_bias", False)),
        torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
        eos_token_ids=_eos_ids(raw.get("eos_token_id")),
        bos_token_id=raw.get("bos_token_id") if isinstance(raw.get("bos_token_id"), int) else None,
        qk_norm=arch == "Qwen3ForCausalLM",
    )


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
