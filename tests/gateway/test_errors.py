"""The gateway's exception mapping: rich statuses pass through, bugs become INTERNAL with a
request id and no text, and only a lost worker (not an out-of-memory step) triggers recovery."""

from __future__ import annotations

import grpc
from shardlm.errors import ResourceExhaustedError, UnavailableError

from shardlm_server.gateway.api.interceptors import to_error
from shardlm_server.gateway.api.runtime import Runtime
from shardlm_server.gateway.text.tokenizer import TokenizerError


def test_to_error():
    assert to_error(TokenizerError("template refused")).code == grpc.StatusCode.INVALID_ARGUMENT
    error = to_error(ZeroDivisionError("internal detail"))
    assert error.code == grpc.StatusCode.INTERNAL and "detail" not in error.message
    assert error.metadata["request_id"] in error.message


def test_only_unavailable_triggers_recovery():
    calls = []
    runtime = Runtime.__new__(Runtime)  # only the failure path is exercised
    runtime.model = None
    runtime.on_failure = calls.append
    runtime._worker_failed(ResourceExhaustedError("oom", reason="OUT_OF_MEMORY"))
    assert calls == []
    runtime._worker_failed(UnavailableError("gone", reason="WORKER_UNAVAILABLE"))
    assert len(calls) == 1
