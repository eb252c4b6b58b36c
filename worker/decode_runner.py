"""Decode steps on fixed buffers, and CUDA graphs of them.

A decode call keeps each sequence in one row for all of its steps. A step's per-row inputs (token
id, position, cache slot, context length) are staged in one host buffer, page-locked on a GPU, and
reach the device with one non-blocking copy; the block tables are copied once per call. A row
that has finished, and every row that pads the batch up to a captured size, gets slot -1 (the
cache write skips it) and context length 0 (attention returns zeros for it): padding is made a
no-op by the data, not by branches, so one captured graph serves every batch up to its size.

On CUDA, for a single rank, one graph per batch-size bucket is captured when the cache is
allocated; a step is then one replay instead of hundreds of kernel launches. Steps that no graph
fits (debug taps, a larger batch, a longer context, tensor parallelism) run the same code eagerly.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from shardlm.constants import DEFAULT_CUDA_GRAPH_MAX_BATCH, DEFAULT_CUDA_GRAPH_MAX_CONTEXT

from shardlm_server.worker.attention import AttentionMetadata
from shardlm_server.worker.model import Taps, TransformerModel
from shardlm_server.worker.transfer import pinned_if_cuda, to_device

log = logging.getLogger(__name__)

# Rows of the staging buffer, and what a padding row holds in each.
IDS, POSITIONS, SLOTS, CONTEXT = range(4)
PADDING = (0, 0, -1, 0)


@dataclass(frozen=True)
class GraphConfig:
    """CUDA graphs for decode: whether to capture them, and the largest batch and context a
    captured step serves (longer contexts widen every graph's attention grid, so they run eagerly).
    Set per Load from the request's EngineOptions (worker/convert.py)."""

    enabled: bool = True
    max_batch: int = DEFAULT_CUDA_GRAPH_MAX_BATCH
    max_context: int = DEFAULT_CUDA_GRAPH_MAX_CONTEXT


def batch_buckets(max_batch: int) -> list[int]:
    """Captured batch sizes: 1, 2, 4, 8, then every 8 up to 64, every 16 up to 128, every 32
    beyond; a batch runs in the smallest bucket that holds it."""
    sizes = [1, 2, 4, *range(8, 65, 8), *range(80, 129, 16), *range(160, max_batch + 32, 32)]
    buckets = [b for b in sizes if b < max_batch]
    return [*buckets, max_batch] if max_batch >= 1 else []


class StepBuffers:
    """Device inputs of a decode step for up to `rows` sequences of up to `blocks` cache blocks."""

    def __init__(self, rows: int, blocks: int, device: torch.device) -> None:
        self.rows, self.blocks, self.device = rows, blocks, device
        self.host = pinned_if_cuda((4, rows), torch.int64, device)
        self._staged = self.host.numpy()
        self.inputs = (torch.zeros((4, rows), dtype=torch.int64, device=device)
                       if device.type == "cuda" else self.host)
        self.context_lens = torch.zeros(rows, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros((rows, blocks), dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(rows + 1, dtype=torch.int32, device=device)
        self.logits_indices = torch.arange(rows, dtype=torch.int64, device=device)
        self.stage_padding(rows)

    def fits(self, rows: int, blocks: int) -> bool:
        return rows <= self.rows and blocks <= self.blocks

    def set_block_tables(self, tables: list[list[int]]) -> None:
        """Row i reads blocks tables[i]; columns past a table's end are never read."""
        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]
        self.block_tables[: len(tables), :width].copy_(
            to_device(padded, torch.int32, self.device), non_blocking=True)

    def stage(self, rows: int, live: list[int], ids: list[int] | None, positions: list[int],
              slots: list[int]) -> None:
        """Queue the inputs of one step: rows `live` get their values, rows [0, rows) outside it
        are padding. `ids=None` leaves the ids to `feed_ids`.

        The host buffer is rewritten here, so the previous step's copy must have run: callers
        wait for each step's results before staging the next.
        """
        staged = self._staged
        for row, value in enumerate(PADDING):
            staged[row, :rows] = value
        if ids is not None:
            staged[IDS, live] = ids
        staged[POSITIONS, live] = positions
        staged[SLOTS, live] = slots
        staged[CONTEXT, live] = [p + 1 for p in positions]
        if self.inputs is not self.host:
            # The whole buffer (a few KiB): a column slice would not be contiguous, and a
            # non-contiguous pinned source is staged through pageable memory, which blocks.
            self.inputs.copy_(self.host, non_blocking=True)

    def stage_padding(self, rows: int) -> None:
        self.stage(rows, [], None, [], [])

    def feed_ids(self, live: list[int], ids: torch.Tensor) -> None:
        """Rows `live` take their input ids from a device tensor (the previous step's samples)."""
        if live == list(range(len(live))):
            if self.inputs is self.host:  # CPU: one numpy write, no tensor views
                self._staged[IDS, : len(live)] = ids.numpy()
            else:
                self.inputs[IDS, : len(live)].copy_(ids)
        else:
            self.inputs[IDS].index_copy_(0, to_device(live, torch.int64, self.device), ids)

    def forward(self, model: TransformerModel, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                rows: int, max_context: int, taps: Taps | None = None) -> torch.Tensor:
        """Logits [rows, vocab] of the staged step (captured as is by `DecodeGraphs`)."""
        self.context_lens[:rows].copy_(self.inputs[CONTEXT, :rows])
        meta = AttentionMetadata(
            is_decode=True,
            positions=self.inputs[POSITIONS, :rows],
            slot_mapping=self.inputs[SLOTS, :rows],
            block_tables=self.block_tables[:rows],
            seq_lens=self.context_lens[:rows],
            query_start_loc=self.query_start_loc[: rows + 1],
            max_query_len=1,
            max_seq_len=max_context,
            logits_indices=self.logits_indices[:rows],
        )
        return model.forward(self.inputs[IDS, :rows], meta, kv_caches, taps)


class DecodeGraphs:
    """One CUDA graph per (batch bucket, context bucket) of `forward(rows, context)`, sharing one
    memory pool (captured largest first, so the smaller graphs reuse its activations).

    The context bucket sizes the decode attention's grid (one block per 512 tokens of context
    per head and row): a graph sized for the longest context would launch, at every step, blocks
    that find nothing to do for short sequences, so short contexts get graphs of their own."""

    def __init__(self, forward: Callable[[int, int], torch.Tensor], buckets: list[int],
                 contexts: list[int]) -> None:
        self.buckets = sorted(buckets)
        self.contexts = sorted(contexts)
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._logits: dict[tuple[int, int], torch.Tensor] = {}
        pool = None
        for key in sorted(((r, c) for r in self.buckets for c in self.contexts), reverse=True):
            # Warm up on a side stream first, as torch's capture rules ask: lazy initialisation
            # (cuBLAS handles, workspaces) must not happen inside the capture.
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    forward(*key)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # thread_local: a health probe asking for memory figures from another thread while
            # the load thread captures must neither fail nor invalidate the capture.
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                self._logits[key] = forward(*key)
            pool = graph.pool()
            self._graphs[key] = graph
        torch.cuda.synchronize()

    def bucket_for(self, rows: int, context: int) -> tuple[int, int] | None:
        """The smallest captured (rows, context) that holds this step, if any."""
        return pick_bucket(self.buckets, self.contexts, rows, context)

    def replay(self, key: tuple[int, int]) -> torch.Tensor:
        self._graphs[key].replay()
        return self._logits[key]


def pick_bucket(buckets: list[int], contexts: list[int], rows: int,
                context: int) -> tuple[int, int] | None:
    row_bucket = next((b for b in buckets if b >= rows), None)
    ctx_bucket = next((c for c in contexts if c >= context), None)
    if row_bucket is None or ctx_bucket is None:
        return None
    return row_bucket, ctx_bucket


def context_buckets(max_context: int) -> list[int]:
    """Captured context sizes: 1024 and 4096 tokens (2 and 8 attention blocks per head and row),
    and the largest context graphs serve."""
    return sorted({c for c in (1024, 4096) if c < max_context} | {max_context})


class DecodeCall:
    """The buffers one decode call runs on: a graph bucket, or eager buffers of its exact size."""

    def __init__(self, runner: DecodeRunner, buffers: StepBuffers, rows: int, max_context: int,
                 graphs: DecodeGraphs | None) -> None:
        self.runner = runner
        self.buffers = buffers
        self.rows = rows  # rows computed per step: the bucket, or the batch itself when eager
        self.max_context = max_context  # the context bucket when a graph runs the step
        self.graphs = graphs

    def run(self, taps: Taps | None = None) -> torch.Tensor:
        """Logits of the staged step: [rows, vocab] (float32)."""
        if self.graphs is not None:
            return self.graphs.replay((self.rows, self.max_context))
        return self.buffers.forward(self.runner.model, self.runner.kv_caches, self.rows,
                                    self.max_context, taps)


class DecodeRunner:
    """Owns the step buffers (and graphs) of one engine for one cache allocation."""

    def __init__(self, model: TransformerModel, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 block_size: int, config: GraphConfig | None = None) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = model.device
        self.config = config or GraphConfig()
        self._eager: StepBuffers | None = None
        self._graph_buffers: StepBuffers | None = None
        self.graphs: DecodeGraphs | None = None
        if self._graphs_possible():
            self._capture()

    def _graphs_possible(self) -> bool:
        c = self.config
        return (c.enabled and self.device.type == "cuda" and c.max_batch > 0 and c.max_context > 0
                and self.model.parallel.world_size == 1)

    def _capture(self) -> None:
        c = self.config
        max_context = min(c.max_context, self.model.cfg.max_position_embeddings)
        blocks = -(-max_context // self.block_size)
        buffers = StepBuffers(c.max_batch, blocks, self.device)
        buckets, contexts = batch_buckets(c.max_batch), context_buckets(max_context)
        self.graphs = DecodeGraphs(
            lambda rows, context: buffers.forward(self.model, self.kv_caches, rows, context),
            buckets, contexts)
        self._graph_buffers = buffers
        log.info("captured CUDA graphs for decode batches %s x contexts %s", buckets, contexts)

    def begin(self, tables: list[list[int]], max_context: int, eager: bool = False) -> DecodeCall:
        """Buffers for a call over len(tables) rows whose contexts stay <= max_context."""
        rows = len(tables)
        width = max(len(t) for t in tables)
        if (not eager and self.graphs is not None and self._graph_buffers is not None
                and self._graph_buffers.fits(rows, width)):
            bucket = self.graphs.bucket_for(rows, max_context)
            if bucket is not None:
                self._graph_buffers.set_block_tables(tables)
                return DecodeCall(self, self._graph_buffers, *bucket, self.graphs)
        if self._eager is None or not self._eager.fits(rows, width):
            grown_rows = max(rows, self._eager.rows if self._eager else 0)
            grown_blocks = max(width, self._eager.blocks if self._eager else 0)
            self._eager = StepBuffers(grown_rows, grown_blocks, self.device)
        self._eager.set_block_tables(tables)
        return DecodeCall(self, self._eager, rows, max_context, None)
