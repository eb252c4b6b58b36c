"""Conversions between the worker protobuf messages and the engine's plain types.

Kept apart so the engine stays free of gRPC and the servicer stays thin.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from shardlm.common.v1 import common_pb2
from shardlm.constants import (
    ACTIVATION_PRECISIONS,
    DEFAULT_CPU_STREAM_INTERVAL_MS,
    DEFAULT_CUDA_GRAPH_MAX_BATCH,
    DEFAULT_CUDA_GRAPH_MAX_CONTEXT,
    DTYPE_NAMES,
    MAX_SPECULATIVE_TOKENS,
    SPECULATION_MODES,
    dtype_enum_name,
)
from shardlm.worker.v1 import worker_pb2

from shardlm_server.worker.decode_runner import GraphConfig
from shardlm_server.worker.engine import (
    DTYPES,
    DecodeItem,
    Engine,
    EngineOptions,
    PrefillItem,
    StepOutput,
    StopParams,
)
from shardlm_server.worker.errors import InvalidRequestError
from shardlm_server.worker.grammar import SequenceConstraint
from shardlm_server.worker.kv_cache import DEFAULT_BLOCK_SIZE, CacheCapacity, CacheConfig, CacheMode
from shardlm_server.worker.sampling import SamplerSettings
from shardlm_server.worker.speculative import SpeculationConfig

# Dtype enum <-> the engine's names and torch dtypes, derived from the one list of names.
DTYPE_BY_ENUM = {common_pb2.Dtype.Value(dtype_enum_name(name)): name for name in DTYPE_NAMES}
DTYPE_ENUMS = {DTYPES[name]: enum for enum, name in DTYPE_BY_ENUM.items()}
FORMAT_ENUMS = {"safetensors": common_pb2.CHECKPOINT_FORMAT_SAFETENSORS,
                "gguf": common_pb2.CHECKPOINT_FORMAT_GGUF}
MODE_ENUMS = {CacheMode.PAGED: common_pb2.KV_CACHE_MODE_PAGED,
              CacheMode.STATIC: common_pb2.KV_CACHE_MODE_STATIC}


def sampling_from_proto(p: common_pb2.SamplingParams) -> SamplerSettings:
    return SamplerSettings(
        temperature=p.temperature,
        top_k=p.top_k,
        top_p=p.top_p if p.HasField("top_p") else 1.0,
        min_p=p.min_p,
        repetition_penalty=p.repetition_penalty if p.HasField("repetition_penalty") else 1.0,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        seed=p.seed if p.HasField("seed") else None,
        logprobs=p.logprobs,
        top_logprobs=p.top_logprobs,
    )


def stop_from_proto(p: common_pb2.StopConditions) -> StopParams:
    """Workers apply the budget and the stop ids only (see worker.proto's PrefillSequence.stop)."""
    return StopParams(max_new_tokens=p.max_new_tokens, stop_token_ids=tuple(p.stop_token_ids))


def cache_config_from_proto(p: common_pb2.KvCacheConfig) -> CacheConfig:
    return CacheConfig(
        mode=CacheMode.STATIC if p.mode == common_pb2.KV_CACHE_MODE_STATIC else CacheMode.PAGED,
        block_size=p.block_size or DEFAULT_BLOCK_SIZE,
        memory_bytes=p.memory_bytes,
        gpu_memory_fraction=p.gpu_memory_fraction,
        num_blocks=p.num_blocks,
        static_max_sequences=p.static_max_sequences,
        static_max_sequence_length=p.static_max_sequence_length,
        dtype=DTYPES[DTYPE_BY_ENUM[p.dtype]] if p.dtype in DTYPE_BY_ENUM else None,
        sequences=p.max_running_sequences,
    )


def engine_options_from_proto(p: worker_pb2.EngineOptions) -> EngineOptions:
    """The engine's options from a LoadRequest; zero values take the worker's defaults."""
    graphs = GraphConfig(enabled=not p.disable_cuda_graphs,
                         max_batch=p.cuda_graph_max_batch or DEFAULT_CUDA_GRAPH_MAX_BATCH,
                         max_context=p.cuda_graph_max_context or DEFAULT_CUDA_GRAPH_MAX_CONTEXT)
    precision = p.activation_precision or ACTIVATION_PRECISIONS[0]
    if precision not in ACTIVATION_PRECISIONS:
        raise InvalidRequestError(
            f"activation_precision must be one of {', '.join(ACTIVATION_PRECISIONS)}, got "
            f"{precision!r}", field="engine.activation_precision")
    return EngineOptions(graphs=graphs, cpu_simd=not p.disable_cpu_simd,
                         activation_precision=precision, speculation=_speculation(p))


def _speculation(p: worker_pb2.EngineOptions) -> SpeculationConfig:
    mode = p.speculation or SPECULATION_MODES[0]
    if mode not in SPECULATION_MODES:
        raise InvalidRequestError(
            f"speculation must be one of {', '.join(SPECULATION_MODES)}, got {mode!r}",
            field="engine.speculation")
    if p.speculative_tokens > MAX_SPECULATIVE_TOKENS:
        raise InvalidRequestError(
            f"speculative_tokens must be at most {MAX_SPECULATIVE_TOKENS}, got "
            f"{p.speculative_tokens}", field="engine.speculative_tokens")
    return SpeculationConfig(mode, p.speculative_tokens)


def capacity_to_proto(c: CacheCapacity) -> common_pb2.KvCacheCapacity:
    return common_pb2.KvCacheCapacity(
        num_blocks=c.num_blocks, block_size=c.block_size, mode=MODE_ENUMS[c.mode],
        bytes_per_block=c.bytes_per_block, max_sequences=c.max_sequences,
        max_sequence_length=c.max_sequence_length,
    )


def model_info_to_proto(engine: Engine) -> common_pb2.ModelInfo:
    cfg = engine.cfg
    info = common_pb2.ModelInfo(
        architecture=cfg.architecture, model_path=str(engine.model_dir),
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, intermediate_size=cfg.intermediate_size,
        max_position_embeddings=cfg.max_position_embeddings, dtype=DTYPE_ENUMS[engine.dtype],
        eos_token_ids=list(engine.eos_token_ids), tensor_parallel_size=engine.comm.world_size,
        format=FORMAT_ENUMS.get(engine.source.format, common_pb2.CHECKPOINT_FORMAT_UNSPECIFIED),
        tensor_types=list(engine.source.tensor_types),
        weight_bytes=engine.weight_bytes, kv_cache_bytes=engine.cache.nbytes,
        kv_cache_dtype=DTYPE_ENUMS[engine.cache.dtype],
    )
    if cfg.bos_token_id is not None:
        info.bos_token_id = cfg.bos_token_id
    return info


def constraint_from_proto(p: worker_pb2.GrammarConstraint) -> SequenceConstraint:
    return SequenceConstraint(grammar=p.grammar, start_position=p.start_position)


def prefill_items(request: worker_pb2.PrefillRequest) -> list[PrefillItem]:
    return [
        PrefillItem(
            sequence_id=s.sequence_id,
            token_ids=list(s.token_ids),
            start_position=s.start_position,
            block_table=list(s.block_table),
            sampling=sampling_from_proto(s.sampling),
            stop=stop_from_proto(s.stop),
            sample=s.sample,
            prefix_token_ids=list(s.prefix_token_ids),
            constraint=constraint_from_proto(s.constraint) if s.HasField("constraint") else None,
            output_start=s.output_start,
        )
        for s in request.sequences
    ]


def decode_items(request: worker_pb2.DecodeRequest) -> list[DecodeItem]:
    return [
        DecodeItem(
            sequence_id=s.sequence_id,
            block_table=list(s.block_table),
            max_steps=s.max_steps or request.num_steps,
            sampling=sampling_from_proto(s.sampling) if s.HasField("sampling") else None,
            stop=stop_from_proto(s.stop) if s.HasField("stop") else None,
            constraint=constraint_from_proto(s.constraint) if s.HasField("constraint") else None,
        )
        for s in request.sequences
    ]


def tokens_to_proto(output: StepOutput) -> list[worker_pb2.SequenceToken]:
    out = []
    for t in output.tokens:
        msg = worker_pb2.SequenceToken(sequence_id=t.sequence_id, token_id=t.token.token_id,
                                       constraint_complete=t.constraint_complete)
        if t.token.logprob is not None:
            msg.logprobs.chosen.token_id = t.token.token_id
            msg.logprobs.chosen.logprob = t.token.logprob
            for token_id, logprob in t.token.top_logprobs:
                msg.logprobs.top.add(token_id=token_id, logprob=logprob)
        out.append(msg)
    return out


def drafts_to_proto(output: StepOutput) -> list[worker_pb2.DraftTokens]:
    return [worker_pb2.DraftTokens(sequence_id=d.sequence_id, proposed=d.proposed,
                                   accepted=d.accepted) for d in output.drafts]


def taps_to_proto(taps: dict[str, torch.Tensor]) -> list[common_pb2.DebugTensor]:
    return [
        common_pb2.DebugTensor(name=name, shape=list(value.shape),
                               data=value.float().contiguous().numpy().astype("<f4").tobytes())
        for name, value in taps.items()
    ]


def stream_gather_s(request: worker_pb2.DecodeRequest, device: torch.device) -> float:
    """How long a Decode call's steps may wait to go out together in one message: the request's
    stream interval, or unset the default for this device; 0 with taps (a message a step)."""
    if request.debug_taps:
        return 0.0
    if request.HasField("stream_interval_ms"):
        return request.stream_interval_ms / 1000
    return (DEFAULT_CPU_STREAM_INTERVAL_MS if device.type == "cpu" else 0) / 1000


def decode_responses(groups: Iterable[list[StepOutput]], *, samples: bool,
                     ) -> Iterator[worker_pb2.DecodeResponse]:
    """A Decode call's messages, one for each group of consecutive steps' outputs (grouped by
    EngineThread.stream under the stream interval: where steps take a few milliseconds each
    message carries a few tokens and wakes the threads on both ends of the link once for all of
    them). `samples`: this rank samples (its messages carry the tokens; other ranks' carry only
    the step, the group's last)."""
    step = -1
    for group in groups:
        step += len(group)
        message = worker_pb2.DecodeResponse(step=step)
        if samples:
            for output in group:
                message.tokens.extend(tokens_to_proto(output))
                message.taps.extend(taps_to_proto(output.taps))
                message.drafts.extend(drafts_to_proto(output))
                if output.mask_seconds > 0:
                    message.constraint_mask_seconds.append(output.mask_seconds)
        yield message
