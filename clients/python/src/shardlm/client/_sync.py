"""The blocking client."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Generator, Iterable, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from shardlm.common.v1 import common_pb2
from shardlm.constants import DEFAULT_GATEWAY_ADDRESS
from shardlm.errors import InternalError, ShardLMError
from shardlm.gateway.v1 import gateway_pb2, gateway_pb2_grpc

from . import _common as c
from ._types import (
    Chunk,
    Collector,
    Completion,
    LoadReport,
    ModelInfo,
    PrefillResult,
    ServerInfo,
    Tokens,
    chunk_of,
    load_report_of,
    model_info_of,
    prefill_result,
    server_info_of,
)

if TYPE_CHECKING:
    from typing_extensions import Unpack

_Req = TypeVar("_Req")
_Resp = TypeVar("_Resp")


_Piece = TypeVar("_Piece", gateway_pb2.GenerateResponse, gateway_pb2.DecodeResponse)


def _raw(data: bytes) -> bytes:
    return data


def _chunks(responses: Generator[_Piece, None, None]) -> Generator[Chunk, None, None]:
    # Closing this generator closes the call's generator at once, which cancels the RPC.
    with contextlib.closing(responses):
        for response in responses:
            yield chunk_of(response)


class Client:
    """A blocking client of a ShardLM gateway.

    Every failure raises a `shardlm.errors.ShardLMError` subclass. `timeout` is the deadline of
    each public call in seconds, retries included (None: no deadline). Transient failures are
    retried up to `max_retries` times with exponential backoff from `retry_backoff` seconds; see
    `RetryPolicy` and the README for which calls are retried when. `auth_token` is sent as
    `authorization: Bearer <token>` on every call. Certificates (or `tls=True`) select TLS;
    `options` adds gRPC channel options. A Client may be shared between threads.
    """

    def __init__(self, address: str = DEFAULT_GATEWAY_ADDRESS, *, tls: bool = False,
                 root_certificates: bytes | None = None, private_key: bytes | None = None,
                 certificate_chain: bytes | None = None, auth_token: str | None = None,
                 timeout: float | None = None, max_retries: int = 3, retry_backoff: float = 0.2,
                 options: Sequence[tuple[str, Any]] | None = None) -> None:
        config = c.channel_config(address, tls=tls, root_certificates=root_certificates,
                                  private_key=private_key, certificate_chain=certificate_chain,
                                  auth_token=auth_token, retry_backoff=retry_backoff,
                                  options=options)
        if config.credentials is not None:
            self._channel = grpc.secure_channel(address, config.credentials, config.options)
        else:
            self._channel = grpc.insecure_channel(address, config.options)
        self._stub = gateway_pb2_grpc.GatewayServiceStub(self._channel)
        self._health = self._channel.unary_unary(c.HEALTH_CHECK_METHOD, request_serializer=_raw,
                                                 response_deserializer=_raw)
        self._metadata = config.metadata
        self._timeout = timeout
        self.address = address
        self.retry_policy = c.RetryPolicy(max_retries=max_retries, backoff=retry_backoff)

    # ------------------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Close the channel; calls in flight are cancelled."""
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    # ------------------------------------------------------------------------------ calls
    def _unary(self, method: grpc.UnaryUnaryMultiCallable[_Req, _Resp], request: _Req,
               safety: c.Safety) -> _Resp:
        deadline = c.deadline_after(self._timeout)
        attempt = 0
        while True:
            try:
                return method(request, timeout=c.remaining(deadline), metadata=self._metadata)
            except grpc.RpcError as exc:
                error = ShardLMError.from_rpc_error(exc)
                wait = self.retry_policy.delay(attempt, error, safety, deadline)
                if wait is None:
                    raise error from exc
            time.sleep(wait)
            attempt += 1

    def _stream(self, method: grpc.UnaryStreamMultiCallable[_Req, _Resp], request: _Req,
                safety: c.Safety) -> Generator[_Resp, None, None]:
        deadline = c.deadline_after(self._timeout)
        attempt = 0
        while True:
            call = method(request, timeout=c.remaining(deadline), metadata=self._metadata)
            received = False
            try:
                for item in call:
                    received = True
                    yield item
                return
            except grpc.RpcError as exc:
                error = ShardLMError.from_rpc_error(exc)
                # Once a chunk was delivered a retry would repeat its tokens: never retry then.
                wait = None if received else self.retry_policy.delay(attempt, error, safety,
                                                                     deadline)
                if wait is None:
                    raise error from exc
            finally:
                call.cancel()  # no-op when finished; stops generation if the caller stopped early
            time.sleep(wait)
            attempt += 1

    # ------------------------------------------------------------------------------ generation
    def stream_generate(
        self, prompt: c.Prompt, *, max_new_tokens: int | None = None, temperature: float = 0.0,
        top_k: int = 0, top_p: float | None = None, min_p: float = 0.0,
        repetition_penalty: float | None = None, presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0, seed: int | None = None,
        stop: Sequence[str] | str | None = None, stop_token_ids: Sequence[int] | None = None,
        ignore_eos: bool = False, logprobs: bool = False, top_logprobs: int = 0,
        add_special_tokens: bool | None = None,
        constraint: common_pb2.Constraint | None = None,
    ) -> Generator[Chunk, None, None]:
        """Generate a completion of `prompt` (text, token ids or chat messages), yielding chunks
        as they are produced. Breaking out of the loop cancels the generation on the server.

        `constraint` (built with `shardlm.client.constraints`: a JSON schema, regex, grammar,
        choice, ...) restricts the generated text to its language; the generation then ends
        with finish reason "grammar_complete" once the text is complete."""
        request = c.generate_request(
            prompt, c.sampling_params(
                temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
                frequency_penalty=frequency_penalty, seed=seed, logprobs=logprobs,
                top_logprobs=top_logprobs),
            c.stop_conditions(max_new_tokens, stop, stop_token_ids, ignore_eos),
            add_special_tokens, constraint)
        # Built eagerly so that a bad argument raises here, not at the first iteration.
        return _chunks(self._stream(self._stub.Generate, request, c.Safety.IDEMPOTENT))

    def generate(
        self, prompt: c.Prompt, *, max_new_tokens: int | None = None, temperature: float = 0.0,
        top_k: int = 0, top_p: float | None = None, min_p: float = 0.0,
        repetition_penalty: float | None = None, presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0, seed: int | None = None,
        stop: Sequence[str] | str | None = None, stop_token_ids: Sequence[int] | None = None,
        ignore_eos: bool = False, logprobs: bool = False, top_logprobs: int = 0,
        add_special_tokens: bool | None = None,
        constraint: common_pb2.Constraint | None = None,
    ) -> Completion:
        """Generate a completion of `prompt` and return it whole (see `stream_generate`,
        `constraint` included)."""
        collector = Collector()
        for chunk in self.stream_generate(
                prompt, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                top_p=top_p, min_p=min_p, repetition_penalty=repetition_penalty,
                presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                seed=seed, stop=stop, stop_token_ids=stop_token_ids, ignore_eos=ignore_eos,
                logprobs=logprobs, top_logprobs=top_logprobs,
                add_special_tokens=add_special_tokens, constraint=constraint):
            collector.add(chunk)
        return collector.result()

    # ------------------------------------------------------------------------------ sessions
    def prefill(self, prompt: c.Prompt, *, session_id: str | None = None,
                add_special_tokens: bool | None = None,
                constraint: common_pb2.Constraint | None = None,
                **sampling: Unpack[c.SamplingOptions]) -> PrefillResult:
        """Process `prompt` into a new session (or append a turn to `session_id`) and sample its
        first token. Sampling keywords set the session's parameters; none keeps them.

        `constraint` (see `shardlm.client.constraints`) constrains the text of this turn, from
        the first token on and through the following `decode` calls, which continue it where
        the last one stopped; None leaves the turn unconstrained."""
        request = c.prefill_request(prompt, session_id, add_special_tokens, sampling,
                                    constraint)
        return prefill_result(self._unary(self._stub.Prefill, request, c.Safety.STATEFUL))

    def stream_decode(self, session_id: str, *, max_new_tokens: int | None = None,
                      stop: Sequence[str] | str | None = None,
                      stop_token_ids: Sequence[int] | None = None, ignore_eos: bool = False,
                      constraint: common_pb2.Constraint | None = None,
                      **sampling: Unpack[c.SamplingOptions]) -> Generator[Chunk, None, None]:
        """Continue a session after `prefill`, yielding chunks. Sampling keywords replace the
        session's parameters for this and later calls.

        `constraint`: None (the default) continues the turn's constraint, if any, where the
        previous call left it; a Constraint replaces it from this call's first token on; an
        empty `common_pb2.Constraint()` (`constraints.unconstrained()`) removes it."""
        request = c.decode_request(
            session_id, c.stop_conditions(max_new_tokens, stop, stop_token_ids, ignore_eos),
            sampling, constraint)
        return _chunks(self._stream(self._stub.Decode, request, c.Safety.STATEFUL))

    def decode(self, session_id: str, *, max_new_tokens: int | None = None,
               stop: Sequence[str] | str | None = None,
               stop_token_ids: Sequence[int] | None = None, ignore_eos: bool = False,
               constraint: common_pb2.Constraint | None = None,
               **sampling: Unpack[c.SamplingOptions]) -> Completion:
        """Continue a session after `prefill` and return the whole continuation (see
        `stream_decode`: `constraint=None` continues the turn's constraint, an empty
        `common_pb2.Constraint()` removes it)."""
        collector = Collector()
        for chunk in self.stream_decode(session_id, max_new_tokens=max_new_tokens, stop=stop,
                                        stop_token_ids=stop_token_ids, ignore_eos=ignore_eos,
                                        constraint=constraint, **sampling):
            collector.add(chunk)
        return collector.result()

    def reset_cache(self, session_ids: Iterable[str] | str | None = None, *,
                    all: bool = False) -> int:
        """Release sessions (or, with `all=True`, every session and the whole KV cache) and
        return how many sessions were released."""
        request = c.reset_request(session_ids, all)
        return self._unary(self._stub.ResetCache, request, c.Safety.IDEMPOTENT).released_sessions

    # ------------------------------------------------------------------------------ model
    def load(self, model_path: str | os.PathLike[str], *, dtype: str | None = None,
             tensor_parallel_size: int = 0, kv_cache: common_pb2.KvCacheConfig | None = None,
             progress: Callable[[float, str], None] | None = None) -> ModelInfo:
        """Load the checkpoint at `model_path` (a folder on the server), replacing the current
        model. `progress(fraction, message)` is called for each progress event."""
        request = c.load_request(os.fspath(model_path), dtype, tensor_parallel_size, kv_cache)
        events = self._stream(self._stub.Load, request, c.Safety.STATEFUL)
        with contextlib.closing(events):
            for event in events:
                if event.HasField("progress") and progress is not None:
                    progress(event.progress.fraction, c.progress_text(event.progress))
                elif event.HasField("model"):
                    return model_info_of(event.model, event.capacity)
        raise InternalError("the Load stream ended without the loaded model", reason="INTERNAL")

    def model_info(self) -> ServerInfo:
        """The loaded model (if any), its KV cache and the server's limits and version."""
        return server_info_of(self._unary(self._stub.GetModelInfo,
                                          gateway_pb2.GetModelInfoRequest(), c.Safety.IDEMPOTENT))

    def load_report(self) -> LoadReport:
        """The replica's load: running and waiting sequences, KV cache blocks, the generation
        rate, the prefix cache's hit rate and the prefill work queued."""
        return load_report_of(self._unary(self._stub.GetLoad, gateway_pb2.GetLoadRequest(),
                                               c.Safety.IDEMPOTENT))

    def tokenize(self, text: str | Sequence[c.Message], *,
                 add_special_tokens: bool | None = None) -> Tokens:
        """Token ids of text or chat messages (a `list[int]`; `.tokens` and `.token_bytes`
        hold each one's vocabulary string and bytes)."""
        request = c.tokenize_request(text, add_special_tokens)
        response = self._unary(self._stub.Tokenize, request, c.Safety.IDEMPOTENT)
        return Tokens(response.token_ids, response.tokens, response.token_bytes)

    def health(self, service: str = "") -> bool:
        """Whether the server reports SERVING over grpc.health.v1 (False before a model is
        loaded). Raises `UnavailableError` when the server cannot be reached."""
        blob = self._unary(self._health, c.encode_health_request(service), c.Safety.IDEMPOTENT)
        return c.is_serving(c.decode_health_status(blob))
