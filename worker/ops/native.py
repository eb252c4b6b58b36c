"""Loads ShardLM's compiled ops library (``shardlm_server.worker._C``) and says which
implementation the op wrappers call: the compiled ops (``torch.ops.shardlm``), or the plain-PyTorch
reference when ``SHARDLM_OPS=reference`` (then a missing library is tolerated).

Both the wrappers (the package) and the fused decoder blocks (``ops.blocks``) read this one
module, so neither imports the other to learn the switch.
"""

from __future__ import annotations

import os

import torch

INSTALL_COMMAND = "pip install --no-build-isolation -e ."
USE_REFERENCE = os.environ.get("SHARDLM_OPS", "").strip().lower() == "reference"

try:
    from .. import _C
except ImportError as exc:
    if not USE_REFERENCE:
        raise ImportError(
            f"ShardLM's compiled ops (shardlm_server.worker._C) could not be loaded: {exc}. Build them from "
            f"the repository root with `{INSTALL_COMMAND}` (using the same Python environment "
            "and torch), or set SHARDLM_OPS=reference to use the slow PyTorch reference ops."
        ) from exc
    _C = None

#: The compiled extension module, or None when the reference ops stand in for a missing build.
library = _C

#: True when shardlm_server.worker._C was built with CUDA kernels (False for CPU-only builds).
CUDA_BUILT = bool(_C is not None and _C.cuda_built)

_OP_NAMES = (
    "rms_norm",
    "fused_add_rms_norm",
    "rotary_embedding",
    "silu_and_mul",
    "gelu_tanh_and_mul",
    "skinny_linear",
    "quant_linear",
    "quant_rows",
    "reshape_and_cache",
    "paged_attention_decode",
    "paged_attention_prefill",
    "attention_block",
    "mlp_block",
    "sample_rows",
    "penalize_rows",
)


def _fake_mutating_op(*args, **kwargs) -> None:
    # Every op writes into caller-provided tensors and returns nothing, so the
    # fake (meta) implementation has no output to describe.
    return None


if _C is not None:
    for _name in _OP_NAMES:
        torch.library.register_fake(f"shardlm::{_name}")(_fake_mutating_op)

#: The registered ops (``torch.ops.shardlm``), or None without the compiled library.
torch_ops = torch.ops.shardlm if _C is not None else None
