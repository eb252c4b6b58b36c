"""One place that turns whatever a worker call raised into a proper gRPC status.

Engine errors carry a stable reason; each reason has one status code. A communicator failure
means a peer is gone (UNAVAILABLE). Anything else is a bug: the client gets INTERNAL with a
request id, the log gets the traceback, and no exception text leaves the process.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import torch
from shardlm.errors import FieldViolation, ShardLMError

from shardlm_server.worker.comm import CommunicatorError
from shardlm_server.worker.errors import EngineError

log = logging.getLogger("shardlm.worker")

CODES = {
    "INVALID_FIELD": grpc.StatusCode.INVALID_ARGUMENT,
    "TENSOR_PARALLEL_MISMATCH": grpc.StatusCode.INVALID_ARGUMENT,
    "CHECKPOINT_INVALID": grpc.StatusCode.FAILED_PRECONDITION,
    "UNSUPPORTED_ARCHITECTURE": grpc.StatusCode.FAILED_PRECONDITION,
    "SEQUENCE_NOT_CACHED": grpc.StatusCode.NOT_FOUND,
    "KV_CACHE_FULL": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "OUT_OF_MEMORY": grpc.StatusCode.RESOURCE_EXHAUSTED,
}


def to_shardlm_error(exc: BaseException) -> ShardLMError:
    if isinstance(exc, ShardLMError):
        return exc
    if isinstance(exc, EngineError):
        field = exc.metadata.get("field")
        violations = [FieldViolation(field, exc.message)] if field else None
        resource = None
        if exc.reason == "SEQUENCE_NOT_CACHED":
            resource = ("shardlm.sequence", exc.metadata.get("sequence_id", ""))
        return ShardLMError(exc.message, reason=exc.reason, code=CODES.get(exc.reason, grpc.StatusCode.INTERNAL),
                            metadata=exc.metadata, field_violations=violations, resource=resource)
    if isinstance(exc, CommunicatorError):
        log.error("collective failed: %s", exc)
        return ShardLMError("a tensor-parallel peer failed or timed out", reason="PEER_FAILED",
                            code=grpc.StatusCode.UNAVAILABLE, retry_after_s=1.0)
    if isinstance(exc, torch.OutOfMemoryError):
        return ShardLMError("device out of memory during the step", reason="OUT_OF_MEMORY",
                            code=grpc.StatusCode.RESOURCE_EXHAUSTED, retry_after_s=1.0)
    request_id = uuid.uuid4().hex[:12]
    log.error("internal error (request %s)", request_id, exc_info=exc)
    return ShardLMError(f"internal error; request id {request_id}", reason="INTERNAL",
                        code=grpc.StatusCode.INTERNAL, metadata={"request_id": request_id})


def _abort(context: grpc.ServicerContext, exc: BaseException) -> None:
    context.abort_with_status(to_shardlm_error(exc).to_grpc_status())


class ErrorMappingInterceptor(grpc.ServerInterceptor):
    """Wraps every unary and server-streaming handler so that exceptions become statuses."""

    def intercept_service(self, continuation: Callable, handler_call_details: Any):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        if handler.unary_unary:
            inner = handler.unary_unary

            def unary(request, context):
                try:
                    return inner(request, context)
                except Exception as exc:  # noqa: BLE001 - mapped, never leaked
                    if _already_aborted(exc):
                        raise
                    _abort(context, exc)

            return grpc.unary_unary_rpc_method_handler(
                unary, handler.request_deserializer, handler.response_serializer)
        if handler.unary_stream:
            inner_stream = handler.unary_stream

            def stream(request, context) -> Iterator:
                try:
                    yield from inner_stream(request, context)
                except Exception as exc:  # noqa: BLE001
                    if _already_aborted(exc):
                        raise
                    _abort(context, exc)

            return grpc.unary_stream_rpc_method_handler(
                stream, handler.request_deserializer, handler.response_serializer)
        return handler


def _already_aborted(exc: BaseException) -> bool:
    # grpc's context.abort ends the handler by raising a bare `Exception()`; let it through.
    return type(exc) is Exception and not exc.args
