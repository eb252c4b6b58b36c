"""worker/sampling.py against plain references written here, on random inputs: which tokens top-k,
top-p and min-p keep, what the repetition, presence and frequency penalties do to the logits, and
that a seeded draw only ever picks a token the truncation kept, and repeats itself. The penalty
and draw tests run both ways sampling is done: the compiled ops a CPU uses and the torch ops a
GPU uses (run here on CPU, so that path cannot rot unseen)."""

from __future__ import annotations

import dataclasses
import math
import random
from collections import Counter

import pytest
import torch

from shardlm_server.worker import sampling

CPU = torch.device("cpu")


@pytest.fixture(params=["compiled", "torch ops"])
def path(request, monkeypatch):
    """Runs a test with the CPU's compiled sampling, or with the GPU path's torch ops in its
    place (sample_on_device and apply_penalties call whichever the module holds)."""
    if request.param == "torch ops":
        monkeypatch.setattr(sampling, "sample_on_cpu", sampling.sample_with_torch_ops)
        monkeypatch.setattr(sampling, "penalize_on_cpu", sampling.penalize_with_torch_ops)
    return request.param
VOCAB = 24
# A parameter this close to a value it is compared with could go either way in float32: the
# random parameters keep clear of them, so the reference (in float64) and the code agree exactly.
EDGE = 1e-4


# -- the references ------------------------------------------------------------------------------


def ranked(logits: list[float]) -> list[int]:
    return sorted(range(len(logits)), key=lambda token: -logits[token])


def truncation_edges(logits: list[float], top_k: int) -> tuple[list[float], list[float]]:
    """What top-p and min-p compare their parameter with, for each of the top-k candidates: the
    probability of the candidates ranked above it, and its probability over the best one's."""
    order = ranked(logits)
    candidates = order[:top_k] if top_k > 0 else order
    best = logits[order[0]]
    ratios = [math.exp(logits[token] - best) for token in candidates]
    total = sum(ratios)
    above, mass = [], 0.0
    for ratio in ratios:
        above.append(mass)
        mass += ratio / total
    return above, ratios


def reference_kept(logits: list[float], top_k: int, top_p: float, min_p: float) -> set[int]:
    """Top-k keeps the k best tokens. Among those (their probabilities renormalised), top-p keeps
    a token while the probability of the ones ranked above it is at most top_p, and min-p keeps a
    token at least min_p times as likely as the best. The best token is always kept."""
    order = ranked(logits)
    candidates = order[:top_k] if top_k > 0 else order
    above, ratios = truncation_edges(logits, top_k)
    kept = {order[0]}
    for token, mass_above, ratio in zip(candidates, above, ratios, strict=True):
        if mass_above <= top_p and ratio >= min_p:
            kept.add(token)
    return kept


def reference_penalised(logits: list[float], prompt: list[int], outputs: list[int],
                        params) -> list[float]:
    """Repetition (Hugging Face): a token in the prompt or the output has a positive logit divided
    by the penalty, a negative one multiplied. Frequency and presence (OpenAI): minus the penalty
    times the token's count in the output, and minus the presence penalty once if it is there."""
    seen, counts = set(prompt) | set(outputs), Counter(outputs)
    out = []
    for token, value in enumerate(logits):
        if token in seen and params.repetition_penalty != 1.0:
            value = (value / params.repetition_penalty if value > 0
                     else value * params.repetition_penalty)
        value -= params.frequency_penalty * counts[token]
        value -= params.presence_penalty * (1 if counts[token] else 0)
        out.append(value)
    return out


# -- random inputs -----------------------------------------------------------------------------


def random_logits(rng: random.Random) -> list[float]:
    """Distinct float32 values (the order of equal logits is the sort's choice, not a rule), from
    a flat to a peaked distribution."""
    scale = rng.choice([0.3, 1.0, 3.0, 8.0])
    while True:
        values = torch.tensor([rng.gauss(0.0, scale) for _ in range(VOCAB)])
        if values.unique().numel() == VOCAB:
            return values.tolist()


def clear_of(value: float, edges: list[float]) -> bool:
    return all(abs(value - edge) > EDGE for edge in edges)


def random_truncation(rng: random.Random, logits: list[float]) -> dict:
    """Each of top-k, top-p and min-p on or off at random, their values clear of the edges."""
    top_k = rng.choice([0, 0, 1, 2, 5, VOCAB - 1, VOCAB, VOCAB + 3])
    above, ratios = truncation_edges(logits, top_k)
    top_p, min_p = 1.0, 0.0
    if rng.random() < 0.6:
        while not clear_of(top_p := rng.uniform(0.05, 0.99), above):
            pass
    if rng.random() < 0.5:
        while not clear_of(min_p := rng.uniform(0.001, 0.9), ratios):
            pass
    return dict(top_k=top_k, top_p=top_p, min_p=min_p)


def random_penalties(rng: random.Random) -> dict:
    return dict(
        repetition_penalty=rng.choice([1.0, rng.uniform(0.5, 2.5)]),
        presence_penalty=rng.choice([0.0, rng.uniform(-2.0, 2.0)]),
        frequency_penalty=rng.choice([0.0, rng.uniform(-2.0, 2.0)]))


def kept_by_code(row: torch.Tensor, logits: list[float]) -> set[int]:
    """The tokens `truncate` left as they were; it must have set every other one to -inf."""
    kept = {token for token, value in enumerate(row.tolist()) if value != float("-inf")}
    for token in kept:
        assert row[token].item() == logits[token], (token, row[token].item(), logits[token])
    return kept


# -- truncation ----------------------------------------------------------------------------------


def test_truncation_by_hand():
    logits = torch.tensor([[math.log(p) for p in (0.5, 0.3, 0.15, 0.05)]])

    def kept(**params) -> set[int]:
        row = sampling.SamplingRow(sampling.SamplerSettings(temperature=1.0, **params))
        return {t for t, v in enumerate(sampling.truncate(logits, [row])[0].tolist())
                if v != float("-inf")}

    assert kept() == {0, 1, 2, 3}
    assert kept(top_k=2) == {0, 1}
    assert kept(top_p=0.7) == {0, 1}  # 0.8 lies above token 2: past 0.7
    assert kept(top_p=0.85) == {0, 1, 2}
    assert kept(top_p=0.01) == {0}  # the best token survives any top-p
    assert kept(min_p=0.25) == {0, 1, 2}  # at least 0.125
    assert kept(min_p=0.7) == {0}
    assert kept(min_p=1.5) == {0}  # the best token survives whatever the parameters
    assert kept(top_k=3, top_p=0.7, min_p=0.25) == {0, 1}


@pytest.mark.parametrize("seed", range(4))
def test_truncation_keeps_what_the_reference_keeps(seed):
    rng = random.Random(seed)
    for _ in range(50):
        # One batch, each row with its own parameters: the code is vectorised over the rows.
        batch = [random_logits(rng) for _ in range(rng.randint(1, 5))]
        params = [sampling.SamplerSettings(temperature=1.0, **random_truncation(rng, logits))
                  for logits in batch]
        out = sampling.truncate(torch.tensor(batch), [sampling.SamplingRow(p) for p in params])
        for i, (logits, p) in enumerate(zip(batch, params, strict=True)):
            expected = reference_kept(logits, p.top_k, p.top_p, p.min_p)
            assert kept_by_code(out[i], logits) == expected, (p, logits)


# -- penalties -----------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(4))
def test_penalties_adjust_the_logits_like_the_reference(seed, path):
    rng = random.Random(seed)
    for _ in range(50):
        rows, expected = [], []
        for _ in range(rng.randint(1, 5)):
            logits = random_logits(rng)
            params = sampling.SamplerSettings(temperature=1.0, **random_penalties(rng))
            prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(0, 12))]
            outputs = [rng.randrange(VOCAB // 2) for _ in range(rng.randint(0, 12))]  # repeats
            if rng.random() < 0.2:  # a row without a history is left alone
                rows.append((sampling.SamplingRow(params), logits))
                expected.append(logits)
                continue
            history = sampling.TokenHistory.from_prompt(prompt, VOCAB, CPU)
            row = sampling.SamplingRow(params, history=history)
            for token in outputs:  # the way the engine records each step's choice
                sampling.record_outputs(torch.tensor([token]), [row])
            rows.append((row, logits))
            expected.append(reference_penalised(logits, prompt, outputs, params))
        logits = torch.tensor([logits for _row, logits in rows])
        out = sampling.apply_penalties(logits, [row for row, _logits in rows])
        torch.testing.assert_close(out, torch.tensor(expected))


def test_token_history_counts_outputs_and_sees_the_prompt_too():
    history = sampling.TokenHistory.from_prompt([3, 3, 7], VOCAB, CPU)
    row = sampling.SamplingRow(sampling.SamplerSettings(), history=history)
    for token in (7, 9, 9):
        sampling.record_outputs(torch.tensor([token]), [row])
    assert {t for t, s in enumerate(history.seen.tolist()) if s} == {3, 7, 9}
    assert {t: c for t, c in enumerate(history.output_counts.tolist()) if c} == {7: 1, 9: 2}


# -- seeded sampling -----------------------------------------------------------------------------


def draw(logits: torch.Tensor, rows: list, times: int) -> list[list[int]]:
    """`times` samples of every row, in one call: each row repeated `times` over, copy j drawing
    the token at the row's position + j (so a seeded row's copies have keys of their own)."""
    copies = [dataclasses.replace(row, position=row.position + j)
              for row in rows for j in range(times)]
    ids = sampling.sample_on_device(logits.repeat_interleave(times, dim=0), copies).ids.tolist()
    return [ids[i * times:(i + 1) * times] for i in range(len(rows))]


@pytest.mark.parametrize("seed", range(4))
def test_seeded_sampling_only_picks_kept_tokens_and_repeats_itself(seed, path):
    rng = random.Random(seed)
    torch.manual_seed(seed)  # the unseeded rows share torch's generator
    for _ in range(5):
        batch, rows, allowed, likely = [], [], [], []
        for _ in range(rng.randint(2, 5)):
            logits = random_logits(rng)
            prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(0, 6))]
            greedy = rng.random() < 0.2
            temperature = 0.0 if greedy else rng.uniform(0.3, 2.0)
            penalties = random_penalties(rng)
            plain = sampling.SamplerSettings(temperature=1.0, **penalties)
            penalised = reference_penalised(logits, prompt, [], plain)
            # Truncation sees the tempered logits: its parameters keep clear of their edges.
            tempered = (torch.tensor(penalised) / (temperature or 1.0)).tolist()
            truncation = random_truncation(rng, tempered)
            seed = rng.randrange(2**64) if rng.random() < 0.7 else None
            params = sampling.SamplerSettings(temperature=temperature, **penalties, **truncation,
                                              seed=seed)
            history = sampling.TokenHistory.from_prompt(prompt, VOCAB, CPU)
            batch.append(logits)
            rows.append(sampling.SamplingRow(params, history, position=rng.randrange(1000)))
            if greedy:
                allowed.append({ranked(penalised)[0]})
                likely.append(allowed[-1])
                continue
            allowed.append(reference_kept(tempered, **truncation))
            best = max(tempered[t] for t in allowed[-1])
            total = sum(math.exp(tempered[t] - best) for t in allowed[-1])
            likely.append({t for t in allowed[-1] if math.exp(tempered[t] - best) / total >= 0.05})
        logits = torch.tensor(batch)
        drawn = draw(logits, rows, times=400)
        for picks, kept, common in zip(drawn, allowed, likely, strict=True):
            assert set(picks) <= kept, (set(picks) - kept, kept)
            # Nothing the truncation kept is lost: a token of 5 % or more shows up in 400 draws
            # (a miss would have odds of 0.95**400, below 1e-8).
            assert common <= set(picks), (common - set(picks), Counter(picks))
        # The same seeds and positions draw the same tokens, alone or among other rows, in any
        # order (the unseeded rows may differ).
        seeded = [i for i, row in enumerate(rows) if row.seeded]
        first = draw(logits, rows, times=30)
        again = draw(logits.flip(0), rows[::-1], times=30)[::-1]
        assert [first[i] for i in seeded] == [again[i] for i in seeded]
        for i in seeded:
            assert draw(logits[i:i + 1], [rows[i]], times=30)[0] == first[i]


def test_a_seeded_draw_is_keyed_by_seed_and_position_with_splitmix64():
    # splitmix64's published first outputs from seed 0 and from seed 1234567.
    assert sampling.draw_key(0, 0) == 0xE220A8397B1DCDAF
    assert sampling.draw_key(1234567, 0) == 0x599ED017FB08FC85
    keys = {sampling.draw_key(seed, position) for seed in (0, 1, 2**64 - 1)
            for position in range(100)}
    assert len(keys) == 300  # every seed and position its own key
    assert all(0.0 <= sampling.seeded_uniform(7, p) < 1.0 for p in range(1000))


def test_a_history_rebuilt_from_tokens_counts_only_those_generated_as_output():
    history = sampling.TokenHistory.from_tokens([3, 7, 9, 7, 9, 9], 3, VOCAB, CPU)
    assert {t for t, s in enumerate(history.seen.tolist()) if s} == {3, 7, 9}
    assert {t: c for t, c in enumerate(history.output_counts.tolist()) if c} == {7: 1, 9: 2}
    for none_generated in (0, 6):
        history = sampling.TokenHistory.from_tokens([3, 7, 9], none_generated, VOCAB, CPU)
        assert not history.output_counts.any()
