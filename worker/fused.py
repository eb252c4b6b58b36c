"""Checkpoint tensors that hold several of ShardLM's tensors row over row, and where each lies.

Phi-3 stores a layer's query, key and value projections as one `self_attn.qkv_proj` ([q; k; v]
rows) and its gate and up projections as one `mlp.gate_up_proj` ([gate; up] rows); llama.cpp
keeps them fused too (`attn_qkv`, and `ffn_up` holding both for phi3). The model's layers ask for
`q_proj`, `k_proj`, ... as for every other family; both readers (worker/safetensors_reader.py,
worker/gguf/reader.py) answer such a name with its row range of the stored tensor, cut before
anything else. So a tensor-parallel rank's slice of `k_proj` is its slice of the key rows, not a
slice of the fused rows, and ColumnParallelLinear, read_linear and the packed GGUF blocks (whose
rows are independent) need nothing of their own.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from shardlm_server.worker.config import ModelConfig

#: A fused tensor (its name inside a layer) -> the tensors it holds, in row order.
FUSED_PARTS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}
_FUSED_NAME = re.compile(r"(model\.layers\.\d+)\.(self_attn\.qkv_proj|mlp\.gate_up_proj)\."
                         r"(weight|bias)")


def part_rows(cfg: ModelConfig, fused: str) -> tuple[int, ...]:
    """The rows of each tensor `fused` holds, in order."""
    if fused == "self_attn.qkv_proj":
        return cfg.q_size, cfg.kv_size, cfg.kv_size
    return cfg.intermediate_size, cfg.intermediate_size


@dataclass(frozen=True)
class RowRange:
    """Rows [start, stop) of the stored tensor `stored`, which has `rows` rows in all."""

    stored: str
    start: int
    stop: int
    rows: int


class FusedRows:
    """The row ranges of a checkpoint's fused tensors, by the names of the tensors they hold.
    `config` is called only when the checkpoint has a fused tensor (the sizes come from it)."""

    def __init__(self, stored_names: Iterable[str], config: Callable[[], ModelConfig]) -> None:
        self._parts: dict[str, RowRange] = {}
        self._members: dict[str, tuple[str, ...]] = {}
        cfg: ModelConfig | None = None
        for name in stored_names:
            match = _FUSED_NAME.fullmatch(name)
            if match is None:
                continue
            cfg = cfg or config()
            prefix, fused, kind = match.groups()
            sizes = part_rows(cfg, fused)
            start, members = 0, []
            for part, size in zip(FUSED_PARTS[fused], sizes, strict=True):
                member = f"{prefix}.{part}.{kind}"
                self._parts[member] = RowRange(name, start, start + size, sum(sizes))
                members.append(member)
                start += size
            self._members[name] = tuple(members)

    def get(self, name: str) -> RowRange | None:
        """Where `name` lies inside a fused tensor; None when it is no part of one."""
        return self._parts.get(name)

    def used(self, stored: str, consumed: set[str]) -> bool:
        """Whether the fused tensor `stored` was read whole: every tensor it holds was."""
        members = self._members.get(stored)
        return members is not None and all(m in consumed for m in members)
