"""How the CPU quantized linears treat their input: exact (float32, the default); or, the opt-in
fast mode, rounded to int8 per block of 32 elements the way GGML's Q8_0 rounds it, so the kernels
take integer dot products (``csrc/cpu/int8_linear.h``), for the 8-row grouped layouts
(``INT8_LAYOUTS``: every 1- to 6-bit weight kept packed); or,
near-exact, int16: in the panel path (``PANEL_LAYOUTS``, products of ``INT16_MIN_ROWS`` rows or
more over K a multiple of ``INT16_BLOCK``: prefills and large batches) each ``INT16_BLOCK``-element
block of the input is rounded to 14-bit integers and each row of the dequantized weight to 13-bit
ones, whose pair products VNNI sums at twice the float32 FMA rate (``csrc/cpu/panel_int16.h``).
Other weights and shorter products stay exact.

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

__all__ = ["ACTIVATION_PRECISIONS", "INT16_BLOCK", "INT16_LEVELS", "INT16_WEIGHT_LEVELS",
           "INT8_LAYOUTS", "PANEL_LAYOUTS", "INT16_MIN_ROWS", "activation_precision",
           "round_blocks", "round_to_int16", "round_to_int8", "rounds_input", "rounds_panel",
           "set_activation_precision", "using"]
#: The weight layouts the int8 fast mode covers: every 8-row grouped one (csrc: quant::grouped;
#: csrc/cpu/int8_linear.h: takes).
INT8_LAYOUTS = ("Q4x8", *GROUPED_LAYOUTS)
#: The layouts the panel path takes (csrc/cpu/panel_linear.h: takes), Q8_0 only in whole groups
#: of 8 output rows; the int16 precision rounds there from INT16_MIN_ROWS input rows
#: (csrc/cpu/panel_int16.h: kMinRows).
PANEL_LAYOUTS = ("Q4x8", *GROUPED_LAYOUTS, "Q8_0")
INT16_MIN_ROWS = 32
#: The int16 precision's integer ranges (csrc/cpu/panel_int16.h: kInputLevels, kWeightLevels):
#: +-INT16_LEVELS for the input, per block of INT16_BLOCK elements (kBlock); +-INT16_WEIGHT_LEVELS
#: for the weight, per row. 64 products of both sum within int32.
INT16_LEVELS = 8191
INT16_WEIGHT_LEVELS = 4095
INT16_BLOCK = 64

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


def rounds_panel(qtype: str, m: int, n: int, k: int) -> bool:
    """Whether quant_linear of m input rows against an [n, k] weight of `qtype` rounds both its
    input and the weight to integers now (the int16 precision's panel path)."""
    return (_current == "int16" and m >= INT16_MIN_ROWS and qtype in PANEL_LAYOUTS
            and (qtype != "Q8_0" or n % 8 == 0) and k % INT16_BLOCK == 0)


def round_blocks(x: torch.Tensor, levels: int, block: int = BLOCK) -> torch.Tensor:
    """x [..., K] (K a multiple of `block`) rounded per block in float32: step = max|x| / levels
    and x = step * round(x * (levels / max|x|)), to nearest even (0 for a zero block)."""
    blocks = x.float().reshape(*x.shape[:-1], x.shape[-1] // block, block)
    amax = blocks.abs().amax(-1, keepdim=True)
    # Divisions of tensors, each rounded once as the kernels' are (a number divided by a tensor
    # would be its reciprocal times the number: two roundings).
    level = torch.full_like(amax, float(levels))
    inverse = torch.where(amax > 0, level / amax, torch.zeros_like(amax))
    return (torch.round(blocks * inverse) * (amax / level)).reshape(x.shape)


def round_to_int16(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] and w [N, K] as the int16 precision's panel path sees them: x per block of
    INT16_BLOCK to +-INT16_LEVELS, each row of w over its whole K to +-INT16_WEIGHT_LEVELS."""
    return (round_blocks(x, INT16_LEVELS, INT16_BLOCK),
            round_blocks(w, INT16_WEIGHT_LEVELS, w.shape[-1]))


def round_to_int8(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] as the int8 fast mode sees it: round_blocks to +-127, as GGML's Q8_0."""
    return round_blocks(x, 127)
