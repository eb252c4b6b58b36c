"""ShardLM's error model, shared by servers (which raise and send it) and clients (which receive
and re-raise it as typed exceptions).

An error travels as a `google.rpc.Status` in the `grpc-status-details-bin` trailer with an
`ErrorInfo` (domain "shardlm", a stable UPPER_SNAKE reason from `ErrorReason` in
proto/shardlm/common/v1/common.proto), plus `BadRequest` field violations, `ResourceInfo` and
`RetryInfo` where they apply. Clients branch on `reason`, never on message text.
"""

from __future__ import annotations

from collections import namedtuple
from dataclasses import dataclass

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2

DOMAIN = "shardlm"
_DETAILS_KEY = "grpc-status-details-bin"


@dataclass(frozen=True)
class FieldViolation:
    field: str
    description: str


class ShardLMError(Exception):
    """An error with a gRPC status code and the rich details of the ShardLM error model."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(
        self,
        message: str,
        *,
        reason: str = "INTERNAL",
        code: grpc.StatusCode | None = None,
        metadata: dict[str, str] | None = None,
        field_violations: list[FieldViolation] | None = None,
        retry_after_s: float | None = None,
        resource: tuple[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.reason = reason
        if code is not None:
            self.code = code
        self.metadata = {k: str(v) for k, v in (metadata or {}).items()}
        self.field_violations = list(field_violations or [])
        self.retry_after_s = retry_after_s
        self.resource = resource

    def __str__(self) -> str:
        return f"{self.code.name} {self.reason}: {self.message}"

    # ------------------------------------------------------------------ server side
    def to_status_proto(self) -> status_pb2.Status:
        details = [error_details_pb2.ErrorInfo(reason=self.reason, domain=DOMAIN,
                                               metadata=self.metadata)]
        if self.field_violations:
            details.append(error_details_pb2.BadRequest(field_violations=[
                error_details_pb2.BadRequest.FieldViolation(field=v.field, description=v.description)
                for v in self.field_violations
            ]))
        if self.resource is not None:
            details.append(error_details_pb2.ResourceInfo(
                resource_type=self.resource[0], resource_name=self.resource[1]))
        if self.retry_after_s is not None:
            delay = duration_pb2.Duration()
            delay.FromMilliseconds(int(self.retry_after_s * 1000))
            details.append(error_details_pb2.RetryInfo(retry_delay=delay))
        packed = []
        for detail in details:
            message = any_pb2.Any()
            message.Pack(detail)
            packed.append(message)
        return status_pb2.Status(code=self.code.value[0], message=self.message, details=packed)

    def to_grpc_status(self) -> grpc.Status:
        """A `grpc.Status` for `context.abort_with_status` (sync servers)."""
        proto = self.to_status_proto()
        return _Status(self.code, self.message, ((_DETAILS_KEY, proto.SerializeToString()),))

    def trailing_metadata(self) -> tuple[tuple[str, bytes], ...]:
        """Trailing metadata for `await context.abort(code, message, trailing_metadata)` (aio)."""
        return ((_DETAILS_KEY, self.to_status_proto().SerializeToString()),)

    # ------------------------------------------------------------------ client side
    @classmethod
    def from_rpc_error(cls, error: grpc.RpcError) -> ShardLMError:
        """The typed exception for a failed call, with its details parsed."""
        code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
        message = error.details() if hasattr(error, "details") else str(error)
        kwargs: dict = {"reason": code.name, "code": code}
        for key, value in (error.trailing_metadata() or ()) if hasattr(
            error, "trailing_metadata"
        ) else ():
            if key == _DETAILS_KEY:
                kwargs.update(_parse_details(value))
        exc_type = _BY_CODE.get(code, ShardLMError)
        return exc_type(message or "", **kwargs)


class _Status(namedtuple("_Status", ("code", "details", "trailing_metadata")), grpc.Status):
    pass


def _parse_details(blob: bytes) -> dict:
    status = status_pb2.Status.FromString(blob)
    out: dict = {"field_violations": [], "metadata": {}}
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            out["reason"] = info.reason
            out["metadata"] = dict(info.metadata)
        elif detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            out["field_violations"] = [FieldViolation(v.field, v.description)
                                       for v in bad.field_violations]
        elif detail.Is(error_details_pb2.ResourceInfo.DESCRIPTOR):
            res = error_details_pb2.ResourceInfo()
            detail.Unpack(res)
            out["resource"] = (res.resource_type, res.resource_name)
        elif detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            retry = error_details_pb2.RetryInfo()
            detail.Unpack(retry)
            out["retry_after_s"] = retry.retry_delay.ToMilliseconds() / 1000.0
    return out


# Explicit subclasses (rather than built with type()) so that type checkers see real classes
# that SDK users can name in annotations.
class InvalidArgumentError(ShardLMError):
    """The request is wrong; see field_violations."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFoundError(ShardLMError):
    """A named session, sequence or path does not exist."""

    code = grpc.StatusCode.NOT_FOUND


class FailedPreconditionError(ShardLMError):
    """The server is not in a state to serve this request."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhaustedError(ShardLMError):
    """A queue, the KV cache or memory is full; see retry_after_s."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class UnavailableError(ShardLMError):
    """A worker or peer is down, or the server is draining."""

    code = grpc.StatusCode.UNAVAILABLE


class UnauthenticatedError(ShardLMError):
    """The call carries no valid credentials."""

    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDeniedError(ShardLMError):
    """The caller may not do this."""

    code = grpc.StatusCode.PERMISSION_DENIED


class CancelledError(ShardLMError):
    """The call was cancelled."""

    code = grpc.StatusCode.CANCELLED


class DeadlineExceededError(ShardLMError):
    """The call's deadline passed."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class InternalError(ShardLMError):
    """A server bug; see request_id."""

    code = grpc.StatusCode.INTERNAL


_BY_CODE = {cls.code: cls for cls in (
    InvalidArgumentError, NotFoundError, FailedPreconditionError, ResourceExhaustedError,
    UnavailableError, UnauthenticatedError, PermissionDeniedError, CancelledError,
    DeadlineExceededError, InternalError,
)}

__all__ = [
    "DOMAIN", "FieldViolation", "ShardLMError", "InvalidArgumentError", "NotFoundError",
    "FailedPreconditionError", "ResourceExhaustedError", "UnavailableError",
    "UnauthenticatedError", "PermissionDeniedError", "CancelledError", "DeadlineExceededError",
    "InternalError",
]
