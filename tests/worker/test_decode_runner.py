"""Decode on fixed step buffers: padding rows change nothing, pipelined steps lose nothing, and on
CUDA a captured graph gives the eager path's tokens exactly."""

from __future__ import annotations

import pytest
import torch

from shardlm_server.worker import decode_runner
from shardlm_server.worker.decode_runner import (
    GraphConfig,
    StepBuffers,
    batch_buckets,
    context_buckets,
    pick_bucket,
)
from shardlm_server.worker.engine import DecodeItem, Engine, EngineOptions, PrefillItem, StopParams
from shardlm_server.worker.kv_cache import CacheConfig
from shardlm_server.worker.sampling import SamplerSettings
from tests.worker.eager_steps import graph_steps_run_eagerly

BLOCK = 8
PER_SEQ = 20  # blocks per sequence: 160 tokens (batch 17: a 117-token prompt and 24 steps)


def table(seq: int) -> list[int]:
    return list(range(seq * PER_SEQ, (seq + 1) * PER_SEQ))


def load(model_dir, device: str = "cpu", graphs: GraphConfig | None = None) -> Engine:
    return Engine.load(model_dir, dtype="float32" if device == "cpu" else "bfloat16",
                       device=device, options=EngineOptions(graphs=graphs or GraphConfig()),
                       cache_config=CacheConfig(block_size=BLOCK, num_blocks=20 * PER_SEQ))


@pytest.fixture(scope="module")
def engine(llama_dir):
    return load(llama_dir)


def prompts(count: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(count)
    return [torch.randint(3, vocab, (5 + 7 * i,), generator=g).tolist() for i in range(count)]


def generate(engine: Engine, ids: list[list[int]], steps: int, chunk: int | None = None,
             sampling: SamplerSettings | None = None) -> list[list[int]]:
    """Prefill every prompt, then decode `steps` tokens in calls of `chunk` steps."""
    engine.reset()
    stop = StopParams(max_new_tokens=steps + 1)
    params = sampling or SamplerSettings()
    first = engine.prefill([PrefillItem(i, p, 0, table(i), sampling=params, stop=stop)
                            for i, p in enumerate(ids)])
    out = [[t.token.token_id] for t in first.tokens]
    chunk = chunk or steps
    for start in range(0, steps, chunk):
        n = min(chunk, steps - start)
        for step in engine.decode([DecodeItem(i, table(i), n) for i in range(len(ids))], n):
            for t in step.tokens:
                out[t.sequence_id].append(t.token.token_id)
    return out


def test_buckets_cover_every_batch_size():
    for top in (1, 5, 64, 128, 200, 256):
        buckets = batch_buckets(top)
        assert buckets == sorted(set(buckets)) and buckets[0] == 1 and buckets[-1] == top
        assert all(any(b >= n for b in buckets) for n in range(1, top + 1))
    assert batch_buckets(128)[:5] == [1, 2, 4, 8, 16]


def test_a_step_takes_the_smallest_graph_that_holds_it():
    assert context_buckets(16384) == [1024, 4096, 16384]
    assert context_buckets(2048) == [1024, 2048] and context_buckets(256) == [256]
    rows, contexts = batch_buckets(128), context_buckets(16384)
    assert pick_bucket(rows, contexts, 3, 70) == (4, 1024)
    assert pick_bucket(rows, contexts, 65, 1025) == (80, 4096)
    assert pick_bucket(rows, contexts, 128, 16384) == (128, 16384)
    assert pick_bucket(rows, contexts, 129, 10) is None  # larger batches run eagerly
    assert pick_bucket(rows, contexts, 1, 16385) is None  # and so do longer contexts


def test_padding_rows_change_neither_logits_nor_cache(engine):
    ids = prompts(3, engine.cfg.vocab_size)
    engine.reset()
    engine.prefill([PrefillItem(i, p, 0, table(i)) for i, p in enumerate(ids)])
    seqs = [engine.sequences[i] for i in range(3)]
    positions = [s.num_cached for s in seqs]
    slots = [table(i)[p // BLOCK] * BLOCK + p % BLOCK for i, p in enumerate(positions)]
    tokens = [s.pending for s in seqs]

    def step(rows: int, live: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        buffers = StepBuffers(rows, PER_SEQ, engine.device)
        buffers.set_block_tables([table(i) for i in range(rows)])
        buffers.stage(rows, live, [tokens[i] for i in live], [positions[i] for i in live],
                      [slots[i] for i in live])
        caches = [(k.clone(), v.clone()) for k, v in engine.cache.layers]
        logits = buffers.forward(engine.model, caches, rows, max(positions) + 1)
        return logits, [k for k, _v in caches]

    exact, _ = step(3, [0, 1, 2])
    padded, padded_cache = step(8, [0, 1, 2])  # rows 3..7 pad the bucket
    # Equal up to the GEMMs' blocking, which depends on the number of rows.
    torch.testing.assert_close(padded[:3], exact, rtol=0, atol=1e-4)
    assert torch.count_nonzero(padded[3:]) > 0  # padding rows still ran the model ...
    for before, after in zip(engine.cache.layers, padded_cache, strict=True):
        changed = (after != before[0]).flatten(2).any(dim=2).flatten().nonzero().flatten()
        assert 0 < len(changed) and set(changed.tolist()) <= set(slots)  # ... wrote no cache
    # A row that has left the batch (row 1 here) is padding too: the others are unchanged.
    holed, _ = step(3, [0, 2])
    torch.testing.assert_close(holed[[0, 2]], exact[[0, 2]], rtol=0, atol=1e-4)


def test_pipelined_decode_equals_one_step_per_call(engine):
    ids = prompts(4, engine.cfg.vocab_size)
    whole = generate(engine, ids, 20)
    assert generate(engine, ids, 20, chunk=1) == whole
    assert generate(engine, ids, 20, chunk=7) == whole


def test_cpu_decode_yields_each_step_before_running_the_next(engine, monkeypatch):
    """On CPU a step runs when launched, so a step's tokens must reach the caller before the
    next forward pass: pipelining would hold every token back by a step."""
    ids = prompts(2, engine.cfg.vocab_size)
    engine.reset()
    stop = StopParams(max_new_tokens=10)
    engine.prefill([PrefillItem(i, p, 0, table(i), stop=stop) for i, p in enumerate(ids)])
    forwards = []
    original = engine.model.forward
    monkeypatch.setattr(engine.model, "forward",
                        lambda *a, **k: forwards.append(1) or original(*a, **k))
    seen = []
    for _ in engine.decode([DecodeItem(i, table(i), 4) for i in range(2)], 4):
        seen.append(len(forwards))
    assert seen == [1, 2, 3, 4]


def test_abandoned_decode_keeps_the_engine_consistent(engine):
    """A caller that stops reading after two steps (on a GPU the third is already queued) must
    be able to continue the sequences as if it had asked for two steps."""
    ids = prompts(2, engine.cfg.vocab_size)
    expected = generate(engine, ids, 6)
    engine.reset()
    stop = StopParams(max_new_tokens=10)
    first = engine.prefill([PrefillItem(i, p, 0, table(i), stop=stop) for i, p in enumerate(ids)])
    out = [[t.token.token_id] for t in first.tokens]
    steps = engine.decode([DecodeItem(i, table(i), 5) for i in range(2)], 5)
    for _ in range(2):
        for t in next(steps).tokens:
            out[t.sequence_id].append(t.token.token_id)
    steps.close()
    for step in engine.decode([DecodeItem(i, table(i), 4) for i in range(2)], 4):
        for t in step.tokens:
            out[t.sequence_id].append(t.token.token_id)
    assert out == expected


def test_rows_leave_the_batch_at_their_own_budget(engine):
    ids = prompts(3, engine.cfg.vocab_size)
    whole = generate(engine, ids, 8)
    engine.reset()
    stop = StopParams(max_new_tokens=20)
    engine.prefill([PrefillItem(i, p, 0, table(i), stop=stop) for i, p in enumerate(ids)])
    budgets = [2, 8, 5]
    seen = [0, 0, 0]
    for step in engine.decode([DecodeItem(i, table(i), budgets[i]) for i in range(3)], 8):
        for t in step.tokens:
            assert t.token.token_id == whole[t.sequence_id][1 + seen[t.sequence_id]]
            seen[t.sequence_id] += 1
    assert seen == budgets


def test_failed_graph_capture_falls_back_to_eager(engine, monkeypatch):
    real = decode_runner.DecodeRunner.__init__
    calls = []

    def flaky(self, model, caches, block_size, config=None):
        calls.append(config)
        if len(calls) == 1:
            raise torch.OutOfMemoryError("out of memory while capturing")
        real(self, model, caches, block_size, config)

    monkeypatch.setattr(decode_runner.DecodeRunner, "__init__", flaky)
    runner = engine._decode_runner()
    assert runner.graphs is None and calls[-1] == GraphConfig(enabled=False)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("batch", [1, 3, 17])
def test_cuda_graphs_equal_eager_token_for_token(llama_dir, batch):
    engine = load(llama_dir, "cuda", GraphConfig(max_batch=32, max_context=256))
    assert engine.runner.graphs is not None
    ids = prompts(batch, engine.cfg.vocab_size)
    seeded = SamplerSettings(temperature=0.8, top_p=0.9, seed=7)
    replayed = [generate(engine, ids, 24, chunk=8), generate(engine, ids, 16, sampling=seeded)]
    with graph_steps_run_eagerly():  # the same padded steps
        eager = [generate(engine, ids, 24, chunk=8), generate(engine, ids, 16, sampling=seeded)]
    assert replayed == eager


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_decode_matches_cpu_greedy(llama_dir):
    """Graphs, pinned staging and pipelining on a GPU against the float32 CPU engine: the
    greedy tokens agree until bfloat16 rounding first flips an argmax (checked on a prefix)."""
    ids = prompts(4, 1000)
    gpu = load(llama_dir, "cuda", GraphConfig(max_batch=8, max_context=256))
    cpu = load(llama_dir)
    got, want = generate(gpu, ids, 8), generate(cpu, ids, 8)
    assert sum(g[:4] == w[:4] for g, w in zip(got, want, strict=True)) >= 3
