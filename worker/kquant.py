"""GGML's K-quant and 5-bit blocks, and the layouts the CPU kernels read them in (tensors only).

Q4_K (144 bytes per 256 weights): float16 d and dmin, 12 bytes of 6-bit scales and mins for the
8 sub-blocks of 32 weights, then 128 bytes of nibbles: bytes 32c .. 32c+31 hold sub-block 2c in
their low nibbles and 2c+1 in their high ones. A weight is d * sc[s] * q - dmin * mn[s].
`to_q4kx8` regroups it into Q4Kx8 (csrc/cpu/quant_blocks.h: 8 rows side by side, each sub-block's
quants as a Q4x8 block's words), which the Q4x8 kernels read with per-sub-block scales; the
dequantizers here are the kernels' reference and compute as GGML does: (d * sc) * q - dmin * mn
in float32, where both products are exact.

Q6_K (210 bytes per 256 weights): 128 bytes of low nibbles, 64 of high bit pairs, 16 int8
scales (one per 16 weights), then a float16 d; w = d * sc[i / 16] * (q - 32) with q in 0..63.
`to_q6kx8` regroups it into Q6Kx8 (quant_blocks.h), read by csrc/cpu/q6kx8.cpp; the reference
computes (d * sc) * (q - 32) in float32, the first product exact, as GGML does.

Q5_0 (22 bytes per 32 weights): float16 d, 32 high bits, 16 bytes of nibbles (weight i in the
low nibble of byte i, i + 16 in its high one); w = d * (q - 16) with q in 0..31. `q5_0_to_q8_0`
stores the same weights as Q8_0 (the signed quant q - 16 fits an int8, d unchanged): exact, and
read by the Q8_0 kernels, at 34 bytes a block instead of 22. Q5_1 (24 bytes) adds a float16
offset m after d: w = d * q + m, the product exact; `to_q51x8` regroups it into Q51x8 (Q5x8's
words with each row's m beside its d), read by the Q4x8 kernels like Q4_1's Q4x8.
"""

from __future__ import annotations

import torch

Q4_K_BLOCK_BYTES = 144
SUPER = 256  # weights per Q4_K block
SUB_BLOCKS = 8
Q4KX8_SUPER_BYTES = 1184  # one group of 8 rows, one super-block (quant_blocks.h)
ROWS = 8  # rows of a Q4Kx8 group
Q5_0_BLOCK_BYTES = 22
Q5X8_BLOCK_BYTES = 176  # one group of 8 rows, one block of 32 (quant_blocks.h)
Q5_1_BLOCK_BYTES = 24
Q51X8_BLOCK_BYTES = 192  # one group of 8 rows, one block of 32 (quant_blocks.h)
Q5_K_BLOCK_BYTES = 176
Q5KX8_SUPER_BYTES = 1440  # one group of 8 rows, one super-block (quant_blocks.h)
Q6_K_BLOCK_BYTES = 210
Q6KX8_SUPER_BYTES = 1680  # one group of 8 rows, one super-block (quant_blocks.h)


def _halves(raw: torch.Tensor) -> torch.Tensor:
    """Byte pairs [..., 2] as float32 [..., 1]."""
    return raw.contiguous().view(torch.float16).float()


def _k_scales(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 sub-blocks' 6-bit scales and mins [..., 8] (uint8) of Q4_K / Q5_K's 12 packed
    bytes [..., 12], as GGML's get_scale_min_k4 unpacks them."""
    q = raw.to(torch.int32)
    low = torch.cat((q[..., 0:4] & 63, (q[..., 8:12] & 0x0F) | ((q[..., 0:4] >> 6) << 4)), -1)
    mins = torch.cat((q[..., 4:8] & 63, (q[..., 8:12] >> 4) | ((q[..., 4:8] >> 6) << 4)), -1)
    return low.to(torch.uint8), mins.to(torch.uint8)


def _k_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Q4_K / Q5_K's 128 nibble bytes [n, nb, 128] as quants [n, nb, 8, 32] in weight order:
    bytes 32c .. 32c+31 hold sub-block 2c in their low nibbles and 2c+1 in their high ones."""
    n, supers = qs.shape[:2]
    q = qs.reshape(n, supers, 4, 1, 32)
    return torch.cat((q & 0x0F, q >> 4), dim=3).reshape(n, supers, SUB_BLOCKS, 32)


def q4_k_parts(blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The raw fields of Q4_K blocks [n, K / 256 * 144]: d and dmin as float16 bytes
    [n, nb, 2], the scales and mins [n, nb, 8] (uint8, 0..63) and the quants [n, nb, 8, 32]
    (uint8, 0..15) in weight order."""
    b = blocks.reshape(blocks.shape[0], -1, Q4_K_BLOCK_BYTES)
    return (b[..., 0:2], b[..., 2:4], *_k_scales(b[..., 4:16]), _k_nibbles(b[..., 16:]))


def dequantize_q4_k(blocks: torch.Tensor) -> torch.Tensor:
    """float32 [n, K] of Q4_K blocks, as GGML computes them."""
    d, dmin, sc, mn, q = q4_k_parts(blocks)
    scale = (_halves(d) * sc.float()).unsqueeze(-1)  # [n, nb, 8, 1], exact
    offset = (_halves(dmin) * mn.float()).unsqueeze(-1)
    return (scale * q.float() - offset).reshape(blocks.shape[0], -1)


def _k_header(d, dmin, sc, mn) -> torch.Tensor:
    """Q4Kx8 / Q5Kx8's 160-byte header per group and super-block [g, nb, 160] from the fields
    `q4_k_parts` gives: d[8], dmin[8] (float16 bytes, row-minor), then sc[8][8], mn[8][8]."""
    return torch.cat((group_rows(d), group_rows(dmin), group_columns(sc), group_columns(mn)),
                     dim=-1)


def _k_scales_of(header: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sub-block's scale d * sc and offset dmin * mn (float32, exact) [g, 8, nb, 8, 1] from
    headers [g, nb, 160]."""
    groups, supers = header.shape[:2]

    def by_row(raw: torch.Tensor) -> torch.Tensor:  # [g, nb, 16] -> [g, r, nb, 1, 1]
        return _halves(raw.reshape(groups, supers, ROWS, 2)).permute(0, 2, 1, 3).unsqueeze(-1)

    def by_sub(raw: torch.Tensor) -> torch.Tensor:  # [g, nb, 64] -> [g, r, nb, sub, 1]
        return raw.reshape(groups, supers, SUB_BLOCKS, ROWS).permute(0, 3, 1, 2).unsqueeze(-1)

    return (by_row(header[..., 0:16]) * by_sub(header[..., 32:96]).float(),
            by_row(header[..., 16:32]) * by_sub(header[..., 96:160]).float())


def _to_super_x8(parts: tuple[torch.Tensor, ...], five: bool) -> torch.Tensor:
    """Q4Kx8 (or with `five`, Q5Kx8) bytes [n / 8, ...] of `q4_k_parts` / `q5_k_parts` fields:
    the header, then per block (its high-bit words and) its nibble words."""
    d, dmin, sc, mn, q = parts
    groups, supers = d.shape[0] // ROWS, d.shape[1]
    q = q.reshape(groups, ROWS, supers, SUB_BLOCKS, 32)
    words = torch.cat((high_words(q), nibble_words(q)), dim=-1) if five else nibble_words(q)
    packed = torch.cat((_k_header(d, dmin, sc, mn), words.reshape(groups, supers, -1)), dim=-1)
    return packed.reshape(groups, -1).contiguous()


def _dequantize_super_x8(blocks: torch.Tensor, five: bool) -> torch.Tensor:
    """float32 [N, K] of Q4Kx8 (or with `five`, Q5Kx8) blocks, as GGML computes Q4_K's / Q5_K's."""
    groups = blocks.shape[0]
    b = blocks.reshape(groups, -1, Q5KX8_SUPER_BYTES if five else Q4KX8_SUPER_BYTES)
    supers = b.shape[1]
    scale, offset = _k_scales_of(b[..., :160])
    words = b[..., 160:].reshape(groups, supers, SUB_BLOCKS, -1)
    q = nibble_quants(words[..., -128:])
    if five:
        q = q | high_bits(words[..., :32])
    return (scale * q.float() - offset).reshape(groups * ROWS, supers * SUPER)


def to_q4kx8(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_K blocks [n, K / 256 * 144] (n a multiple of 8) as Q4Kx8 [n / 8, K / 256 * 1184]."""
    return _to_super_x8(q4_k_parts(blocks), five=False)


def dequantize_q4kx8(blocks: torch.Tensor) -> torch.Tensor:
    """float32 [N, K] of Q4Kx8 blocks [N / 8, K / 256 * 1184], as GGML computes the Q4_K ones."""
    return _dequantize_super_x8(blocks, five=False)


def q5_k_parts(blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """`q4_k_parts` for Q5_K blocks [n, K / 256 * 176] (d, dmin, scales, then 32 bytes of high
    bits and Q4_K's nibbles): quants 0..31, sub-block t's high bits in bit t of bytes 0..31."""
    n = blocks.shape[0]
    b = blocks.reshape(n, -1, Q5_K_BLOCK_BYTES)
    high = (b[..., 16:48].unsqueeze(2) >> torch.arange(SUB_BLOCKS, dtype=torch.uint8)
            .view(1, 1, SUB_BLOCKS, 1)) & 1  # [n, nb, sub, 32]
    return (b[..., 0:2], b[..., 2:4], *_k_scales(b[..., 4:16]),
            _k_nibbles(b[..., 48:]) | (high << 4))


def dequantize_q5_k(blocks: torch.Tensor) -> torch.Tensor:
    """float32 [n, K] of Q5_K blocks, as GGML computes them."""
    d, dmin, sc, mn, q = q5_k_parts(blocks)
    scale = (_halves(d) * sc.float()).unsqueeze(-1)
    offset = (_halves(dmin) * mn.float()).unsqueeze(-1)
    return (scale * q.float() - offset).reshape(blocks.shape[0], -1)


def to_q5kx8(blocks: torch.Tensor) -> torch.Tensor:
    """Q5_K blocks [n, K / 256 * 176] (n a multiple of 8) as Q5Kx8 [n / 8, K / 256 * 1440]."""
    return _to_super_x8(q5_k_parts(blocks), five=True)


def dequantize_q5kx8(blocks: torch.Tensor) -> torch.Tensor:
    """float32 [N, K] of Q5Kx8 blocks [N / 8, K / 256 * 1440], as GGML computes the Q5_K ones."""
    return _dequantize_super_x8(blocks, five=True)


def nibble_words(quants: torch.Tensor) -> torch.Tensor:
    """Quants [g, 8, *blocks, 32] (their low 4 bits) as each block's nibble words [g, *blocks,
    128]: word s of row r at bytes 32 s + 4 r, quant 8s + j in bits 4j .. 4j+3 (Q4x8's)."""
    g, rows, *lead, width = quants.shape
    q = (quants & 0x0F).reshape(g, rows, *lead, 4, 4, 2)  # [.., s, byte, low/high]
    words = q[..., 0] | (q[..., 1] << 4)  # [g, r, *blocks, s, byte]
    order = (0, *range(2, 2 + len(lead)), 2 + len(lead), 1, 3 + len(lead))
    return words.permute(order).reshape(g, *lead, 128)


def nibble_quants(words: torch.Tensor) -> torch.Tensor:
    """`nibble_words` undone: words [g, *blocks, 128] as quants [g, 8, *blocks, 32] (0..15)."""
    g, *lead, _ = words.shape
    w = words.reshape(g, *lead, 4, ROWS, 4)
    q = torch.stack((w & 0x0F, w >> 4), dim=-1).reshape(g, *lead, 4, ROWS, 8)
    order = (0, 2 + len(lead), *range(1, 1 + len(lead)), 1 + len(lead), 3 + len(lead))
    return q.permute(order).reshape(g, ROWS, *lead, 32)


_HIGH_BIT = torch.tensor([4 * (i % 8) + i // 8 for i in range(32)])  # quant 8s + j at 4j + s


def bit_words(fields: torch.Tensor, shifts: torch.Tensor) -> torch.Tensor:
    """Fields [g, 8, *blocks, w, f] (small integers) packed into w uint32 words per row and
    block, field i at bit shifts[i]: [g, *blocks, w * 32] bytes, word u of row r at 32 u + 4 r."""
    g, rows, *lead, w, _ = fields.shape
    word = (fields.to(torch.int64) << shifts).sum(-1)  # [g, r, *blocks, w]
    bytes_ = torch.stack([(word >> (8 * t)) & 0xFF for t in range(4)], -1).to(torch.uint8)
    order = (0, *range(2, 2 + len(lead)), 2 + len(lead), 1, 3 + len(lead))
    return bytes_.permute(order).reshape(g, *lead, w * rows * 4)


def word_fields(words: torch.Tensor, w: int, shifts: torch.Tensor, mask: int) -> torch.Tensor:
    """`bit_words` undone: bytes [g, *blocks, w * 32] as fields [g, 8, *blocks, w, f]."""
    g, *lead, _ = words.shape
    b = words.reshape(g, *lead, w, ROWS, 4).to(torch.int64)
    word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)
    fields = (word.unsqueeze(-1) >> shifts) & mask  # [g, *blocks, w, r, f]
    order = (0, 2 + len(lead), *range(1, 1 + len(lead)), 1 + len(lead), 3 + len(lead))
    return fields.permute(order).to(torch.uint8)


def high_words(quants: torch.Tensor) -> torch.Tensor:
    """The high bits (bit 4) of quants [g, 8, *blocks, 32] as each block's words [g, *blocks,
    32]: row r's uint32 at bytes 4 r, quant 8s + j's bit at bit 4j + s (quant_blocks.h)."""
    return bit_words(((quants >> 4) & 1).unsqueeze(-2), _HIGH_BIT)


def high_bits(words: torch.Tensor) -> torch.Tensor:
    """`high_words` undone: words [g, *blocks, 32] as bit 4 of quants [g, 8, *blocks, 32]."""
    return word_fields(words, 1, _HIGH_BIT, 1).squeeze(-2) << 4


def _q5_parts(blocks: torch.Tensor, block_bytes: int) -> tuple[torch.Tensor, ...]:
    """The fields of Q5_0 / Q5_1 blocks [n, K / 32 * bytes]: the float16 bytes ahead of the
    high bits ([n, nb, 2] d, for Q5_1 then [n, nb, 2] m) and the quants [n, nb, 32] (uint8,
    0..31) in weight order."""
    n = blocks.shape[0]
    b = blocks.reshape(n, -1, block_bytes)
    lead = block_bytes - 20  # d (and m), then 4 bytes of high bits and 16 of nibbles
    high = b[..., lead:lead + 4].contiguous().view(torch.int32)  # [n, nb, 1], little-endian
    bits = (high >> torch.arange(32, dtype=torch.int32)) & 1  # [n, nb, 32], weight order
    qs = b[..., lead + 4:]
    low = torch.cat((qs & 0x0F, qs >> 4), dim=-1).to(torch.int32)
    halves = tuple(b[..., i:i + 2] for i in range(0, lead, 2))
    return (*halves, (low | (bits << 4)).to(torch.uint8))


def q5_0_parts(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The fields of Q5_0 blocks [n, K / 32 * 22]: d as float16 bytes [n, nb, 2] and the quants
    [n, nb, 32] (uint8, 0..31) in weight order."""
    return _q5_parts(blocks, Q5_0_BLOCK_BYTES)


def dequantize_q5_0(blocks: torch.Tensor) -> torch.Tensor:
    """float32 [n, K] of Q5_0 blocks, as GGML computes them: d * (q - 16), exact."""
    d, q = q5_0_parts(blocks)
    return (_halves(d) * (q.float() - 16)).reshape(blocks.shape[0], -1)


def dequantize_q5_1(blocks: torch.Tensor) -> torch.Tensor:
    """float32 [n, K] of Q5_1 blocks (24 bytes: d, m, high bits, nibbles), as GGML computes
    them: d * q + m, the product exact."""
    d, m, q = _q5_parts(blocks, Q5_1_BLOCK_BYTES)
    return (_halves(d) * q.float() + _halves(m)).reshape(blocks.shape[0], -1)


def q5_0_to_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    """Q5_0 blocks [n, K / 32 * 22] as Q8_0 [n, K / 32 * 34]: the same weights exactly (for
    rows that do not fill groups of 8)."""
    d, q = q5_0_parts(blocks)
    quants = (q.to(torch.int32) - 16).to(torch.int8).view(torch.uint8)
    return torch.cat((d, quants), -1).reshape(blocks.shape[0], -1)


def group_rows(field: torch.Tensor) -> torch.Tensor:
    """A per-row, per-block field [n, nb, w] as [n / 8, nb, 8 w], the group's rows side by side."""
    n, nb, width = field.shape
    groups = n // ROWS
    return field.reshape(groups, ROWS, nb, width).permute(0, 2, 1, 3).reshape(groups, nb, ROWS * width)


def group_columns(field: torch.Tensor) -> torch.Tensor:
    """A per-row, per-block field of w small values [n, nb, w] as [n / 8, nb, w * 8]: value i of
    the group's row r at 8 i + r (the int8 scales of the K-quant layouts)."""
    n, nb, width = field.shape
    groups = n // ROWS
    return field.reshape(groups, ROWS, nb, width).permute(0, 2, 3, 1).reshape(groups, nb, width * ROWS)


def row_halves(raw: torch.Tensor) -> torch.Tensor:
    """`group_rows` of float16 bytes undone, as values: [g, nb, 16] -> float32 [g, 8, nb, 1]."""
    groups, nb = raw.shape[:2]
    return _halves(raw.reshape(groups, nb, ROWS, 2)).permute(0, 2, 1, 3)


def _to_5bit_x8(parts: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Q5x8 / Q51x8 bytes [n / 8, ...] of `_q5_parts` fields: per block the rows' float16
    fields (d[8], for Q5_1 then m[8]), their high-bit words, then their nibble words."""
    *halves, q = parts
    n, nb = q.shape[:2]
    groups = n // ROWS
    q = q.reshape(groups, ROWS, nb, 32)
    fields = [group_rows(h) for h in halves]
    return torch.cat((*fields, high_words(q), nibble_words(q)), -1).reshape(groups, -1).contiguous()


def to_q5x8(blocks: torch.Tensor) -> torch.Tensor:
    """Q5_0 blocks [n, K / 32 * 22] (n a multiple of 8) as Q5x8 [n / 8, K / 32 * 176]."""
    return _to_5bit_x8(q5_0_parts(blocks))


def to_q51x8(blocks: torch.Tensor) -> torch.Tensor:
    """Q5_1 blocks [n, K / 32 * 24] (n a multiple of 8) as Q51x8 [n / 8, K / 32 * 192]."""
    return _to_5bit_x8(_q5_parts(blocks, Q5_1_BLOCK_BYTES))


def _dequantize_5bit_x8(blocks: torch.Tensor, block_bytes: int) -> torch.Tensor:
    """float32 [N, K] of Q5x8 (or, 192-byte blocks, Q51x8) blocks, as GGML computes Q5_0's
    (Q5_1's)."""
    groups = blocks.shape[0]
    b = blocks.reshape(groups, -1, block_bytes)
    nb = b.shape[1]
    lead = block_bytes - 160
    d = row_halves(b[..., 0:16])
    q = (high_bits(b[..., lead:lead + 32]) | nibble_quants(b[..., lead + 32:])).float()
    values = d * q + row_halves(b[..., 16:32]) if lead == 32 else d * (q - 16)
    return values.reshape(groups * ROWS, nb * 32)


def dequantize_q5x8(blocks: torch.Tensor) -> torch.Tensor:
    """float32 [N, K] of Q5x8 blocks [N / 8, K / 32 * 176], as GGML computes the Q5_0 ones."""
    return _dequantize_5bit_x8(blocks, Q5X8_BLOCK_BYTES)


def dequantize_q51x8(blocks: torch.Tensor) -> torch.Tensor:
    """float32 [N, K] of Q51x8 blocks [N / 8, K / 32 * 192], as GGML computes the Q5_1 ones."""
    return _dequantize_5bit_x8(blocks, Q51X8_BLOCK_BYTES)


def q6_k_parts(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fields of Q6_K blocks [n, K / 256 * 210]: d as float16 bytes [n, nb, 2], the int8
    scales [n, nb, 16] and the quants [n, nb, 256] (uint8, 0..63) in weight order."""
    n = blocks.shape[0]
    b = blocks.reshape(n, -1, Q6_K_BLOCK_BYTES)
    supers = b.shape[1]
    low = b[..., 0:128].reshape(n, supers, 2, 64)  # per half of 128 weights
    high = b[..., 128:192].reshape(n, supers, 2, 32)
    nibbles = torch.cat((low & 0x0F, low >> 4), dim=-1)  # weights 0..63, then 64..127
    pairs = torch.cat([(high >> shift) & 3 for shift in (0, 2, 4, 6)], dim=-1)
    quants = (nibbles | (pairs << 4)).reshape(n, supers, SUPER)
    return b[..., 208:210], b[..., 192:208].contiguous().view(torch.int8), quants


def _q6_values(d: torch.Tensor, scales: torch.Tensor, quants: torch.Tensor) -> torch.Tensor:
    """(d * sc) * (q - 32) per weight: d [..., 1] float32, scales [..., 16], quants [..., 256]."""
    scale = (d * scales.float()).repeat_interleave(16, dim=-1)
    return scale * (quants.float() - 32)


def dequantize_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    """float32 [n, K] of Q6_K blocks, as GGML computes them."""
    d, scales, quants = q6_k_parts(blocks)
    return _q6_values(_halves(d), scales, quants).reshape(blocks.shape[0], -1)


def q6k_header(d: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Q6Kx8's header [g, nb, 144] (also Q3Kx8's, lowbit.py) of d as float16 bytes
    [n, nb, 2] and the int8 scales [n, nb, 16]: each row's d, then the scales [half][row]."""
    return torch.cat((group_rows(d), group_columns(scales.view(torch.uint8))), dim=-1)


def q6k_header_fields(header: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`q6k_header` undone, as values: d float32 [g, r, nb, 1] and the scales [g, r, nb, 16]."""
    groups, supers = header.shape[:2]
    scales = (header[..., 16:144].contiguous().view(torch.int8).reshape(groups, supers, 16, ROWS)
              .permute(0, 3, 1, 2))
    return row_halves(header[..., 0:16]), scales


def to_q6kx8(blocks: torch.Tensor) -> torch.Tensor:
    """Q6_K blocks [n, K / 256 * 210] (n a multiple of 8) as Q6Kx8 [n / 8, K / 256 * 1680]."""
    n = blocks.shape[0]
    d, scales, quants = q6_k_parts(blocks)
    groups, supers = n // ROWS, d.shape[1]
    q = quants.reshape(groups, ROWS, supers, SUB_BLOCKS, 32)  # [g, r, nb, block, i]
    words = torch.cat((nibble_words(q), _pair_words(q)), dim=-1)  # [g, nb, block, 192]
    packed = torch.cat((q6k_header(d, scales), words.reshape(groups, supers, SUB_BLOCKS * 192)),
                       dim=-1)
    return packed.reshape(groups, -1).contiguous()


# Within a half of 16 quants (8s + j, s = 2u + t), quant i's two high bits at 4j + 2t.
_PAIR_SHIFT = torch.tensor([4 * (i % 8) + 2 * (i // 8) for i in range(16)])


def _pair_words(quants: torch.Tensor) -> torch.Tensor:
    """The high two bits (bits 4, 5) of quants [g, 8, nb, block, 32] as each block's two words
    per row [g, nb, block, 64]: word u of row r at bytes 32 u + 4 r (quant_blocks.h)."""
    g, rows, supers, blocks, _ = quants.shape
    return bit_words(((quants >> 4) & 3).reshape(g, rows, supers, blocks, 2, 16), _PAIR_SHIFT)


def _pair_bits(words: torch.Tensor) -> torch.Tensor:
    """`_pair_words` undone: words [g, nb, block, 64] as bits 4, 5 of quants [g, 8, nb, block,
    32]."""
    g, supers, blocks, _ = words.shape
    return word_fields(words, 2, _PAIR_SHIFT, 3).reshape(g, ROWS, supers, blocks, 32) << 4


def dequantize_q6kx8(blocks: torch.Tensor) -> torch.Tensor:
    """float32 [N, K] of Q6Kx8 blocks [N / 8, K / 256 * 1680], as GGML computes the Q6_K ones."""
    groups = blocks.shape[0]
    b = blocks.reshape(groups, -1, Q6KX8_SUPER_BYTES)
    supers = b.shape[1]
    d, scales = q6k_header_fields(b[..., :144])  # [g, r, nb, 1], [g, r, nb, 16]
    words = b[..., 144:].reshape(groups, supers, SUB_BLOCKS, 192)
    quants = (nibble_quants(words[..., :128]) | _pair_bits(words[..., 128:])).reshape(
        groups, ROWS, supers, SUPER)
    values = _q6_values(d, scales, quants)  # [g, r, nb, 256]
    return values.reshape(groups * ROWS, supers * SUPER)
