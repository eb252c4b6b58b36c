"""The engine a worker runs: load a checkpoint shard, hold the KV cache and per-sequence state,
and execute exactly the prefill / decode batches it is sent. Free of gRPC types.

Every rank of a tensor-parallel group runs the same calls in lock-step; rank 0 samples and
broadcasts the chosen ids so that all ranks feed the same next token.

A sequence stops only on what it was sent: its stop ids (the gateway includes the model's EOS
ids there unless the caller ignores them), its token budget, and the end of the position table.
The engine's `eos_token_ids` are reported in ModelInfo, never consulted when stepping.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from shardlm.constants import ACTIVATION_PRECISIONS, DTYPE_NAMES

from shardlm_server.worker import ops
from shardlm_server.worker.batch import build_prefill_batch, slot_of
from shardlm_server.worker.checkpoint import CheckpointSource
from shardlm_server.worker.comm import Communicator, SingleRankCommunicator
from shardlm_server.worker.config import ModelConfig
from shardlm_server.worker.decode_runner import DecodeCall, DecodeRunner, GraphConfig
from shardlm_server.worker.engine_types import (  # noqa: F401 - the engine's API types, re-exported
    DecodeItem,
    FinishReason,
    PrefillItem,
    ResidentSequence,
    StepOutput,
    StopParams,
    TokenOutput,
)
from shardlm_server.worker.eos import checkpoint_eos_ids
from shardlm_server.worker.errors import EngineError, InvalidRequestError
from shardlm_server.worker.grammar import GrammarRuntime
from shardlm_server.worker.kv_cache import CacheCapacity, CacheConfig, KVCache, cache_dtype
from shardlm_server.worker.layers import Parallel
from shardlm_server.worker.loader import load_checkpoint_config, open_checkpoint
from shardlm_server.worker.memory import release_load_memory, trim_after_prefill, weight_bytes
from shardlm_server.worker.model import TransformerModel, tap_names
from shardlm_server.worker.quant import check_mode as check_quantize_mode
from shardlm_server.worker.sequences import SequenceStates
from shardlm_server.worker.speculative import SpeculationConfig, Speculator
from shardlm_server.worker.step_checks import (
    check_unique,
)
from shardlm_server.worker.step_sampler import PendingSample, StepSampler
from shardlm_server.worker.transfer import to_device

log = logging.getLogger(__name__)

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}


@dataclass(frozen=True)
class EngineOptions:
    """How the engine runs, not what it computes: decode CUDA graphs, and whether the CPU kernels
    may take their SIMD paths, AVX2 or AVX-512, the widest this CPU has (False: the portable
    loops; a process-wide switch, set at load), the CPU quantized linears' activation
    precision (ops.activations; process-wide too), and speculative decoding. Filled from the LoadRequest's EngineOptions by
    worker/convert.py."""

    graphs: GraphConfig = field(default_factory=GraphConfig)
    cpu_simd: bool = True
    activation_precision: str = ACTIVATION_PRECISIONS[0]
    speculation: SpeculationConfig = field(default_factory=SpeculationConfig)


class Engine:
    def __init__(
        self,
        model: TransformerModel,
        cache_config: CacheConfig,
        model_dir: Path,
        dtype: torch.dtype,
        eos_token_ids: tuple[int, ...],
        graph_config: GraphConfig | None = None,
        source: CheckpointSource | None = None,
        grammar: GrammarRuntime | None = None,
        speculation: SpeculationConfig | None = None,
    ) -> None:
        self.model = model
        self.cfg: ModelConfig = model.cfg
        self.comm: Communicator = model.parallel.comm
        self.device = model.device
        self.dtype = dtype
        self.model_dir = model_dir
        self.source = source or CheckpointSource("safetensors", ())
        self.eos_token_ids = eos_token_ids  # reported in ModelInfo; see the module docstring
        self.graph_config = graph_config or GraphConfig()
        self.weight_bytes = weight_bytes(model)  # this rank's, as ModelInfo reports them
        self.cache = self._allocate(cache_config)
        self.runner = self._decode_runner()
        self.sampler = StepSampler(self.comm, self.device)
        self.grammar = grammar  # constrained decoding, on the sampling rank (rank 0) only
        self.states = SequenceStates(self.cfg, self.comm, self.device, grammar)
        self.sequences = self.states.by_id
        speculation = speculation or SpeculationConfig()
        self.speculator = (Speculator(speculation, model, self.comm, self.sampler, self.states)
                           if speculation.enabled(self.device) else None)
        self._tap_names = frozenset(tap_names(self.cfg.num_layers))

    # ----------------------------------------------------------------- loading and the cache
    @staticmethod
    def check_parallel(model_dir: str | Path, world_size: int) -> None:
        """Fail fast, before any rendezvous, if the model cannot be split `world_size` ways."""
        cfg = load_checkpoint_config(model_dir)
        if world_size > 1:
            check = Parallel(_SizeOnly(world_size))
            for size, what in ((cfg.num_heads, "num_attention_heads"),
                               (cfg.num_kv_heads, "num_key_value_heads"),
                               (cfg.intermediate_size, "intermediate_size"),
                               (cfg.vocab_size, "vocab_size")):
                check.split(size, what)

    @classmethod
    def load(
        cls,
        model_dir: str | Path,
        *,
        dtype: str | torch.dtype | None = None,
        device: str | torch.device = "cpu",
        comm: Communicator | None = None,
        cache_config: CacheConfig | None = None,
        options: EngineOptions | None = None,
        quantize: str = "",
        tokenizer_json: str = "",
        progress: Callable[[float, str], None] = lambda _f, _m: None,
    ) -> Engine:
        """`quantize`: how linear weights are kept on CPU (worker.quant.QUANTIZE_MODES).
        `tokenizer_json` (Hugging Face tokenizers JSON) enables constrained decoding on rank 0."""
        options = options or EngineOptions()
        ops.set_cpu_simd(options.cpu_simd)
        ops.set_activation_precision(options.activation_precision)
        model_dir = Path(model_dir)
        check_quantize_mode(quantize)
        device = torch.device(device)
        cfg = load_checkpoint_config(model_dir)
        torch_dtype = _resolve_dtype(dtype, cfg, device)
        comm = comm or SingleRankCommunicator()
        parallel = Parallel(comm)
        with open_checkpoint(model_dir, device, torch_dtype, quantize) as reader:
            model = TransformerModel(cfg, parallel, reader, device, progress)
            source = CheckpointSource(reader.format, tuple(reader.tensor_types))
        del reader  # its file's map closes with the parsed file's cache
        release_load_memory()
        eos = checkpoint_eos_ids(model_dir, cfg.eos_token_ids)
        grammar = (GrammarRuntime.for_tokenizer(tokenizer_json, cfg.vocab_size, eos)
                   if tokenizer_json and comm.rank == 0 else None)
        return cls(model, cache_config or CacheConfig(), model_dir, torch_dtype, eos,
                   options.graphs, source, grammar, options.speculation)

    def _allocate(self, config: CacheConfig) -> KVCache:
        return KVCache(
            config,
            num_layers=self.cfg.num_layers,
            kv_heads=self.model.num_kv_heads_per_rank,
            head_dim=self.cfg.head_dim,
            dtype=cache_dtype(config, self.dtype),
            device=self.device,
            max_model_len=self.cfg.max_position_embeddings,
        )

    def _decode_runner(self) -> DecodeRunner:
        """Step buffers (and on CUDA the decode graphs) over the current cache. A capture that
        fails (e.g. the cache left too little memory) costs speed, not service: decode runs eagerly."""
        try:
            return DecodeRunner(self.model, self.cache.layers, self.cache.block_size,
                                self.graph_config)
        except (RuntimeError, torch.OutOfMemoryError) as exc:
            log.warning("CUDA graph capture failed (%s); decode runs without graphs", exc)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            return DecodeRunner(self.model, self.cache.layers, self.cache.block_size,
                                GraphConfig(enabled=False))

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
        cache_dtype(config, self.dtype)  # refused before the pool in use is let go
        old = self.cache.config
        self.sequences.clear()
        # Free the old pool (and the graphs that point into it) before allocating the new one.
        self.cache = self.runner = None  # type: ignore[assignment]
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        try:
            self.cache = self._allocate(config)
        except EngineError:
            self.cache = self._allocate(old)  # keep serving with the pool that worked
            raise
        finally:
            if self.cache is not None:
                self.runner = self._decode_runner()
        return self.cache.capacity

    def used_blocks(self) -> int:
        sequences = list(self.sequences.values())  # GetInfo reads this without the step lock
        return len({b for s in sequences for b in s.block_table})

    # ----------------------------------------------------------------- steps
    def prefill(self, items: list[PrefillItem], taps: list[str] | tuple[str, ...] = ()) -> StepOutput:
        """Run the new tokens of several sequences as one packed batch; sample where asked."""
        if not items:
            raise InvalidRequestError("prefill needs at least one sequence")
        check_unique([i.sequence_id for i in items])
        sequences = [self.states.for_prefill(item, self.cache) for item in items]
        batch = build_prefill_batch(
            [(s.tokens, item.start_position, len(item.token_ids)) for s, item in
             zip(sequences, items, strict=True)],
            [s.block_table for s in sequences],
            self.cache.block_size,
            self.device,
        )
        tap_values = self._requested_taps(taps)
        rows = [row for row, item in enumerate(items) if item.sample]
        picked = [sequences[r] for r in rows]
        masks = self.states.start_masks(picked)  # made while the forward pass runs
        logits = self.model.forward(batch.input_ids, batch.meta, self.cache.layers, tap_values)
        trim_after_prefill(self.device, len(batch.input_ids))
        if not rows:
            return StepOutput([], tap_values or {})
        if len(rows) != logits.shape[0]:
            logits = logits.index_select(0, to_device(rows, torch.int64, self.device))
        pending = self.sampler.launch(logits, picked, rows, masks)
        tokens = self.sampler.collect(pending)
        return StepOutput(self.states.advance(picked, tokens), tap_values or {}, pending.mask_seconds)

    def decode(
        self, items: list[DecodeItem], num_steps: int, taps: list[str] | tuple[str, ...] = ()
    ) -> Iterator[StepOutput]:
        """Up to `num_steps` decode steps over the batch; yields each step's tokens. A sequence
        leaves the batch when it finishes or has used its own `max_steps`.

        On a GPU steps are pipelined: step t+1 is queued on the device before step t's tokens are
        yielded, so the caller's work on them (detokenising, streaming) overlaps the device's
        work. On CPU a step runs when it is launched, so there each step's tokens are yielded
        before the next step runs: pipelining there would only hold every token back by a step
        (two at the start of a call). Each
        sequence keeps one row of the step buffers for the whole call; a row whose sequence has
        left computes nothing (slot -1, context 0). With speculative decoding (not while taps are
        captured) a step may yield several tokens of a sequence: `max_steps` then counts its
        tokens, which may exceed `num_steps` (accepted drafts take a sequence further in the
        call's steps, where its block table has room), and the call still ends after `num_steps`
        steps; without drafts a sequence takes at most `num_steps` tokens.
        """
        if num_steps <= 0:
            raise InvalidRequestError("num_steps must be positive")
        check_unique([i.sequence_id for i in items])
        tap_values = self._requested_taps(taps)
        speculator = self.speculator if tap_values is None else None
        budgets = [item.max_steps if speculator else min(item.max_steps, num_steps)
                   for item in items]
        seqs = [self.states.for_decode(item, budget, self.cache)
                for item, budget in zip(items, budgets, strict=True)]
        if not seqs:
            return
        longest = max(s.num_cached + b for s, b in zip(seqs, budgets, strict=True))
        call = self.runner.begin([s.block_table for s in seqs], longest,
                                 eager=tap_values is not None)
        if speculator is not None:
            yield from self._decode_speculative(speculator, call, seqs, budgets, num_steps)
            return

        def live_rows(step: int) -> list[int]:
            return [i for i, s in enumerate(seqs) if s.finished is None and budgets[i] > step]

        pipelined = self.device.type == "cuda"
        live = live_rows(0)
        pending = self._launch_decode(call, seqs, live, None, tap_values) if live else None
        step = 0
        try:
            while pending is not None:
                tokens = self.sampler.collect(pending)
                for i in live:  # the fed token's K/V is now cached
                    seqs[i].tokens.append(seqs[i].pending)  # type: ignore[arg-type]
                outputs = self.states.advance([seqs[i] for i in live], tokens)
                step += 1
                previous, live = pending, live_rows(step) if step < num_steps else []
                result = StepOutput(outputs, (tap_values or {}) if step == 1 else {},
                                    previous.mask_seconds)
                if pipelined:
                    pending = self._launch_decode(call, seqs, live, previous) if live else None
                    yield result
                else:
                    pending = None  # nothing queued while the caller holds the tokens
                    yield result
                    pending = self._launch_decode(call, seqs, live, previous) if live else None
        finally:
            # A caller that stops reading leaves one step queued; its tokens are dropped (the
            # sequences stay as after the last step read) but its reads of the step buffers
            # must finish before another call rewrites them.
            if pending is not None and pending.done is not None:
                pending.done.synchronize()

    def _decode_speculative(self, speculator: Speculator, call: DecodeCall,
                            seqs: list[ResidentSequence], budgets: list[int],
                            num_steps: int) -> Iterator[StepOutput]:
        """`decode` with drafts: a step whose sequences propose none runs the plain decode step
        on the call's buffers; one with drafts verifies them (worker/speculative.py). Steps are
        not pipelined: the next step's drafts come from this one's tokens."""
        emitted = [0] * len(seqs)
        index = {s.sequence_id: i for i, s in enumerate(seqs)}
        for _step in range(num_steps):
            live = [i for i, s in enumerate(seqs) if s.finished is None and emitted[i] < budgets[i]]
            if not live:
                return
            stepping = [seqs[i] for i in live]
            room = [budgets[i] - emitted[i] for i in live]
            drafts = speculator.propose(stepping, room, call.rows)
            started = time.perf_counter()
            counts = []
            if any(drafts):
                verified = speculator.verify(stepping, drafts, self.cache)
                outputs, counts = speculator.accept(stepping, drafts, verified, room)
                mask_seconds = verified.pending.mask_seconds
            else:
                pending = self._launch_decode(call, seqs, live, None)
                tokens = self.sampler.collect(pending)
                for seq in stepping:
                    seq.tokens.append(seq.pending)  # type: ignore[arg-type]
                outputs = self.states.advance(stepping, tokens)
                for seq, out in zip(stepping, outputs, strict=True):
                    speculator.after_step(seq, [out.token.token_id])
                mask_seconds = pending.mask_seconds
            # Rows computed: a verifying step packs the live rows and their drafts; a plain one
            # computes every row of the call's buffers, finished ones included.
            verify = any(drafts)
            rows = len(live) + sum(map(len, drafts)) if verify else call.rows
            speculator.observe(rows, time.perf_counter() - started, verify)
            for out in outputs:
                emitted[index[out.sequence_id]] += 1
            yield StepOutput(outputs, {}, mask_seconds, counts)

    # ----------------------------------------------------------------- step internals
    def _launch_decode(self, call: DecodeCall, seqs: list[ResidentSequence], live: list[int],
                       previous: PendingSample | None, taps: dict | None = None) -> PendingSample:
        """Queue one decode step of rows `live` (and the sampling of its tokens)."""
        positions = [seqs[i].num_cached for i in live]
        slots = [slot_of(seqs[i].block_table, p, self.cache.block_size)
                 for i, p in zip(live, positions, strict=True)]
        if previous is None:
            call.buffers.stage(call.rows, live, [seqs[i].pending for i in live],  # type: ignore[misc]
                               positions, slots)
        else:  # the ids are the previous step's samples, still on the device
            call.buffers.stage(call.rows, live, None, positions, slots)
            call.buffers.feed_ids(previous.rows, previous.ids)
        stepping = [seqs[i] for i in live]
        masks = self.states.start_masks(stepping)  # made while the forward pass runs
        logits = call.run(taps)
        if live != list(range(logits.shape[0])):
            logits = logits.index_select(0, to_device(live, torch.int64, self.device))
        return self.sampler.launch(logits, stepping, live, masks)

    # ----------------------------------------------------------------- internals
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
