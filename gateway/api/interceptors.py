"""The one place where exceptions become gRPC statuses (and metrics count final statuses).

A `ShardLMError` carries its code and rich details. A tokenizer error is the user's input (a chat
template that refused the messages): INVALID_ARGUMENT. Anything else is a bug: the client gets
INTERNAL with a request id and no exception text; the log gets the traceback under that id.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

import grpc
from shardlm.errors import ShardLMError

from shardlm_server.gateway.metrics import Metrics
from shardlm_server.gateway.text.tokenizer import TokenizerError

log = logging.getLogger("shardlm.gateway")


def to_error(exc: BaseException) -> ShardLMError:
    if isinstance(exc, ShardLMError):
        return exc
    if isinstance(exc, TokenizerError):
        return ShardLMError(str(exc), reason="INVALID_FIELD", code=grpc.StatusCode.INVALID_ARGUMENT)
    request_id = uuid.uuid4().hex[:12]
    log.error("internal error (request %s)", request_id, exc_info=exc)
    return ShardLMError(f"internal error; request id {request_id}", reason="INTERNAL",
                        code=grpc.StatusCode.INTERNAL, metadata={"request_id": request_id})


class _Undecodable:
    """Stands for a request body that did not parse (gRPC would answer UNKNOWN with the parser's
    exception text if the deserializer raised)."""


def _tolerant(deserialize: Callable | None) -> Callable | None:
    if deserialize is None:
        return None

    def parse(data: bytes):
        try:
            return deserialize(data)
        except Exception:  # noqa: BLE001 - any parse failure is the client's malformed body
            return _Undecodable()

    return parse


def _check_decoded(request: Any) -> None:
    if isinstance(request, _Undecodable):
        raise ShardLMError("the request body is not a valid protobuf message of this RPC",
                           reason="INVALID_FIELD", code=grpc.StatusCode.INVALID_ARGUMENT)


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def _done(self, method: str, code: grpc.StatusCode, started: float) -> None:
        self.metrics.requests.labels(method, code.name).inc()
        self.metrics.request_duration.labels(method).observe(time.monotonic() - started)

    async def intercept_service(self, continuation: Callable, details: Any):
        handler = await continuation(details)
        if handler is None:
            return None
        method = details.method.rsplit("/", 1)[-1]
        deserialize = _tolerant(handler.request_deserializer)
        if handler.unary_unary:
            inner = handler.unary_unary

            async def unary(request, context):
                started = time.monotonic()
                try:
                    _check_decoded(request)
                    reply = await inner(request, context)
                except asyncio.CancelledError:
                    self._done(method, grpc.StatusCode.CANCELLED, started)
                    raise
                except Exception as exc:  # noqa: BLE001 - mapped, never leaked
                    await self._abort(context, exc, method, started)
                self._done(method, grpc.StatusCode.OK, started)
                return reply

            return grpc.unary_unary_rpc_method_handler(
                unary, deserialize, handler.response_serializer)
        if handler.unary_stream:
            inner_stream = handler.unary_stream

            async def stream(request, context):
                started = time.monotonic()
                try:
                    _check_decoded(request)
                    replies = inner_stream(request, context)
                    if inspect.isawaitable(replies):  # writes with context.write (health Watch)
                        await replies
                    else:
                        async for message in replies:
                            yield message
                except asyncio.CancelledError:
                    self._done(method, grpc.StatusCode.CANCELLED, started)
                    raise
                except Exception as exc:  # noqa: BLE001
                    await self._abort(context, exc, method, started)
                self._done(method, grpc.StatusCode.OK, started)

            return grpc.unary_stream_rpc_method_handler(
                stream, deserialize, handler.response_serializer)
        return handler

    async def _abort(self, context, exc: BaseException, method: str, started: float) -> None:
        if isinstance(exc, grpc.aio.AbortError):
            raise exc
        error = to_error(exc)
        self._done(method, error.code, started)
        await context.abort(error.code, error.message, error.trailing_metadata())
