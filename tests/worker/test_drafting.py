"""worker/drafting.py: prompt-lookup proposals against a plain search written here, the
incremental index against one rebuilt from scratch, the acceptance gate closing and reopening,
and the planner's choices against the cost of a step's rows."""

from __future__ import annotations

import random

from shardlm_server.worker.drafting import (
    NGRAM_MAX,
    NGRAM_MIN,
    REVISIT_STEPS,
    Acceptance,
    DraftPlanner,
    NgramDrafter,
)


def reference_proposal(tokens: list[int], limit: int) -> list[int]:
    """The tokens after the latest earlier occurrence of the longest suffix that occurs before."""
    for n in range(NGRAM_MAX, NGRAM_MIN - 1, -1):
        if len(tokens) <= n:
            continue
        suffix = tokens[-n:]
        for end in range(len(tokens) - 1, n - 1, -1):  # occurrences ending before the last token
            if tokens[end - n:end] == suffix:
                return tokens[end:end + limit]
    return []


def test_proposals_match_a_plain_search_as_tokens_arrive():
    rng = random.Random(3)
    for _ in range(20):
        alphabet = rng.randint(2, 6)  # small alphabets repeat n-grams often
        tokens = [rng.randrange(alphabet) for _ in range(rng.randint(1, 80))]
        drafter = NgramDrafter()
        for i, token in enumerate(tokens):
            drafter.extend([token])
            for limit in (1, 3, 8):
                assert drafter.propose(limit) == reference_proposal(tokens[:i + 1], limit)


def test_a_repeated_passage_is_proposed_to_its_end():
    passage = list(range(100, 130))
    drafter = NgramDrafter()
    drafter.extend([1, 2, *passage, 7, 8, *passage[:5]])
    assert drafter.propose(10) == passage[5:15]
    assert drafter.propose(0) == []


def test_sync_follows_appends_and_reindexes_a_rewritten_history():
    drafter = NgramDrafter()
    drafter.sync([5, 6, 7, 5, 6])
    assert drafter.propose(2) == [7, 5]
    drafter.sync([5, 6, 7, 5, 6, 7, 5, 6])  # appended
    assert drafter.tokens == [5, 6, 7, 5, 6, 7, 5, 6]
    drafter.sync([9, 9, 1, 2, 9, 9])  # not a continuation: rebuilt
    assert drafter.tokens == [9, 9, 1, 2, 9, 9]
    assert drafter.propose(2) == [1, 2]


def test_the_gate_closes_on_refused_drafts_and_reopens_when_shadow_proposals_match():
    acceptance = Acceptance()
    prior = acceptance.rate
    for _ in range(10):
        acceptance.record(drafted=4, accepted=0)
    low = acceptance.rate
    assert low < 0.2 < prior
    planner = DraftPlanner()
    assert planner.plan([low], [8]) == [0]  # drafting does not pay
    for _ in range(10):  # not drafted, but the proposals would have been right
        acceptance.shadow = [1, 2, 3]
        acceptance.score_shadow([1, 2, 3])
    assert acceptance.rate > 0.8
    assert planner.plan([acceptance.rate], [8])[0] > 0


def test_the_planner_weighs_expected_tokens_against_measured_step_costs():
    planner = DraftPlanner()
    for rows in range(1, 12):  # extra rows almost free: draft deep where acceptance is high
        planner.costs.observe(rows, 1.0 + 0.01 * (rows - 1), verify=rows > 1)
    assert planner.plan([0.95], [8]) == [8]
    assert planner.plan([0.95, 0.3], [8, 8])[0] >= planner.plan([0.95, 0.3], [8, 8])[1]
    assert planner.plan([0.9], [2]) == [2]  # no more than the proposal holds
    expensive = DraftPlanner()
    for rows in range(1, 12):  # every row costs a full step: only a sure draft could pay
        expensive.costs.observe(rows, float(rows), verify=rows > 1)
    assert expensive.plan([0.9, 0.9], [8, 8]) == [0, 0]


def test_verifying_steps_are_costed_apart_from_plain_ones():
    planner = DraftPlanner()
    planner.costs.observe(4, 1.0, verify=False)
    assert planner.plan([0.9] * 4, [4] * 4) != [0] * 4  # the prior: extra rows cost little
    planner.costs.observe(5, 1.5, verify=True)  # but the verifying path costs more
    assert planner.plan([0.9] * 4, [4] * 4) == [0] * 4
    assert planner.costs.estimate(8, verify=True) > planner.costs.estimate(5, verify=True)


def test_a_large_batch_is_not_verified_on_the_strength_of_a_lone_sequences_timings():
    """Verify steps timed only for one sequence (2-5 rows, 10-14 ms) and plain steps of a
    32-sequence batch (80 ms): scaled from the small ones, a 33-row verify step would look like
    35 ms, cheaper than the plain step; it is taken for at least a plain step's cost instead."""
    planner = DraftPlanner()
    for rows in range(2, 6):
        planner.costs.observe(rows, 0.008 + 0.0015 * rows, verify=True)
    planner.costs.observe(32, 0.080, verify=False)
    assert planner.costs.estimate(33, verify=True) >= planner.costs.estimate(33, verify=False)
    assert planner.plan([0.5] * 32, [4] * 32) == [0] * 32


def test_one_slow_verify_timing_does_not_keep_drafting_off_for_good():
    """A verify step timed on a busy moment looks too dear to repeat; every REVISIT_STEPS steps
    with a likely draft the planner verifies one anyway, and a normal timing turns drafting
    back on."""
    planner = DraftPlanner()
    planner.costs.observe(1, 0.006, verify=False)
    planner.costs.observe(2, 0.030, verify=True)  # preempted: five plain steps' worth
    plans = [planner.plan([0.9], [8]) for _ in range(REVISIT_STEPS)]
    assert plans[:-1] == [[0]] * (REVISIT_STEPS - 1) and plans[-1] == [1]
    for _ in range(10):  # the revisits' timings pull the average back to what a step costs
        planner.costs.observe(2, 0.0062, verify=True)
    assert planner.plan([0.9], [8])[0] > 0
    unlikely = DraftPlanner()  # a draft that would fail is not verified to re-time anything
    unlikely.costs.observe(2, 0.030, verify=True)
    assert all(unlikely.plan([0.2], [8]) == [0] for _ in range(2 * REVISIT_STEPS))


def test_a_fixed_count_drafts_whatever_the_proposal_holds():
    planner = DraftPlanner(fixed=3)
    assert planner.plan([0.0, 0.9, 0.5], [8, 2, 0]) == [3, 2, 0]
