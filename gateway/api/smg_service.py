"""The engine service the Shepherd Model Gateway (SMG) routes to: `vllm.grpc.engine.VllmEngine`
from the `smg-grpc-proto` package, served beside ShardLM's own API on the gateway's port, and
with `serve --smg-port` alone on a plaintext port of its own (SMG's gRPC client speaks neither
TLS nor ShardLM's bearer tokens, so a gateway that requires them is reached there).

Why the vLLM flavour: SMG tokenizes, applies the chat template and detokenizes itself and sends
token ids, which ShardLM's Generate takes as they are; its sampling parameters map one to one
onto ShardLM's; and it is the flavour with a load report (GetLoads) and a tokenizer download
(GetTokenizer), so SMG's load-aware policies and tokenizer autoload work. (SGLang's scheduler
protocol carries SGLang's own scheduler features; MLX's has no load report.)

Each call is translated onto the public API's handlers (gateway/api/servicer.py), so validation,
limits, errors and metrics are the same as for ShardLM's own clients. What ShardLM does not do
(n > 1, logit bias, prompt logprobs, min_tokens, multimodal input, KV transfer) is refused
with INVALID_ARGUMENT. Every constraint kind SMG sends (JSON schema, JSON object, regex,
grammar, choice, structural tag: what response_format, its extra-body fields and forced tool
calls become) maps onto ShardLM's own Constraint, one to one, from the first generated token
(ShardLM runs no reasoning parser, so `grammar_from_first_token` is what it always does);
FlushCache empties the prefix cache; SubscribeKvEvents streams the prefix cache's changes
(gateway/kv/events.py) so the router's cache-aware policy routes on what each replica holds;
Embed and profiling are left UNIMPLEMENTED.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import time
import zipfile
from collections.abc import AsyncIterator
from contextlib import suppress
from datetime import UTC, datetime
from pathlib import Path

import grpc
from shardlm.common.v1 import common_pb2
from shardlm.errors import FieldViolation, InvalidArgumentError
from shardlm.gateway.v1 import gateway_pb2
from smg_grpc_proto.generated import common_pb2 as smg_common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as engine_pb2
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as engine_pb2_grpc

from shardlm_server.gateway import __version__
from shardlm_server.gateway.api.auth import require_admin
from shardlm_server.gateway.api.load_report import engine_load, scheduler_load
from shardlm_server.gateway.api.runtime import LoadedModel
from shardlm_server.gateway.api.servicer import GatewayServicer

SERVICE_NAME = engine_pb2.DESCRIPTOR.services_by_name["VllmEngine"].full_name
TOKENIZER_CHUNK_BYTES = 512 << 10
SERVER_TYPE = "shardlm-grpc"

_FINISH_REASONS = {
    common_pb2.FINISH_REASON_EOS: "stop",
    common_pb2.FINISH_REASON_STOP_TOKEN: "stop",
    common_pb2.FINISH_REASON_STOP_SEQUENCE: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_CONTEXT_LENGTH: "length",
    common_pb2.FINISH_REASON_GRAMMAR_COMPLETE: "stop",
}


def _refuse_unsupported(request: engine_pb2.GenerateRequest) -> None:
    p = request.sampling_params
    unsupported = [
        ("sampling_params.n", p.n > 1, "ShardLM generates one completion per request"),
        ("sampling_params.logit_bias", bool(p.logit_bias), "logit bias is not supported"),
        ("sampling_params.prompt_logprobs", p.HasField("prompt_logprobs"),
         "prompt logprobs are not supported"),
        ("sampling_params.min_tokens", p.min_tokens > 0, "min_tokens is not supported"),
        ("sampling_params.logprobs", p.HasField("logprobs") and not 0 <= p.logprobs <= 20,
         "logprobs must be in [0, 20]"),
        ("mm_inputs", request.HasField("mm_inputs") or bool(request.extra_mm_inputs)
         or request.HasField("media_refs"), "ShardLM serves text-only models"),
        ("kv_transfer_params", request.HasField("kv_transfer_params")
         or request.HasField("kv_transfer_params_json"), "KV transfer is not supported"),
        ("input", request.WhichOneof("input") is None, "set tokenized or text"),
    ]
    problems = [(field, why) for field, bad, why in unsupported if bad]
    if problems:
        raise InvalidArgumentError("; ".join(f"{field}: {why}" for field, why in problems),
                                   reason="INVALID_FIELD",
                                   field_violations=[FieldViolation(f, w) for f, w in problems])


def to_shardlm_request(request: engine_pb2.GenerateRequest) -> gateway_pb2.GenerateRequest:
    """ShardLM's GenerateRequest for SMG's (INVALID_ARGUMENT for what ShardLM does not do)."""
    _refuse_unsupported(request)
    p = request.sampling_params
    sampling = common_pb2.SamplingParams(
        temperature=p.temperature if p.HasField("temperature") else 1.0, top_k=p.top_k,
        min_p=p.min_p, presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty)
    if p.top_p:  # proto3 0 means unset in SMG's messages
        sampling.top_p = p.top_p
    if p.repetition_penalty:
        sampling.repetition_penalty = p.repetition_penalty
    if p.HasField("seed"):
        sampling.seed = p.seed % (1 << 64)
    if p.HasField("logprobs"):
        sampling.logprobs = True
        sampling.top_logprobs = p.logprobs
    stop = common_pb2.StopConditions(
        max_new_tokens=p.max_tokens if p.HasField("max_tokens") else 0,
        stop_sequences=list(p.stop), stop_token_ids=list(p.stop_token_ids),
        ignore_eos=p.ignore_eos)
    shard = gateway_pb2.GenerateRequest(sampling=sampling, stop=stop)
    kind = p.WhichOneof("constraint")
    if kind == "choice":
        shard.constraint.choice.choices.extend(p.choice.choices)
    elif kind is not None:  # the same names, the same meaning
        setattr(shard.constraint, kind, getattr(p, kind))
    if request.WhichOneof("input") == "tokenized":
        shard.token_ids.token_ids.extend(request.tokenized.input_ids)
    else:
        shard.text = request.text
    return shard


def _logprobs(entries: list[common_pb2.Logprobs]) -> engine_pb2.OutputLogProbs:
    out = engine_pb2.OutputLogProbs()
    for entry in entries:
        out.token_logprobs.append(entry.chosen.logprob)
        out.token_ids.append(entry.chosen.token_id)
        out.top_logprobs.add(values=[t.logprob for t in entry.top],
                             token_ids=[t.token_id for t in entry.top])
    return out


async def _until_aborted(stream: AsyncIterator, aborted: asyncio.Event) -> AsyncIterator:
    """The messages of `stream` until it ends or `aborted` is set; an abort cancels the stream
    where it waits, so the sequence is released by the handler's own clean-up."""
    waiter = asyncio.ensure_future(aborted.wait())
    try:
        while True:
            step = asyncio.ensure_future(anext(stream))
            await asyncio.wait({step, waiter}, return_when=asyncio.FIRST_COMPLETED)
            if not step.done():
                step.cancel()
                with suppress(asyncio.CancelledError, StopAsyncIteration):
                    await step
                return
            try:
                yield step.result()
            except StopAsyncIteration:
                return
    finally:
        waiter.cancel()


def _model_type(architecture: str) -> str:
    """ "LlamaForCausalLM" -> "llama", as in a Hugging Face config's model_type."""
    return architecture.removesuffix("ForCausalLM").lower()


def served_model_name(model: LoadedModel) -> str:
    """The model id SMG lists and clients name: the checkpoint folder's or GGUF file's name."""
    return Path(model.info.model_path).stem


def tokenizer_zip(model: LoadedModel) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, text in model.tokenizer.hf_files().items():
            archive.writestr(name, text)
    return buffer.getvalue()


async def _unimplemented(context, what: str) -> None:
    await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"ShardLM does not implement {what}")


class _Unimplemented:
    """The engine RPCs ShardLM does not serve, answered UNIMPLEMENTED (as an unregistered method
    would be), never as an internal error."""

    async def Embed(self, request, context):
        await _unimplemented(context, "embeddings")

    async def StartProfile(self, request, context):
        await _unimplemented(context, "profiling")

    async def StopProfile(self, request, context):
        await _unimplemented(context, "profiling")


class SmgEngineServicer(_Unimplemented, engine_pb2_grpc.VllmEngineServicer):
    def __init__(self, api: GatewayServicer) -> None:
        self.api = api
        self.rt = api.rt
        self.rt.kv_events.load = lambda: engine_load(self.rt)
        self.started = time.time()
        self.last_request = 0.0
        self._aborts: dict[str, asyncio.Event] = {}

    async def FlushCache(self, request, context) -> smg_common_pb2.FlushCacheResponse:
        """Empty the prefix cache, at once: the blocks running requests hold stay theirs (only
        their sharing ends), so there is nothing to wait for and `timeout_s` is not needed. An
        admin's call where the gateway has tokens, as ResetCache of everything is."""
        require_admin("FlushCache")
        self.rt.require().scheduler.clear_prefix_cache()
        return smg_common_pb2.FlushCacheResponse(success=True, message="prefix cache flushed")

    async def Generate(self, request, context) -> AsyncIterator[engine_pb2.GenerateResponse]:
        self.last_request = time.time()
        shard = to_shardlm_request(request)
        prompt_tokens = (len(request.tokenized.input_ids)
                         if request.WhichOneof("input") == "tokenized" else 0)
        aborted = asyncio.Event()
        self._aborts[request.request_id] = aborted
        stream = self.api.Generate(shard, context)
        output_ids: list[int] = []
        finish = "abort"
        complete = engine_pb2.GenerateComplete()
        try:
            async for message in _until_aborted(stream, aborted):
                output_ids.extend(message.token_ids)
                if message.HasField("usage"):
                    prompt_tokens = message.usage.prompt_tokens
                    complete.cached_tokens = message.usage.cached_tokens
                if message.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                    finish = _FINISH_REASONS.get(message.finish_reason, "abort")
                    if message.finish_reason in (common_pb2.FINISH_REASON_EOS,
                                                 common_pb2.FINISH_REASON_STOP_TOKEN):
                        complete.matched_token_id = output_ids[-1]
                if request.stream and message.token_ids:
                    yield engine_pb2.GenerateResponse(chunk=engine_pb2.GenerateStreamChunk(
                        token_ids=message.token_ids, prompt_tokens=prompt_tokens,
                        completion_tokens=len(output_ids), cached_tokens=complete.cached_tokens,
                        output_logprobs=_logprobs(list(message.logprobs))))
                elif message.logprobs:
                    complete.output_logprobs.MergeFrom(_logprobs(list(message.logprobs)))
        finally:
            self._aborts.pop(request.request_id, None)
            await stream.aclose()
        # Streamed tokens went out in the chunks; the final message only closes the stream.
        complete.output_ids.extend([] if request.stream else output_ids)
        complete.finish_reason = finish
        complete.prompt_tokens = prompt_tokens
        complete.completion_tokens = len(output_ids)
        yield engine_pb2.GenerateResponse(complete=complete)

    async def Abort(self, request, context) -> engine_pb2.AbortResponse:
        for request_id in request.request_ids:
            event = self._aborts.get(request_id)
            if event is not None:
                event.set()
        return engine_pb2.AbortResponse()

    async def HealthCheck(self, request, context) -> engine_pb2.HealthCheckResponse:
        rt = self.rt
        if rt.stopping:
            return engine_pb2.HealthCheckResponse(healthy=False, message="draining")
        if rt.recovering:
            return engine_pb2.HealthCheckResponse(healthy=False, message="workers restarting")
        if rt.model is None:
            return engine_pb2.HealthCheckResponse(healthy=False, message="no model loaded")
        return engine_pb2.HealthCheckResponse(healthy=True, message="serving")

    async def GetModelInfo(self, request, context) -> engine_pb2.GetModelInfoResponse:
        model = self.rt.require()
        info = model.info
        return engine_pb2.GetModelInfoResponse(
            model_path=info.model_path, is_generation=True,
            max_context_length=model.max_context, vocab_size=info.vocab_size,
            served_model_name=served_model_name(model), model_type=_model_type(info.architecture),
            architectures=[info.architecture], eos_token_ids=list(info.eos_token_ids),
            pad_token_id=-1, bos_token_id=info.bos_token_id if info.HasField("bos_token_id")
            else -1, max_req_input_len=model.max_context - 1)

    async def GetServerInfo(self, request, context) -> engine_pb2.GetServerInfoResponse:
        rt = self.rt
        model = rt.model
        reply = engine_pb2.GetServerInfoResponse(
            is_paused=rt.stopping, last_receive_timestamp=self.last_request,
            uptime_seconds=time.time() - self.started, server_type=SERVER_TYPE,
            data_parallel_size=1, kv_cache_dtype="auto", max_num_seqs=rt.limits.max_running)
        if model is not None:
            reply.active_requests = model.scheduler.running + model.scheduler.waiting
            reply.block_size = model.allocator.block_size
            reply.model_dtype = common_pb2.Dtype.Name(model.info.dtype)
        return reply

    async def GetLoads(self, request, context) -> engine_pb2.GetLoadsResponse:
        if request.HasField("dp_rank") and request.dp_rank != 0:
            raise InvalidArgumentError("ShardLM runs one data-parallel rank (0)",
                                       reason="INVALID_FIELD",
                                       field_violations=[FieldViolation("dp_rank", "must be 0")])
        return engine_pb2.GetLoadsResponse(timestamp=datetime.now(UTC).isoformat(),
                                           version=__version__, dp_rank_count=1,
                                           loads=[scheduler_load(self.rt)])

    async def SubscribeKvEvents(self, request, context) -> AsyncIterator[smg_common_pb2.KvEventBatch]:
        """The prefix cache's changes (gateway/kv/events.py) from `start_sequence_number` on:
        what the router's cache-aware policy indexes. UNIMPLEMENTED with --no-kv-events, so the
        router falls back to its own approximate tree."""
        log = self.rt.kv_events
        if not log.enabled:
            await _unimplemented(context, "KV events (serve --no-kv-events; poll GetLoads)")
            return
        async for batch in log.subscribe(request.start_sequence_number):
            yield batch

    async def GetTokenizer(self, request, context) -> AsyncIterator[smg_common_pb2.GetTokenizerChunk]:
        model = self.rt.require()
        data = await asyncio.to_thread(tokenizer_zip, model)
        digest = hashlib.sha256(data).hexdigest()
        for start in range(0, len(data), TOKENIZER_CHUNK_BYTES):
            end = start + TOKENIZER_CHUNK_BYTES
            yield smg_common_pb2.GetTokenizerChunk(data=data[start:end],
                                                   sha256=digest if end >= len(data) else "")


def add_smg_engine_service(server: grpc.aio.Server, api: GatewayServicer) -> str:
    """Serve SMG's engine API on `server` beside ShardLM's; returns its full service name."""
    engine_pb2_grpc.add_VllmEngineServicer_to_server(SmgEngineServicer(api), server)
    return SERVICE_NAME


async def start_smg_server(api: GatewayServicer, interceptors: list, host: str,
                           port: int) -> tuple[grpc.aio.Server, int]:
    """The engine API alone on a port of its own (serve --smg-port): plaintext and without
    bearer tokens, because SMG's gRPC client sends neither; for a gateway whose main port uses
    TLS or auth. Keep this port reachable by the router only (a NetworkPolicy in Kubernetes)."""
    server = grpc.aio.server(interceptors=interceptors)
    add_smg_engine_service(server, api)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port}")
    await server.start()
    return server, bound
