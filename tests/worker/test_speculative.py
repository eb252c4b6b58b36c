"""Speculative decoding (worker/speculative.py) against decoding one token per step on the same
checkpoint: greedy tokens identical token for token, seeded sampling identical and repeatable,
penalties and grammars applied as without drafts, limits and stop tokens kept, and unseeded
sampling drawing from the same distribution (a two-sample comparison on a small vocabulary).

A model with random weights does not copy its context, so the n-gram drafter's proposals are
mostly refused; to verify accepted drafts too, an oracle drafter proposes the tokens of a plain
run with every fourth one wrong (the real drafter is tested on the real model in
tests/test_default_model.py and on its own in test_drafting.py)."""

from __future__ import annotations

from collections import Counter

import llguidance
import pytest
import torch

from shardlm_server.worker import speculative
from shardlm_server.worker.drafting import StepCosts
from shardlm_server.worker.engine import (
    DecodeItem,
    Engine,
    EngineOptions,
    PrefillItem,
    StopParams,
)
from shardlm_server.worker.grammar import SequenceConstraint
from shardlm_server.worker.sampling import SamplerSettings
from shardlm_server.worker.speculative import SpeculationConfig
from tests.worker.greedy_runs import prompt

BLOCKS_PER_SEQUENCE = 16  # 256 tokens at the default block size


@pytest.fixture(scope="module")
def engines(llama_dir):
    """Plain decoding, drafts the planner chooses, and a fixed 3 drafts wherever proposed."""
    tokenizer_json = (llama_dir / "tokenizer.json").read_text()

    def load(config: SpeculationConfig) -> Engine:
        return Engine.load(llama_dir, dtype="float32", tokenizer_json=tokenizer_json,
                           options=EngineOptions(speculation=config))
    return {"off": load(SpeculationConfig("off")), "auto": load(SpeculationConfig("ngram")),
            "fixed": load(SpeculationConfig("ngram", tokens=3))}


class OracleDrafter:
    """Proposes each sequence's known future (a plain run's tokens), every `wrong_every`-th token
    replaced by another, so steps accept some drafts and refuse the rest."""

    def __init__(self, futures: list[list[int]], vocab: int, wrong_every: int) -> None:
        self.futures, self.vocab, self.wrong_every = futures, vocab, wrong_every
        self.seq = None

    def __call__(self, seq):  # stands in for speculative._drafter
        self.seq = seq
        return self

    def propose(self, limit: int) -> list[int]:
        position = self.seq.num_cached + 1  # the token after the pending one
        future = self.futures[self.seq.sequence_id][position:position + max(limit, 0)]
        return [(t + 1) % self.vocab if (position + j) % self.wrong_every == 0 else t
                for j, t in enumerate(future)]


@pytest.fixture
def oracle(monkeypatch):
    """Call with the plain run's prompts and tokens: drafts come from them from then on."""
    def install(ids: list[list[int]], tokens: list[list[int]], vocab: int,
                wrong_every: int = 4) -> None:
        drafter = OracleDrafter([p + t for p, t in zip(ids, tokens, strict=True)], vocab,
                                wrong_every)
        monkeypatch.setattr(speculative, "_drafter", drafter)
    return install


def prompts(vocab: int) -> list[list[int]]:
    """One prompt that repeats a phrase (drafts), one random, one short."""
    phrase = prompt(12, vocab, seed=1)
    return [prompt(5, vocab, seed=2) + phrase * 4, prompt(40, vocab, seed=3), prompt(3, vocab, 4)]


def table(i: int) -> list[int]:
    return list(range(i * BLOCKS_PER_SEQUENCE, (i + 1) * BLOCKS_PER_SEQUENCE))


def generate(engine: Engine, ids: list[list[int]], sampling: SamplerSettings, steps: int,
             calls: int = 2, stop: StopParams | None = None,
             constraint: SequenceConstraint | None = None):
    """Each sequence's tokens over a prefill and `calls` decode calls of `steps`, and the drafts
    proposed and accepted in all."""
    engine.reset()
    stop = stop or StopParams()
    first = engine.prefill([PrefillItem(i, p, 0, table(i), sampling, stop, constraint=constraint)
                            for i, p in enumerate(ids)])
    tokens = {t.sequence_id: [t.token.token_id] for t in first.tokens}
    proposed = accepted = 0
    for _ in range(calls):
        live = [i for i in tokens if engine.sequences[i].finished is None]
        for step in engine.decode([DecodeItem(i, table(i), steps) for i in live], steps):
            for t in step.tokens:
                tokens[t.sequence_id].append(t.token.token_id)
            proposed += sum(d.proposed for d in step.drafts)
            accepted += sum(d.accepted for d in step.drafts)
    return [tokens[i] for i in range(len(ids))], proposed, accepted


@pytest.mark.parametrize("mode", ["auto", "fixed"])
@pytest.mark.parametrize("drafter", ["ngram", "oracle"])
def test_greedy_tokens_are_identical_with_drafts(engines, oracle, mode, drafter, monkeypatch):
    vocab = engines["off"].cfg.vocab_size
    if mode == "auto":  # the planner reads its prior costs, not this machine's busy timings
        planner = engines["auto"].speculator.planner
        monkeypatch.setattr(planner, "costs", StepCosts())
        monkeypatch.setattr(planner.costs, "observe", lambda *_args: None)
    ids = prompts(vocab)
    plain, none, _ = generate(engines["off"], ids, SamplerSettings(), steps=24)
    if drafter == "oracle":
        oracle(ids, plain, vocab)
    drafted, proposed, accepted = generate(engines[mode], ids, SamplerSettings(), steps=24)
    assert none == 0
    assert proposed > 0 or (drafter, mode) == ("ngram", "auto")  # its gate may stay closed
    assert drafted == plain
    assert [len(t) for t in drafted] == [49] * 3  # max_steps counts tokens, drafts or not
    if drafter == "oracle":
        assert 0 < accepted < proposed  # drafts were both accepted and refused


def test_seeded_sampling_repeats_itself_and_matches_plain_decoding(engines, oracle):
    vocab = engines["off"].cfg.vocab_size
    ids = prompts(vocab)
    sampling = SamplerSettings(temperature=0.7, top_p=0.95, top_k=50, seed=11)
    plain, _, _ = generate(engines["off"], ids, sampling, steps=20)
    oracle(ids, plain, vocab)
    first, proposed, accepted = generate(engines["fixed"], ids, sampling, steps=20)
    again, _, _ = generate(engines["auto"], ids, sampling, steps=20)
    assert 0 < accepted < proposed
    assert first == again == plain


def test_penalties_count_the_drafts_before_each_row(engines, oracle):
    vocab = engines["off"].cfg.vocab_size
    ids = prompts(vocab)
    sampling = SamplerSettings(repetition_penalty=1.2, presence_penalty=0.3,
                               frequency_penalty=0.2)
    plain, _, _ = generate(engines["off"], ids, sampling, steps=20)
    oracle(ids, plain, vocab)
    drafted, proposed, accepted = generate(engines["fixed"], ids, sampling, steps=20)
    assert 0 < accepted < proposed
    assert drafted == plain


def test_limits_and_stop_tokens_end_a_sequence_inside_a_verified_step(engines, oracle):
    vocab = engines["off"].cfg.vocab_size
    ids = prompts(vocab)[:1]
    plain, _, _ = generate(engines["off"], ids, SamplerSettings(), steps=30, calls=1)
    oracle(ids, plain, vocab)
    stop_id = plain[0][12]  # a token the greedy run produces mid-way
    stop = StopParams(max_new_tokens=25, stop_token_ids=(stop_id,))
    expected = plain[0][: plain[0].index(stop_id) + 1]
    for mode in ("off", "fixed"):
        got, _, _ = generate(engines[mode], ids, SamplerSettings(), steps=30, calls=1, stop=stop)
        assert got[0] == expected
    short = StopParams(max_new_tokens=7)
    for mode in ("off", "fixed"):
        got, _, _ = generate(engines[mode], ids, SamplerSettings(), steps=30, calls=1, stop=short)
        assert got[0] == plain[0][:7]


def test_accepted_drafts_take_a_sequence_past_the_calls_steps_within_its_token_budget(
        engines, oracle):
    """A call of 6 steps whose sequences may take 20 tokens: the plain engine stops each at 6
    tokens; with drafts they go further in the same 6 steps, never past 20, and the tokens are
    the plain run's."""
    vocab = engines["off"].cfg.vocab_size
    ids = prompts(vocab)
    plain, _, _ = generate(engines["off"], ids, SamplerSettings(), steps=40, calls=1)
    oracle(ids, plain, vocab)
    for mode, most in (("off", 6), ("fixed", 20)):
        engine = engines[mode]
        engine.reset()
        first = engine.prefill([PrefillItem(i, p, 0, table(i), SamplerSettings(), StopParams())
                                for i, p in enumerate(ids)])
        got = {t.sequence_id: [t.token.token_id] for t in first.tokens}
        steps = list(engine.decode([DecodeItem(i, table(i), 20) for i in got], 6))
        assert len(steps) <= 6
        for step in steps:
            for t in step.tokens:
                got[t.sequence_id].append(t.token.token_id)
        lengths = [len(got[i]) - 1 for i in range(len(ids))]
        assert all(n <= most for n in lengths)
        assert [got[i] for i in range(len(ids))] == [p[:len(got[i])] for i, p in enumerate(plain)]
        if mode == "off":
            assert lengths == [6] * 3
        else:
            assert max(lengths) > 6  # accepted drafts went past one token per step


def test_drafts_follow_the_grammar_of_a_constrained_sequence(engines, oracle):
    vocab = engines["off"].cfg.vocab_size
    grammar = llguidance.LLMatcher.grammar_from_regex(r"(ab|cd|ef)( (ab|cd|ef)){4,12}\.")
    ids = [prompt(6, vocab, seed=5) * 3]
    constraint = SequenceConstraint(grammar, start_position=len(ids[0]))
    plain, _, _ = generate(engines["off"], ids, SamplerSettings(), steps=16, constraint=constraint)
    oracle(ids, plain, vocab)  # its wrong drafts are refused by the grammar or the model
    drafted, proposed, accepted = generate(engines["fixed"], ids, SamplerSettings(), steps=16,
                                           constraint=constraint)
    assert 0 < accepted <= proposed
    assert drafted == plain


def test_unseeded_sampling_draws_from_the_distribution_of_plain_decoding(llama_dir, oracle):
    """Three tokens after a prompt (top-3 sampling: at most 27 outcomes), sampled 3072 times each
    way, drafts proposing the greedy ones: the joint frequencies agree within what sampling noise
    allows (about 0.04 in total variation; a fixed global seed keeps the test repeatable). Keeping
    every draft, or never the draft at a refused row, would move far more mass than that."""
    engine_off = Engine.load(llama_dir, dtype="float32",
                             options=EngineOptions(speculation=SpeculationConfig("off")))
    engine_on = Engine.load(llama_dir, dtype="float32",
                            options=EngineOptions(speculation=SpeculationConfig("ngram", 2)))
    vocab = engine_off.cfg.vocab_size
    ids = prompt(4, vocab, seed=6) * 6
    sampling = SamplerSettings(temperature=1.0, top_k=3)
    greedy, _, _ = generate(engine_off, [ids], SamplerSettings(), steps=2, calls=1)
    torch.manual_seed(0)

    def pairs(engine: Engine) -> tuple[Counter, int]:
        counts: Counter = Counter()
        accepted = 0
        for _round in range(48):
            tokens, _, kept = generate(engine, [ids] * 64, sampling, steps=2, calls=1,
                                       stop=StopParams(max_new_tokens=3))
            counts.update(tuple(t) for t in tokens)
            accepted += kept
        return counts, accepted

    plain, _ = pairs(engine_off)
    oracle([ids] * 64, greedy * 64, vocab, wrong_every=10**9)  # the greedy tokens as they are
    drafted, accepted = pairs(engine_on)
    assert accepted > 500  # many samples came from accepted drafts
    total = sum(plain.values())
    distance = sum(abs(plain[k] - drafted[k]) for k in plain.keys() | drafted.keys()) / (2 * total)
    assert distance < 0.08, (distance, plain.most_common(5), drafted.most_common(5))
