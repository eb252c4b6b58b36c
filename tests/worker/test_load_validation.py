"""Worker Load request checks (worker.proto's CommBackend rule): a multi-rank load must name its
communicator backend; a single-rank one needs none."""

from __future__ import annotations

import pytest
from shardlm.errors import InvalidArgumentError
from shardlm.worker.v1 import worker_pb2

from shardlm_server.worker.worker_servicer import _validate_comm, _validate_load


def _request(world_size: int, backend: int, **comm) -> worker_pb2.LoadRequest:
    return worker_pb2.LoadRequest(model_path="/models/m", device="cpu", rank=0,
                                  world_size=world_size,
                                  comm=worker_pb2.CommunicatorConfig(backend=backend, **comm))


def test_multi_rank_load_without_a_backend_is_rejected():
    with pytest.raises(InvalidArgumentError) as err:
        _validate_comm(_request(2, worker_pb2.COMM_BACKEND_UNSPECIFIED))
    assert err.value.reason == "INVALID_FIELD"
    assert [v.field for v in err.value.field_violations] == ["comm.backend"]


def test_single_rank_load_needs_no_backend():
    request = _request(1, worker_pb2.COMM_BACKEND_UNSPECIFIED)
    assert _validate_load(request).type == "cpu"
    _validate_comm(request)


def test_gloo_still_needs_the_rendezvous_address():
    with pytest.raises(InvalidArgumentError) as err:
        _validate_comm(_request(2, worker_pb2.COMM_BACKEND_GLOO))
    assert [v.field for v in err.value.field_violations] == ["comm.init_address"]
    _validate_comm(_request(2, worker_pb2.COMM_BACKEND_GLOO, init_address="h:1"))
