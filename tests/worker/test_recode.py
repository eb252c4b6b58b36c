"""IQ4_NL and Q5_0 re-encoded as Q8_0 (worker/recode.py) where rows fill no group of 8: every
weight equal bit for bit to what the `gguf` package's GGML dequantizers give for the file's own
blocks; and a file's tensors of the types with 8-row layouts kept packed, in those layouts where
the rows fill groups of 8 (Q3_K: worker/lowbit.py), else re-encoded or read dense."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from shardlm_server.worker import iquant, lowbit, recode
from shardlm_server.worker.checkpoint import PackedTensor
from shardlm_server.worker.quant import QuantizedWeight, dequantize_blocks, read_blocks, read_linear
from tests.gguf_files import QUANTIZABLE, random_k_blocks

T = gguf.GGMLQuantizationType


def _blocks(qtype: T, rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    if qtype in QUANTIZABLE:
        values = rng.standard_normal((rows, cols)).astype(np.float32)
        return torch.from_numpy(gguf.quants.quantize(values, qtype))
    return torch.from_numpy(random_k_blocks(rows, cols, qtype, rng))


def _ggml(blocks: torch.Tensor, qtype: T) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(blocks.numpy(), qtype),
                                                 dtype=np.float32))


def test_the_iq4_table_is_ggmls():
    assert iquant.IQ4_VALUES == tuple(gguf.quants.IQ4_NL.kvalues)


def test_iq4_nl_as_q8_0_holds_the_same_weights():
    blocks = _blocks(T.IQ4_NL, 5, 320, seed=3)
    q8 = recode.iq4_nl_to_q8_0(blocks)
    assert q8.shape == (5, 10 * 34)
    assert torch.equal(dequantize_blocks(q8, "Q8_0"), _ggml(blocks, T.IQ4_NL))


class _Reader:
    """A checkpoint reader of one packed tensor, as the GGUF reader hands it over."""

    def __init__(self, qtype: T, blocks: torch.Tensor, shape: tuple[int, int]) -> None:
        self.device, self.quantize, self.dtype = torch.device("cpu"), "", torch.float32
        self.packed = PackedTensor(qtype.name, blocks, shape)
        self.dense = _ggml(blocks, qtype)

    def read_packed(self, name, shape, **_):
        return self.packed

    def read(self, name, shape, **_):
        return self.dense


# rows: whole groups of 8 (the type's 8-row layout), or not (IQ4_NL and Q5_0 then held as Q8_0)
@pytest.mark.parametrize("qtype,rows,layout", [(T.Q3_K, 24, "Q3Kx8"), (T.IQ4_NL, 20, "Q8_0"),
                                               (T.IQ4_NL, 24, "IQ4NLx8"), (T.Q5_0, 20, "Q8_0")])
def test_a_file_tensor_stays_packed(qtype, rows, layout):
    cols = 512
    reader = _Reader(qtype, _blocks(qtype, rows, cols, seed=4), (rows, cols))
    weight = read_linear(reader, "w", (rows, cols))
    assert isinstance(weight, QuantizedWeight) and weight.qtype == layout
    assert torch.equal(weight.dequantize(), reader.dense)


def test_q3_k_fields_dequantize_as_ggml():
    blocks = _blocks(T.Q3_K, 6, 768)
    d, scales, quants = lowbit.q3_k_parts(blocks)
    assert int(quants.min()) == -4 and int(quants.max()) == 3  # random bytes take every value
    assert int(scales.min()) == -32 and int(scales.max()) == 31
    assert torch.equal(lowbit.dequantize_q3_k(blocks), _ggml(blocks, T.Q3_K))


def test_q3_k_rows_that_fill_no_groups_of_8_are_read_dense():
    reader = _Reader(T.Q3_K, _blocks(T.Q3_K, 12, 256, seed=5), (12, 256))
    assert read_blocks(reader, "w", (12, 256)) is None
    assert torch.equal(read_linear(reader, "w", (12, 256)), reader.dense)
