"""The asyncio client: the same calls, options and retry rules as `Client`, on grpc.aio."""

from __future__ import annotations

import asyncio
import inspect
import os
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar, cast

import grpc
import grpc.aio

from shardlm.common.v1 import common_pb2
from shardlm.constants import DEFAULT_GATEWAY_ADDRESS
from shardlm.errors import InternalError, ShardLMError
from shardlm.gateway.v1 import gateway_pb2 as pb
from shardlm.gateway.v1 import gateway_pb2_grpc

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
_Piece = TypeVar("_Piece", pb.GenerateResponse, pb.DecodeResponse)
_Unary = grpc.aio.UnaryUnaryMultiCallable
_Streaming = grpc.aio.UnaryStreamMultiCallable


def _raw(data: bytes) -> bytes:
    return data


class _AioStub:
    """The generated stub's methods, typed for grpc.aio (the generated .pyi types them as the
    blocking callables, although the same stub class works on an aio channel)."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        self.Load = cast("_Streaming[pb.LoadRequest, pb.LoadResponse]", stub.Load)
        self.Prefill = cast("_Unary[pb.PrefillRequest, pb.PrefillResponse]", stub.Prefill)
        self.Decode = cast("_Streaming[pb.DecodeRequest, pb.DecodeResponse]", stub.Decode)
        self.ResetCache = cast("_Unary[pb.ResetCacheRequest, pb.ResetCacheResponse]",
                               stub.ResetCache)
        self.Generate = cast("_Streaming[pb.GenerateRequest, pb.GenerateResponse]",
                             stub.Generate)
        self.Tokenize = cast("_Unary[pb.TokenizeRequest, pb.TokenizeResponse]", stub.Tokenize)
        self.GetModelInfo = cast("_Unary[pb.GetModelInfoRequest, pb.GetModelInfoResponse]",
                                 stub.GetModelInfo)


class AsyncClient:
    """An asyncio client of a ShardLM gateway; options and behaviour as `Client`.

    Use it as `async with AsyncClient(...) as client:`, or call `await client.close()`. Stream
    methods return async iterators; leaving `async for` early cancels the call once the iterator
    is closed (wrap it in `contextlib.aclosing` to close it at once). Create it inside the event
    loop that uses it: grpc.aio channels belong to one loop.
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
            self._channel = grpc.aio.secure_channel(address, config.credentials, config.options)
        else:
            self._channel = grpc.aio.insecure_channel(address, config.options)
        self._stub = _AioStub(self._channel)
        self._health = self._channel.unary_unary(c.HEALTH_CHECK_METHOD, request_serializer=_raw,
                                                 response_deserializer=_raw)
        self._metadata = config.metadata
        self._timeout = timeout
        self.address = address
        self.retry_policy = c.RetryPolicy(max_retries=max_retries, backoff=retry_backoff)

    # ------------------------------------------------------------------------------ lifecycle
    async def close(self) -> None:
        """Close the channel; calls in flight are cancelled."""
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    # ------------------------------------------------------------------------------ calls
    async def _unary(self, method: _Unary[_Req, _Resp], request: _Req,
                     safety: c.Safety) -> _Resp:
        deadline = c.deadline_after(self._timeout)
        attempt = 0
        while True:
            try:
                return await method(request, timeout=c.remaining(deadline),
                                    metadata=self._metadata)
            except grpc.RpcError as exc:
                error = ShardLMError.from_rpc_error(exc)
                wait = self.retry_policy.delay(attempt, error, safety, deadline)
                if wait is None:
                    raise error from exc
            await asyncio.sleep(wait)
            attempt += 1

    async def _stream(self, method: _Streaming[_Req, _Resp], request: _Req,
                      safety: c.Safety) -> AsyncGenerator[_Resp, None]:
        deadline = c.deadline_after(self._timeout)
        attempt = 0
        while True:
            call = method(request, timeout=c.remaining(deadline), metadata=self._metadata)
            received = False
            try:
                async for item in call:
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
            await asyncio.sleep(wait)
            attempt += 1

    async def _chunks(self, responses: AsyncGenerator[_Piece, None],
                      ) -> AsyncGenerator[Chunk, None]:
        try:
            async for response in responses:
                yield chunk_of(response)
        finally:  # closing this generator closes the call's generator, which cancels the RPC
            await responses.aclose()

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
    ) -> AsyncGenerator[Chunk, None]:
        """Generate a completion of `prompt`, as an async iterator of chunks (not a coroutine:
        `async for chunk in client.stream_generate(...)`). `constraint`: see
        `Client.stream_generate` and `shardlm.client.constraints`."""
        request = c.generate_request(
            prompt, c.sampling_params(
                temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
                frequency_penalty=frequency_penalty, seed=seed, logprobs=logprobs,
                top_logprobs=top_logprobs),
            c.stop_conditions(max_new_tokens, stop, stop_token_ids, ignore_eos),
            add_special_tokens, constraint)
        return self._chunks(self._stream(self._stub.Generate, request, c.Safety.IDEMPOTENT))

    async def generate(
        self, prompt: c.Prompt, *, max_new_tokens: int | None = None, temperature: float = 0.0,
        top_k: int = 0, top_p: float | None = None, min_p: float = 0.0,
        repetition_penalty: float | None = None, presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0, seed: int | None = None,
        stop: Sequence[str] | str | None = None, stop_token_ids: Sequence[int] | None = None,
        ignore_eos: bool = False, logprobs: bool = False, top_logprobs: int = 0,
        add_special_tokens: bool | None = None,
        constraint: common_pb2.Constraint | None = None,
    ) -> Completion:
        """Generate a completion of `prompt` and return it whole."""
        collector = Collector()
        async for chunk in self.stream_generate(
                prompt, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                top_p=top_p, min_p=min_p, repetition_penalty=repetition_penalty,
                presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                seed=seed, stop=stop, stop_token_ids=stop_token_ids, ignore_eos=ignore_eos,
                logprobs=logprobs, top_logprobs=top_logprobs,
                add_special_tokens=add_special_tokens, constraint=constraint):
            collector.add(chunk)
        return collector.result()

    # ------------------------------------------------------------------------------ sessions
    async def prefill(self, prompt: c.Prompt, *, session_id: str | None = None,
                      add_special_tokens: bool | None = None,
                      constraint: common_pb2.Constraint | None = None,
                      **sampling: Unpack[c.SamplingOptions]) -> PrefillResult:
        """Process `prompt` into a new session (or a new turn of `session_id`); see
        `Client.prefill` (`constraint` constrains the turn, through the following decodes)."""
        request = c.prefill_request(prompt, session_id, add_special_tokens, sampling,
                                    constraint)
        return prefill_result(await self._unary(self._stub.Prefill, request, c.Safety.STATEFUL))

    def stream_decode(self, session_id: str, *, max_new_tokens: int | None = None,
                      stop: Sequence[str] | str | None = None,
                      stop_token_ids: Sequence[int] | None = None, ignore_eos: bool = False,
                      constraint: common_pb2.Constraint | None = None,
                      **sampling: Unpack[c.SamplingOptions]) -> AsyncGenerator[Chunk, None]:
        """Continue a session after `prefill`, as an async iterator of chunks. `constraint`:
        None continues the turn's constraint, a Constraint replaces it, an empty
        `common_pb2.Constraint()` removes it (see `Client.stream_decode`)."""
        request = c.decode_request(
            session_id, c.stop_conditions(max_new_tokens, stop, stop_token_ids, ignore_eos),
            sampling, constraint)
        return self._chunks(self._stream(self._stub.Decode, request, c.Safety.STATEFUL))

    async def decode(self, session_id: str, *, max_new_tokens: int | None = None,
                     stop: Sequence[str] | str | None = None,
                     stop_token_ids: Sequence[int] | None = None, ignore_eos: bool = False,
                     constraint: common_pb2.Constraint | None = None,
                     **sampling: Unpack[c.SamplingOptions]) -> Completion:
        """Continue a session after `prefill` and return the whole continuation (`constraint`:
        None continues the turn's, an empty `common_pb2.Constraint()` removes it)."""
        collector = Collector()
        async for chunk in self.stream_decode(
                session_id, max_new_tokens=max_new_tokens, stop=stop,
                stop_token_ids=stop_token_ids, ignore_eos=ignore_eos, constraint=constraint,
                **sampling):
            collector.add(chunk)
        return collector.result()

    async def reset_cache(self, session_ids: Iterable[str] | str | None = None, *,
                          all: bool = False) -> int:
        """Release sessions (or all of them and the KV cache); returns how many were released."""
        request = c.reset_request(session_ids, all)
        response = await self._unary(self._stub.ResetCache, request, c.Safety.IDEMPOTENT)
        return response.released_sessions

    # ------------------------------------------------------------------------------ model
    async def load(self, model_path: str | os.PathLike[str], *, dtype: str | None = None,
                   tensor_parallel_size: int = 0,
                   kv_cache: common_pb2.KvCacheConfig | None = None,
                   progress: Callable[[float, str], Awaitable[None] | None] | None = None,
                   ) -> ModelInfo:
        """Load a checkpoint (see `Client.load`); `progress` may be a plain or async function."""
        request = c.load_request(os.fspath(model_path), dtype, tensor_parallel_size, kv_cache)
        events = self._stream(self._stub.Load, request, c.Safety.STATEFUL)
        try:
            async for event in events:
                if event.HasField("progress") and progress is not None:
                    outcome = progress(event.progress.fraction, c.progress_text(event.progress))
                    if inspect.isawaitable(outcome):
                        await outcome
                elif event.HasField("model"):
                    return model_info_of(event.model, event.capacity)
        finally:
            await events.aclose()
        raise InternalError("the Load stream ended without the loaded model", reason="INTERNAL")

    async def model_info(self) -> ServerInfo:
        """The loaded model (if any), its KV cache and the server's limits and version."""
        return server_info_of(await self._unary(self._stub.GetModelInfo,
                                                pb.GetModelInfoRequest(), c.Safety.IDEMPOTENT))

    async def load_report(self) -> LoadReport:
        """The replica's load: running and waiting sequences, KV cache blocks, the generation
        rate, the prefix cache's hit rate and the prefill work queued."""
        return load_report_of(await self._unary(self._stub.GetLoad, pb.GetLoadRequest(),
                                                c.Safety.IDEMPOTENT))

    async def tokenize(self, text: str | Sequence[c.Message], *,
                       add_special_tokens: bool | None = None) -> Tokens:
        """Token ids of text or chat messages (a `list[int]`; `.tokens` and `.token_bytes`
        hold each one's vocabulary string and bytes)."""
        request = c.tokenize_request(text, add_special_tokens)
        response = await self._unary(self._stub.Tokenize, request, c.Safety.IDEMPOTENT)
        return Tokens(response.token_ids, response.tokens, response.token_bytes)

    async def health(self, service: str = "") -> bool:
        """Whether the server reports SERVING over grpc.health.v1; see `Client.health`."""
        blob = await self._unary(self._health, c.encode_health_request(service),
                                 c.Safety.IDEMPOTENT)
        return c.is_serving(c.decode_health_status(blob))
