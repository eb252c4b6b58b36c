"""Bearer-token authentication and the admin scope.

Tokens come from a file the operator owns (one `TOKEN NAME [admin]` per line, `#` comments). The
interceptor checks `authorization: Bearer TOKEN` on every call except health checks and server
reflection, and makes the caller's identity available to handlers through a context variable (gRPC
aio runs each call in its own task, so the value is per call). Handlers ask for the admin scope
where an operation touches everyone (Load, ResetCache of all sessions); sessions are bound to the
identity that created them.
"""

from __future__ import annotations

import contextvars
import hmac
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from shardlm.errors import PermissionDeniedError, ShardLMError

EXEMPT_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


@dataclass(frozen=True)
class Identity:
    name: str
    admin: bool


ANONYMOUS = Identity("", admin=True)  # auth off: everyone may do everything
current_identity: contextvars.ContextVar[Identity] = contextvars.ContextVar(
    "shardlm_identity", default=ANONYMOUS)


def load_tokens(path: str | Path) -> dict[str, Identity]:
    tokens: dict[str, Identity] = {}
    for number, raw in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] != "admin"):
            raise ValueError(f"{path}:{number}: expected 'TOKEN NAME [admin]'")
        tokens[parts[0]] = Identity(parts[1], admin=len(parts) == 3)
    if not tokens:
        raise ValueError(f"{path}: no tokens")
    return tokens


def require_admin(action: str) -> None:
    if not current_identity.get().admin:
        raise PermissionDeniedError(f"{action} needs the admin scope", reason="PERMISSION_DENIED",
                                    code=grpc.StatusCode.PERMISSION_DENIED)


def _unauthenticated(message: str) -> ShardLMError:
    return ShardLMError(message, reason="UNAUTHENTICATED", code=grpc.StatusCode.UNAUTHENTICATED)


class AuthInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, tokens: dict[str, Identity]) -> None:
        self.tokens = tokens

    def _identify(self, context) -> Identity:
        header = dict(context.invocation_metadata() or ()).get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise _unauthenticated("missing bearer token (metadata 'authorization: Bearer ...')")
        for known, identity in self.tokens.items():  # constant-time compare against each
            if hmac.compare_digest(known.encode(), token.encode()):
                return identity
        raise _unauthenticated("invalid bearer token")

    async def intercept_service(self, continuation: Callable, details: Any):
        handler = await continuation(details)
        if handler is None or details.method.startswith(EXEMPT_PREFIXES):
            return handler
        if handler.unary_unary:
            inner = handler.unary_unary

            async def unary(request, context):
                current_identity.set(self._identify(context))
                return await inner(request, context)

            return grpc.unary_unary_rpc_method_handler(
                unary, handler.request_deserializer, handler.response_serializer)
        if handler.unary_stream:
            inner_stream = handler.unary_stream

            async def stream(request, context):
                current_identity.set(self._identify(context))
                async for message in inner_stream(request, context):
                    yield message

            return grpc.unary_stream_rpc_method_handler(
                stream, handler.request_deserializer, handler.response_serializer)
        return handler
