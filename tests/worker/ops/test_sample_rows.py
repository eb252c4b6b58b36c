"""The CPU sampling kernel (csrc/cpu/sampling.cpp) against its plain reference
(worker/ops/reference.py): the same token for the same uniform number on random rows at every
SIMD level, the truncations' edge cases (ties, peaked rows whose cut lies far down the ranking,
masked and non-finite rows), the drawn frequencies against the truncated distribution, and
clear errors for malformed inputs; and the penalty kernel (csrc/cpu/penalties.cpp) likewise."""

from __future__ import annotations

import pytest
import torch

from shardlm_server.worker import ops
from shardlm_server.worker.ops import reference as ref

if ops.USE_REFERENCE:
    pytest.skip("SHARDLM_OPS=reference: nothing compiled to test", allow_module_level=True)


def columns(rows: int, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    def col(value, dtype):
        return value.to(dtype) if isinstance(value, torch.Tensor) else torch.full((rows,), value,
                                                                                  dtype=dtype)
    return (col(temperature, torch.float32), col(top_k, torch.int64), col(top_p, torch.float32),
            col(min_p, torch.float32))


def both(logits, cols, uniform):
    return ops.sample_rows(logits, *cols, uniform), ref.sample_rows(logits, *cols, uniform)


@pytest.fixture
def simd():
    yield ops.set_cpu_simd
    ops.set_cpu_simd(True)


@pytest.mark.parametrize("level", ops.SIMD_LEVELS)
def test_random_rows_match_the_reference(simd, level):
    simd(level)
    gen = torch.Generator().manual_seed(0)
    rows, vocab = 48, 3000
    logits = torch.randn(rows, vocab, generator=gen) * 3
    temperature = torch.rand(rows, generator=gen) * 1.5 + 0.1
    temperature[:4] = 0.0  # greedy rows
    top_k = torch.randint(0, 60, (rows,), generator=gen)
    top_k[::3] = 0
    top_p = torch.rand(rows, generator=gen) * 0.9 + 0.1
    top_p[::4] = 1.0
    min_p = torch.where(torch.rand(rows, generator=gen) < 0.3,
                        torch.rand(rows, generator=gen) * 0.2, torch.zeros(rows))
    cols = (temperature, top_k, top_p, min_p)
    for _ in range(10):
        got, expected = both(logits, cols, torch.rand(rows, dtype=torch.float64, generator=gen))
        assert torch.equal(got, expected)


def test_ties_keep_the_lower_ids():
    # Ten equal logits, top-k 3: ids 0-2 survive, whatever the uniform number.
    logits = torch.zeros(1, 10)
    cols = columns(1, top_k=3)
    seen = {int(ops.sample_rows(logits, *cols, torch.tensor([u], dtype=torch.float64)))
            for u in (0.0, 0.2, 0.5, 0.8, 0.999999)}
    assert seen == {0, 1, 2}
    # top-p 0.5 over four equal tokens: ids 0 and 1 before the mass passes 0.5; id 2 has 0.5
    # before it, which does not pass, so it stays too.
    cols = columns(1, top_p=0.5)
    seen = {int(ops.sample_rows(torch.zeros(1, 4), *cols, torch.tensor([u], dtype=torch.float64)))
            for u in (0.0, 0.3, 0.6, 0.999999)}
    assert seen == {0, 1, 2}


@pytest.mark.parametrize("top_k,top_p", [(5, 1.0), (0, 0.999999), (2000, 1.0)])
def test_a_cut_far_down_the_ranking(top_k, top_p):
    """A peaked row (one token 40 nats above the rest) puts the cut past every narrow window
    of leaders, so the kernel ranks the whole vocabulary, as the reference does."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 4000, generator=gen)
    logits[:, 7] = 40.0
    cols = columns(2, top_k=top_k, top_p=top_p)
    for u in (0.0, 0.5, 0.9):
        got, expected = both(logits, cols, torch.full((2,), u, dtype=torch.float64))
        assert torch.equal(got, expected)


def test_masked_and_non_finite_rows():
    logits = torch.full((4, 6), float("-inf"))
    logits[0, 4] = 0.0  # one allowed token
    logits[1, 2] = float("nan")  # the first NaN, as torch.argmax
    logits[1, 5] = float("nan")
    logits[2, 3] = float("inf")
    logits[3, 1:] = torch.arange(5.0)  # token 0 masked, the rest ordinary
    cols = columns(4, temperature=0.8, top_p=0.9)
    got = ops.sample_rows(logits, *cols, torch.full((4,), 0.5, dtype=torch.float64))
    assert got[:3].tolist() == [4, 2, 3]
    assert got[3] != 0
    greedy = ops.sample_rows(logits, *columns(4, temperature=0.0), torch.zeros(4, dtype=torch.float64))
    assert greedy.tolist() == [int(logits[r].argmax()) for r in range(4)]


def test_frequencies_follow_the_truncated_distribution():
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.2, -1.0, -3.0]])
    temperature, top_p = 1.3, 0.85
    x = logits[0] / temperature
    probs = torch.softmax(x.double(), 0)
    # Ranked order is id order here; a token stays while the mass before it is <= top_p.
    keep = (probs.cumsum(0) - probs) <= top_p
    expected = torch.where(keep, probs, torch.zeros_like(probs))
    expected /= expected.sum()
    draws = 20000
    uniform = torch.rand(draws, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    ids = ops.sample_rows(logits.expand(draws, -1).contiguous(),
                          *columns(draws, temperature=temperature, top_p=top_p), uniform)
    counts = torch.bincount(ids, minlength=6).double()
    assert counts[~keep].sum() == 0
    # Chi-square over the kept tokens: 3 degrees of freedom here; 16.3 is the 0.1% tail.
    kept = keep.nonzero().flatten()
    chi2 = (((counts[kept] - draws * expected[kept]) ** 2) / (draws * expected[kept])).sum()
    assert chi2 < 16.3, (counts, expected)


def test_clear_errors():
    logits = torch.randn(2, 8)
    cols = columns(2)
    uniform = torch.rand(2, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="logits must be a contiguous float32"):
        ops.sample_rows(logits.half(), *cols, uniform)
    with pytest.raises(RuntimeError, match="uniform must be a contiguous Double \\[2\\]"):
        ops.sample_rows(logits, *cols, uniform.float())
    with pytest.raises(RuntimeError, match="top_k must be a contiguous Long \\[2\\]"):
        ops.sample_rows(logits, cols[0], torch.zeros(3, dtype=torch.int64), *cols[2:], uniform)


def test_penalties_match_the_reference():
    gen = torch.Generator().manual_seed(4)
    rows, vocab = 6, 700
    logits = torch.randn(rows, vocab, generator=gen) * 4
    seen = [torch.rand(vocab, generator=gen) < 0.2 for _ in range(rows)]
    counts = [torch.randint(0, 3, (vocab,), generator=gen, dtype=torch.int32) for _ in range(rows)]
    seen[4] = counts[4] = torch.empty(0)  # a row without a history
    repetition = torch.tensor([1.3, 1.0, 0.8, 1.3, 1.3, 1.1])
    frequency = torch.tensor([0.0, 0.5, 0.0, -0.4, 0.5, 0.2])
    presence = torch.tensor([0.0, 0.3, 0.0, 0.6, 0.3, -0.1])
    args = (seen, counts, repetition, frequency, presence)
    got = ops.penalize_rows(logits.clone(), *args)
    expected = ref.penalize_rows(logits.clone(), *args)
    torch.testing.assert_close(got, expected, atol=0, rtol=0)
    assert torch.equal(got[4], logits[4]) and not torch.equal(got[0], logits[0])


def test_penalty_errors():
    logits = torch.randn(2, 8)
    ones = torch.ones(2)
    with pytest.raises(RuntimeError, match="one seen and one counts tensor per row"):
        ops.penalize_rows(logits, [torch.zeros(8, dtype=torch.bool)], [], ones, ones, ones)
    with pytest.raises(RuntimeError, match="seen\\[1\\] must be empty or a contiguous bool \\[8\\]"):
        ops.penalize_rows(logits, [torch.empty(0), torch.zeros(7, dtype=torch.bool)],
                          [torch.empty(0)] * 2, ones, ones, ones)
