"""Linear weights kept block-quantized in memory on CPU.

A `QuantizedWeight` holds a weight matrix as GGML blocks of 32 weights (Q8_0, Q4_0 or Q4_1: a
float16 scale, for Q4_1 a float16 offset, then the quants), exactly as a GGUF file stores them.
`ops.linear` multiplies it with `ops.quant_linear`, which unpacks the blocks in registers and
accumulates in float32 against unrounded activations, so a 4-bit weight costs a sixth of the
memory traffic of its bfloat16 form and the result equals the dequantized product up to
summation order. On CPU, 4-bit weights are then regrouped into Q4x8 or, for Q4_0, Q40x8
(`to_q4x8`: 8 rows side by side, the same weights at the same size), the layouts the
matrix-vector kernel reads fastest.

Where weights come from (`read_linear`):
- a GGUF tensor of a kernel type stays packed (a rank's row slice, or a column slice on block
  boundaries): Q4_0, Q4_1 and Q8_0 as stored, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q5_0, Q5_1,
  IQ4_XS, IQ4_NL and the grid i-quants (IQ3_XXS, IQ3_S, IQ2_XXS, IQ2_XS, IQ2_S, IQ1_S, IQ1_M)
  regrouped into their 8-row layouts (kquant.py, lowbit.py, iquant.py, gridquant.py) where the
  rows fill groups of 8 (Q5_0 and IQ4_NL otherwise as Q8_0, exact: recode.py); any other type
  (F16, BF16, the i-quants whose rows fill no group) is dequantized at load;
- `quantize="int8"` / `"int4"` quantizes the remaining dense weights at load, weight-only, per
  32-weight block: int8 symmetric into Q8_0, int4 with scale and minimum into Q4_1;
- `quantize="none"` dequantizes everything, and on a GPU every weight is dense (dequantized at
  load) because there is no quantized CUDA kernel yet.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from shardlm_server.worker import gridquant, iquant, kquant, lowbit, recode
from shardlm_server.worker.checkpoint import PackedTensor
from shardlm_server.worker.errors import InvalidRequestError

#: Type ids of the block formats `ops.quant_linear` reads: GGML's, and the 8-row layouts
#: (ShardLM's own, see `regrouped`).
GGML_TYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8, "Q4x8": 100, "Q4Kx8": 101, "Q6Kx8": 102,
              "Q5x8": 103, "Q5Kx8": 104, "Q40x8": 105, "Mixed": 106, "Q51x8": 107,
              "IQ4x8": 108, "IQ4NLx8": 109, "Q3Kx8": 110, "Q2Kx8": 111, "IQ3XXSx8": 112,
              "IQ3Sx8": 113, "IQ2XXSx8": 114, "IQ1Sx8": 115, "IQ2XSx8": 116, "IQ2Sx8": 117,
              "IQ1Mx8": 118}
#: The layouts of one type the compiled ops read (quant_linear, and quant_rows for a lookup).
KERNEL_LAYOUTS = tuple(t for t in GGML_TYPES if t != "Mixed")
#: GGML types the kernels read only regrouped into an 8-row layout (`regrouped`), so kept packed
#: where a weight's rows fill groups of 8.
K_LAYOUTS = {"Q4_K": ("Q4Kx8", kquant.to_q4kx8), "Q6_K": ("Q6Kx8", kquant.to_q6kx8),
             "Q5_K": ("Q5Kx8", kquant.to_q5kx8), "Q5_0": ("Q5x8", kquant.to_q5x8),
             "Q5_1": ("Q51x8", kquant.to_q51x8), "IQ4_XS": ("IQ4x8", iquant.to_iq4x8),
             "IQ4_NL": ("IQ4NLx8", iquant.to_iq4nlx8), "Q3_K": ("Q3Kx8", lowbit.to_q3kx8),
             "Q2_K": ("Q2Kx8", lowbit.to_q2kx8),
             **{qtype: (grid.layout, gridquant.converter(qtype))
                for qtype, grid in gridquant.TYPES.items()}}
#: The 8-row layouts whose rows `dequantize_rows` takes from whole dequantized groups.
GROUPED_LAYOUTS = ("Q4Kx8", "Q6Kx8", "Q5x8", "Q5Kx8", "Q40x8", "Q51x8", "IQ4x8", "IQ4NLx8",
                   "Q3Kx8", "Q2Kx8", *gridquant.LAYOUTS)
BLOCK = 32  # weights per block
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
GROUP_ROWS = 8  # rows of a Q4x8 group
#: Bytes ahead of a group-block's 128 bytes of nibble words: Q4x8's d[8] and m[8] float16, Q40x8's
#: d[8] only (Q4_0: m = -8 d).
GROUP_HEADER_BYTES = {"Q4x8": 32, "Q40x8": 16}
GROUP_BLOCK_BYTES = GROUP_HEADER_BYTES["Q4x8"] + 128

#: `--quantize` choices: "" keeps a GGUF file's kernel-type blocks packed (on CPU) and reads the
#: rest dense, "none" reads everything dense, "int8" / "int4" also quantize dense weights.
QUANTIZE_SCHEMES = {"int8": "Q8_0", "int4": "Q4_1"}
QUANTIZE_MODES = ("", "none", *QUANTIZE_SCHEMES)


@dataclass(frozen=True)
class QuantizedWeight:
    """A [N, K] weight as GGML blocks: `blocks` is uint8 [N, K / 32 * bytes per block]."""

    qtype: str
    blocks: torch.Tensor
    shape: tuple[int, int]

    @property
    def ggml_type(self) -> int:
        return GGML_TYPES[self.qtype]

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_blocks(self.blocks, self.qtype).to(dtype)


def check_mode(quantize: str) -> str:
    """`quantize` if it is a known mode, else an InvalidRequestError naming the field."""
    if quantize not in QUANTIZE_MODES:
        raise InvalidRequestError(
            f"quantize must be one of {', '.join(repr(m) for m in QUANTIZE_MODES)}, "
            f"got {quantize!r}", field="quantize")
    return quantize


def to_q4x8(weight: QuantizedWeight) -> QuantizedWeight:
    """A Q4_1 weight regrouped for the CPU matrix-vector kernel as Q4x8, a Q4_0 one as Q40x8: rows
    side by side in groups of 8, so a vector lane is an output feature (layouts in
    csrc/cpu/quant_blocks.h). The same weights exactly, at the file's size (Q40x8 keeps no offset:
    Q4_0's is m = -8 d); `weight` itself when it is of another type or its rows do not fill whole
    groups."""
    n, k = weight.shape
    if weight.qtype not in ("Q4_0", "Q4_1") or n % GROUP_ROWS:
        return weight
    groups, blocks = n // GROUP_ROWS, k // BLOCK
    b = weight.blocks.reshape(n, blocks, BLOCK_BYTES[weight.qtype])
    d = b[..., 0:2].contiguous().view(torch.float16)  # [n, blocks, 1]
    if weight.qtype == "Q4_1":
        m, qs = b[..., 2:4].contiguous().view(torch.float16), b[..., 4:]
    else:
        m, qs = d * -8, b[..., 2:]  # exact: a power of two
    quants = torch.cat((qs & 0x0F, qs >> 4), dim=-1)  # [n, blocks, 32], weight order

    def by_group(halves: torch.Tensor) -> torch.Tensor:  # [n, blocks, 1] -> [g, blocks, 16]
        return (halves.view(torch.uint8).reshape(groups, GROUP_ROWS, blocks, 2)
                .permute(0, 2, 1, 3).reshape(groups, blocks, 2 * GROUP_ROWS))

    q = quants.reshape(groups, GROUP_ROWS, blocks, 4, 8)  # [g, row, block, s, j]
    words = (q[..., 0::2] | (q[..., 1::2] << 4)).permute(0, 2, 3, 1, 4)  # [g, block, s, row, 4]
    scales = (by_group(d), by_group(m)) if weight.qtype == "Q4_1" else (by_group(d),)
    packed = torch.cat((*scales, words.reshape(groups, blocks, 128)), dim=-1)
    layout = "Q4x8" if weight.qtype == "Q4_1" else "Q40x8"
    return QuantizedWeight(layout, packed.reshape(groups, -1).contiguous(), weight.shape)


def regrouped(weight: QuantizedWeight) -> QuantizedWeight:
    """The layout the CPU kernels read `weight` in: Q40x8 / Q4x8 for Q4_0 / Q4_1 (`to_q4x8`), Q4Kx8,
    Q6Kx8, Q5Kx8 and Q5x8 for Q4_K, Q6_K, Q5_K and Q5_0 (whose rows `read_blocks` keeps to
    whole groups of 8), the weight itself otherwise."""
    if weight.qtype in K_LAYOUTS:
        layout, convert = K_LAYOUTS[weight.qtype]
        return QuantizedWeight(layout, convert(weight.blocks), weight.shape)
    return to_q4x8(weight)


def _dequantize_q4x8(blocks: torch.Tensor, qtype: str) -> torch.Tensor:
    """float32 [N, K] of Q4x8 or Q40x8 blocks [N / 8, K / 32 * group-block bytes]."""
    header = GROUP_HEADER_BYTES[qtype]
    groups = blocks.shape[0]
    b = blocks.reshape(groups, -1, header + 128)
    nblocks = b.shape[1]

    def by_row(raw: torch.Tensor) -> torch.Tensor:  # [g, blocks, 16] -> [g, row, blocks, 1]
        return raw.contiguous().view(torch.float16).float().permute(0, 2, 1).unsqueeze(-1)

    words = b[..., header:].reshape(groups, nblocks, 4, GROUP_ROWS, 4)  # [g, block, s, row, byte]
    q = torch.stack((words & 0x0F, words >> 4), dim=-1).reshape(groups, nblocks, 4, GROUP_ROWS, 8)
    q = q.permute(0, 3, 1, 2, 4).reshape(groups, GROUP_ROWS, nblocks, BLOCK).float()
    d = by_row(b[..., 0:16])
    w = d * q + (by_row(b[..., 16:32]) if qtype == "Q4x8" else d * -8)
    return w.reshape(groups * GROUP_ROWS, nblocks * BLOCK)


_K_DEQUANTIZERS = {"Q4_K": kquant.dequantize_q4_k, "Q4Kx8": kquant.dequantize_q4kx8,
                   "Q6_K": kquant.dequantize_q6_k, "Q6Kx8": kquant.dequantize_q6kx8,
                   "Q5_K": kquant.dequantize_q5_k, "Q5Kx8": kquant.dequantize_q5kx8,
                   "Q5_0": kquant.dequantize_q5_0, "Q5x8": kquant.dequantize_q5x8,
                   "Q5_1": kquant.dequantize_q5_1, "Q51x8": kquant.dequantize_q51x8,
                   "IQ4_XS": iquant.dequantize_iq4_xs, "IQ4x8": iquant.dequantize_iq4x8,
                   "IQ4_NL": iquant.dequantize_iq4_nl, "IQ4NLx8": iquant.dequantize_iq4nlx8,
                   "Q3_K": lowbit.dequantize_q3_k, "Q3Kx8": lowbit.dequantize_q3kx8,
                   "Q2_K": lowbit.dequantize_q2_k, "Q2Kx8": lowbit.dequantize_q2kx8,
                   **{qtype: functools.partial(gridquant.dequantize_grid, qtype=qtype)
                      for qtype in gridquant.TYPES},
                   **{layout: functools.partial(gridquant.dequantize_grid_layout, layout=layout)
                      for layout in gridquant.LAYOUTS}}


def dequantize_blocks(blocks: torch.Tensor, qtype: str) -> torch.Tensor:
    """float32 [N, K] of GGML blocks, computed as GGML does (the reference of quant_linear)."""
    if qtype == "Mixed":
        return torch.cat([part.dequantize() for part in mixed_parts(blocks)])
    if qtype in GROUP_HEADER_BYTES:
        return _dequantize_q4x8(blocks, qtype)
    if qtype in _K_DEQUANTIZERS:
        return _K_DEQUANTIZERS[qtype](blocks)
    n = blocks.shape[0]
    b = blocks.reshape(n, -1, BLOCK_BYTES[qtype])
    d = b[..., 0:2].contiguous().view(torch.float16).float()
    if qtype == "Q8_0":
        return (d * b[..., 2:].contiguous().view(torch.int8).float()).reshape(n, -1)
    qs = b[..., 4:] if qtype == "Q4_1" else b[..., 2:]
    q = torch.cat((qs & 0x0F, qs >> 4), dim=-1).float()
    if qtype == "Q4_0":
        return (d * (q - 8)).reshape(n, -1)
    m = b[..., 2:4].contiguous().view(torch.float16).float()
    return (d * q + m).reshape(n, -1)


def _q4x8_rows(blocks: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """float32 rows `rows` of a Q4x8 weight: each row's scale, offset and 16 nibble bytes per
    block gathered out of its group (layout in `to_q4x8`), then `_dequantize_q4x8`'s arithmetic."""
    b = blocks.reshape(blocks.shape[0], -1, GROUP_BLOCK_BYTES)
    nblocks = b.shape[1]
    r = (rows % GROUP_ROWS).unsqueeze(1)  # [n, 1]
    steps = torch.arange(2, device=rows.device)
    # Byte offsets of row r in a group block: d at 2r, m at 16 + 2r, then for each of the 4
    # sub-blocks s its 4 bytes at 32 + 32 s + 4 r.
    words = (32 + 32 * torch.arange(4, device=rows.device).view(4, 1)
             + torch.arange(4, device=rows.device).view(1, 4)).reshape(1, 16)
    offsets = torch.cat((2 * r + steps, 16 + 2 * r + steps, words + 4 * r), dim=1)  # [n, 20]
    picked = torch.gather(b.index_select(0, rows // GROUP_ROWS), 2,
                          offsets.unsqueeze(1).expand(-1, nblocks, -1))  # [n, blocks, 20]
    d = picked[..., 0:2].contiguous().view(torch.float16).float()
    m = picked[..., 2:4].contiguous().view(torch.float16).float()
    nibbles = picked[..., 4:]
    q = torch.stack((nibbles & 0x0F, nibbles >> 4), dim=-1).reshape(len(rows), nblocks, BLOCK)
    return (d * q.float() + m).reshape(len(rows), nblocks * BLOCK)


def dequantize_rows(weight: QuantizedWeight, rows: torch.Tensor) -> torch.Tensor:
    """float32 [len(rows), K]: the rows `rows` (int64 ids) of `weight`, dequantized alone and
    equal bit for bit to those rows of `weight.dequantize()` (an embedding lookup: a step reads
    a few rows, so the table stays packed)."""
    if weight.qtype == "Q4x8":
        return _q4x8_rows(weight.blocks, rows)
    if weight.qtype in GROUPED_LAYOUTS:  # the rows' groups whole, then each row of its group
        groups = dequantize_blocks(weight.blocks.index_select(0, rows // GROUP_ROWS), weight.qtype)
        picked = torch.arange(len(rows), device=rows.device) * GROUP_ROWS + rows % GROUP_ROWS
        return groups.index_select(0, picked)
    return dequantize_blocks(weight.blocks.index_select(0, rows), weight.qtype)


def _halves(values: torch.Tensor) -> torch.Tensor:
    """float16 values [n, nb, 1] as their bytes [n, nb, 2]."""
    return values.to(torch.float16).contiguous().view(torch.uint8)


def quantize(weight: torch.Tensor, scheme: str) -> QuantizedWeight:
    """Weight-only block quantization of a [N, K] weight (K a multiple of 32): "int8" gives Q8_0
    (d = max|w| / 127, q = round(w / d)), "int4" gives Q4_1 (d = (max - min) / 15, m = min,
    q = round((w - m) / d)); scales are rounded to float16 before the quants are chosen."""
    qtype = QUANTIZE_SCHEMES[scheme]
    n, k = weight.shape
    if k % BLOCK:
        raise ValueError(f"cannot quantize a weight of {k} input features in blocks of {BLOCK}")
    w = weight.detach().float().cpu().reshape(n, k // BLOCK, BLOCK)
    if qtype == "Q8_0":
        d = (w.abs().amax(-1, keepdim=True) / 127).half().float()
        inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
        q = (w * inv).round().clamp(-127, 127).to(torch.int8).view(torch.uint8)
        packed = torch.cat((_halves(d), q), dim=-1)
    else:
        lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
        d = ((hi - lo) / 15).half().float()
        m = lo.half().float()
        inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
        q = ((w - m) * inv).round().clamp(0, 15).to(torch.uint8)
        nibbles = q[..., :16] | (q[..., 16:] << 4)
        packed = torch.cat((_halves(d), _halves(m), nibbles), dim=-1)
    return QuantizedWeight(qtype, packed.reshape(n, -1).contiguous(), (n, k))


def cat_rows(weights: list[QuantizedWeight]) -> QuantizedWeight | None:
    """The weights stacked by rows (fused q/k/v, gate/up), or None when their types differ."""
    if len({w.qtype for w in weights}) != 1 or len({w.shape[1] for w in weights}) != 1:
        return None
    blocks = torch.cat([w.blocks for w in weights]).contiguous()
    return QuantizedWeight(weights[0].qtype, blocks,
                           (sum(w.shape[0] for w in weights), weights[0].shape[1]))


def read_blocks(reader, name: str, shape: tuple[int, int], *, shard_dim: int | None = None,
                rank: int = 0, world_size: int = 1) -> QuantizedWeight | None:
    """`name`'s slice as the file's blocks when it is of a kernel type and the reader keeps
    weights packed (on CPU, unless quantize="none"); None when it must be read dense."""
    if reader.device.type != "cpu" or reader.quantize == "none":
        return None
    packed = reader.read_packed(name, shape, shard_dim=shard_dim, rank=rank,
                                world_size=world_size)
    if packed is None:
        return None
    grouped = packed.shape[0] % GROUP_ROWS == 0  # the 8-row layouts take whole groups only
    if packed.qtype in recode.RECODED and not grouped:
        qtype, convert = recode.RECODED[packed.qtype]
        packed = PackedTensor(qtype, convert(packed.blocks), packed.shape)
    if packed.qtype in K_LAYOUTS and grouped:
        return QuantizedWeight(packed.qtype, packed.blocks.contiguous(), packed.shape)
    if packed.qtype not in BLOCK_BYTES:
        return None
    return QuantizedWeight(packed.qtype, packed.blocks.contiguous(), packed.shape)


def read_linear(reader, name: str, shape: tuple[int, int], *, shard_dim: int | None = None,
                rank: int = 0, world_size: int = 1,
                dense: torch.Tensor | None = None,
                regroup: bool = True) -> torch.Tensor | QuantizedWeight:
    """A linear layer's weight slice: packed when the reader's quantize mode and the device allow
    it (see the module notes), else dense in the serving dtype. `dense`, when given, is the slice
    already read (a tied embedding) and is returned when no packed form is made. `regroup=False`
    leaves 4-bit blocks as the file stores them, for parts that `fuse_rows` stacks first."""
    group = regrouped if regroup else (lambda weight: weight)
    mode = reader.quantize
    if reader.device.type != "cpu" or mode == "none":
        return dense if dense is not None else reader.read(
            name, shape, shard_dim=shard_dim, rank=rank, world_size=world_size)
    packed = read_blocks(reader, name, shape, shard_dim=shard_dim, rank=rank,
                         world_size=world_size)
    if packed is not None:
        return group(packed)
    if dense is None:
        dense = reader.read(name, shape, shard_dim=shard_dim, rank=rank, world_size=world_size)
    if mode in QUANTIZE_SCHEMES and dense.dim() == 2 and dense.shape[1] % BLOCK == 0:
        return group(quantize(dense, mode))
    return dense


_TYPE_NAMES = {v: name for name, v in GGML_TYPES.items()}
MIXED_ALIGN = 64  # bytes: the header and every part of a Mixed weight start on this boundary


def _aligned(data: torch.Tensor) -> torch.Tensor:
    return torch.cat((data, data.new_zeros(-data.numel() % MIXED_ALIGN)))


def mixed_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Row-stacked weights of different block types (a Q4_K_M file's q/k/v with a Q6_K attn_v)
    as one "Mixed" weight, each part kept in its own type: uint8 [1, bytes] holding a header of
    int64 words (count, K, then per part its type id, rows and bytes), then each part's blocks,
    every piece 64-byte aligned (csrc/mixed_rows.h reads it). quant_linear runs each part into its
    columns of the output."""
    k = parts[0].shape[1]
    words = [len(parts), k, *(v for p in parts for v in (p.ggml_type, p.shape[0], p.nbytes))]
    header = torch.tensor(words, dtype=torch.int64).view(torch.uint8)
    pieces = [_aligned(header), *(_aligned(p.blocks.reshape(-1)) for p in parts)]
    return QuantizedWeight("Mixed", torch.cat(pieces).reshape(1, -1),
                           (sum(p.shape[0] for p in parts), k))


def mixed_parts(blocks: torch.Tensor) -> list[QuantizedWeight]:
    """The parts of a Mixed weight's blocks (`mixed_rows`), as views."""
    flat = blocks.reshape(-1)
    count, k = flat[:16].clone().view(torch.int64).tolist()
    words = flat[16:8 * (2 + 3 * count)].clone().view(torch.int64).tolist()
    parts, offset = [], 8 * (2 + 3 * count) + -(8 * (2 + 3 * count)) % MIXED_ALIGN
    for i in range(count):
        qtype, rows, nbytes = _TYPE_NAMES[words[3 * i]], words[3 * i + 1], words[3 * i + 2]
        rows_per_row = GROUP_ROWS if GGML_TYPES[qtype] >= 100 else 1
        part = flat[offset:offset + nbytes].view(rows // rows_per_row, -1)
        parts.append(QuantizedWeight(qtype, part, (rows, k)))
        offset += nbytes + -nbytes % MIXED_ALIGN
    return parts


def fuse_rows(weights: list[torch.Tensor | QuantizedWeight],
              dtype: torch.dtype) -> torch.Tensor | QuantizedWeight:
    """Row-stacked weights for one GEMM: packed when all are packed alike (4-bit ones then
    regrouped, see `regrouped`), or Q5_0 beside Q8_0 (llama-quantize's mixes: a SmolLM2 Q4_K_M
    file's attn_v) all as Q8_0, exactly; packed parts of other types side by side as one Mixed
    weight (`mixed_rows`: a Q4_K_M file's Q4_K q/k and Q6_K v); else dense."""
    if all(isinstance(w, QuantizedWeight) for w in weights):
        if len({w.qtype for w in weights}) > 1 and {w.qtype for w in weights} <= {"Q5_0", "Q8_0"}:
            weights = [QuantizedWeight("Q8_0", kquant.q5_0_to_q8_0(w.blocks), w.shape)
                       if w.qtype == "Q5_0" else w for w in weights]
        fused = cat_rows(weights)
        if fused is not None:
            return regrouped(fused)
        if len({w.shape[1] for w in weights}) == 1:
            return mixed_rows([regrouped(w) for w in weights])
    dense = [w.dequantize(dtype) if isinstance(w, QuantizedWeight) else w for w in weights]
    return torch.cat(dense).contiguous()
