"""The public gRPC API. Handlers validate, translate and stream; the scheduler does the work.

Sessions keep their KV cache between calls; a Generate is a session-less prefill + decode whose
sequence is freed when the call ends, whether it finished, failed or was cancelled.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from shardlm.common.v1 import common_pb2
from shardlm.errors import (
    FailedPreconditionError,
    FieldViolation,
    InvalidArgumentError,
    ResourceExhaustedError,
)
from shardlm.gateway.v1 import gateway_pb2, gateway_pb2_grpc

from gateway import __version__
from gateway.auth import current_identity, require_admin
from gateway.runtime import Model, Runtime
from gateway.sequence import ErrorEvent, Limits, Phase, Sequence
from gateway.sessions import Session
from gateway.streaming import TokenStream
from gateway.tokenizer import ChatMessage
from gateway.validation import (
    Violations,
    check_prompt,
    check_sampling,
    check_session_id,
    check_stop,
)


def _too_long(prompt: int, max_new: int, context: int) -> InvalidArgumentError:
    return InvalidArgumentError(
        f"prompt of {prompt} tokens plus max_new_tokens {max_new} exceeds the context of "
        f"{context} tokens", reason="PROMPT_TOO_LONG",
        field_violations=[FieldViolation("prompt", f"{prompt} + {max_new} > {context}")],
        metadata={"prompt_tokens": prompt, "max_new_tokens": max_new,
                  "max_context_length": context})


def _messages(request) -> list[dict[str, str]]:
    return [{"role": m.role, "content": m.content} for m in request.messages.messages]


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class GatewayServicer(gateway_pb2_grpc.GatewayServiceServicer):
    def __init__(self, runtime: Runtime) -> None:
        self.rt = runtime

    # ----------------------------------------------------------------- helpers
    def _identity(self, context) -> str:
        return current_identity.get().name

    def _limits(self, model: Model, stop: common_pb2.StopConditions, prompt_len: int,
                *, clamp: bool) -> Limits:
        max_new = stop.max_new_tokens or min(self.rt.limits.default_max_new_tokens,
                                            max(model.max_context - prompt_len, 1))
        if prompt_len + max_new > model.max_context:
            if not clamp:
                raise _too_long(prompt_len, max_new, model.max_context)
            max_new = model.max_context - prompt_len
        if model.allocator.blocks_for(prompt_len + max_new) > model.allocator.num_blocks:
            raise ResourceExhaustedError(
                "the KV cache is too small for this request; lower max_new_tokens",
                reason="KV_CACHE_FULL", metadata={
                    "required_blocks": model.allocator.blocks_for(prompt_len + max_new),
                    "total_blocks": model.allocator.num_blocks})
        extra_eos = () if stop.ignore_eos else tuple(
            sorted(model.eos_ids - set(model.info.eos_token_ids)))
        return Limits(max_new, tuple(stop.stop_token_ids) + extra_eos, stop.ignore_eos)

    def _encode(self, model: Model, request, first_turn: bool, history: list[dict]) -> list[int]:
        kind = request.WhichOneof("prompt")
        if kind == "token_ids":
            return list(request.token_ids.token_ids)
        if kind == "messages":
            messages = [ChatMessage(m["role"], m["content"]) for m in history + _messages(request)]
            return model.tokenizer.encode_chat(messages)
        special = (request.add_special_tokens if request.HasField("add_special_tokens")
                   else first_turn)
        return model.tokenizer.encode(request.text, add_special_tokens=special)

    async def _one_event(self, model: Model, seq: Sequence):
        try:
            event = await seq.events.get()
        except asyncio.CancelledError:
            model.scheduler.cancel(seq)
            raise
        if isinstance(event, ErrorEvent):
            raise event.error
        return event

    def _check_free(self, seq: Sequence) -> None:
        if seq.phase in (Phase.WAITING, Phase.RUNNING):  # the last call is still winding down
            raise FailedPreconditionError("the session's previous call is still ending; retry",
                                          reason="SESSION_BUSY")

    # ----------------------------------------------------------------- RPCs
    async def Load(self, request, context) -> AsyncIterator[gateway_pb2.LoadResponse]:
        require_admin("Load")
        progress: asyncio.Queue = asyncio.Queue()
        task = asyncio.ensure_future(self.rt.load(
            request.model_path, request.dtype, request.tensor_parallel_size,
            request.kv_cache if request.HasField("kv_cache") else None, progress.put_nowait))
        while not task.done():
            getter = asyncio.ensure_future(progress.get())
            await asyncio.wait({task, getter}, return_when=asyncio.FIRST_COMPLETED)
            if getter.done():
                yield gateway_pb2.LoadResponse(progress=getter.result())
            else:
                getter.cancel()
        model = task.result()
        yield gateway_pb2.LoadResponse(model=model.info, capacity=model.capacity)

    async def Prefill(self, request, context) -> gateway_pb2.PrefillResponse:
        started = time.monotonic()
        model = self.rt.require()
        v = Violations()
        check_session_id(request.session_id, v)
        check_prompt(request, v, vocab_size=model.info.vocab_size)
        if request.HasField("sampling"):
            check_sampling(request.sampling, v)
        v.raise_if_any()
        owner = self._identity(context)
        session: Session | None = None
        if request.session_id:
            session = model.sessions.acquire(request.session_id, owner)
        new_session = session is None
        seq = model.scheduler.new_sequence([], request.sampling) if session is None else session.seq
        try:
            if session is not None:
                self._check_free(seq)
            history = [] if session is None else session.messages + session.pending_reply()
            tokens = await asyncio.to_thread(self._encode, model, request, new_session, history)
            if request.WhichOneof("prompt") == "messages":
                # The whole conversation is re-rendered; the cache is good up to the first
                # token where the new rendering differs from the history.
                keep = _common_prefix(seq.tokens, tokens)
                seq.tokens = tokens
                seq.cached, seq.in_sync = min(seq.cached, keep), False
            else:
                seq.tokens = seq.tokens + tokens
            if len(seq.tokens) + 1 > model.max_context:
                raise _too_long(len(seq.tokens), 1, model.max_context)
            if request.HasField("sampling") and not new_session:
                seq.sampling, seq.sampling_changed = request.sampling, True
            cached = seq.cached
            model.scheduler.submit(seq, Limits(1), prefill_only=True)
            if new_session:
                session = model.sessions.create(seq, owner)
                session.busy = True
            if request.WhichOneof("prompt") == "messages":
                session.messages = history + _messages(request)
                session.reply_parts.clear()
            event = await self._one_event(model, seq)
            text = model.tokenizer.decode([event.token_id])
            session.reply_parts.append(text)
            self.rt.metrics.prompt_tokens.inc(len(seq.tokens) - 1)
            self.rt.metrics.cached_prompt_tokens.inc(cached)
            timings = common_pb2.Timings(total_seconds=time.monotonic() - started,
                                         time_to_first_token_seconds=time.monotonic() - started)
            if seq.admitted_at is not None:
                timings.queue_seconds = max(0.0, seq.admitted_at - seq.enqueued_at)
            return gateway_pb2.PrefillResponse(
                session_id=session.session_id,
                usage=common_pb2.Usage(prompt_tokens=len(seq.tokens) - 1, cached_tokens=cached,
                                      generated_tokens=1),
                first_token=gateway_pb2.Token(token_id=event.token_id, text=text,
                                              logprobs=event.logprobs),
                timings=timings)
        except BaseException:
            if new_session:  # a session that never got its first token does not exist
                if session is not None:
                    model.sessions.remove(session.session_id)
                model.scheduler.release(seq)
            raise
        finally:
            if session is not None:
                model.sessions.release_busy(session)

    async def Decode(self, request, context) -> AsyncIterator[gateway_pb2.DecodeResponse]:
        started = time.monotonic()
        model = self.rt.require()
        v = Violations()
        check_session_id(request.session_id, v)
        check_stop(request.stop, v, max_new_tokens_limit=self.rt.limits.max_new_tokens,
                   vocab_size=model.info.vocab_size)
        if request.HasField("sampling"):
            check_sampling(request.sampling, v)
        v.raise_if_any()
        session = model.sessions.acquire(request.session_id, self._identity(context))
        try:
            seq = session.seq
            self._check_free(seq)
            if request.HasField("sampling"):
                seq.sampling, seq.sampling_changed = request.sampling, True
            limits = self._limits(model, request.stop, len(seq.tokens), clamp=True)
            usage = common_pb2.Usage(prompt_tokens=len(seq.tokens), cached_tokens=seq.cached)
            if limits.max_new_tokens <= 0:
                yield gateway_pb2.DecodeResponse(
                    finish_reason=common_pb2.FINISH_REASON_CONTEXT_LENGTH, usage=usage)
                return
            stream = TokenStream(model.tokenizer, seq, stop_sequences=list(request.stop.stop_sequences),
                                 eos_ids=model.eos_ids, usage=usage, metrics=self.rt.metrics,
                                 started_at=started)
            model.scheduler.submit(seq, limits, prefill_only=False)
            finished = False
            try:
                async for chunk in stream.chunks():
                    message = gateway_pb2.DecodeResponse()
                    chunk.fill(message)
                    finished = chunk.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
                    yield message
            finally:
                session.reply_parts.append(stream.text)
                if not finished:  # the client left: keep only what it was sent
                    seq.finish_after = stream.count
                    model.scheduler.cancel(seq)
        finally:
            model.sessions.release_busy(session)

    async def Generate(self, request, context) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        started = time.monotonic()
        model = self.rt.require()
        v = Violations()
        check_prompt(request, v, vocab_size=model.info.vocab_size)
        check_sampling(request.sampling, v)
        check_stop(request.stop, v, max_new_tokens_limit=self.rt.limits.max_new_tokens,
                   vocab_size=model.info.vocab_size)
        v.raise_if_any()
        tokens = await asyncio.to_thread(self._encode, model, request, True, [])
        limits = self._limits(model, request.stop, len(tokens), clamp=False)
        seq = model.scheduler.new_sequence(tokens, request.sampling)
        seq.ephemeral = True
        usage = common_pb2.Usage(prompt_tokens=len(tokens))
        stream = TokenStream(model.tokenizer, seq, stop_sequences=list(request.stop.stop_sequences),
                             eos_ids=model.eos_ids, usage=usage, metrics=self.rt.metrics,
                             started_at=started)
        model.scheduler.submit(seq, limits, prefill_only=False)
        self.rt.metrics.prompt_tokens.inc(len(tokens))
        try:
            async for chunk in stream.chunks():
                message = gateway_pb2.GenerateResponse()
                chunk.fill(message)
                yield message
        finally:
            model.scheduler.release(seq)

    async def ResetCache(self, request, context) -> gateway_pb2.ResetCacheResponse:
        model = self.rt.require()
        if bool(request.session_ids) == request.all:
            raise InvalidArgumentError("set exactly one of session_ids or all",
                                       reason="INVALID_FIELD", field_violations=[
                                           FieldViolation("session_ids", "or all, not both")])
        if request.HasField("kv_cache") and not request.all:
            raise InvalidArgumentError("kv_cache may only be changed together with all",
                                       reason="INVALID_FIELD",
                                       field_violations=[FieldViolation("kv_cache", "needs all")])
        if request.all:
            require_admin("ResetCache of all sessions")
        owner = self._identity(context)
        found = (model.sessions.find(sid, owner) for sid in request.session_ids)
        targets = model.sessions.all() if request.all else [s for s in found if s is not None]
        for session in targets:
            model.sessions.remove(session.session_id)
            model.scheduler.release(session.seq)
        capacity = model.capacity
        if request.HasField("kv_cache"):
            capacity = await self.rt.reset_cache(request.kv_cache)
        return gateway_pb2.ResetCacheResponse(released_sessions=len(targets), capacity=capacity)

    async def Tokenize(self, request, context) -> gateway_pb2.TokenizeResponse:
        model = self.rt.require()
        v = Violations()
        kind = request.WhichOneof("input")
        if kind is None or (kind == "text" and not request.text):
            v.add("text", "set text or messages", "EMPTY_PROMPT")
        else:
            shim = (gateway_pb2.PrefillRequest(messages=request.messages) if kind == "messages"
                    else gateway_pb2.PrefillRequest(text=request.text))
            check_prompt(shim, v, vocab_size=model.info.vocab_size)
        v.raise_if_any()
        if kind == "messages":
            messages = [ChatMessage(m.role, m.content) for m in request.messages.messages]
            ids = await asyncio.to_thread(model.tokenizer.encode_chat, messages)
        else:
            special = request.add_special_tokens if request.HasField("add_special_tokens") else True
            ids = await asyncio.to_thread(model.tokenizer.encode, request.text,
                                          add_special_tokens=special)
        return gateway_pb2.TokenizeResponse(token_ids=ids, tokens=model.tokenizer.token_strings(ids))

    async def GetModelInfo(self, request, context) -> gateway_pb2.GetModelInfoResponse:
        reply = gateway_pb2.GetModelInfoResponse(
            loaded=self.rt.model is not None, server_version=__version__,
            max_new_tokens_limit=self.rt.limits.max_new_tokens)
        if self.rt.model is not None:
            reply.model.CopyFrom(self.rt.model.info)
            reply.capacity.CopyFrom(self.rt.model.capacity)
            reply.max_context_length = self.rt.model.max_context
        return reply
