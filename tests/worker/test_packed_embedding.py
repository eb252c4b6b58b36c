"""The token embedding of a packed GGUF model stays in its blocks (worker.layers
VocabParallelEmbedding): a lookup dequantizes only the rows it reads and equals the dense table
bit for bit, on one rank and with the vocabulary split over two; a tied lm_head shares the very
same blocks, so no float copy of the table and no second copy of its blocks exists."""

from __future__ import annotations

import pytest
import torch

from shardlm_server.worker.comm import SingleRankCommunicator
from shardlm_server.worker.engine import Engine
from shardlm_server.worker.kv_cache import CacheConfig
from shardlm_server.worker.layers import Parallel, VocabParallelEmbedding
from shardlm_server.worker.loader import open_checkpoint
from shardlm_server.worker.quant import QuantizedWeight, dequantize_rows, quantize, to_q4x8
from tests.gguf_files import GGUFSpec, T, write_gguf

NAME = "model.embed_tokens.weight"
CACHE = CacheConfig(block_size=16, num_blocks=16)


class _Rank(SingleRankCommunicator):
    """Rank `rank` of `world_size`, with the all-reduce left to the test (it sums the ranks)."""

    def __init__(self, rank: int, world_size: int) -> None:
        super().__init__()
        self.rank, self.world_size = rank, world_size

    def all_reduce(self, tensor: torch.Tensor) -> None:
        pass


def _weight(qtype: str, rows: int = 64, cols: int = 96) -> QuantizedWeight:
    if qtype == "Q40x8":
        return to_q4x8(_weight("Q4_0", rows, cols))
    dense = torch.randn(rows, cols, generator=torch.Generator().manual_seed(3))
    if qtype == "Q4_0":  # `quantize` makes no Q4_0: Q4_1's blocks without their offsets
        q41 = quantize(dense, "int4").blocks.reshape(rows, -1, 20)
        blocks = torch.cat((q41[..., 0:2], q41[..., 4:]), -1).reshape(rows, -1).contiguous()
        return QuantizedWeight("Q4_0", blocks, (rows, cols))
    weight = quantize(dense, "int8" if qtype == "Q8_0" else "int4")
    return to_q4x8(weight) if qtype == "Q4x8" else weight


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q4x8", "Q40x8"])
def test_rows_equal_the_dequantized_table_bit_for_bit(qtype):
    weight = _weight(qtype)
    assert weight.qtype == qtype
    ids = torch.tensor([0, 63, 7, 8, 8, 31, 1, 40])
    assert torch.equal(dequantize_rows(weight, ids), weight.dequantize()[ids])


@pytest.fixture(scope="module", params=[T.Q8_0, T.Q4_0, T.Q4_1])
def packed_file(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"embed-{request.param.name}") / "model.gguf"
    write_gguf(path, GGUFSpec("llama", tied=True, default_type=T.Q4_1,
                              types={"token_embd.weight": request.param}))
    return path, request.param.name


def _embedding(path, rank: int = 0, world_size: int = 1, quantize: str = ""):
    with open_checkpoint(path, torch.device("cpu"), torch.float32, quantize) as reader:
        return VocabParallelEmbedding.load(reader, Parallel(_Rank(rank, world_size)), NAME,
                                           reader.config.vocab_size, reader.config.hidden_size)


def test_lookups_equal_the_dense_embedding(packed_file):
    path, qtype = packed_file
    packed, dense = _embedding(path), _embedding(path, quantize="none")
    assert isinstance(packed.weight, QuantizedWeight) and packed.weight.qtype == qtype
    assert isinstance(dense.weight, torch.Tensor)
    ids = torch.tensor([0, 399, 5, 5, 123, 8, 256, 1])
    assert torch.equal(packed(ids), dense(ids))
    # The head's layout (4-bit tables regrouped for a tied head) is looked up alike.
    packed.tied_head()
    assert torch.equal(packed(ids), dense(ids))


def test_a_vocabulary_split_over_two_ranks_sums_to_the_dense_rows(packed_file):
    path, _ = packed_file
    dense = _embedding(path, quantize="none")
    ranks = [_embedding(path, rank, 2) for rank in range(2)]
    assert all(isinstance(r.weight, QuantizedWeight) and r.weight.shape[0] == 200 for r in ranks)
    ids = torch.tensor([0, 199, 200, 399, 17, 250])
    assert torch.equal(ranks[0](ids) + ranks[1](ids), dense(ids))


def test_a_tied_head_shares_the_packed_blocks(packed_file):
    path, qtype = packed_file
    engine = Engine.load(path, dtype="float32", cache_config=CACHE)
    embed, head = engine.model.embed.weight, engine.model.lm_head.weight
    assert head is embed  # one copy of the blocks, nothing dense
    assert embed.qtype == {"Q8_0": "Q8_0", "Q4_0": "Q40x8"}.get(qtype, "Q4x8")
    assert engine.model.embed.dtype == torch.float32
