"""The engine a worker runs: load a checkpoint shard, hold the KV cache and per-sequence state,
and execute exactly the prefill / decode batches it is sent. Free of gRPC types.

Every rank of a tensor-parallel group runs the same calls in lock-step; rank 0 samples and
broadcasts the chosen ids so that all ranks feed the same next token.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

import torch

from worker.batch import build_decode_batch, build_prefill_batch
from worker.comm import Communicator, SingleRankCommunicator
from worker.config import ModelConfig, load_config
from worker.errors import EngineError, InvalidRequestError, SequenceNotCachedError
from worker.kv_cache import CacheCapacity, CacheConfig, KVCache
from worker.layers import Parallel
from worker.loader import CheckpointReader
from worker.model import TransformerModel, tap_names
from worker.sampling import SampledToken, SamplingParams, SamplingRow, TokenHistory, sample

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class FinishReason(StrEnum):
    LENGTH = "length"
    EOS = "eos"
    STOP_TOKEN = "stop_token"
    CONTEXT_LENGTH = "context_length"


@dataclass(frozen=True)
class StopParams:
    max_new_tokens: int = 0  # 0 = bounded only by the context
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False


@dataclass
class PrefillItem:
    sequence_id: int
    token_ids: list[int]  # new tokens only
    start_position: int  # tokens of this sequence already in the cache
    block_table: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: StopParams = field(default_factory=StopParams)
    sample: bool = True  # False for a non-final chunk of a chunked prefill


@dataclass
class DecodeItem:
    sequence_id: int
    block_table: list[int]
    max_steps: int
    sampling: SamplingParams | None = None  # replaces the sequence's parameters when given
    stop: StopParams | None = None


@dataclass
class TokenOutput:
    sequence_id: int
    token: SampledToken
    finish_reason: FinishReason | None = None


@dataclass
class StepOutput:
    tokens: list[TokenOutput]
    taps: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class Sequence:
    """What a rank remembers of a sequence between calls."""

    sequence_id: int
    tokens: list[int]  # every token whose K/V is in the cache, in order
    block_table: list[int]
    sampling: SamplingParams
    stop: StopParams
    pending: int | None = None  # sampled but not yet fed (its K/V is not cached yet)
    generated: int = 0
    finished: FinishReason | None = None
    generator: torch.Generator | None = None
    history: TokenHistory | None = None

    @property
    def num_cached(self) -> int:
        return len(self.tokens)


class Engine:
    def __init__(
        self,
        model: TransformerModel,
        cache_config: CacheConfig,
        model_dir: Path,
        dtype: torch.dtype,
        eos_token_ids: tuple[int, ...],
    ) -> None:
        self.model = model
        self.cfg: ModelConfig = model.cfg
        self.comm: Communicator = model.parallel.comm
        self.device = model.device
        self.dtype = dtype
        self.model_dir = model_dir
        self.eos_token_ids = eos_token_ids
        self.sequences: dict[int, Sequence] = {}
        self.cache = self._allocate(cache_config)
        self._tap_names = frozenset(tap_names(self.cfg.num_layers))

    # ----------------------------------------------------------------- loading and the cache
    @staticmethod
    def check_parallel(model_dir: str | Path, world_size: int) -> ModelConfig:
        """Fail fast, before any rendezvous, if the model cannot be split `world_size` ways."""
        cfg = load_config(model_dir)
        if world_size > 1:
            check = Parallel(_SizeOnly(world_size))
            for size, what in ((cfg.num_heads, "num_attention_heads"),
                               (cfg.num_kv_heads, "num_key_value_heads"),
                               (cfg.intermediate_size, "intermediate_size"),
                               (cfg.vocab_size, "vocab_size")):
                check.split(size, what)
        return cfg

    @classmethod
    def load(
        cls,
        model_dir: str | Path,
        *,
        dtype: str | torch.dtype | None = None,
        device: str | torch.device = "cpu",
        comm: Communicator | None = None,
        cache_config: CacheConfig | None = None,
        progress: Callable[[float, str], None] = lambda _f, _m: None,
    ) -> Engine:
        model_dir = Path(model_dir)
        device = torch.device(device)
        cfg = load_config(model_dir)
        torch_dtype = _resolve_dtype(dtype, cfg, device)
        comm = comm or SingleRankCommunicator()
        parallel = Parallel(comm)
        with CheckpointReader(model_dir, device, torch_dtype) as reader:
            model = TransformerModel(cfg, parallel, reader, device, progress)
        eos = tuple(dict.fromkeys(cfg.eos_token_ids + _generation_eos(model_dir)))
        return cls(model, cache_config or CacheConfig(), model_dir, torch_dtype, eos)

    def _allocate(self, config: CacheConfig) -> KVCache:
        return KVCache(
            config,
            num_layers=self.cfg.num_layers,
            kv_heads=self.model.num_kv_heads_per_rank,
            head_dim=self.cfg.head_dim,
            dtype=self.dtype,
            device=self.device,
            max_model_len=self.cfg.max_position_embeddings,
        )

    @property
    def capacity(self) -> CacheCapacity:
        return self.cache.capacity

    def reset(self, sequence_ids: list[int] | None = None) -> None:
        """Forget some sequences (or all). Their blocks are the gateway's to reuse."""
        if sequence_ids is None:
            self.sequences.clear()
        else:
            for sid in sequence_ids:
                self.sequences.pop(sid, None)

    def reconfigure(self, config: CacheConfig) -> CacheCapacity:
        """Drop every sequence and reallocate the cache with a new configuration."""
        config.validate()
        old = self.cache.config
        self.sequences.clear()
        self.cache = None  # type: ignore[assignment]  # free the old pool before the new one
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        try:
            self.cache = self._allocate(config)
        except EngineError:
            self.cache = self._allocate(old)  # keep serving with the pool that worked
            raise
        return self.cache.capacity

    def used_blocks(self) -> int:
        sequences = list(self.sequences.values())  # GetInfo reads this without the step lock
        return len({b for s in sequences for b in s.block_table})

    # ----------------------------------------------------------------- steps
    def prefill(self, items: list[PrefillItem], taps: list[str] | tuple[str, ...] = ()) -> StepOutput:
        """Run the new tokens of several sequences as one packed batch; sample where asked."""
        if not items:
            raise InvalidRequestError("prefill needs at least one sequence")
        self._check_unique([i.sequence_id for i in items])
        sequences = [self._prepare_prefill(item) for item in items]
        batch = build_prefill_batch(
            [(s.tokens, item.start_position, len(item.token_ids)) for s, item in
             zip(sequences, items, strict=True)],
            [s.block_table for s in sequences],
            self.cache.block_size,
            self.device,
        )
        tap_values = self._requested_taps(taps)
        logits = self.model.forward(batch.input_ids, batch.meta, self.cache.layers, tap_values)
        to_sample = [(s, row) for row, (s, item) in enumerate(zip(sequences, items, strict=True))
                     if item.sample]
        outputs = self._sample_and_advance(logits, to_sample)
        return StepOutput(outputs, tap_values or {})

    def decode(
        self, items: list[DecodeItem], num_steps: int, taps: list[str] | tuple[str, ...] = ()
    ) -> Iterator[StepOutput]:
        """Up to `num_steps` decode steps over the batch; yields each step's tokens. A sequence
        leaves the batch when it finishes or has used its own `max_steps`."""
        if num_steps <= 0:
            raise InvalidRequestError("num_steps must be positive")
        self._check_unique([i.sequence_id for i in items])
        plan = [(self._prepare_decode(item, num_steps), item.max_steps) for item in items]
        for step in range(num_steps):
            active = [s for s, budget in plan if s.finished is None and budget > step]
            if not active:
                return
            batch = build_decode_batch(
                [s.pending for s in active],  # type: ignore[misc]
                [s.num_cached for s in active],
                [s.block_table for s in active],
                self.cache.block_size,
                self.device,
            )
            tap_values = self._requested_taps(taps) if step == 0 else None
            logits = self.model.forward(batch.input_ids, batch.meta, self.cache.layers, tap_values)
            for s in active:  # the fed token's K/V is now cached
                s.tokens.append(s.pending)  # type: ignore[arg-type]
                s.pending = None
            outputs = self._sample_and_advance(logits, [(s, i) for i, s in enumerate(active)])
            yield StepOutput(outputs, tap_values or {})

    # ----------------------------------------------------------------- internals
    def _check_unique(self, ids: list[int]) -> None:
        if len(set(ids)) != len(ids):
            raise InvalidRequestError("a batch names the same sequence twice")

    def _requested_taps(self, names: list[str] | tuple[str, ...]) -> dict[str, torch.Tensor] | None:
        if not names:
            return None
        unknown = [n for n in names if n not in self._tap_names]
        if unknown:
            raise InvalidRequestError(
                f"unknown debug tap '{unknown[0]}' (e.g. layers.0.q, layers.0.mlp_output, logits)",
                field="debug_taps",
            )
        return dict.fromkeys(names, torch.empty(0))

    def _check_block_table(self, table: list[int], tokens: int, sequence_id: int) -> None:
        bs, nb = self.cache.block_size, self.cache.num_blocks
        if any(b < 0 or b >= nb for b in table):
            raise InvalidRequestError(
                f"sequence {sequence_id}: block table entries must be in [0, {nb})",
                field="block_table",
            )
        if len(table) * bs < tokens:
            raise InvalidRequestError(
                f"sequence {sequence_id}: block table of {len(table)} blocks cannot hold "
                f"{tokens} tokens (block size {bs})",
                field="block_table",
            )

    def _check_tokens(self, token_ids: list[int], sequence_id: int) -> None:
        vocab = self.cfg.vocab_size
        if any(t < 0 or t >= vocab for t in token_ids):
            raise InvalidRequestError(
                f"sequence {sequence_id}: token ids must be in [0, {vocab})", field="token_ids"
            )

    def _prepare_prefill(self, item: PrefillItem) -> Sequence:
        if not item.token_ids:
            raise InvalidRequestError(f"sequence {item.sequence_id}: no tokens to prefill")
        self._check_tokens(item.token_ids, item.sequence_id)
        end = item.start_position + len(item.token_ids)
        if end > self.cfg.max_position_embeddings:
            raise InvalidRequestError(
                f"sequence {item.sequence_id}: {end} tokens exceed the context of "
                f"{self.cfg.max_position_embeddings}",
                field="token_ids",
            )
        self._check_block_table(item.block_table, end, item.sequence_id)
        known = self.sequences.get(item.sequence_id)
        if item.start_position > 0 and (known is None or known.num_cached < item.start_position):
            raise SequenceNotCachedError(
                f"sequence {item.sequence_id}: {item.start_position} tokens are not in this "
                "worker's cache; prefill the whole history from position 0",
                sequence_id=item.sequence_id,
            )
        prefix = known.tokens[: item.start_position] if known else []
        seq = Sequence(
            sequence_id=item.sequence_id,
            tokens=prefix + list(item.token_ids),
            block_table=list(item.block_table),
            sampling=item.sampling,
            stop=item.stop,
        )
        self._attach_sampler_state(seq)
        self.sequences[item.sequence_id] = seq
        return seq

    def _prepare_decode(self, item: DecodeItem, num_steps: int) -> Sequence:
        seq = self.sequences.get(item.sequence_id)
        if seq is None or seq.pending is None:
            raise SequenceNotCachedError(
                f"sequence {item.sequence_id} has no pending token on this worker; prefill it first",
                sequence_id=item.sequence_id,
            )
        if seq.finished is not None and item.stop is None:
            raise InvalidRequestError(
                f"sequence {item.sequence_id} already finished ({seq.finished.value})"
            )
        steps = min(num_steps, item.max_steps)
        self._check_block_table(item.block_table, seq.num_cached + steps, item.sequence_id)
        seq.block_table = list(item.block_table)
        if item.sampling is not None and item.sampling != seq.sampling:
            seq.sampling = item.sampling
            self._attach_sampler_state(seq)  # new parameters: new generator and penalty state
        if item.stop is not None:  # a new call with its own limits: count from here
            seq.stop, seq.generated, seq.finished = item.stop, 0, None
        return seq

    def _attach_sampler_state(self, seq: Sequence) -> None:
        if self.comm.rank != 0:
            return  # only rank 0 samples
        p = seq.sampling
        seq.generator = None
        if p.seed is not None and not p.greedy:
            seq.generator = torch.Generator(device=self.device).manual_seed(p.seed)
        seq.history = None
        if p.uses_repetition_penalty or p.uses_output_penalties:
            seq.history = TokenHistory.from_prompt(seq.tokens, self.cfg.vocab_size, self.device)

    def _sample_and_advance(
        self, logits: torch.Tensor, rows: list[tuple[Sequence, int]]
    ) -> list[TokenOutput]:
        if not rows:
            return []
        picked = logits[[r for _s, r in rows]] if len(rows) != logits.shape[0] else logits
        if self.comm.rank == 0:
            tokens = sample(
                picked, [SamplingRow(s.sampling, s.generator, s.history) for s, _r in rows]
            )
        if self.comm.world_size > 1:
            ids = torch.zeros(len(rows), dtype=torch.int64, device=self.device)
            if self.comm.rank == 0:
                ids.copy_(torch.tensor([t.token_id for t in tokens]))
            self.comm.broadcast(ids, src=0)
            self.comm.synchronize()  # bounded wait: a dead peer raises instead of hanging here
            if self.comm.rank != 0:
                tokens = [SampledToken(t) for t in ids.tolist()]
        outputs = []
        for (seq, _row), token in zip(rows, tokens, strict=True):
            seq.pending = token.token_id
            seq.generated += 1
            seq.finished = self._finish_reason(seq, token.token_id)
            outputs.append(TokenOutput(seq.sequence_id, token, seq.finished))
        return outputs

    def _finish_reason(self, seq: Sequence, token_id: int) -> FinishReason | None:
        if not seq.stop.ignore_eos and token_id in self.eos_token_ids:
            return FinishReason.EOS
        if token_id in seq.stop.stop_token_ids:
            return FinishReason.STOP_TOKEN
        if seq.stop.max_new_tokens and seq.generated >= seq.stop.max_new_tokens:
            return FinishReason.LENGTH
        if seq.num_cached >= self.cfg.max_position_embeddings:
            return FinishReason.CONTEXT_LENGTH  # no position left to feed the new token
        return None


class _SizeOnly(SingleRankCommunicator):
    """Stands in for a group of `world_size` ranks where only the size matters."""

    def __init__(self, world_size: int) -> None:
        super().__init__()
        self.world_size = world_size


def _resolve_dtype(dtype: str | torch.dtype | None, cfg: ModelConfig, device: torch.device):
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype:
        if dtype not in DTYPES:
            raise InvalidRequestError(f"dtype must be one of {', '.join(DTYPES)}", field="dtype")
        return DTYPES[dtype]
    if device.type == "cuda" and cfg.torch_dtype in ("bfloat16", "float16"):
        return DTYPES[cfg.torch_dtype]
    return torch.float32


def _generation_eos(model_dir: Path) -> tuple[int, ...]:
    """generation_config.json may list more end-of-turn ids than config.json (chat models)."""
    try:
        raw = json.loads((model_dir / "generation_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return ()
    value = raw.get("eos_token_id") if isinstance(raw, dict) else None
    if isinstance(value, int):
        return (value,)
    if isinstance(value, list):
        return tuple(v for v in value if isinstance(v, int))
    return ()
