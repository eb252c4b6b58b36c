"""The engine against transformers on the same tiny checkpoints, in float32 on CPU."""

from __future__ import annotations

import pytest
import torch

from shardlm_server.worker.engine import DecodeItem, Engine, FinishReason, PrefillItem, StopParams
from shardlm_server.worker.kv_cache import CacheConfig
from shardlm_server.worker.sampling import SamplerSettings
from tests.checkpoints import load_reference
from tests.worker import greedy_runs
from tests.worker.greedy_runs import prompt, reference_greedy

BLOCK = 16
BLOCKS_PER_SEQ = 16  # 256 tokens per test sequence


def table(seq: int) -> list[int]:
    return list(range(seq * BLOCKS_PER_SEQ, (seq + 1) * BLOCKS_PER_SEQ))


@pytest.fixture(scope="module")
def engines(llama_dir, qwen2_dir):
    config = CacheConfig(block_size=BLOCK, num_blocks=8 * BLOCKS_PER_SEQ)
    return {
        "llama": (Engine.load(llama_dir, dtype="float32", cache_config=config),
                  load_reference(llama_dir)),
        "qwen2": (Engine.load(qwen2_dir, dtype="float32", cache_config=config),
                  load_reference(qwen2_dir)),
    }


@pytest.fixture(params=["llama", "qwen2"])
def pair(request, engines):
    engine, reference = engines[request.param]
    engine.reset()
    return engine, reference


def ref_logits(reference, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return reference(torch.tensor([ids])).logits[0].float()


def test_prefill_and_decode_logits_match(pair):
    engine, reference = pair
    ids = prompt(37, engine.cfg.vocab_size, 1)
    out = engine.prefill(
        [PrefillItem(0, ids, 0, table(0), stop=StopParams())], taps=["logits"]
    )
    expected = ref_logits(reference, ids)
    torch.testing.assert_close(out.taps["logits"][0], expected[-1], atol=1e-4, rtol=0)
    first = out.tokens[0].token.token_id
    assert first == int(expected[-1].argmax())
    step = next(engine.decode([DecodeItem(0, table(0), 1)], 1, taps=["logits"]))
    expected = ref_logits(reference, ids + [first])
    torch.testing.assert_close(step.taps["logits"][0], expected[-1], atol=1e-4, rtol=0)


def greedy_tokens(engine: Engine, seq: int, ids: list[int], n: int) -> list[int]:
    return greedy_runs.greedy_tokens(engine, seq, ids, n, table(seq))


def test_64_greedy_tokens_equal_transformers_generate(pair):
    engine, reference = pair
    ids = prompt(21, engine.cfg.vocab_size, 2)
    ours = greedy_tokens(engine, 0, ids, 64)
    theirs = reference_greedy(reference, ids, 64)
    assert ours == theirs


def test_batch_of_different_lengths_equals_each_alone(pair):
    engine, _ = pair
    prompts = [prompt(n, engine.cfg.vocab_size, 10 + n) for n in (5, 33, 1, 18)]
    alone = []
    for p in prompts:
        alone.append(greedy_tokens(engine, 0, p, 12))
        engine.reset()
    stop = StopParams(max_new_tokens=12)
    first = engine.prefill(
        [PrefillItem(i, p, 0, table(i), stop=stop) for i, p in enumerate(prompts)]
    )
    together = [[t.token.token_id] for t in first.tokens]
    # Uneven step budgets: sequence 2 leaves the batch early, the others go on without it.
    items = [DecodeItem(i, table(i), 12 if i != 2 else 3) for i in range(4)]
    for step in engine.decode(items, 12):
        for t in step.tokens:
            together[t.sequence_id].append(t.token.token_id)
    items = [DecodeItem(2, table(2), 12)]
    for step in engine.decode(items, 12):
        together[2] += [t.token.token_id for t in step.tokens]
    assert together == alone


def test_continued_prefill_equals_one_prefill(pair):
    engine, _ = pair
    ids = prompt(50, engine.cfg.vocab_size, 3)
    whole = engine.prefill([PrefillItem(0, ids, 0, table(0))], taps=["logits"]).taps["logits"]
    engine.reset()
    engine.prefill([PrefillItem(1, ids[:19], 0, table(1), sample=False)])
    # The second turn: only the new tokens are run, the first 19 come from the cache.
    part = engine.prefill([PrefillItem(1, ids[19:], 19, table(1))], taps=["logits"])
    torch.testing.assert_close(part.taps["logits"], whole, atol=1e-4, rtol=0)


def test_stop_conditions_end_sequences(pair):
    engine, _ = pair
    ids = prompt(9, engine.cfg.vocab_size, 4)
    free = greedy_tokens(engine, 0, ids, 10)
    engine.reset()
    k = next(i for i in range(1, len(free)) if free[i] not in free[:i])
    stop = StopParams(max_new_tokens=10, stop_token_ids=(free[k],))
    engine.prefill([PrefillItem(0, ids, 0, table(0), stop=stop)])
    steps = list(engine.decode([DecodeItem(0, table(0), 10)], 10))
    last = steps[-1].tokens[0]
    assert last.token.token_id == free[k] and len(steps) == k  # the call ended on the stop id
    assert engine.sequences[0].finished is FinishReason.STOP_TOKEN


def test_seeded_sampling_is_reproducible(pair):
    engine, _ = pair
    ids = prompt(12, engine.cfg.vocab_size, 5)
    params = SamplerSettings(temperature=1.3, top_k=50, top_p=0.95, min_p=0.01,
                            repetition_penalty=1.2, presence_penalty=0.3,
                            frequency_penalty=0.2, seed=1234)

    def run(seq: int, p: SamplerSettings, neighbour: bool) -> list[int]:
        stop = StopParams(max_new_tokens=20)
        items = [PrefillItem(seq, ids, 0, table(seq), sampling=p, stop=stop)]
        if neighbour:  # another request in the batch must not change this one's draws
            items.append(PrefillItem(seq + 1, ids[:5], 0, table(seq + 1),
                                     sampling=SamplerSettings(temperature=1.0), stop=stop))
        out = [engine.prefill(items).tokens[0].token.token_id]
        decode = [DecodeItem(i.sequence_id, i.block_table, 20) for i in items]
        for step in engine.decode(decode, 19):
            out += [t.token.token_id for t in step.tokens if t.sequence_id == seq]
        return out

    a, b = run(0, params, False), run(2, params, True)
    c = run(4, SamplerSettings(**{**params.__dict__, "seed": 99}), False)
    assert a == b
    assert a != c


def test_logprobs_follow_the_model_distribution(pair):
    engine, reference = pair
    ids = prompt(8, engine.cfg.vocab_size, 6)
    p = SamplerSettings(logprobs=True, top_logprobs=3)
    token = engine.prefill([PrefillItem(0, ids, 0, table(0), sampling=p)]).tokens[0].token
    expected = ref_logits(reference, ids)[-1].log_softmax(-1)
    assert token.logprob == pytest.approx(float(expected[token.token_id]), abs=1e-4)
    top = expected.topk(3)
    assert [t for t, _ in token.top_logprobs] == top.indices.tolist()
