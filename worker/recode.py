"""GGML block types the CPU kernels do not read (or, for Q5_0 and IQ4_NL, not in rows that fill
no group of 8), re-encoded exactly into ones they do (tensors only).

Each re-encoding keeps every weight bit for bit as GGML dequantizes it, so a file of these types
stays packed in memory (at a little under twice its bytes for those matrices instead of the
seven to nine times that float32 takes) and multiplies as exactly as the file's own kernel types:

- Q3_K (110 bytes per 256 weights: 32 bytes of high bits, 64 of 2-bit quants, 12 bytes of 16
  6-bit scales, then a float16 d; w = d * (sc - 32) * q with q in -4..3, one scale per 16
  weights) as Q6_K (w = d * sc * (q - 32), q in 0..63, one int8 scale per 16 weights): the same
  d, sc - 32 as the int8 scale, q + 32 as the 6-bit quant. GGML computes both as
  (d * scale) * quant in float32 with an exact first product, so the values are the same floats.
- IQ4_NL (18 bytes per 32 weights: a float16 d, then 16 bytes of nibbles, weight i in the low
  nibble of byte i and i + 16 in its high one, each an index into a fixed table of 16 int8
  values) as Q8_0: the same d, the table's values as the int8 quants.
- Q5_0 as Q8_0 (kquant.q5_0_to_q8_0): the same d, q - 16 as the int8 quant.
"""

from __future__ import annotations

import torch

from shardlm_server.worker.iquant import IQ4_VALUES, iq4_nibbles
from shardlm_server.worker.kquant import q5_0_to_q8_0

Q3_K_BLOCK_BYTES = 110
IQ4_NL_BLOCK_BYTES = 18


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


def q6_k_blocks(d: torch.Tensor, scales: torch.Tensor, quants: torch.Tensor) -> torch.Tensor:
    """Q6_K blocks [n, nb * 210] of the fields `kquant.q6_k_parts` reads: d as float16 bytes
    [n, nb, 2], int8 scales [n, nb, 16], quants [n, nb, 256] (0..63) in weight order."""
    n, supers = quants.shape[:2]
    q = quants.to(torch.uint8).reshape(n, supers, 2, 128)  # per half of 128 weights
    low = (q[..., 0:64] & 0x0F) | ((q[..., 64:128] & 0x0F) << 4)  # weights l and 64 + l
    pairs = (q >> 4).reshape(n, supers, 2, 4, 32)  # weight 32 k + l's bits at 2k of byte l
    high = pairs[..., 0, :] | (pairs[..., 1, :] << 2) | (pairs[..., 2, :] << 4) | (pairs[..., 3, :] << 6)
    packed = torch.cat((low.reshape(n, supers, 128), high.reshape(n, supers, 64),
                        scales.view(torch.uint8), d), dim=-1)
    return packed.reshape(n, -1).contiguous()


def q3_k_to_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    """Q3_K blocks [n, K / 256 * 110] as Q6_K [n, K / 256 * 210]: the same weights exactly."""
    d, scales, quants = q3_k_parts(blocks)
    return q6_k_blocks(d, scales, (quants + 32).to(torch.uint8))


def iq4_nl_to_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    """IQ4_NL blocks [n, K / 32 * 18] as Q8_0 [n, K / 32 * 34]: the same weights exactly."""
    n = blocks.shape[0]
    b = blocks.reshape(n, -1, IQ4_NL_BLOCK_BYTES)
    nibbles = iq4_nibbles(b[..., 2:]).squeeze(-2).long()
    values = torch.tensor(IQ4_VALUES, dtype=torch.int8)[nibbles]
    return torch.cat((b[..., 0:2], values.view(torch.uint8)), dim=-1).reshape(n, -1).contiguous()


#: The types re-encoded at load: what into, and how.
RECODED = {"Q3_K": ("Q6_K", q3_k_to_q6_k), "IQ4_NL": ("Q8_0", iq4_nl_to_q8_0),
           "Q5_0": ("Q8_0", q5_0_to_q8_0)}
