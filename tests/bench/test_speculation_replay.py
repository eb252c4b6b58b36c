"""bench.speculation_replay's replay, on made-up answers: a copied passage is drafted and the
oracle takes every acceptable draft, text with nothing to copy replays as plain decoding, and
bad costs or arguments are clear errors."""

from __future__ import annotations

import pytest

from bench.speculation_replay import (
    COST_ROWS,
    Costs,
    fixed_policy,
    main,
    mean_context,
    oracle_policy,
    planner_policy,
    replay,
    workload_row,
)

# A plain step 4 ms; a verify pass 4 ms for one row and 1.5 ms for each row after it.
COSTS = Costs(4.0, {rows: 4.0 + 1.5 * (rows - 1) for rows in COST_ROWS})
PASSAGE = list(range(100, 140))


def test_an_answer_that_copies_its_prompt_comes_mostly_from_drafts():
    prompt = [1, 2, 3, *PASSAGE, 4, 5]
    answer = [7, *PASSAGE[:30]]  # after one token of its own, the answer quotes the passage
    oracle = replay(prompt, answer, COSTS, oracle_policy)
    planner = replay(prompt, answer, COSTS, planner_policy)
    assert oracle["draft_tokens"] >= 20 and oracle["steps"] < 10
    assert oracle["ms"] <= planner["ms"] < 30 * COSTS.plain_ms
    row = workload_row([(prompt, answer)], COSTS)
    assert row["tokens"] == 30
    assert row["oracle"]["speedup"] >= row["best_fixed"]["speedup"] >= 1.0
    assert row["planner"]["speedup"] > 1.5
    assert 1 <= row["best_fixed_k"] <= max(COST_ROWS) - 1


def test_text_with_nothing_to_copy_replays_as_plain_decoding():
    prompt, answer = [1, 2, 3], list(range(10, 40))  # no n-gram ever repeats
    for policy in (planner_policy, oracle_policy, fixed_policy(4)):
        run = replay(prompt, answer, COSTS, policy)
        assert run == {"ms": 29 * COSTS.plain_ms, "steps": 29, "draft_tokens": 0}


def test_refused_drafts_are_paid_for_and_skipped():
    prompt = [1, 2, 3, 4, 5, 6]
    answer = [9, 1, 2, 8, 8, 8]  # "1 2" proposes "3 4 5 ...", which is refused
    fixed = replay(prompt, answer, COSTS, fixed_policy(3))
    oracle = replay(prompt, answer, COSTS, oracle_policy)
    assert fixed["ms"] > oracle["ms"] and oracle["draft_tokens"] == fixed["draft_tokens"]


def test_costs_need_every_row_count():
    result = {"plain_step_ms": 4.0, "verify_ms": {"1": 4.0, "2": 5.0}}
    with pytest.raises(ValueError, match="no verify pass of"):
        Costs.from_verify_steps(result)
    full = {"plain_step_ms": 4.0, "verify_ms": {str(r): 4.0 + r for r in COST_ROWS}}
    assert Costs.from_verify_steps(full).step_ms(2) == 7.0
    # A verifying step also spends what a plain step spends beyond its one-row pass (sampling).
    full["plain_step_ms"] = 6.0
    costs = Costs.from_verify_steps(full)
    assert costs.step_ms(0) == 6.0 and costs.step_ms(2) == 8.0


def test_bad_arguments_are_usage_errors(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--workloads", "poetry"])
    assert exit_.value.code == 2 and "--workloads takes names of" in capsys.readouterr().err
    bad = tmp_path / "costs.json"
    bad.write_text('{"plain_step_ms": 4.0, "verify_ms": {"1": 4.0}}')
    with pytest.raises(SystemExit) as exit_:
        main(["--costs", str(bad)])
    assert exit_.value.code == 2 and "no verify pass of" in capsys.readouterr().err


def test_the_mean_context_is_that_of_an_average_decode_step():
    # Decode steps cache prompt + 1, + 2, + 3 tokens (the answer's first token is the prefill's).
    assert mean_context([([1] * 10, [5, 6, 7, 8])]) == 12
    assert mean_context([]) == 1
