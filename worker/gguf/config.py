"""A GGUF file's model configuration: its `<arch>.*` metadata (llama, qwen2, qwen3, gemma3, phi3)
rewritten as the config.json fields `worker.config.parse_config` validates, so both formats share
one set of checks.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from shardlm_server.worker.config import ModelConfig, parse_config
from shardlm_server.worker.errors import CheckpointError, UnsupportedArchitectureError
from shardlm_server.worker.gguf.file import GGUFFile, T
from shardlm_server.worker.gguf.phi3 import phi3_fields
from shardlm_server.worker.gguf.rope_tensors import (
    FREQ_FACTOR_ARCHITECTURES,
    FREQ_FACTORS,
    factor_list,
)

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "gemma3": "Gemma3ForCausalLM",
                 "phi3": "Phi3ForCausalLM"}


def _key(file: GGUFFile, key: str, kind: type, default: Any = None) -> Any:
    value = file.get(key, default)
    if value is None:
        raise CheckpointError(f"GGUF metadata lacks required key '{key}'", field=key)
    if kind is float and isinstance(value, int):
        value = float(value)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise CheckpointError(f"GGUF metadata '{key}' must be {kind.__name__}, got {value!r}",
                              field=key)
    return value


def _served_dtype(file: GGUFFile) -> str:
    """The dtype a GPU serves by default: the file's own float type where every matrix has it,
    bfloat16 for block-quantized files (their scales are float16, their range is not)."""
    kinds = {t.qtype for t in file.tensors.values() if len(t.shape) == 2}
    if kinds == {T.F32}:
        return "float32"
    if kinds == {T.F16}:
        return "float16"
    return "bfloat16"


def _rope_scaling(file: GGUFFile, arch: str) -> dict[str, Any] | None:
    """The file's rope.scaling.* keys as config.json's rope_scaling (linear or none)."""
    kind = file.get(f"{arch}.rope.scaling.type", "none")
    if kind == "linear":
        return {"rope_type": "linear",
                "factor": _key(file, f"{arch}.rope.scaling.factor", float)}
    if kind not in ("none", None):
        raise CheckpointError(f"GGUF rope scaling '{kind}' is not supported (supported: none, "
                              "linear)", field=f"{arch}.rope.scaling.type")
    return None


def _freq_factors(file: GGUFFile, arch: str, rotary: int,
                  scaling: dict[str, Any] | None) -> dict[str, Any] | None:
    """The rope a `rope_freqs.weight` tensor states (worker/gguf/rope_tensors.py), as the engine's
    "freq_factors" kind (worker/rope.py), folded with a linear scaling where the file has both
    (llama.cpp applies both: every frequency divided by the factor too); None without one."""
    if FREQ_FACTORS not in file.tensors:
        return None
    if arch not in FREQ_FACTOR_ARCHITECTURES:
        raise CheckpointError(f"per-frequency rope factors ({FREQ_FACTORS}) are not read for "
                              f"architecture '{arch}' (only {', '.join(FREQ_FACTOR_ARCHITECTURES)})",
                              tensor=FREQ_FACTORS)
    factors = factor_list(file, FREQ_FACTORS, rotary // 2)
    linear = scaling["factor"] if scaling else 1.0
    return {"rope_type": "freq_factors", "factors": [f * linear for f in factors]}


def _gemma3(file: GGUFFile, raw: dict[str, Any]) -> None:
    """Gemma 3's fields, where llama.cpp keeps them: its window pattern, local rope base and score
    scale are fixed in llama.cpp's code for this architecture unless the file states them."""
    pattern = file.get("gemma3.attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):  # one flag per layer: true where the layer is windowed
        raw["layer_types"] = ["sliding_attention" if p else "full_attention" for p in pattern]
    else:
        raw["sliding_window_pattern"] = pattern
    raw["sliding_window"] = _key(file, "gemma3.attention.sliding_window", int)
    raw["rope_local_base_freq"] = _key(file, "gemma3.rope.freq_base_swa", float, 10000.0)
    # llama.cpp: 1/sqrt(hidden / heads) for the 27B model (62 blocks), 1/sqrt(head_dim) otherwise,
    # as the checkpoints' query_pre_attn_scalar says.
    scalar = raw["hidden_size"] // raw["num_attention_heads"] if raw["num_hidden_layers"] == 62 \
        else raw["head_dim"]
    raw["query_pre_attn_scalar"] = scalar
    raw["final_logit_softcapping"] = file.get("gemma3.final_logit_softcapping")


def gguf_config(file: GGUFFile) -> ModelConfig:
    """The engine's view of the model in `file`."""
    arch = file.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"GGUF architecture '{arch}' is not supported; supported: {', '.join(ARCHITECTURES)}",
            architecture=str(arch))
    heads = _key(file, f"{arch}.attention.head_count", int)
    hidden = _key(file, f"{arch}.embedding_length", int)
    head_dim = _key(file, f"{arch}.attention.key_length", int, hidden // max(heads, 1))
    value_dim = _key(file, f"{arch}.attention.value_length", int, head_dim)
    if value_dim != head_dim:
        raise CheckpointError(f"key length {head_dim} and value length {value_dim} differ; "
                              "ShardLM needs them equal")
    rotary = _key(file, f"{arch}.rope.dimension_count", int, head_dim)
    if rotary != head_dim and arch != "phi3":  # phi3 turns a part (worker/gguf/phi3.py)
        raise CheckpointError(f"partial rotary embedding ({rotary} of {head_dim} dimensions) "
                              "is not supported")
    rope_scaling = _rope_scaling(file, arch)
    tokens = file.get("tokenizer.ggml.tokens")
    embed = file.tensors.get("token_embd.weight")
    vocab = file.get(f"{arch}.vocab_size") or (len(tokens) if tokens else None) or (
        embed.shape[0] if embed is not None else None)
    if not isinstance(vocab, int):
        raise CheckpointError("GGUF file states no vocabulary size (no vocab_size, tokens or "
                              "token_embd.weight)")
    eos = [file.get(k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")]
    raw = {
        "architectures": [ARCHITECTURES[arch]],
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": _key(file, f"{arch}.feed_forward_length", int),
        "num_hidden_layers": _key(file, f"{arch}.block_count", int),
        "num_attention_heads": heads,
        "num_key_value_heads": _key(file, f"{arch}.attention.head_count_kv", int, heads),
        "head_dim": head_dim,
        "max_position_embeddings": _key(file, f"{arch}.context_length", int),
        "rms_norm_eps": _key(file, f"{arch}.attention.layer_norm_rms_epsilon", float),
        "rope_theta": _key(file, f"{arch}.rope.freq_base", float, 10000.0),
        "tie_word_embeddings": "output.weight" not in file.tensors,
        "attention_bias": "blk.0.attn_q.bias" in file.tensors,
        "torch_dtype": _served_dtype(file),
        "eos_token_id": list(dict.fromkeys(e for e in eos if isinstance(e, int))),
        "bos_token_id": file.get("tokenizer.ggml.bos_token_id"),
        "rope_scaling": rope_scaling,
    }
    if arch == "gemma3":
        _gemma3(file, raw)
    if arch == "phi3":
        raw.update(phi3_fields(file, rotary))
    cfg = parse_config(raw)
    # A kind of llama.cpp's files, not of config.json: set past parse_config's checks.
    if (factors := _freq_factors(file, arch, rotary, rope_scaling)) is not None:
        cfg = replace(cfg, rope_scaling=factors)
    # llama.cpp's converter stores Gemma's norm weights with the 1 of (1 + w) already added.
    return replace(cfg, norm_weight_offset=0.0) if cfg.norm_weight_offset else cfg
