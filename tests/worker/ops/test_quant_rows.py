"""ops.quant_rows (csrc/cpu/quant_linear.cpp), the compiled embedding lookup of a packed table:
rows equal the dequantized table's bit for bit in every layout the kernels read, at every SIMD
level, for a decode step's few ids and a prefill's many (split over the threads); bad ids and
tensors are refused with a message, never read out of bounds."""

from __future__ import annotations

import pytest
import torch

from shardlm_server.worker import ops
from shardlm_server.worker.ops import reference
from shardlm_server.worker.quant import KERNEL_LAYOUTS, QuantizedWeight, to_q4x8
from tests.worker.ops.test_kquant import SOURCES, k_weight
from tests.worker.ops.test_quant_ops import ggml_weight

if ops.USE_REFERENCE:
    pytest.skip("SHARDLM_OPS=reference: nothing compiled to test", allow_module_level=True)

ROWS, COLS = 48, 512  # whole groups of 8 rows; 512 = two K-quant super-blocks


def table(layout: str) -> QuantizedWeight:
    """A random [ROWS, COLS] table held in `layout`, as a model loads it on CPU."""
    if layout in SOURCES:
        weight = k_weight(ROWS, COLS, SOURCES[layout], seed=4)
    elif layout in ("Q4x8", "Q40x8"):
        weight = to_q4x8(ggml_weight(ROWS, COLS, "Q4_1" if layout == "Q4x8" else "Q4_0", seed=4))
    else:
        weight = ggml_weight(ROWS, COLS, layout, seed=4)
    assert weight.qtype == layout
    return weight


@pytest.mark.parametrize("level", ops.SIMD_LEVELS)
@pytest.mark.parametrize("layout", KERNEL_LAYOUTS)
def test_rows_equal_the_dequantized_table(layout, level):
    weight = table(layout)
    dense = weight.dequantize()
    decode = torch.tensor([0, 47, 7, 8, 8, 31])  # group edges, a repeat
    prefill = torch.randint(0, ROWS, (300,), generator=torch.Generator().manual_seed(5))
    try:
        ops.set_cpu_simd(level)
        for ids in (decode, prefill, decode[:1]):
            rows = ops.quant_rows(weight, ids)
            assert rows.dtype == torch.float32 and rows.shape == (len(ids), COLS)
            assert torch.equal(rows, dense[ids])
            assert torch.equal(rows, reference.quant_rows(weight, ids))
        assert ops.quant_rows(weight, decode[:0]).shape == (0, COLS)
    finally:
        ops.set_cpu_simd(True)


def test_bad_ids_and_tensors_are_refused():
    weight = table("Q8_0")
    op = torch.ops.shardlm.quant_rows

    def call(ids, out=None, qtype=8, blocks=weight.blocks):
        out = torch.empty(len(ids), COLS) if out is None else out
        op(out, blocks, qtype, ids)

    for bad in (-1, ROWS, 2**40):
        with pytest.raises(IndexError, match=f"id {bad} is out of range for {ROWS} rows"):
            call(torch.tensor([0, bad]))
    with pytest.raises(RuntimeError, match="ids must be an int64"):
        call(torch.tensor([0, 1], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="out must be a float32"):
        call(torch.tensor([0, 1]), out=torch.empty(2, COLS, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="block type 106 is not supported"):
        call(torch.tensor([0]), qtype=106)
    with pytest.raises(RuntimeError, match="whole number of 20-byte blocks"):
        call(torch.tensor([0]), qtype=3)


def test_opcheck():
    for layout in ("Q8_0", "Q4x8", "Q6Kx8"):
        weight = table(layout)
        ids = torch.tensor([3, 9, 40])
        torch.library.opcheck(torch.ops.shardlm.quant_rows,
                              (torch.empty(3, COLS), weight.blocks, weight.ggml_type, ids))
