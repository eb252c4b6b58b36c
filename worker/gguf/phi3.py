"""A phi3 GGUF file's own metadata, rewritten as the config.json fields of a Phi-3 model
(worker/families/phi3.py validates them as it does a config.json's).

llama.cpp's converter writes, besides the shared keys: `phi3.rope.dimension_count` (the rotated
dims, int(partial_rotary_factor * hidden) / heads), `phi3.rope.scaling.original_context_length`,
`phi3.attention.sliding_window` (0 for none: Phi-4), and for a LongRoPE model the two factor lists
as tensors `rope_factors_long.weight` / `rope_factors_short.weight` with the scale on cos and sin
as `phi3.rope.scaling.attn_factor` (it writes no rope.scaling.type for them).
"""

from __future__ import annotations

from typing import Any

from shardlm_server.worker.errors import CheckpointError
from shardlm_server.worker.gguf.file import GGUFFile
from shardlm_server.worker.gguf.rope_tensors import PHI3_FACTORS, factor_list


def phi3_fields(file: GGUFFile, rotary_dim: int) -> dict[str, Any]:
    """The config.json fields a phi3 file implies beyond the shared ones."""
    fields: dict[str, Any] = {"rotary_dim": rotary_dim,
                              "sliding_window": file.get("phi3.attention.sliding_window") or None}
    original = file.get("phi3.rope.scaling.original_context_length")
    if original is not None:
        fields["original_max_position_embeddings"] = original
    present = [n for n in PHI3_FACTORS.values() if n in file.tensors]
    if not present:
        return fields
    if len(present) != len(PHI3_FACTORS):
        raise CheckpointError("a LongRoPE file needs both rope_factors_long.weight and "
                              "rope_factors_short.weight", tensor=present[0])
    scaling: dict[str, Any] = {"rope_type": "longrope"}
    for key, name in PHI3_FACTORS.items():
        scaling[key] = factor_list(file, name)  # checked by families/phi3.py
    attn_factor = file.get("phi3.rope.scaling.attn_factor")
    if attn_factor is not None:
        scaling["attention_factor"] = attn_factor
    fields["rope_scaling"] = scaling
    return fields
