"""ShardLM Python client.

`shardlm.Client` and `shardlm.AsyncClient` are the SDK (see `shardlm.client`); errors are the
typed exceptions of `shardlm.errors`. Generated gRPC stubs and protobuf messages live in
``shardlm.common.v1``, ``shardlm.gateway.v1`` and ``shardlm.worker.v1``.
"""

__version__ = "0.1.0"

from shardlm.client import (  # noqa: E402 - __version__ first, for code that reads it early
    AsyncClient,
    ChatMessage,
    Chunk,
    Client,
    Completion,
    KvCache,
    Logprobs,
    ModelInfo,
    PrefillResult,
    RetryPolicy,
    ServerInfo,
    Timings,
    Token,
    TokenLogprob,
    Tokens,
    Usage,
)
from shardlm.errors import (  # noqa: E402
    CancelledError,
    DeadlineExceededError,
    FailedPreconditionError,
    FieldViolation,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
    ShardLMError,
    UnauthenticatedError,
    UnavailableError,
)

__all__ = [
    "__version__",
    "AsyncClient", "Client", "ChatMessage", "Chunk", "Completion", "KvCache", "Logprobs",
    "ModelInfo", "PrefillResult", "RetryPolicy", "ServerInfo", "Timings", "Token",
    "TokenLogprob", "Tokens", "Usage",
    "ShardLMError", "FieldViolation", "CancelledError", "DeadlineExceededError",
    "FailedPreconditionError", "InternalError", "InvalidArgumentError", "NotFoundError",
    "PermissionDeniedError", "ResourceExhaustedError", "UnauthenticatedError",
    "UnavailableError",
]
