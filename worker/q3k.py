"""GGML's Q3_K blocks and Q3Kx8, the layout the CPU kernels read them in (tensors only).

Q3_K (110 bytes per 256 weights): 32 bytes of high bits, 64 of 2-bit quants, 12 bytes of 16 6-bit
scales, then a float16 d; a weight is d * (sc - 32) * q with q in -4..3, one scale per 16
weights, which GGML computes as (d * (sc - 32)) * q in float32, the first product exact.
`to_q3kx8` regroups it into Q3Kx8 (csrc/cpu/quant_blocks.h): Q6Kx8's header (each row's d, then
the int8 scales sc - 32 of its 16-weight halves) and per block of 32 weights Q4x8's nibble words
holding q + 4 (0..7), read by Q6Kx8's kernels (csrc/cpu/q6kx8.cpp) with an offset of 4 for
Q6_K's 32 and no high-bit words: 4.5625 bits a weight for the file's 3.4375.
"""

from __future__ import annotations

import torch

from shardlm_server.worker.kquant import ROWS, SUB_BLOCKS, SUPER, nibble_quants, nibble_words

Q3_K_BLOCK_BYTES = 110
Q3KX8_SUPER_BYTES = 1168  # one group of 8 rows, one super-block (quant_blocks.h)
OFFSET = 4  # Q3Kx8 holds q + OFFSET


def q3_k_parts(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fields of Q3_K blocks [n, K / 256 * 110]: d as float16 bytes [n, nb, 2], the signed
    scales sc - 32 [n, nb, 16] (int8, one per 16 weights) and the quants [n, nb, 256] (int8,
    -4..3) in weight order, as GGML's dequantize_row_q3_K reads them."""
    n = blocks.shape[0]
    b = blocks.reshape(n, -1, Q3_K_BLOCK_BYTES)
    supers = b.shape[1]
    # Weight 128 h + 32 j + t: bits 2j, 2j+1 of qs[32 h + t], its high bit bit 4h + j of hmask[t]
    # (set: q as read, clear: q - 4).
    qs = b[..., 32:96].reshape(n, supers, 2, 1, 32)
    shifts = torch.arange(4, dtype=torch.uint8).view(1, 1, 1, 4, 1)
    low = (qs >> (2 * shifts)) & 3  # [n, nb, h, j, t]
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
    scale = (d.contiguous().view(torch.float16).float() * scales.float()).repeat_interleave(16, dim=-1)
    return (scale * quants.float()).reshape(blocks.shape[0], -1)


def to_q3kx8(blocks: torch.Tensor) -> torch.Tensor:
    """Q3_K blocks [n, K / 256 * 110] (n a multiple of 8) as Q3Kx8 [n / 8, K / 256 * 1168]."""
    d, scales, quants = q3_k_parts(blocks)
    n, supers = d.shape[:2]
    groups = n // ROWS
    d_bytes = d.reshape(groups, ROWS, supers, 2).permute(0, 2, 1, 3).reshape(groups, supers, 16)
    sc = (scales.view(torch.uint8).reshape(groups, ROWS, supers, 16).permute(0, 2, 3, 1)
          .reshape(groups, supers, 128))  # [half][row]
    q = (quants + OFFSET).to(torch.uint8).reshape(groups, ROWS, supers, SUB_BLOCKS, 32)
    words = nibble_words(q).reshape(groups, supers, SUB_BLOCKS * 128)
    return torch.cat((d_bytes, sc, words), dim=-1).reshape(groups, -1).contiguous()


def dequantize_q3kx8(blocks: torch.Tensor) -> torch.Tensor:
    """float32 [N, K] of Q3Kx8 blocks [N / 8, K / 256 * 1168], as GGML computes the Q3_K ones."""
    groups = blocks.shape[0]
    b = blocks.reshape(groups, -1, Q3KX8_SUPER_BYTES)
    supers = b.shape[1]
    d = (b[..., 0:16].contiguous().view(torch.float16).float()
         .reshape(groups, supers, ROWS).permute(0, 2, 1).unsqueeze(-1))  # [g, r, nb, 1]
    scales = (b[..., 16:144].contiguous().view(torch.int8).reshape(groups, supers, 16, ROWS)
              .permute(0, 3, 1, 2))  # [g, r, nb, 16]
    quants = nibble_quants(b[..., 144:].reshape(groups, supers, SUB_BLOCKS, 128))
    scale = (d * scales.float()).repeat_interleave(16, dim=-1)
    return (scale * (quants.reshape(groups, ROWS, supers, SUPER).float() - OFFSET)).reshape(
        groups * ROWS, supers * SUPER)
