"""The public gRPC API. Handlers validate, translate and stream; the scheduler does the work.

Sessions keep their KV cache between calls; a Generate is a session-less prefill + decode whose
sequence is freed when the call ends, whether it finished, failed or was cancelled.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from shardlm.common.v1 import common_pb2
from shardlm.errors import FailedPreconditionError, FieldViolation, InvalidArgumentError
from shardlm.gateway.v1 import gateway_pb2, gateway_pb2_grpc

from shardlm_server.gateway import __version__
from shardlm_server.gateway.api.auth import current_identity, require_admin
from shardlm_server.gateway.api.load_report import load_report
from shardlm_server.gateway.api.runtime import LoadedModel, Runtime
from shardlm_server.gateway.api.validation import (
    Violations,
    check_prefix_cache,
    check_prompt,
    check_sampling,
    check_session_id,
    check_stop,
)
from shardlm_server.gateway.batching.finish import (
    CallLimits,
    call_limits,
    max_new_tokens_limit,
    prefill_limits,
    prompt_too_long,
)
from shardlm_server.gateway.batching.scheduler import Scheduler
from shardlm_server.gateway.batching.sequence import ErrorEvent, SequenceState
from shardlm_server.gateway.batching.sessions import Session
from shardlm_server.gateway.batching.streaming import ResponseChunk, TokenStream
from shardlm_server.gateway.text.tokenizer import ChatMessage


def _messages(request) -> list[dict[str, str]]:
    return [{"role": m.role, "content": m.content} for m in request.messages.messages]


def _kind(seq: SequenceState) -> str:
    """Usage.constraint_kind of the sequence's current constraint ("" when none)."""
    return seq.constraint.kind if seq.constraint is not None else ""


def _scope(name: str) -> int:
    """A --prefix-cache-scope value as the API's PrefixCacheScope."""
    return gateway_pb2.PrefixCacheScope.Value(f"PREFIX_CACHE_SCOPE_{name.upper()}")


async def _ending_at_stop_sequences(scheduler: Scheduler, seq: SequenceState,
                                    stream: TokenStream) -> AsyncIterator[ResponseChunk]:
    """The stream's chunks. Where a stop sequence ends the stream, the scheduler ends the call:
    the sequence's history keeps only the tokens streamed."""
    async for chunk in stream.chunks():
        if chunk.finish_reason == common_pb2.FINISH_REASON_STOP_SEQUENCE:
            scheduler.cancel(seq, keep_generated=stream.count)
        yield chunk


class GatewayServicer(gateway_pb2_grpc.GatewayServiceServicer):
    def __init__(self, runtime: Runtime) -> None:
        self.rt = runtime

    # ----------------------------------------------------------------- helpers
    def _identity(self, context) -> str:
        return current_identity.get().name

    def _prefix_salt(self, model: LoadedModel, request) -> bytes | None:
        """The key salt the request's blocks are shared under; None when it bypasses."""
        return model.kv.salt_for(current_identity.get().name, request.prefix_cache.salt,
                                 scope=self.rt.limits.prefix_cache_scope,
                                 bypass=request.prefix_cache.bypass)

    def _max_new_limit(self, model: LoadedModel) -> int:
        return max_new_tokens_limit(self.rt.limits.max_new_tokens, model.max_context)

    def _limits(self, model: LoadedModel, stop: common_pb2.StopConditions, history: int,
                *, strict: bool) -> CallLimits:
        return call_limits(stop, history=history, max_context=model.max_context,
                           default_max_new_tokens=self.rt.limits.default_max_new_tokens,
                           eos_ids=model.eos_ids, kv=model.kv, strict=strict)

    def _encode(self, model: LoadedModel, request, first_turn: bool,
                history: list[dict]) -> list[int]:
        kind = request.WhichOneof("prompt")
        if kind == "token_ids":
            return list(request.token_ids.token_ids)
        if kind == "messages":
            messages = [ChatMessage(m["role"], m["content"]) for m in history + _messages(request)]
            return model.tokenizer.encode_chat(messages)
        special = (request.add_special_tokens if request.HasField("add_special_tokens")
                   else first_turn)
        return model.tokenizer.encode(request.text, add_special_tokens=special)

    async def _one_event(self, model: LoadedModel, seq: SequenceState):
        try:
            event = await seq.events.get()
        except asyncio.CancelledError:
            model.scheduler.cancel(seq)
            raise
        if isinstance(event, ErrorEvent):
            raise event.error
        return event

    @staticmethod
    def _check_free(seq: SequenceState) -> None:
        if seq.in_call:  # the last call is still winding down
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
        check_session_id(request.session_id, v, required=False)
        check_prompt(request, v, vocab_size=model.info.vocab_size)
        if request.HasField("sampling"):
            check_sampling(request.sampling, v)
        check_prefix_cache(request.prefix_cache, v)
        v.raise_if_any()
        owner = self._identity(context)
        session: Session | None = None
        if request.session_id:
            session = model.sessions.acquire(request.session_id, owner)
        new_session = session is None
        scheduler = model.scheduler
        salt = self._prefix_salt(model, request)
        seq = (scheduler.new_sequence([], request.sampling, prefix_salt=salt) if session is None
               else session.seq)
        try:
            if session is not None:
                self._check_free(seq)
                if request.HasField("prefix_cache") and salt != seq.prefix_salt:
                    raise InvalidArgumentError(
                        "prefix_cache options are fixed by the session's first Prefill",
                        reason="INVALID_FIELD", field_violations=[FieldViolation(
                            "prefix_cache", "differs from the session's; leave it unset")])
            history = [] if session is None else session.chat_history()
            tokens = await asyncio.to_thread(self._encode, model, request, new_session, history)
            chat = request.WhichOneof("prompt") == "messages"
            length = len(tokens) if chat else len(seq.tokens) + len(tokens)
            if length + 1 > model.max_context:  # checked before the session's history changes
                raise prompt_too_long(length, 1, model.max_context)
            new_sampling = request.sampling if request.HasField("sampling") and not new_session \
                else None
            constraint = await model.constraints.compile(request.constraint)
            scheduler.start_turn(seq, tokens, prefill_limits(model.max_context), rerendered=chat,
                                 sampling=new_sampling, constraint=constraint)
            if new_session:
                session = model.sessions.create(seq, owner)
                session.busy = True
            if chat:
                session.begin_chat_turn(history + _messages(request))
            event = await self._one_event(model, seq)
            text = model.tokenizer.decode([event.token_id])
            session.add_reply_text(text)
            self.rt.metrics.prompt_tokens.inc(len(seq.tokens) - 1)
            cached = seq.cached_prompt_tokens
            timings = common_pb2.Timings(total_seconds=time.monotonic() - started,
                                         time_to_first_token_seconds=time.monotonic() - started)
            if seq.admitted_at is not None:
                timings.queue_seconds = max(0.0, seq.admitted_at - seq.enqueued_at)
            return gateway_pb2.PrefillResponse(
                session_id=session.session_id,
                usage=common_pb2.Usage(prompt_tokens=len(seq.tokens) - 1, cached_tokens=cached,
                                      generated_tokens=1, constraint_kind=_kind(seq)),
                first_token=gateway_pb2.Token(token_id=event.token_id, text=text,
                                              logprobs=event.logprobs),
                timings=timings)
        except BaseException:
            if new_session:  # a session that never got its first token does not exist
                if session is not None:
                    model.sessions.remove(session.session_id)
                scheduler.release(seq)
            raise
        finally:
            if session is not None:
                model.sessions.release_busy(session)

    async def Decode(self, request, context) -> AsyncIterator[gateway_pb2.DecodeResponse]:
        started = time.monotonic()
        model = self.rt.require()
        v = Violations()
        check_session_id(request.session_id, v, required=True)
        check_stop(request.stop, v, max_new_tokens_limit=self._max_new_limit(model),
                   vocab_size=model.info.vocab_size)
        if request.HasField("sampling"):
            check_sampling(request.sampling, v)
        v.raise_if_any()
        constraint = (await model.constraints.compile(request.constraint)
                      if request.HasField("constraint") else None)
        session = model.sessions.acquire(request.session_id, self._identity(context))
        scheduler = model.scheduler
        try:
            seq = session.seq
            self._check_free(seq)
            if request.HasField("sampling"):
                scheduler.set_sampling(seq, request.sampling)
            if request.HasField("constraint"):
                scheduler.set_constraint(seq, constraint)
            limits = self._limits(model, request.stop, len(seq.tokens), strict=False)
            usage = common_pb2.Usage(prompt_tokens=len(seq.tokens), cached_tokens=seq.computed,
                                     constraint_kind=_kind(seq))
            ended = (common_pb2.FINISH_REASON_GRAMMAR_COMPLETE if seq.constraint_complete
                     else common_pb2.FINISH_REASON_CONTEXT_LENGTH
                     if limits.budget(len(seq.tokens), 0) <= 0 else None)
            if ended is not None:  # the turn's grammar is complete, or the context full
                yield gateway_pb2.DecodeResponse(finish_reason=ended, usage=usage)
                return
            stream = TokenStream(model.tokenizer, seq,
                                 stop_sequences=list(request.stop.stop_sequences),
                                 usage=usage, metrics=self.rt.metrics, started_at=started)
            scheduler.submit(seq, limits, prefill_only=False)
            finished = False
            try:
                async for chunk in _ending_at_stop_sequences(scheduler, seq, stream):
                    message = gateway_pb2.DecodeResponse()
                    chunk.fill(message)
                    finished = chunk.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
                    yield message
            finally:
                session.add_reply_text(stream.text)
                if not finished:  # the client left: keep only what it was sent
                    scheduler.cancel(seq, keep_generated=stream.count)
        finally:
            model.sessions.release_busy(session)

    async def Generate(self, request, context) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        started = time.monotonic()
        model = self.rt.require()
        v = Violations()
        check_prompt(request, v, vocab_size=model.info.vocab_size)
        check_sampling(request.sampling, v)
        check_stop(request.stop, v, max_new_tokens_limit=self._max_new_limit(model),
                   vocab_size=model.info.vocab_size)
        check_prefix_cache(request.prefix_cache, v)
        v.raise_if_any()
        constraint = await model.constraints.compile(request.constraint)
        tokens = await asyncio.to_thread(self._encode, model, request, True, [])
        limits = self._limits(model, request.stop, len(tokens), strict=True)
        seq = model.scheduler.new_sequence(tokens, request.sampling, ephemeral=True,
                                           prefix_salt=self._prefix_salt(model, request),
                                           constraint=constraint)
        usage = common_pb2.Usage(prompt_tokens=len(tokens), constraint_kind=_kind(seq))
        stream = TokenStream(model.tokenizer, seq,
                             stop_sequences=list(request.stop.stop_sequences), usage=usage,
                             metrics=self.rt.metrics, started_at=started)
        model.scheduler.submit(seq, limits, prefill_only=False)
        self.rt.metrics.prompt_tokens.inc(len(tokens))
        try:
            async for chunk in _ending_at_stop_sequences(model.scheduler, seq, stream):
                message = gateway_pb2.GenerateResponse()
                chunk.fill(message)
                yield message
        finally:
            model.scheduler.release(seq)

    async def ResetCache(self, request, context) -> gateway_pb2.ResetCacheResponse:
        model = self.rt.require()
        if bool(request.session_ids) == request.all:
            problem = "or all, not both" if request.all else "name sessions, or set all"
            raise InvalidArgumentError("set exactly one of session_ids or all",
                                       reason="INVALID_FIELD", field_violations=[
                                           FieldViolation("session_ids", problem)])
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
        if request.all:
            model.scheduler.clear_prefix_cache()
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
        return gateway_pb2.TokenizeResponse(token_ids=ids, tokens=model.tokenizer.token_strings(ids),
                                            token_bytes=model.tokenizer.token_bytes(ids))

    async def GetModelInfo(self, request, context) -> gateway_pb2.GetModelInfoResponse:
        model = self.rt.model
        reply = gateway_pb2.GetModelInfoResponse(
            loaded=model is not None, server_version=__version__,
            max_new_tokens_limit=(self.rt.limits.max_new_tokens if model is None
                                  else self._max_new_limit(model)))
        if model is not None:
            reply.model.CopyFrom(model.info)
            reply.capacity.CopyFrom(model.capacity)
            reply.max_context_length = model.max_context
            allocator = model.allocator
            reply.prefix_cache.CopyFrom(gateway_pb2.PrefixCacheStats(
                enabled=allocator.prefix_cache, scope=_scope(self.rt.limits.prefix_cache_scope),
                cached_blocks=allocator.cached_blocks,
                idle_blocks=allocator.idle_cached_blocks))
        return reply

    async def GetLoad(self, request, context) -> gateway_pb2.GetLoadResponse:
        return load_report(self.rt)
