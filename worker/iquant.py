"""GGML's IQ4_XS and IQ4_NL blocks, and IQ4x8 and IQ4NLx8, the layouts the CPU kernels read them
in (tensors only).

IQ4_XS (136 bytes per 256 weights): a float16 d, 16 bits of scale highs, 4 bytes of scale lows,
then per sub-block of 32 weights 16 bytes of nibbles (weight i in the low nibble of byte i, i + 16
in its high one). Sub-block s's scale ls (6 bits) is the low nibble s % 2 of byte s / 2 of the
lows with bits 2s, 2s+1 of the highs above it; a weight is d * (ls - 32) * IQ4_VALUES[q], which
GGML computes as (d * (ls - 32)) * value in float32, both products exact (11 + 5 + 7 bits).
`to_iq4x8` regroups it into IQ4x8 (csrc/cpu/quant_blocks.h: 8 rows side by side, each
sub-block's nibbles as a Q4x8 block's words, ls - 32 stored as an int8), which the Q4x8 kernels
read through the table.

IQ4_NL (18 bytes per 32 weights) is a float16 d and IQ4_XS's nibbles, w = d * value, the product
exact; `to_iq4nlx8` regroups it into IQ4NLx8, Q40x8's bytes (each row's d, then the words).
"""

from __future__ import annotations

import torch

from shardlm_server.worker.kquant import (
    ROWS,
    SUB_BLOCKS,
    SUPER,
    group_columns,
    group_rows,
    nibble_quants,
    nibble_words,
    row_halves,
)

IQ4_XS_BLOCK_BYTES = 136
IQ4X8_SUPER_BYTES = 1104  # one group of 8 rows, one super-block (quant_blocks.h)
IQ4_NL_BLOCK_BYTES = 18
IQ4NLX8_BLOCK_BYTES = 144  # one group of 8 rows, one block of 32 (quant_blocks.h)
#: GGML's kvalues_iq4nl: the int8 value each IQ4_NL / IQ4_XS nibble stands for.
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
_TABLE = torch.tensor(IQ4_VALUES, dtype=torch.float32)


def iq4_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Bytes [..., 16 c] of nibbles as indices [..., c, 32] in weight order: per 16 bytes, weight
    i in the low nibble of byte i and i + 16 in its high one (IQ4_NL's and IQ4_XS's)."""
    q = qs.reshape(*qs.shape[:-1], -1, 16)
    return torch.cat((q & 0x0F, q >> 4), dim=-1)


def iq4_xs_parts(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fields of IQ4_XS blocks [n, K / 256 * 136]: d as float16 bytes [n, nb, 2], the
    sub-blocks' signed scales ls - 32 [n, nb, 8] (int8) and the nibbles [n, nb, 8, 32] (uint8,
    0..15) in weight order."""
    n = blocks.shape[0]
    b = blocks.reshape(n, -1, IQ4_XS_BLOCK_BYTES)
    highs = b[..., 2:4].contiguous().view(torch.int16).to(torch.int32)  # [n, nb, 1]
    lows = b[..., 4:8].to(torch.int32)
    subs = torch.arange(SUB_BLOCKS)
    low = (lows[..., subs // 2] >> (4 * (subs % 2))) & 0x0F
    high = (highs >> (2 * subs)) & 3
    scales = ((low | (high << 4)) - 32).to(torch.int8)
    return b[..., 0:2], scales, iq4_nibbles(b[..., 8:])


def _values(d: torch.Tensor, scales: torch.Tensor, nibbles: torch.Tensor,
            table: torch.Tensor = _TABLE) -> torch.Tensor:
    """(d * sc) * table[q] per weight: d float32 [..., 1], scales [..., 8], nibbles [..., 8, 32]."""
    return (d * scales.float()).unsqueeze(-1) * table[nibbles.long()]


def dequantize_iq4_xs(blocks: torch.Tensor) -> torch.Tensor:
    """float32 [n, K] of IQ4_XS blocks, as GGML computes them."""
    d, scales, nibbles = iq4_xs_parts(blocks)
    half = d.contiguous().view(torch.float16).float()
    return _values(half, scales, nibbles).reshape(blocks.shape[0], -1)


def pack_super_table(d: torch.Tensor, scales: torch.Tensor, nibbles: torch.Tensor) -> torch.Tensor:
    """IQ4x8's bytes [n / 8, nb * 1104] of d as float16 bytes [n, nb, 2], the sub-blocks' int8
    scales [n, nb, 8] and the table indices [n, nb, 8, 32] (uint8, 0..15) in weight order; the
    grid i-quants' layouts (gridquant.py) have the same bytes."""
    n, supers = d.shape[:2]
    groups = n // ROWS
    words = nibble_words(nibbles.reshape(groups, ROWS, supers, SUB_BLOCKS, 32))
    packed = torch.cat((group_rows(d), group_columns(scales.view(torch.uint8)),
                        words.reshape(groups, supers, SUB_BLOCKS * 128)), dim=-1)
    return packed.reshape(groups, -1).contiguous()


def to_iq4x8(blocks: torch.Tensor) -> torch.Tensor:
    """IQ4_XS blocks [n, K / 256 * 136] (n a multiple of 8) as IQ4x8 [n / 8, K / 256 * 1104]."""
    return pack_super_table(*iq4_xs_parts(blocks))


def dequantize_super_table(blocks: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """float32 [N, K] of blocks in IQ4x8's bytes [N / 8, K / 256 * 1104], each nibble read
    through `table` (16 float32 values): (d * sc) * table[q], as GGML computes its type's."""
    groups = blocks.shape[0]
    b = blocks.reshape(groups, -1, IQ4X8_SUPER_BYTES)
    supers = b.shape[1]
    d = row_halves(b[..., 0:16])  # [g, r, nb, 1]
    scales = (b[..., 16:80].contiguous().view(torch.int8).reshape(groups, supers, SUB_BLOCKS, ROWS)
              .permute(0, 3, 1, 2))  # [g, r, nb, s]
    nibbles = nibble_quants(b[..., 80:].reshape(groups, supers, SUB_BLOCKS, 128))
    return _values(d, scales, nibbles, table).reshape(groups * ROWS, supers * SUPER)


def dequantize_iq4x8(blocks: torch.Tensor) -> torch.Tensor:
    """float32 [N, K] of IQ4x8 blocks [N / 8, K / 256 * 1104], as GGML computes the IQ4_XS ones."""
    return dequantize_super_table(blocks, _TABLE)


def dequantize_iq4_nl(blocks: torch.Tensor) -> torch.Tensor:
    """float32 [n, K] of IQ4_NL blocks, as GGML computes them: d * value, exact."""
    n = blocks.shape[0]
    b = blocks.reshape(n, -1, IQ4_NL_BLOCK_BYTES)
    d = b[..., 0:2].contiguous().view(torch.float16).float()  # [n, nb, 1]
    return (d * _TABLE[iq4_nibbles(b[..., 2:]).squeeze(-2).long()]).reshape(n, -1)


def to_iq4nlx8(blocks: torch.Tensor) -> torch.Tensor:
    """IQ4_NL blocks [n, K / 32 * 18] (n a multiple of 8) as IQ4NLx8 [n / 8, K / 32 * 144]."""
    n = blocks.shape[0]
    b = blocks.reshape(n, -1, IQ4_NL_BLOCK_BYTES)
    nb, groups = b.shape[1], n // ROWS
    words = nibble_words(iq4_nibbles(b[..., 2:]).reshape(groups, ROWS, nb, 32))
    return torch.cat((group_rows(b[..., 0:2]), words), dim=-1).reshape(groups, -1).contiguous()


def dequantize_iq4nlx8(blocks: torch.Tensor) -> torch.Tensor:
    """float32 [N, K] of IQ4NLx8 blocks [N / 8, K / 32 * 144], as GGML computes the IQ4_NL ones."""
    groups = blocks.shape[0]
    b = blocks.reshape(groups, -1, IQ4NLX8_BLOCK_BYTES)
    nibbles = nibble_quants(b[..., 16:])  # [g, r, nb, 32]
    return (row_halves(b[..., 0:16]) * _TABLE[nibbles.long()]).reshape(groups * ROWS, -1)
