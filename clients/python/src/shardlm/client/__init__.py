"""The ShardLM Python SDK: `Client` (blocking) and `AsyncClient` (asyncio) over the gateway's
gRPC API, returning plain dataclasses and raising the typed errors of `shardlm.errors`.

Retry rules (see `RetryPolicy`): UNAVAILABLE, and RESOURCE_EXHAUSTED with a server RetryInfo,
are retried with exponential backoff (the server's RetryInfo delay wins) for calls that are safe
to repeat: `tokenize`, `model_info`, `health`, `reset_cache` (releasing is idempotent) and the
streams of `generate` before their first chunk arrived. Calls that create or advance state
(`prefill`, `decode`, `load`) are retried only when nothing was done: the connection could not
be established, or the server was draining.

Constrained decoding: `shardlm.client.constraints` builds the `constraint=` argument of
`generate`, `prefill` and `decode` (`constraints.json_schema({...})`, `json_object()`,
`regex(...)`, `grammar(...)`, `choice([...])`, `structural_tag(...)`); such a generation ends
with finish reason "grammar_complete" and reports `usage.constraint_kind`.
"""

from . import constraints
from ._async import AsyncClient
from ._common import Message, Prompt, RetryPolicy, SamplingOptions
from ._sync import Client
from ._types import (
    ChatMessage,
    Chunk,
    Completion,
    KvCache,
    LoadReport,
    Logprobs,
    ModelInfo,
    PrefillResult,
    ServerInfo,
    Timings,
    Token,
    TokenLogprob,
    Tokens,
    Usage,
)

__all__ = [
    "AsyncClient", "ChatMessage", "Chunk", "Client", "Completion", "KvCache", "LoadReport",
    "Logprobs", "Message", "ModelInfo", "PrefillResult", "Prompt", "RetryPolicy", "SamplingOptions",
    "ServerInfo", "Timings", "Token", "TokenLogprob", "Tokens", "Usage", "constraints",
]
