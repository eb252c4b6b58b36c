"""LoadRequest.quantize through real worker processes: int8 over two ranks serves what one rank
serves, and an unknown mode is INVALID_ARGUMENT naming the field."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from shardlm.errors import ShardLMError
from shardlm.worker.v1 import worker_pb2

from tests.worker.live_workers import LiveWorkers
from tests.worker.test_service import KV, greedy_run


@pytest.fixture(scope="module")
def groups():
    spawned = {world: LiveWorkers(world) for world in (1, 2)}
    for group in spawned.values():
        group.quantize = "int8"
    yield spawned
    for group in spawned.values():
        group.close()


def test_int8_over_two_ranks_matches_one_rank(groups, llama_dir):
    tokens1, logits1 = greedy_run(groups[1], llama_dir)
    tokens2, logits2 = greedy_run(groups[2], llama_dir)
    assert tokens1 == tokens2
    np.testing.assert_allclose(logits1, logits2, atol=1e-4, rtol=0)


def test_an_unknown_quantize_mode_is_invalid_argument(groups, llama_dir):
    with pytest.raises(grpc.RpcError) as err:
        list(groups[1].handles[0].stub.Load(worker_pb2.LoadRequest(
            model_path=str(llama_dir), device="cpu", world_size=1, kv_cache=KV,
            quantize="int3")))
    error = ShardLMError.from_rpc_error(err.value)
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "quantize must be one of" in error.message
