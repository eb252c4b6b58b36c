"""The engine on a GPU against the engine on the CPU, on the test checkpoints.

float32 on the GPU gives the CPU's greedy tokens exactly; bfloat16 gives its logits within
bfloat16 rounding. Prefill and decode cross block boundaries (prompts one short of, at and one
past a block), chunked prefills agree with whole ones, and a 16k-token context runs through the
captured graphs' largest context bucket with the CPU's tokens. Needs a GPU and a CUDA build of
shardlm_server.worker._C; selected by `pytest -m cuda` (scripts/gpu_check.sh).

The short tests also run with a second CPU engine in the GPU's place (`target` "cpu"), so that
their own code runs in CI: the first GPU run found two of them broken by API changes that no
CPU run had reached.
"""

from __future__ import annotations

import pytest
import torch

from shardlm_server.worker import ops
from shardlm_server.worker.decode_runner import GraphConfig
from shardlm_server.worker.engine import DecodeItem, Engine, EngineOptions, PrefillItem, StopParams
from shardlm_server.worker.kv_cache import CacheConfig
from tests.checkpoints import LLAMA, build_checkpoint
from tests.worker.eager_steps import graph_steps_run_eagerly

needs_gpu = pytest.mark.skipif(not (torch.cuda.is_available() and ops.CUDA_BUILT),
                               reason="needs a GPU and a CUDA build of shardlm_server.worker._C")
ON_GPU = [pytest.mark.cuda, needs_gpu]

BLOCK = 16
PER_SEQ = 8  # blocks per short sequence: 128 tokens
# Prompt lengths around the block size: one short of a block, exactly one, one past, two past.
BOUNDARY_LENGTHS = [1, 15, 16, 17, 31, 33]
LONG_PROMPT = 16360  # decoding 12 tokens crosses the block boundary at 16368
LONG_STEPS = 12
LONG_CONTEXT = 16384  # the graphs' largest context bucket; the checkpoint allows a bit more


def table(seq: int, per_seq: int = PER_SEQ) -> list[int]:
    return list(range(seq * per_seq, (seq + 1) * per_seq))


def load(model_dir, device: str, dtype: str, *, per_seq: int = PER_SEQ, sequences: int = 8,
         graphs: GraphConfig | None = None) -> Engine:
    return Engine.load(model_dir, dtype=dtype, device=device,
                       options=EngineOptions(graphs or GraphConfig(max_batch=8, max_context=256)),
                       cache_config=CacheConfig(block_size=BLOCK, num_blocks=sequences * per_seq))


def prompt(length: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (length,), generator=g).tolist()


def greedy(engine: Engine, prompts: list[list[int]], steps: int, chunk: int,
           per_seq: int = PER_SEQ) -> list[list[int]]:
    """Prefill all prompts as one batch, then decode `steps` tokens in calls of `chunk` steps."""
    engine.reset()
    stop = StopParams(max_new_tokens=steps + 1)
    first = engine.prefill([PrefillItem(i, p, 0, table(i, per_seq), stop=stop)
                            for i, p in enumerate(prompts)])
    out = [[t.token.token_id] for t in first.tokens]
    for start in range(0, steps, chunk):
        n = min(chunk, steps - start)
        items = [DecodeItem(i, table(i, per_seq), n) for i in range(len(prompts))]
        for step in engine.decode(items, n):
            for t in step.tokens:
                out[t.sequence_id].append(t.token.token_id)
    return out


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double().cpu(), want.double().cpu()
    assert torch.isfinite(got).all()
    return float((got - want).norm() / want.norm())


@pytest.fixture(scope="module")
def cpu_engines(llama_dir, qwen2_dir):
    return {"llama": load(llama_dir, "cpu", "float32"), "qwen2": load(qwen2_dir, "cpu", "float32")}


@pytest.fixture(params=["llama", "qwen2"])
def family(request, llama_dir, qwen2_dir):
    return request.param, {"llama": llama_dir, "qwen2": qwen2_dir}[request.param]


@pytest.fixture(params=[pytest.param("cuda", marks=ON_GPU), "cpu"])
def target(request) -> str:
    """The device of the engine under test: the GPU, or the CPU standing in for it."""
    return request.param


def test_float32_greedy_tokens_equal_the_cpu_engine(family, cpu_engines, target):
    name, folder = family
    gpu = load(folder, target, "float32")
    assert (gpu.runner.graphs is not None) == (target == "cuda")
    prompts = [prompt(n, gpu.cfg.vocab_size, n) for n in BOUNDARY_LENGTHS]
    # 40 steps in calls of 7: decode crosses block boundaries mid-call and between calls.
    assert greedy(gpu, prompts, 40, 7) == greedy(cpu_engines[name], prompts, 40, 7)


def test_bfloat16_logits_within_rounding_of_the_cpu_engine(family, cpu_engines, target):
    name, folder = family
    gpu, cpu = load(folder, target, "bfloat16"), cpu_engines[name]
    prompts = [prompt(n, gpu.cfg.vocab_size, 100 + n) for n in BOUNDARY_LENGTHS]
    stop = StopParams(max_new_tokens=4)
    logits = {}
    for label, engine in (("gpu", gpu), ("cpu", cpu)):
        engine.reset()
        items = [PrefillItem(i, p, 0, table(i), stop=stop) for i, p in enumerate(prompts)]
        prefill = engine.prefill(items, taps=["logits"]).taps["logits"]
        step = next(engine.decode([DecodeItem(i, table(i), 1) for i in range(len(prompts))], 1,
                                  taps=["logits"])).taps["logits"]
        logits[label] = (prefill, step)
    # bfloat16 weights and activations against float32: the CPU engine's own bfloat16 logits
    # are 2.2-2.4e-2 off its float32 ones on these checkpoints (their weights are large); a wrong
    # kernel is off by order 1. The decode step is fed the GPU's own first tokens, which may
    # differ from the CPU's where bfloat16 flips an argmax, so only its finiteness is checked.
    assert relative_error(logits["gpu"][0], logits["cpu"][0]) < 5e-2
    assert torch.isfinite(logits["gpu"][1]).all()


def test_chunked_prefill_across_block_boundaries_equals_one_prefill(llama_dir, target):
    engine = load(llama_dir, target, "float32")
    ids = prompt(70, engine.cfg.vocab_size, 3)
    whole = engine.prefill([PrefillItem(0, ids, 0, table(0))], taps=["logits"]).taps["logits"]
    for cut in (15, 16, 17, 32):
        engine.reset()
        engine.prefill([PrefillItem(1, ids[:cut], 0, table(1), sample=False)])
        part = engine.prefill([PrefillItem(1, ids[cut:], cut, table(1))], taps=["logits"])
        torch.testing.assert_close(part.taps["logits"], whole, atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def long_dir(tmp_path_factory):
    spec = dict(LLAMA, max_position_embeddings=LONG_CONTEXT + 64)
    return build_checkpoint(tmp_path_factory.mktemp("llama-16k"), spec)


@pytest.mark.cuda
@needs_gpu
def test_16k_context_prefill_and_decode_equal_the_cpu_engine(long_dir):
    per_seq = (LONG_CONTEXT + BLOCK - 1) // BLOCK
    graphs = GraphConfig(max_batch=2, max_context=LONG_CONTEXT)
    gpu = load(long_dir, "cuda", "float32", per_seq=per_seq, sequences=1, graphs=graphs)
    assert gpu.runner.graphs is not None
    cpu = load(long_dir, "cpu", "float32", per_seq=per_seq, sequences=1)
    ids = [prompt(LONG_PROMPT, gpu.cfg.vocab_size, 16)]
    # One 16k-token prefill, then decode steps replayed from the 16384-context graphs.
    replayed = greedy(gpu, ids, LONG_STEPS, 5, per_seq)
    with graph_steps_run_eagerly():
        eager = greedy(gpu, ids, LONG_STEPS, 5, per_seq)
    assert replayed == eager
    assert replayed == greedy(cpu, ids, LONG_STEPS, 5, per_seq)

    # The same prompt prefilled in four chunks, as the gateway chunks long prompts.
    gpu.reset()
    whole = gpu.prefill([PrefillItem(1, ids[0], 0, table(0, per_seq))],
                        taps=["logits"]).taps["logits"]
    gpu.reset()
    bounds = [0, 4000, 8192, 12289, LONG_PROMPT]
    for start, end in zip(bounds, bounds[1:], strict=False):
        last = end == LONG_PROMPT
        out = gpu.prefill([PrefillItem(2, ids[0][start:end], start, table(0, per_seq),
                                       sample=last)], taps=["logits"] if last else [])
    torch.testing.assert_close(out.taps["logits"], whole, atol=1e-4, rtol=0)
