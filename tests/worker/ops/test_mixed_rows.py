"""Mixed weights (worker.quant.mixed_rows, csrc/mixed_rows.h): row-stacked parts of different
block types kept packed side by side, as a Q4_K_M file's fused q/k/v with a Q6_K attn_v needs.
quant_linear on one equals the parts' products side by side (exact and int8 activations, every
row count, half precision), and a malformed header is refused with a message."""

from __future__ import annotations

import pytest
import torch

from shardlm_server.worker import ops
from shardlm_server.worker.ops import activations, reference
from shardlm_server.worker.quant import (
    QuantizedWeight,
    fuse_rows,
    mixed_parts,
    mixed_rows,
)
from tests.worker.ops.test_kquant import k_weight
from tests.worker.ops.test_quant_ops import TOL, ggml_weight

if ops.USE_REFERENCE:
    pytest.skip("SHARDLM_OPS=reference: nothing compiled to test", allow_module_level=True)


def parts() -> list[QuantizedWeight]:
    """A Q4_K_M file's mix, a Q3_K_M one's (Q3_K), an IQ4_XS one's and an IQ3_XXS one's (IQ3_S):
    k_weight regroups."""
    return [k_weight(64, 512, "Q4_K"), k_weight(16, 512, "Q6_K", seed=1),
            ggml_weight(8, 512, "Q8_0", seed=2), k_weight(16, 512, "Q3_K", seed=3),
            k_weight(8, 512, "IQ4_XS", seed=4), k_weight(8, 512, "IQ3_S", seed=5)]


def test_the_parts_come_back_as_they_went_in():
    pieces = parts()
    weight = mixed_rows(pieces)
    assert weight.qtype == "Mixed" and weight.shape == (120, 512)
    padding = (len(pieces) + 1) * 64  # the header and every part start on 64-byte boundaries
    assert weight.blocks.shape[0] == 1 and weight.nbytes < sum(p.nbytes for p in pieces) + padding
    for got, want in zip(mixed_parts(weight.blocks), pieces, strict=True):
        assert got.qtype == want.qtype and got.shape == want.shape
        assert torch.equal(got.blocks, want.blocks)
    torch.testing.assert_close(weight.dequantize(), torch.cat([p.dequantize() for p in pieces]),
                               atol=0, rtol=0)


@pytest.mark.parametrize("precision", activations.ACTIVATION_PRECISIONS)
@pytest.mark.parametrize("m", [1, 3, 40])
def test_quant_linear_is_the_parts_side_by_side(precision, m):
    weight = mixed_rows(parts())
    x, bias = torch.randn(m, 512), torch.randn(120)
    with activations.using(precision):
        got = ops.quant_linear(x, weight, bias)
        expected = reference.quant_linear(x, weight.blocks, weight.qtype, bias)
    torch.testing.assert_close(got, expected, **TOL[torch.float32])


def test_half_precision_inputs():
    weight = mixed_rows(parts())
    x = torch.randn(5, 512).bfloat16()
    torch.testing.assert_close(ops.quant_linear(x, weight),
                               reference.quant_linear(x, weight.blocks, weight.qtype),
                               **TOL[torch.bfloat16])


def test_fuse_rows_keeps_parts_of_different_types_packed():
    q, k, v = (k_weight(32, 512, "Q4_K"), k_weight(16, 512, "Q4_K", seed=1),
               k_weight(16, 512, "Q6_K", seed=2))
    fused = fuse_rows([q, k, v], torch.float32)
    assert fused.qtype == "Mixed"
    assert [p.qtype for p in mixed_parts(fused.blocks)] == ["Q4Kx8", "Q4Kx8", "Q6Kx8"]
    torch.testing.assert_close(fused.dequantize(),
                               torch.cat([w.dequantize() for w in (q, k, v)]), atol=0, rtol=0)


def test_malformed_headers_are_refused():
    weight = mixed_rows(parts())
    x, out = torch.randn(1, 512), torch.empty(1, 120)

    def run(blocks: torch.Tensor) -> None:
        torch.ops.shardlm.quant_linear(out, x, blocks, 106, None)

    bad_count = weight.blocks.clone()
    bad_count[0, :8] = torch.tensor([0], dtype=torch.int64).view(torch.uint8)
    with pytest.raises(RuntimeError, match="header is malformed"):
        run(bad_count)
    bad_type = weight.blocks.clone()
    bad_type[0, 16:24] = torch.tensor([106], dtype=torch.int64).view(torch.uint8)
    with pytest.raises(RuntimeError, match="block type 106"):
        run(bad_type)
    with pytest.raises(RuntimeError, match="header is malformed"):
        run(weight.blocks[:, :200].contiguous())  # parts cut off
    bad_rows = weight.blocks.clone()
    bad_rows[0, 24:32] = torch.tensor([63], dtype=torch.int64).view(torch.uint8)
    with pytest.raises(RuntimeError, match="does not hold"):
        run(bad_rows)
