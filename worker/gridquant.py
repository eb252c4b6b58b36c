"""GGML's grid i-quants (IQ3_XXS, IQ3_S, IQ2_XXS, IQ1_S), and IQ3XXSx8, IQ3Sx8, IQ2XXSx8 and
IQ1Sx8, the table layouts the CPU kernels read them in (tensors only).

In these types 4 or 8 neighbouring weights are one point of a fixed grid (GGML's iq3xxs_grid,
iq3s_grid, iq2xxs_grid and iq1s_grid: 256 to 2,048 points), their signs are stored apart (IQ1_S's
grid is signed and adds a delta of +-1/8 per 32 weights instead), and each sub-block of 32 weights
has one 3- or 4-bit scale. GGML computes a weight as

    IQ3_XXS  (d * (0.5 + ls) * 0.5) * g * sign     g in {4, 12, 20, ..., 52, 62}
    IQ3_S    (d * (1 + 2 ls)) * g * sign           g in {1, 3, 5, ..., 15}
    IQ2_XXS  (d * (0.5 + ls) * 0.25) * g * sign    g in {8, 25, 43}
    IQ1_S    (d * (2 ls + 1)) * (g + delta)        g in {-1, 0, 1}

with the first product exact (a float16 times a few bits) and the second rounded once. So every
weight is (d * (2 ls + 1)) * v, v one of at most 16 values of its type (g / 4 or g / 8 with its
sign, g + delta), the product rounded once. The layouts here store that as IQ4x8 stores IQ4_XS
(iquant.py): each row's d, the odd scale 2 ls + 1 as an int8 per sub-block, and per weight a
nibble indexing the type's table of values (`VALUES`, the same as the kernels' in
csrc/cpu/nibble_layouts.h), which the table kernels read. The same weights bit for bit, at
4.3125 bits a weight for the files' 3.0625, 3.4375, 2.0625 and 1.5625, where a float32 copy
takes 32.

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
from shardlm_server.worker.kquant import SUB_BLOCKS

_ONE = (0x00, 0x3C)  # float16 1.0, little-endian
#: Rows converted at a time: the index arithmetic holds a few int64 values per weight.
_CHUNK_ROWS = 1024


@dataclass(frozen=True)
class GridType:
    """One grid i-quant: its layout's name, its block bytes, its grid's points and weights per
    point, and the values its layout's nibbles stand for (the positive ones at 0..7, each
    negative 8 on; IQ1_S: g + 1/8 at g + 1, g - 1/8 at g + 4)."""

    layout: str
    block_bytes: int
    points: int
    width: int
    values: tuple[float, ...]

    @property
    def table(self) -> torch.Tensor:
        return torch.tensor(self.values, dtype=torch.float32)


def _signed(*magnitudes: float) -> tuple[float, ...]:
    padded = magnitudes + (0.0,) * (8 - len(magnitudes))
    return padded + tuple(-v if v else 0.0 for v in padded)


TYPES = {
    "IQ3_XXS": GridType("IQ3XXSx8", 98, 256, 4, _signed(1, 3, 5, 7, 9, 11, 13, 15.5)),
    "IQ3_S": GridType("IQ3Sx8", 110, 512, 4, _signed(1, 3, 5, 7, 9, 11, 13, 15)),
    "IQ2_XXS": GridType("IQ2XXSx8", 66, 256, 8, _signed(1, 3.125, 5.375)),
    "IQ1_S": GridType("IQ1Sx8", 50, 2048, 8,
                      (-0.875, 0.125, 1.125, -1.125, -0.125, 0.875) + (0.0,) * 10),
}
#: The layouts' tables by layout name.
LAYOUT_TABLES = {t.layout: t.table for t in TYPES.values()}


def _unit_blocks(qtype: str, ids: np.ndarray) -> np.ndarray:
    """Blocks [len(ids) / per block, bytes] of `qtype` whose points are `ids` in order, with d = 1,
    the smallest scale and positive signs (IQ1_S: delta +1/8)."""
    kind = TYPES[qtype]
    per_block = 256 // kind.width
    ids = ids.reshape(-1, per_block)
    blocks = np.zeros((len(ids), kind.block_bytes), dtype=np.uint8)
    blocks[:, 0:2] = _ONE
    if qtype == "IQ3_XXS":  # qs: the points; the scales and sign words after them stay 0
        blocks[:, 2:66] = ids
    elif qtype == "IQ3_S":  # qs: each point's low 8 bits, qh: its 9th, bit t % 8 of byte t / 8
        blocks[:, 2:66] = ids & 0xFF
        high = (ids >> 8).reshape(len(ids), 8, 8) << np.arange(8)
        blocks[:, 66:74] = high.sum(axis=-1)
    elif qtype == "IQ2_XXS":  # per sub-block 4 points, then a scale and sign word of 0
        sub = np.zeros((len(ids), 8, 8), dtype=np.uint8)
        sub[:, :, 0:4] = ids.reshape(len(ids), 8, 4)
        blocks[:, 2:66] = sub.reshape(len(ids), 64)
    else:  # IQ1_S: qs the points' low 8 bits, each sub-block's qh their high 3 bits (3 l on)
        blocks[:, 2:34] = ids & 0xFF
        high = (ids >> 8).reshape(len(ids), 8, 4) << (3 * np.arange(4))
        blocks[:, 34:50] = high.sum(axis=-1).astype("<u2").view(np.uint8).reshape(len(ids), 16)
    return blocks


@functools.cache
def _unit_grid(qtype: str) -> torch.Tensor:
    """[points, width] uint8: the index in the type's table of each point's value with a
    positive sign (IQ1_S: with delta +1/8), read out of gguf's dequantizer."""
    kind = TYPES[qtype]
    blocks = _unit_blocks(qtype, np.arange(kind.points))
    units = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[qtype])
    units = torch.from_numpy(np.ascontiguousarray(units)).reshape(kind.points, kind.width)
    matches = units.unsqueeze(-1) == kind.table[:8]
    if not bool(matches.any(-1).all()):
        raise ValueError(f"{qtype}'s grid has values outside its table")
    return matches.to(torch.uint8).argmax(-1).to(torch.uint8)


_PARITY = torch.tensor([bin(i).count("1") & 1 for i in range(128)], dtype=torch.int64)


def _sign_bits(words: torch.Tensor) -> torch.Tensor:
    """Sign words [..., 8] (uint32 values in int64: 4 x 7 bits, GGML's ksigns_iq2xs index, whose
    8th bit makes the count of set bits even) as one bit per weight [..., 8, 32]."""
    index = (words.unsqueeze(-1) >> (7 * torch.arange(4))) & 127  # [..., 8, 4]
    signs = index | (_PARITY[index] << 7)
    return ((signs.unsqueeze(-1) >> torch.arange(8)) & 1).flatten(-2)


def _bits(raw: torch.Tensor) -> torch.Tensor:
    """Bytes [..., c] as bits [..., 8 c], bit j of byte i at 8 i + j."""
    return ((raw.long().unsqueeze(-1) >> torch.arange(8)) & 1).flatten(-2)


def _words(raw: torch.Tensor) -> torch.Tensor:
    """Little-endian uint32 bytes [..., 4 c] as int64 [..., c]."""
    return raw.contiguous().view(torch.int32).long() & 0xFFFFFFFF


def _iq3_xxs(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n, nb = b.shape[:2]
    words = _words(b[..., 66:98])  # per sub-block: the scale in bits 28.., signs below
    points = _unit_grid("IQ3_XXS")[b[..., 2:66].long()].reshape(n, nb, SUB_BLOCKS, 32)
    return words >> 28, points, 8 * _sign_bits(words)


def _iq3_s(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n, nb = b.shape[:2]
    ids = b[..., 2:66].long() | (_bits(b[..., 66:74]) << 8)
    points = _unit_grid("IQ3_S")[ids].reshape(n, nb, SUB_BLOCKS, 32)
    scales = torch.stack((b[..., 106:110] & 0x0F, b[..., 106:110] >> 4), dim=-1).reshape(n, nb, 8)
    return scales.long(), points, 8 * _bits(b[..., 74:106]).reshape(n, nb, SUB_BLOCKS, 32)


def _iq2_xxs(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n, nb = b.shape[:2]
    sub = b[..., 2:66].reshape(n, nb, SUB_BLOCKS, 8)  # 4 points, then a scale and sign word
    words = _words(sub[..., 4:8]).squeeze(-1)
    points = _unit_grid("IQ2_XXS")[sub[..., 0:4].long()].reshape(n, nb, SUB_BLOCKS, 32)
    return words >> 28, points, 8 * _sign_bits(words)


def _iq1_s(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n, nb = b.shape[:2]
    qh = b[..., 34:50].contiguous().view(torch.int16).long() & 0xFFFF  # [n, nb, 8]
    high = (qh.unsqueeze(-1) >> (3 * torch.arange(4))) & 7
    ids = b[..., 2:34].long().reshape(n, nb, SUB_BLOCKS, 4) | (high << 8)
    points = _unit_grid("IQ1_S")[ids].reshape(n, nb, SUB_BLOCKS, 32)
    return (qh >> 12) & 7, points, 3 * (qh >> 15).unsqueeze(-1)  # delta -1/8: 3 entries on


_PARTS: dict[str, Callable] = {"IQ3_XXS": _iq3_xxs, "IQ3_S": _iq3_s, "IQ2_XXS": _iq2_xxs,
                               "IQ1_S": _iq1_s}


def grid_parts(blocks: torch.Tensor, qtype: str) -> tuple[torch.Tensor, ...]:
    """The fields of `qtype` blocks [n, K / 256 * bytes] as the table layouts hold them: d as
    float16 bytes [n, nb, 2], the odd scales 2 ls + 1 [n, nb, 8] (int8) and each weight's index
    in the type's table [n, nb, 8, 32] (uint8, weight order)."""
    n = blocks.shape[0]
    b = blocks.reshape(n, -1, TYPES[qtype].block_bytes)
    scales, points, offsets = _PARTS[qtype](b)
    return b[..., 0:2], (2 * scales + 1).to(torch.int8), (points + offsets).to(torch.uint8)


def to_grid_layout(blocks: torch.Tensor, qtype: str) -> torch.Tensor:
    """`qtype` blocks [n, K / 256 * bytes] (n a multiple of 8) in its table layout
    [n / 8, K / 256 * 1104], a chunk of rows at a time."""
    chunks = [pack_super_table(*grid_parts(blocks[i:i + _CHUNK_ROWS], qtype))
              for i in range(0, blocks.shape[0], _CHUNK_ROWS)]
    return torch.cat(chunks) if len(chunks) > 1 else chunks[0]


def dequantize_grid(blocks: torch.Tensor, qtype: str) -> torch.Tensor:
    """float32 [n, K] of `qtype` blocks, through the `gguf` package's GGML dequantizer."""
    values = gguf.quants.dequantize(blocks.numpy(), gguf.GGMLQuantizationType[qtype])
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))


def dequantize_grid_layout(blocks: torch.Tensor, layout: str) -> torch.Tensor:
    """float32 [N, K] of a table layout's blocks, as GGML computes its type's."""
    return dequantize_super_table(blocks, LAYOUT_TABLES[layout])


def converter(qtype: str) -> Callable[[torch.Tensor], torch.Tensor]:
    return functools.partial(to_grid_layout, qtype=qtype)
