"""GGML's Q2_K and Q3_K blocks, and Q2Kx8 and Q3Kx8, the layouts the CPU kernels read them in
(tensors only).

Q3_K (110 bytes per 256 weights): 32 bytes of high bits, 64 of 2-bit quants, 12 bytes of 16 6-bit
scales, then a float16 d; a weight is d * (sc - 32) * q with q in -4..3, one scale per 16
weights, which GGML computes as (d * (sc - 32)) * q in float32, the first product exact.
`to_q3kx8` regroups it into Q3Kx8 (csrc/cpu/quant_blocks.h): Q6Kx8's header (each row's d, then
the int8 scales sc - 32 of its 16-weight halves) and per block of 32 weights q + 4 (0..7) as its
low two bits in Q2Kx8's 2-bit words and its third bit in one word a row, read by Q6Kx8's
kernels (csrc/cpu/q6kx8.cpp) with an offset of 4 for Q6_K's 32: 3.5625 bits a weight for the
file's 3.4375. Quant t (0..15) of half h has its third bit at bit 16 h + 2 (t % 8) + 1 - t // 8
of that word, so that one shift puts it just above the quant's two low bits once the kernels
have shifted the 2-bit word for its half (see q6k_simd.h).

The IQ2 and IQ1 grid i-quants (gridquant.py) have Q3Kx8's bytes, each weight's 3-bit index into
its type's table in place of q + 4 (`pack_q3kx8`).

Q2_K (84 bytes per 256 weights): 16 bytes of scales (per 16 weights a 4-bit scale sc in the low
nibble and a 4-bit minimum mn in the high one), 64 bytes of 2-bit quants laid out as Q3_K's, then
float16 d and dmin; a weight is (d * sc) * q - dmin * mn, both products exact. `to_q2kx8` gives
Q2Kx8 at the file's 2.625 bits a weight: per group of 8 rows and super-block the rows' d, then
their dmin (float16), then each 16-weight half's byte sc | mn << 4 [half][row], then per block
of 32 weights two words per row of 16 2-bit quants each, one word a half (quant_blocks.h).
"""

from __future__ import annotations

import torch

from shardlm_server.worker.kquant import (
    ROWS,
    SUB_BLOCKS,
    SUPER,
    bit_words,
    group_columns,
    group_rows,
    q6k_header,
    q6k_header_fields,
    row_halves,
    word_fields,
)

Q3_K_BLOCK_BYTES = 110
Q3KX8_SUPER_BYTES = 912  # one group of 8 rows, one super-block (quant_blocks.h)
OFFSET = 4  # Q3Kx8 holds q + OFFSET
Q2_K_BLOCK_BYTES = 84
Q2KX8_SUPER_BYTES = 672  # one group of 8 rows, one super-block (quant_blocks.h)
Q2KX8_HEADER_BYTES = 160  # d[8], dmin[8] float16, then sc | mn << 4 [16][8]
_TWO_BIT_SHIFTS = 2 * torch.arange(16)  # quant t of a half at bits 2t of its word
# Quant i (0..31) of a block: its third bit's place in its row's word (Q3Kx8).
_THIRD_BIT_SHIFTS = torch.tensor([16 * (i // 16) + 2 * (i % 8) + 1 - (i % 16) // 8
                                  for i in range(32)])


def _float16(raw: torch.Tensor) -> torch.Tensor:
    """Byte pairs [..., 2] as float32 [..., 1]."""
    return raw.contiguous().view(torch.float16).float()


def _two_bit_quants(qs: torch.Tensor) -> torch.Tensor:
    """Q2_K's and Q3_K's 64 bytes of 2-bit quants [n, nb, 64] as [n, nb, h, j, t] (uint8, 0..3),
    weight 128 h + 32 j + t: bits 2j, 2j+1 of byte 32 h + t."""
    n, supers = qs.shape[:2]
    shifts = torch.arange(4, dtype=torch.uint8).view(1, 1, 1, 4, 1)
    return (qs.reshape(n, supers, 2, 1, 32) >> (2 * shifts)) & 3


def q3_k_parts(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fields of Q3_K blocks [n, K / 256 * 110]: d as float16 bytes [n, nb, 2], the signed
    scales sc - 32 [n, nb, 16] (int8, one per 16 weights) and the quants [n, nb, 256] (int8,
    -4..3) in weight order, as GGML's dequantize_row_q3_K reads them."""
    n = blocks.shape[0]
    b = blocks.reshape(n, -1, Q3_K_BLOCK_BYTES)
    supers = b.shape[1]
    # Weight 128 h + 32 j + t: bits 2j, 2j+1 of qs[32 h + t], its high bit bit 4h + j of hmask[t]
    # (set: q as read, clear: q - 4).
    low = _two_bit_quants(b[..., 32:96])  # [n, nb, h, j, t]
    shifts = torch.arange(4, dtype=torch.uint8).view(1, 1, 1, 4, 1)
    hmask = b[..., 0:32].reshape(n, supers, 1, 1, 32)
    places = (4 * torch.arange(2, dtype=torch.uint8).view(1, 1, 2, 1, 1) + shifts)
    high = (hmask >> places) & 1
    quants = (low.to(torch.int8) - 4 * (1 - high.to(torch.int8))).reshape(n, supers, 256)
    # Scale i's low 4 bits: byte i's low nibble (i < 8) or byte i - 8's high one; its high 2 bits:
    # bits 2 (i / 4 % 4) .. of byte 8 + i % 4.
    raw = b[..., 96:108]
    low_bits = torch.cat((raw[..., 0:8] & 0x0F, raw[..., 0:8] >> 4), dim=-1)
    tail = raw[..., 8:12]
    high_bits = torch.cat([(tail >> shift) & 3 for shift in (0, 2, 4, 6)], dim=-1)
    scales = (low_bits | (high_bits << 4)).to(torch.int16) - 32
    return b[..., 108:110], scales.to(torch.int8), quants


def dequantize_q3_k(blocks: torch.Tensor) -> torch.Tensor:
    """float32 [n, K] of Q3_K blocks, as GGML computes them: (d * (sc - 32)) * q."""
    d, scales, quants = q3_k_parts(blocks)
    scale = (_float16(d) * scales.float()).repeat_interleave(16, dim=-1)
    return (scale * quants.float()).reshape(blocks.shape[0], -1)


def pack_q3kx8(d: torch.Tensor, scales: torch.Tensor, quants: torch.Tensor) -> torch.Tensor:
    """Q3Kx8's bytes [n / 8, nb * 912] of d as float16 bytes [n, nb, 2], int8 scales [n, nb, 16]
    and 3-bit quants [n, nb, 256] (0..7) in weight order; the IQ2 and IQ1 grid i-quants
    (gridquant.py) have the same bytes, their quants indices into a table."""
    n, supers = quants.shape[:2]
    q = quants.to(torch.uint8).reshape(n // ROWS, ROWS, supers, SUB_BLOCKS, 32)
    low = bit_words((q & 3).reshape(*q.shape[:-1], 2, 16), _TWO_BIT_SHIFTS)
    third = bit_words((q >> 2).unsqueeze(-2), _THIRD_BIT_SHIFTS)
    words = torch.cat((low, third), dim=-1).reshape(n // ROWS, supers, -1)  # per block 64 + 32
    packed = torch.cat((q6k_header(d, scales), words), dim=-1)
    return packed.reshape(packed.shape[0], -1).contiguous()


def q3kx8_fields(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks in Q3Kx8's bytes [N / 8, K / 256 * 912] as each weight's scale d * sc and its
    3-bit quant, both float32 [g, r, nb, 256]."""
    groups = blocks.shape[0]
    b = blocks.reshape(groups, -1, Q3KX8_SUPER_BYTES)
    supers = b.shape[1]
    d, scales = q6k_header_fields(b[..., :144])
    words = b[..., 144:].reshape(groups, supers, SUB_BLOCKS, 96)
    low = word_fields(words[..., :64], 2, _TWO_BIT_SHIFTS, 3).reshape(groups, ROWS, supers, SUPER)
    third = word_fields(words[..., 64:], 1, _THIRD_BIT_SHIFTS, 1).reshape(
        groups, ROWS, supers, SUPER)
    return (d * scales.float()).repeat_interleave(16, dim=-1), (low | (third << 2)).float()


def to_q3kx8(blocks: torch.Tensor) -> torch.Tensor:
    """Q3_K blocks [n, K / 256 * 110] (n a multiple of 8) as Q3Kx8 [n / 8, K / 256 * 912]."""
    d, scales, quants = q3_k_parts(blocks)
    return pack_q3kx8(d, scales, quants + OFFSET)


def dequantize_q3kx8(blocks: torch.Tensor) -> torch.Tensor:
    """float32 [N, K] of Q3Kx8 blocks [N / 8, K / 256 * 912], as GGML computes the Q3_K ones."""
    scale, quants = q3kx8_fields(blocks)
    return (scale * (quants - OFFSET)).reshape(blocks.shape[0] * ROWS, -1)


def q2_k_parts(blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The fields of Q2_K blocks [n, K / 256 * 84]: d and dmin as float16 bytes [n, nb, 2], the
    scales and minimums [n, nb, 16] (uint8, 0..15, one per 16 weights) and the quants [n, nb,
    256] (uint8, 0..3) in weight order, as GGML's dequantize_row_q2_K reads them."""
    n = blocks.shape[0]
    b = blocks.reshape(n, -1, Q2_K_BLOCK_BYTES)
    quants = _two_bit_quants(b[..., 16:80]).reshape(n, b.shape[1], SUPER)
    return b[..., 80:82], b[..., 82:84], b[..., 0:16] & 0x0F, b[..., 0:16] >> 4, quants


def _q2_values(d, dmin, scales, mins, quants) -> torch.Tensor:
    """(d * sc) * q - dmin * mn per weight: d, dmin float32 [..., 1], scales and mins [..., 16],
    quants [..., 256]."""
    scale = (d * scales.float()).repeat_interleave(16, dim=-1)
    offset = (dmin * mins.float()).repeat_interleave(16, dim=-1)
    return scale * quants.float() - offset


def dequantize_q2_k(blocks: torch.Tensor) -> torch.Tensor:
    """float32 [n, K] of Q2_K blocks, as GGML computes them."""
    d, dmin, scales, mins, quants = q2_k_parts(blocks)
    return _q2_values(_float16(d), _float16(dmin), scales, mins, quants).reshape(
        blocks.shape[0], -1)


def to_q2kx8(blocks: torch.Tensor) -> torch.Tensor:
    """Q2_K blocks [n, K / 256 * 84] (n a multiple of 8) as Q2Kx8 [n / 8, K / 256 * 672]."""
    d, dmin, scales, mins, quants = q2_k_parts(blocks)
    n, supers = quants.shape[:2]
    halves = quants.reshape(n // ROWS, ROWS, supers, SUB_BLOCKS, 2, 16)
    packed = torch.cat((group_rows(d), group_rows(dmin), group_columns(scales | (mins << 4)),
                        bit_words(halves, _TWO_BIT_SHIFTS).reshape(n // ROWS, supers, -1)), dim=-1)
    return packed.reshape(packed.shape[0], -1).contiguous()


def dequantize_q2kx8(blocks: torch.Tensor) -> torch.Tensor:
    """float32 [N, K] of Q2Kx8 blocks [N / 8, K / 256 * 672], as GGML computes the Q2_K ones."""
    groups = blocks.shape[0]
    b = blocks.reshape(groups, -1, Q2KX8_SUPER_BYTES)
    supers = b.shape[1]
    packed = b[..., 32:Q2KX8_HEADER_BYTES].reshape(groups, supers, 16, ROWS).permute(0, 3, 1, 2)
    words = b[..., Q2KX8_HEADER_BYTES:].reshape(groups, supers, SUB_BLOCKS, 64)
    quants = word_fields(words, 2, _TWO_BIT_SHIFTS, 3).reshape(groups, ROWS, supers, SUPER)
    return _q2_values(row_halves(b[..., 0:16]), row_halves(b[..., 16:32]), packed & 0x0F,
                      packed >> 4, quants).reshape(groups * ROWS, -1)
