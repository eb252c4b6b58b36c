"""Rope configuration that llama.cpp's converter stores as tensors rather than metadata, read as
lists of floats.

- `rope_freqs.weight` (llama): one divisor per rotated frequency, the converter's rendering of a
  checkpoint's "llama3" rope scaling (Llama 3.1, 3.2, 3.3); the file then states no
  rope.scaling.type. llama.cpp turns dims 2i and 2i + 1 by position * base^(-2i / d) / factor[i].
- `rope_factors_long.weight` / `rope_factors_short.weight` (phi3): LongRoPE's two lists
  (worker/gguf/phi3.py).

The reader counts these tensors as used (they are configuration, not weights).
"""

from __future__ import annotations

import math

import numpy as np

from shardlm_server.worker.errors import CheckpointError
from shardlm_server.worker.gguf.file import GGUFFile, T

FREQ_FACTORS = "rope_freqs.weight"
PHI3_FACTORS = {"long_factor": "rope_factors_long.weight",
                "short_factor": "rope_factors_short.weight"}
# The architectures whose llama.cpp graph applies rope_freqs.weight (of those ShardLM serves).
FREQ_FACTOR_ARCHITECTURES = ("llama",)


def config_tensors(file: GGUFFile) -> list[str]:
    """Tensors of `file` that hold configuration, not weights."""
    arch = file.get("general.architecture")
    names = (list(PHI3_FACTORS.values()) if arch == "phi3"
             else [FREQ_FACTORS] if arch in FREQ_FACTOR_ARCHITECTURES else [])
    return [n for n in names if n in file.tensors]


def factor_list(file: GGUFFile, name: str, count: int | None = None) -> list[float]:
    """The float vector `name` as a list; with `count`, it must hold that many positive finite
    numbers (one per rotated frequency)."""
    tensor = file.tensors[name]
    if tensor.qtype not in (T.F32, T.F16) or len(tensor.shape) != 1:
        raise CheckpointError(f"rope factors '{name}' must be a float vector, got "
                              f"{tensor.qtype.name} {list(tensor.shape)}", tensor=name)
    values = np.asarray(tensor.data, dtype=np.float64).tolist()
    if count is not None and (len(values) != count
                              or not all(math.isfinite(v) and v > 0 for v in values)):
        raise CheckpointError(f"rope factors '{name}' must be {count} positive numbers, one per "
                              f"rotated frequency; got {len(values)} values", tensor=name)
    return values
