"""Every exception a worker can raise maps to a proper status, never exception text."""

from __future__ import annotations

import grpc
import torch

from shardlm_server.worker.comm import CommunicatorError
from shardlm_server.worker.errors import (
    CheckpointError,
    InvalidRequestError,
    SequenceNotCachedError,
)
from shardlm_server.worker.rpc_errors import to_shardlm_error


def test_engine_errors_keep_reason_and_field():
    error = to_shardlm_error(InvalidRequestError("bad table", field="block_table"))
    assert (error.code, error.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_FIELD")
    assert error.field_violations[0].field == "block_table"
    error = to_shardlm_error(SequenceNotCachedError("gone", sequence_id=7))
    assert (error.code, error.resource) == (grpc.StatusCode.NOT_FOUND, ("shardlm.sequence", "7"))
    assert to_shardlm_error(CheckpointError("x")).code == grpc.StatusCode.FAILED_PRECONDITION


def test_device_out_of_memory_is_resource_exhausted_for_that_step():
    error = to_shardlm_error(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate"))
    assert (error.code, error.reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "OUT_OF_MEMORY")
    assert error.retry_after_s is not None and "Tried" not in error.message


def test_peer_failure_and_bugs_leak_no_text():
    error = to_shardlm_error(CommunicatorError("gloo: Connection reset by peer 10.0.0.3"))
    assert (error.code, error.reason) == (grpc.StatusCode.UNAVAILABLE, "PEER_FAILED")
    assert "10.0.0.3" not in error.message
    error = to_shardlm_error(KeyError("secret internal detail"))
    assert (error.code, error.reason) == (grpc.StatusCode.INTERNAL, "INTERNAL")
    assert "secret" not in error.message and error.metadata["request_id"] in error.message
