"""How the CPU quantized linears treat their input: exact (float32, the default) or, the opt-in
fast mode, rounded to int8 per block of 32 elements the way GGML's Q8_0 rounds it, so the kernels
take integer dot products (``csrc/cpu/int8_linear.h``). The fast mode covers the 8-row grouped
layouts (``INT8_LAYOUTS``: every 4-, 5- and 6-bit weight kept packed); other weights stay exact.

A process-wide setting, like the SIMD cap: the worker sets it on Load from its EngineOptions, and
both the compiled ops and the reference (:mod:`worker.ops.reference`) read it here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from shardlm.constants import ACTIVATION_PRECISIONS

from shardlm_server.worker.quant import BLOCK, GROUPED_LAYOUTS

from .native import library as _C

__all__ = ["ACTIVATION_PRECISIONS", "INT8_LAYOUTS", "activation_precision", "round_to_int8",
           "rounds_input", "set_activation_precision", "using"]
#: The weight layouts the int8 fast mode covers: every 8-row grouped one (csrc: quant::grouped).
INT8_LAYOUTS = ("Q4x8", *GROUPED_LAYOUTS)

_current = "exact"


def set_activation_precision(precision: str) -> None:
    """Set the process's activation precision (one of ACTIVATION_PRECISIONS, in the compiled ops'
    numbering by position)."""
    global _current
    if precision not in ACTIVATION_PRECISIONS:
        raise ValueError(f"activation precision must be one of {', '.join(ACTIVATION_PRECISIONS)},"
                         f" not {precision!r}")
    if _C is not None:
        _C.set_activation_precision(ACTIVATION_PRECISIONS.index(precision))
    _current = precision


def activation_precision() -> str:
    return _current


@contextlib.contextmanager
def using(precision: str) -> Iterator[None]:
    """The process's activation precision set to `precision` inside the block, restored after."""
    previous = _current
    set_activation_precision(precision)
    try:
        yield
    finally:
        set_activation_precision(previous)


def rounds_input(qtype: str) -> bool:
    """Whether quant_linear rounds its input to int8 for weights of `qtype` now."""
    return _current == "int8" and qtype in INT8_LAYOUTS


def round_to_int8(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] (K a multiple of 32) as the fast mode sees it, in float32: per block of 32,
    dx = max|x| / 127 and x = dx * round(x * (127 / max|x|)), to nearest even (0 for a zero
    block)."""
    blocks = x.float().reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)
    amax = blocks.abs().amax(-1, keepdim=True)
    # Divisions of tensors, each rounded once as the kernels' are (a number divided by a tensor
    # would be its reciprocal times the number: two roundings).
    levels = torch.full_like(amax, 127.0)
    inverse = torch.where(amax > 0, levels / amax, torch.zeros_like(amax))
    return (torch.round(blocks * inverse) * (amax / levels)).reshape(x.shape)
