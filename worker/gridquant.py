"""GGML's grid i-quants (IQ3_XXS, IQ3_S, IQ2_XXS, IQ2_XS, IQ2_S, IQ1_S, IQ1_M), and the table
layouts the CPU kernels read them in (tensors only).

In these types 4 or 8 neighbouring weights are one point of a fixed grid (GGML's iq3xxs_grid,
iq3s_grid, iq2xxs_grid, iq2xs_grid, iq2s_grid and iq1s_grid: 256 to 2,048 points), their signs
are stored apart (the IQ1 types' grid is signed and adds a delta of +-1/8 per 32 or 8 weights
instead), and each sub-block of 32 weights (IQ2_XS, IQ2_S, IQ1_M: of 16) has one 3- or 4-bit
scale ls. GGML computes a weight as

    IQ3_XXS  (d * (0.5 + ls) * 0.5) * g * sign     g in {4, 12, 20, ..., 52, 62}
    IQ3_S    (d * (1 + 2 ls)) * g * sign           g in {1, 3, 5, ..., 15}
    IQ2_*    (d * (0.5 + ls) * 0.25) * g * sign    g in {8, 25, 43}
    IQ1_*    (d * (2 ls + 1)) * (g + delta)        g in {-1, 0, 1}

with the first product exact (a float16 times a few bits) and the second rounded once. So every
weight is (d * (2 ls + 1)) * v, v one of at most 16 values of its type (g / 4 or g / 8 with its
sign, g + delta), the product rounded once. The layouts store each row's d, the odd scale
2 ls + 1 as an int8 and per weight an index into the type's table of values (`VALUES`, the
kernels' csrc/cpu/value_tables.h): IQ3_XXS and IQ3_S (16 values) as IQ4x8 stores IQ4_XS
(iquant.py), a nibble a weight; the IQ2 and IQ1 types (at most 8 values) as Q3Kx8 stores Q3_K
(lowbit.py), 3 bits a weight and a scale per 16 (IQ2_XXS's and IQ1_S's scale per 32 held for
both halves). The table kernels read them: the same weights bit for bit, at 4.3125 or 3.5625
bits a weight (the files' 1.56 to 3.44), where a float32 copy takes 32.

The grids are not copied here: `_unit_grid` reads each out of the `gguf` package's GGML
dequantizer, from blocks whose scale is the smallest and whose signs are all positive.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import gguf
import numpy as np
import torch

from shardlm_server.worker.iquant import dequantize_super_table, pack_super_table
from shardlm_server.worker.kquant import ROWS, SUB_BLOCKS
from shardlm_server.worker.lowbit import pack_q3kx8, q3kx8_fields

_ONE = (0x00, 0x3C)  # float16 1.0, little-endian
#: Rows converted at a time: the index arithmetic holds a few int64 values per weight.
_CHUNK_ROWS = 1024


def _signed(width: int, *magnitudes: float) -> tuple[float, ...]:
    """The magnitudes padded to `width`, then their negatives, repeated to 16 entries."""
    padded = magnitudes + (0.0,) * (width - len(magnitudes))
    return (padded + tuple(-v if v else 0.0 for v in padded)) * (8 // width)


#: The values each type's indices stand for: the positive ones first, each negative 8 on (IQ3)
#: or 4 on (IQ2); IQ1: g + 1/8 at g + 1, g - 1/8 at g + 4. The IQ2 and IQ1 tables use 8
#: entries, repeated to 16, so that 3-bit indices read as nibbles or with a stray fourth bit
#: find the same values (csrc/cpu/value_tables.h holds the same).
VALUES = {"IQ3_XXS": _signed(8, 1, 3, 5, 7, 9, 11, 13, 15.5),
          "IQ3_S": _signed(8, 1, 3, 5, 7, 9, 11, 13, 15),
          "IQ2": _signed(4, 1, 3.125, 5.375),
          "IQ1": ((-0.875, 0.125, 1.125, -1.125, -0.125, 0.875) + (0.0,) * 2) * 2}


@dataclass(frozen=True)
class GridType:
    """One grid i-quant: its layout's name, its block bytes, its grid (points, weights a point,
    and the type whose grid it shares, if any) and its table (a `VALUES` key)."""

    layout: str
    block_bytes: int
    points: int
    width: int
    values: str
    grid_of: str = ""

    @property
    def table(self) -> torch.Tensor:
        return torch.tensor(VALUES[self.values], dtype=torch.float32)

    @property
    def three_bit(self) -> bool:
        """Whether the layout has Q3Kx8's bytes (3-bit indices, a scale per 16 weights) rather
        than IQ4x8's (nibbles, a scale per 32): so where the table's 8 values repeat (IQ2, IQ1)."""
        values = VALUES[self.values]
        return values[:8] == values[8:]


TYPES = {
    "IQ3_XXS": GridType("IQ3XXSx8", 98, 256, 4, "IQ3_XXS"),
    "IQ3_S": GridType("IQ3Sx8", 110, 512, 4, "IQ3_S"),
    "IQ2_XXS": GridType("IQ2XXSx8", 66, 256, 8, "IQ2"),
    "IQ2_XS": GridType("IQ2XSx8", 74, 512, 8, "IQ2"),
    "IQ2_S": GridType("IQ2Sx8", 82, 1024, 8, "IQ2"),
    "IQ1_S": GridType("IQ1Sx8", 50, 2048, 8, "IQ1"),
    "IQ1_M": GridType("IQ1Mx8", 56, 2048, 8, "IQ1", grid_of="IQ1_S"),
}
#: The layouts by name, with the type each holds.
LAYOUTS = {t.layout: qtype for qtype, t in TYPES.items()}


def _unit_blocks(qtype: str, ids: np.ndarray) -> np.ndarray:
    """Blocks [len(ids) / per block, bytes] of `qtype` whose points are `ids` in order, with d = 1,
    the smallest scale and positive signs (IQ1_S: delta +1/8)."""
    kind = TYPES[qtype]
    ids = ids.reshape(-1, 256 // kind.width)
    n = len(ids)
    blocks = np.zeros((n, kind.block_bytes), dtype=np.uint8)
    blocks[:, 0:2] = _ONE
    if qtype == "IQ3_XXS":  # qs: the points; the scale and sign words after them stay 0
        blocks[:, 2:66] = ids
    elif qtype == "IQ3_S":  # qs: each point's low 8 bits, qh: its 9th, bit t % 8 of byte t / 8
        blocks[:, 2:66] = ids & 0xFF
        blocks[:, 66:74] = ((ids >> 8).reshape(n, 8, 8) << np.arange(8)).sum(axis=-1)
    elif qtype == "IQ2_XXS":  # per sub-block 4 points, then a scale and sign word of 0
        sub = np.zeros((n, 8, 8), dtype=np.uint8)
        sub[:, :, 0:4] = ids.reshape(n, 8, 4)
        blocks[:, 2:66] = sub.reshape(n, 64)
    elif qtype == "IQ2_XS":  # per point a uint16: the point in bits 0..8, signs above (0)
        blocks[:, 2:66] = ids.astype("<u2").view(np.uint8).reshape(n, 64)
    elif qtype == "IQ2_S":  # qs: the low 8 bits, then 32 sign bytes; qh: 2 bits a point
        blocks[:, 2:34] = ids & 0xFF
        blocks[:, 66:74] = ((ids >> 8).reshape(n, 8, 4) << (2 * np.arange(4))).sum(axis=-1)
    else:  # IQ1_S: qs the points' low 8 bits, each sub-block's qh their high 3 bits (3 l on)
        blocks[:, 2:34] = ids & 0xFF
        high = (ids >> 8).reshape(n, 8, 4) << (3 * np.arange(4))
        blocks[:, 34:50] = high.sum(axis=-1).astype("<u2").view(np.uint8).reshape(n, 16)
    return blocks


@functools.cache
def _unit_grid(qtype: str) -> torch.Tensor:
    """[points, width] int64: the index in the type's table of each point's value with a
    positive sign (IQ1: with delta +1/8), read out of gguf's dequantizer."""
    kind = TYPES[qtype]
    if kind.grid_of:
        return _unit_grid(kind.grid_of)
    blocks = _unit_blocks(qtype, np.arange(kind.points))
    units = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[qtype])
    units = torch.from_numpy(np.ascontiguousarray(units)).reshape(kind.points, kind.width)
    matches = units.unsqueeze(-1) == kind.table[:8]
    if not bool(matches.any(-1).all()):
        raise ValueError(f"{qtype}'s grid has values outside its table")
    return matches.to(torch.uint8).argmax(-1)


_PARITY = torch.tensor([bin(i).count("1") & 1 for i in range(128)], dtype=torch.int64)


def _ksigns(index: torch.Tensor) -> torch.Tensor:
    """7-bit sign indices [...] (GGML's ksigns_iq2xs: the 8th sign makes the count of negative
    ones even) as one bit per weight [..., 8]."""
    signs = index | (_PARITY[index] << 7)
    return (signs.unsqueeze(-1) >> torch.arange(8)) & 1


def _word_signs(words: torch.Tensor) -> torch.Tensor:
    """Sign words [..., c] (uint32 values in int64, four 7-bit ksigns indices from bit 0 on, one
    per 8 weights) as one bit per weight [..., c, 32]."""
    return _ksigns((words.unsqueeze(-1) >> (7 * torch.arange(4))) & 127).flatten(-2)


def _bits(raw: torch.Tensor) -> torch.Tensor:
    """Bytes [..., c] as bits [..., 8 c], bit j of byte i at 8 i + j."""
    return ((raw.long().unsqueeze(-1) >> torch.arange(8)) & 1).flatten(-2)


def _uint(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Little-endian unsigned integers of `dtype`'s width (int16, int32) as int64 [..., c]."""
    return raw.contiguous().view(dtype).long() & ((1 << (8 * dtype.itemsize)) - 1)


def _halves(raw: torch.Tensor) -> torch.Tensor:
    """Per sub-block bytes [..., 8] of two 4-bit scales (the first 16 weights' low) as [..., 16]."""
    return torch.stack((raw & 0x0F, raw >> 4), dim=-1).flatten(-2).long()


# Each parser takes blocks [n, nb, bytes] and gives d as float16 bytes [n, nb, 2], the scales ls
# [n, nb, 8 or 16] (int64) and each weight's index in the type's table [n, nb, 256] (int64).

def _iq3_xxs(b: torch.Tensor):
    n, nb = b.shape[:2]
    words = _uint(b[..., 66:98], torch.int32)  # per sub-block: ls in bits 28.., signs below
    index = _unit_grid("IQ3_XXS")[b[..., 2:66].long()].reshape(n, nb, 256)
    return b[..., 0:2], words >> 28, index + 8 * _word_signs(words).reshape(n, nb, 256)


def _iq3_s(b: torch.Tensor):
    n, nb = b.shape[:2]
    index = _unit_grid("IQ3_S")[b[..., 2:66].long() | (_bits(b[..., 66:74]) << 8)]
    scales = _halves(b[..., 106:110])  # one 4-bit scale per 32 weights
    return b[..., 0:2], scales, index.reshape(n, nb, 256) + 8 * _bits(b[..., 74:106])


def _iq2_xxs(b: torch.Tensor):
    n, nb = b.shape[:2]
    sub = b[..., 2:66].reshape(n, nb, SUB_BLOCKS, 8)  # 4 points, then a scale and sign word
    words = _uint(sub[..., 4:8], torch.int32).squeeze(-1)
    index = _unit_grid("IQ2_XXS")[sub[..., 0:4].long()].reshape(n, nb, SUB_BLOCKS, 32)
    return b[..., 0:2], words >> 28, (index + 4 * _word_signs(words)).reshape(n, nb, 256)


def _iq2_xs(b: torch.Tensor):
    n, nb = b.shape[:2]
    points = _uint(b[..., 2:66], torch.int16)  # the point in bits 0..8, its signs' index above
    index = _unit_grid("IQ2_XS")[points & 511] + 4 * _ksigns(points >> 9)
    return b[..., 0:2], _halves(b[..., 66:74]), index.reshape(n, nb, 256)


def _iq2_s(b: torch.Tensor):
    n, nb = b.shape[:2]
    high = (b[..., 66:74].long().unsqueeze(-1) >> (2 * torch.arange(4))) & 3  # [n, nb, 8, 4]
    index = _unit_grid("IQ2_S")[b[..., 2:34].long() | (high.reshape(n, nb, 32) << 8)]
    return b[..., 0:2], _halves(b[..., 74:82]), index.reshape(n, nb, 256) + 4 * _bits(b[..., 34:66])


def _iq1_s(b: torch.Tensor):
    n, nb = b.shape[:2]
    qh = _uint(b[..., 34:50], torch.int16)  # per sub-block: ls in bits 12..14, delta's sign 15
    high = (qh.unsqueeze(-1) >> (3 * torch.arange(4))) & 7
    index = _unit_grid("IQ1_S")[b[..., 2:34].long().reshape(n, nb, SUB_BLOCKS, 4) | (high << 8)]
    index = index + 3 * (qh >> 15).reshape(n, nb, SUB_BLOCKS, 1, 1)  # delta -1/8: 3 entries on
    return b[..., 0:2], (qh >> 12) & 7, index.reshape(n, nb, 256)


def _iq1_m(b: torch.Tensor):
    n, nb = b.shape[:2]
    scales = _uint(b[..., 48:56], torch.int16)  # [n, nb, 4]: 4 x 3-bit scales and d's 4 bits
    d = sum(((scales[..., i] >> 12) & 0xF) << (4 * i) for i in range(4))
    d = d.to(torch.int16).unsqueeze(-1).view(torch.uint8)  # d's float16 bytes
    places = 3 * torch.arange(4)  # sub-block ib's two scales: bits 6 (ib % 2) and 3 on
    ls = ((scales.unsqueeze(-1) >> places) & 7).reshape(n, nb, 16)
    qh = b[..., 32:48].long().reshape(n, nb, SUB_BLOCKS, 2, 1)  # per 2 points: 3 bits + delta
    nibble = ((qh >> (4 * torch.arange(2))) & 0xF).reshape(n, nb, SUB_BLOCKS, 4)
    points = b[..., 0:32].long().reshape(n, nb, SUB_BLOCKS, 4) | ((nibble & 7) << 8)
    index = _unit_grid("IQ1_M")[points] + 3 * (nibble >> 3).unsqueeze(-1)
    return d, ls, index.reshape(n, nb, 256)


_PARSERS: dict[str, Callable] = {"IQ3_XXS": _iq3_xxs, "IQ3_S": _iq3_s, "IQ2_XXS": _iq2_xxs,
                                 "IQ2_XS": _iq2_xs, "IQ2_S": _iq2_s, "IQ1_S": _iq1_s,
                                 "IQ1_M": _iq1_m}


def grid_parts(blocks: torch.Tensor, qtype: str) -> tuple[torch.Tensor, ...]:
    """The fields of `qtype` blocks [n, K / 256 * bytes] as its table layout holds them: d as
    float16 bytes [n, nb, 2], the odd scales 2 ls + 1 [n, nb, 8 or 16] (int8) and each weight's
    index in the type's table [n, nb, 256] (uint8, weight order)."""
    n = blocks.shape[0]
    d, ls, index = _PARSERS[qtype](blocks.reshape(n, -1, TYPES[qtype].block_bytes))
    return d, (2 * ls + 1).to(torch.int8), index.to(torch.uint8)


def _pack(blocks: torch.Tensor, qtype: str) -> torch.Tensor:
    d, scales, index = grid_parts(blocks, qtype)
    if TYPES[qtype].three_bit:
        if scales.shape[-1] == SUB_BLOCKS:  # a scale per 32 weights, held for each half
            scales = scales.repeat_interleave(2, dim=-1)
        return pack_q3kx8(d, scales, index)
    n, nb = d.shape[:2]
    return pack_super_table(d, scales, index.reshape(n, nb, SUB_BLOCKS, 32))


def to_grid_layout(blocks: torch.Tensor, qtype: str) -> torch.Tensor:
    """`qtype` blocks [n, K / 256 * bytes] (n a multiple of 8) in its table layout
    [n / 8, K / 256 * (1104 or 912)], a chunk of rows at a time."""
    chunks = [_pack(blocks[i:i + _CHUNK_ROWS], qtype)
              for i in range(0, blocks.shape[0], _CHUNK_ROWS)]
    return (torch.cat(chunks) if len(chunks) > 1 else chunks[0]).contiguous()


def dequantize_grid(blocks: torch.Tensor, qtype: str) -> torch.Tensor:
    """float32 [n, K] of `qtype` blocks, through the `gguf` package's GGML dequantizer."""
    values = gguf.quants.dequantize(blocks.numpy(), gguf.GGMLQuantizationType[qtype])
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))


def dequantize_grid_layout(blocks: torch.Tensor, layout: str) -> torch.Tensor:
    """float32 [N, K] of a table layout's blocks, as GGML computes its type's:
    (d * sc) * value."""
    kind = TYPES[LAYOUTS[layout]]
    if not kind.three_bit:
        return dequantize_super_table(blocks, kind.table)
    scale, index = q3kx8_fields(blocks)
    return (scale * kind.table[index.long()]).reshape(blocks.shape[0] * ROWS, -1)


def converter(qtype: str) -> Callable[[torch.Tensor], torch.Tensor]:
    return functools.partial(to_grid_layout, qtype=qtype)
