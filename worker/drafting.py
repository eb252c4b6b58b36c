"""Draft tokens without a draft model: prompt lookup over a sequence's own tokens, each
sequence's acceptance rate, and how many drafts a step verifies.

A sequence that repeats itself (code being edited, a passage being quoted, a JSON object's
keys) continues the way it went the last time its latest few tokens appeared. `NgramDrafter`
keeps, per n-gram length, where each n-gram last ended, so a proposal is a dictionary lookup and
each new token costs a few inserts, however long the sequence.

`Acceptance` estimates the chance that a sequence's next draft token is accepted, from a
decayed count of what its drafts did. Between drafts it keeps scoring the proposals it would
have made against the tokens actually sampled, so a sequence whose drafts stopped paying drafts
nothing (the gate is closed) and starts again when its text turns repetitive.

`DraftPlanner` decides the drafts of a whole step: a step of n rows costs T(n), measured on
this engine's own steps (`StepCosts`), and the j-th draft of a sequence yields a token with
probability alpha^j; the planner adds drafts in order of that probability and keeps the count
that gives the most expected tokens per second. So a batch that already fills the machine,
or a sequence whose drafts fail, verifies nothing, and a lone repetitive sequence verifies
several.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from shardlm.constants import DEFAULT_MAX_DRAFT_TOKENS

# N-gram lengths matched, longest first: a longer match predicts its continuation better.
NGRAM_MAX = 4
NGRAM_MIN = 2
# Acceptance: prior rate and its weight (in draft tokens), and the decay of old evidence per
# verified step, so the estimate follows a sequence that changes from prose to quoting.
PRIOR_RATE = 0.5
PRIOR_WEIGHT = 2.0
DECAY = 0.85
# Step-cost prior: each row past the first adds this share of a one-row step, until rows of
# that size have been timed.
PRIOR_ROW_COST = 0.25
COST_SMOOTHING = 0.2  # weight of a new timing in the running average of its row count
# Steps in a row with a likely draft (rate >= PRIOR_RATE) and no verification, after which the
# planner verifies that draft anyway: verify costs are timed only when such a step runs, so one
# slow timing (a step preempted on a busy host) would otherwise keep drafting off for good.
REVISIT_STEPS = 32


class NgramDrafter:
    """Prompt-lookup proposals for one sequence, indexed incrementally as its tokens grow."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        # n -> n-gram -> index just past its latest occurrence that has a known successor.
        self._last_end: dict[int, dict[tuple[int, ...], int]] = {
            n: {} for n in range(NGRAM_MIN, NGRAM_MAX + 1)}

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            self.tokens.append(token)
            end = len(self.tokens) - 1  # the n-grams ending before the new token now have one
            for n, index in self._last_end.items():
                if end >= n:
                    index[tuple(self.tokens[end - n:end])] = end

    def sync(self, tokens: list[int]) -> None:
        """Follow a sequence whose tokens are `tokens` (a prefix of them may be indexed)."""
        known = len(self.tokens)
        if known <= len(tokens) and self.tokens == tokens[:known]:
            self.extend(tokens[known:])
            return
        self.__init__()  # type: ignore[misc]  # history rewritten: index it afresh
        self.extend(tokens)

    def propose(self, limit: int) -> list[int]:
        """Up to `limit` tokens that followed the latest earlier occurrence of the longest
        matching suffix (NGRAM_MAX down to NGRAM_MIN tokens); empty when none matches."""
        tokens = self.tokens
        if limit <= 0:
            return []
        for n in range(NGRAM_MAX, NGRAM_MIN - 1, -1):
            if len(tokens) <= n:
                continue
            start = self._last_end[n].get(tuple(tokens[-n:]))
            if start is not None:
                return tokens[start:start + limit]
        return []


@dataclass
class Acceptance:
    """A decayed estimate of the chance that a sequence's next draft token is accepted."""

    accepted: float = 0.0
    tried: float = 0.0
    shadow: list[int] = field(default_factory=list)  # proposal not verified, scored afterwards

    @property
    def rate(self) -> float:
        return (self.accepted + PRIOR_RATE * PRIOR_WEIGHT) / (self.tried + PRIOR_WEIGHT)

    def record(self, drafted: int, accepted: int) -> None:
        """A step verified `drafted` drafts and accepted the first `accepted` of them."""
        if drafted <= 0:
            return
        self.accepted = self.accepted * DECAY + accepted
        # The tokens tried: every accepted one, and the first refused one if any was.
        self.tried = self.tried * DECAY + accepted + (1 if accepted < drafted else 0)

    def score_shadow(self, emitted: list[int]) -> None:
        """Score the proposal made but not verified against the tokens that came instead."""
        proposal, self.shadow = self.shadow, []
        if proposal and emitted:
            matched = 0
            for guess, token in zip(proposal, emitted, strict=False):
                if guess != token:
                    break
                matched += 1
            self.record(min(len(proposal), len(emitted)), matched)


class StepCosts:
    """Seconds of a step by the number of rows it computes, averaged per row count, kept apart
    for plain steps (the decode path) and verifying ones (the packed prefill path, whose fixed
    cost differs), with a prior for the counts not timed yet."""

    def __init__(self) -> None:
        self._seconds: dict[bool, dict[int, float]] = {False: {}, True: {}}
        # Each table's timed counts in order: the planner estimates every draft count of every
        # step, so the nearest timed count is a bisection, not a pass over the table.
        self._counts: dict[bool, list[int]] = {False: [], True: []}

    def observe(self, rows: int, seconds: float, verify: bool) -> None:
        table = self._seconds[verify]
        old = table.get(rows)
        if old is None:
            bisect.insort(self._counts[verify], rows)
        table[rows] = seconds if old is None else old + COST_SMOOTHING * (seconds - old)

    def estimate(self, rows: int, verify: bool) -> float:
        """Seconds of a `rows`-row step; relative figures are what the planner reads. A count
        not timed takes the nearest timed one of its kind (else of the other kind) scaled by the
        prior's ratio between the two. A verifying step is never taken for cheaper than a plain
        one of as many rows: it computes the same rows on the packed path, and a verify count
        not timed yet, scaled from small ones (a lone sequence's), would otherwise look far
        cheaper than a large batch's plain step."""
        kind = verify if self._seconds[verify] else not verify
        table = self._seconds[kind]
        if rows in table:
            seconds = table[rows]
        elif not table:
            seconds = _prior(rows)
        else:
            near = _nearest(self._counts[kind], rows)
            seconds = table[near] * _prior(rows) / _prior(near)
        return max(seconds, self.estimate(rows, verify=False)) if verify else seconds


def _nearest(counts: list[int], rows: int) -> int:
    """The count in sorted, non-empty `counts` nearest to `rows` (the smaller one of a tie)."""
    i = bisect.bisect_left(counts, rows)
    if i == 0:
        return counts[0]
    if i == len(counts):
        return counts[-1]
    below, above = counts[i - 1], counts[i]
    return below if rows - below <= above - rows else above


def _prior(rows: int) -> float:
    return 1.0 + PRIOR_ROW_COST * (rows - 1)


class DraftPlanner:
    """How many drafts each sequence of a step verifies: `fixed` > 0 verifies that many
    wherever a proposal has them; 0 chooses by expected tokens per second."""

    def __init__(self, fixed: int = 0, max_per_sequence: int = DEFAULT_MAX_DRAFT_TOKENS) -> None:
        self.fixed = fixed
        self.max_per_sequence = fixed or max_per_sequence
        self.costs = StepCosts()
        self._unverified = 0  # steps in a row that had a likely draft and verified none

    def plan(self, rates: list[float], available: list[int], plain_rows: int = 0) -> list[int]:
        """Drafts per sequence, given each one's acceptance rate and proposal length, against a
        step without drafts that computes `plain_rows` rows (default: one per sequence)."""
        if self.fixed:
            return [min(self.fixed, a) for a in available]
        gains = sorted(
            ((rate ** j, i) for i, (rate, a) in enumerate(zip(rates, available, strict=True))
             for j in range(1, min(a, self.max_per_sequence) + 1)),
            reverse=True)
        rows = len(rates)
        plain = self.costs.estimate(plain_rows or rows, verify=False)
        best_rate, best_count = rows / plain, 0
        expected = float(rows)
        for count, (gain, _i) in enumerate(gains, start=1):
            expected += gain
            rate = expected / self.costs.estimate(rows + count, verify=True)
            if rate > best_rate:
                best_rate, best_count = rate, count
        if best_count == 0 and gains and gains[0][0] >= PRIOR_RATE:
            self._unverified += 1
            if self._unverified >= REVISIT_STEPS:
                best_count = 1  # re-time a verify step (REVISIT_STEPS)
        if best_count:
            self._unverified = 0
        drafts = [0] * len(rates)
        for _gain, i in gains[:best_count]:  # a sequence's gains fall with j: a prefix of each
            drafts[i] += 1
        return drafts
