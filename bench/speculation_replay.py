"""How far speculative decoding's draft choices are from the best possible: the worker's drafter
and planner replayed offline over the model's own greedy answers, with step costs measured on
this machine.

    python -m bench.speculation_replay                      # the default model, costs measured
    python -m bench.speculation_replay --costs verify.json  # costs of `bench.verify_steps --json`

For each workload of bench.speculation (bench/speculation_prompts.py) the engine decodes each
prompt's greedy answer in process (speculation off; chat template; up to --max-new-tokens,
ending at an EOS id). Decoding is then replayed step by step as the worker runs it
(worker/speculative.py): the sequence's n-gram proposal (worker/drafting.py), the drafts a
policy verifies, the drafts greedy decoding accepts (known from the answer), the step's cost
from the measured table (a plain decode step; a verify pass of 1 + k rows, as
`bench.verify_steps` times them at the answers' mean context, plus what a plain step spends
beyond its one-row pass), and the acceptance estimate updated as the worker updates it.
Printed per workload, as speed-ups of the decode steps over plain decoding (no prefill, no
stack, so the full stack's ratios in bench.speculation are lower):

- planner: the worker's DraftPlanner, fed the measured costs;
- best fixed: the best of verifying a fixed count k = 1 .. max drafts wherever a proposal has them;
- oracle: every step verifies exactly the drafts that will be accepted, as if the planner knew
  the answer: no refused draft is ever paid for and no acceptable one left out, the ceiling of
  what a better acceptance estimate could gain with these proposals and costs.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from shardlm.constants import DEFAULT_MAX_DRAFT_TOKENS

from bench.speculation_prompts import WORKLOADS
from shardlm_server.worker.drafting import Acceptance, DraftPlanner, NgramDrafter

COST_ROWS = list(range(1, DEFAULT_MAX_DRAFT_TOKENS + 2))  # a verify pass of 1 .. max + 1 rows


@dataclass
class Costs:
    """Milliseconds of a plain decode step and of a verify pass by its row count."""

    plain_ms: float
    verify_ms: dict[int, float]

    @classmethod
    def from_verify_steps(cls, result: dict) -> Costs:
        verify = {int(r): float(ms) for r, ms in result["verify_ms"].items()}
        missing = [r for r in COST_ROWS if r not in verify]
        if missing:
            raise ValueError(f"the costs have no verify pass of {missing} rows "
                             f"(bench.verify_steps --rows {','.join(map(str, COST_ROWS))})")
        return cls(float(result["plain_step_ms"]), verify)

    def step_ms(self, drafts: int) -> float:
        """A step's milliseconds: a verifying step is its pass plus what a plain step spends
        beyond its one-row pass (sampling, the step's own Python), which it spends too."""
        if not drafts:
            return self.plain_ms
        return self.verify_ms[1 + drafts] + max(0.0, self.plain_ms - self.verify_ms[1])

    def planner(self) -> DraftPlanner:
        """The worker's planner with these costs already observed."""
        planner = DraftPlanner()
        planner.costs.observe(1, self.plain_ms, verify=False)
        for rows in self.verify_ms:
            if rows > 1:
                planner.costs.observe(rows, self.step_ms(rows - 1), verify=True)
        return planner


# A policy: (planner, acceptance, proposal, the answer's tokens from this step on) -> drafts.
Policy = Callable[[DraftPlanner, Acceptance, list[int], list[int]], int]


def planner_policy(planner: DraftPlanner, acceptance: Acceptance, proposal: list[int],
                   _ahead: list[int]) -> int:
    return planner.plan([acceptance.rate], [len(proposal)])[0]


def fixed_policy(k: int) -> Policy:
    return lambda _planner, _acceptance, proposal, _ahead: min(k, len(proposal))


def oracle_policy(_planner: DraftPlanner, _acceptance: Acceptance, proposal: list[int],
                  ahead: list[int]) -> int:
    return _matched(proposal, ahead)


def _matched(draft: list[int], ahead: list[int]) -> int:
    """How many of `draft`'s tokens greedy decoding accepts: its prefix equal to `ahead`."""
    n = 0
    while n < len(draft) and n < len(ahead) and draft[n] == ahead[n]:
        n += 1
    return n


def replay(prompt: list[int], answer: list[int], costs: Costs, policy: Policy) -> dict:
    """Decode `answer` (its first token came from the prefill) step by step under `policy`:
    the milliseconds of its steps, their count and the tokens that came from drafts."""
    planner, acceptance, drafter = costs.planner(), Acceptance(), NgramDrafter()
    drafter.extend(prompt + answer[:1])
    done, ms, steps, drafted_tokens = 1, 0.0, 0, 0
    while done < len(answer):
        ahead = answer[done:]
        proposal = drafter.propose(min(planner.max_per_sequence, len(ahead) - 1))
        count = policy(planner, acceptance, proposal, ahead)
        accepted = _matched(proposal[:count], ahead)
        emitted = ahead[:accepted + 1]
        if count:
            acceptance.record(count, accepted)
        else:  # scored against what came instead, as the worker scores a draft it did not verify
            acceptance.shadow = proposal
            acceptance.score_shadow(emitted)
        ms += costs.step_ms(count)
        steps += 1
        drafted_tokens += accepted
        drafter.extend(emitted)
        done += len(emitted)
    return {"ms": ms, "steps": steps, "draft_tokens": drafted_tokens}


def workload_row(answers: list[tuple[list[int], list[int]]], costs: Costs) -> dict:
    """The speed-ups of every policy over plain decoding on one workload's answers."""
    tokens = sum(len(a) - 1 for _, a in answers)  # decode steps' tokens (the first is prefill's)
    plain_ms = tokens * costs.plain_ms

    def run(policy: Policy) -> dict:
        runs = [replay(p, a, costs, policy) for p, a in answers]
        ms = sum(r["ms"] for r in runs)
        return {"speedup": plain_ms / ms if ms else 1.0,
                "tokens_per_step": tokens / max(1, sum(r["steps"] for r in runs)),
                "from_drafts": sum(r["draft_tokens"] for r in runs) / max(1, tokens)}

    fixed = {k: run(fixed_policy(k)) for k in range(1, DEFAULT_MAX_DRAFT_TOKENS + 1)}
    best_k = max(fixed, key=lambda k: fixed[k]["speedup"])
    return {"tokens": tokens, "planner": run(planner_policy), "best_fixed_k": best_k,
            "best_fixed": fixed[best_k], "oracle": run(oracle_policy)}


def mean_context(answers: list[tuple[list[int], list[int]]]) -> int:
    """The tokens cached at an average decode step of these answers."""
    contexts = [len(p) + i for p, a in answers for i in range(1, len(a))]
    return round(sum(contexts) / len(contexts)) if contexts else 1


def greedy_answers(model: Path, prompts: list[str], max_new_tokens: int) -> list[tuple[list[int], list[int]]]:
    """Each prompt (a user message in the chat template) and the engine's greedy answer to it."""
    import torch

    from bench.engine_bench import load_engine
    from shardlm_server.gateway.text.tokenizer import ChatMessage, Tokenizer
    from shardlm_server.worker.engine_types import DecodeItem, PrefillItem, StopParams

    tokenizer = Tokenizer.from_pretrained(model)
    encoded = [tokenizer.encode_chat([ChatMessage("user", p)]) for p in prompts]
    longest = max(len(e) for e in encoded) + max_new_tokens
    engine = load_engine(model, torch.float32, torch.device("cpu"), 1, longest, longest)
    stop = StopParams(max_new_tokens=max_new_tokens, stop_token_ids=tokenizer.eos_token_ids)
    table = list(range(engine.cache.capacity.num_blocks))
    answers = []
    for prompt in encoded:
        engine.reset()
        first = engine.prefill([PrefillItem(0, prompt, 0, table, stop=stop)])
        answer = [t.token.token_id for t in first.tokens]
        for step in engine.decode([DecodeItem(0, table, max_new_tokens)], max_new_tokens):
            answer.extend(t.token.token_id for t in step.tokens)
        answers.append((prompt, answer))
    return answers


def print_rows(rows: dict[str, dict]) -> None:
    print("| workload | decode tokens | planner | best fixed (k) | oracle | tokens a step: "
          "planner / oracle | from drafts: planner / oracle |")
    print("|---|---|---|---|---|---|---|")
    for name, row in rows.items():
        p, f, o = row["planner"], row["best_fixed"], row["oracle"]
        print(f"| {name} | {row['tokens']} | **{p['speedup']:.2f}x** | {f['speedup']:.2f}x "
              f"({row['best_fixed_k']}) | {o['speedup']:.2f}x | {p['tokens_per_step']:.2f} / "
              f"{o['tokens_per_step']:.2f} | {p['from_drafts']:.0%} / {o['from_drafts']:.0%} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="GGUF file or model folder (default: the "
                        "default model)")
    parser.add_argument("--costs", type=Path, help="a `bench.verify_steps --json` result with "
                        f"rows {','.join(map(str, COST_ROWS))} (default: measured now)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--workloads", default=",".join(WORKLOADS),
                        help=f"comma-separated, of {', '.join(WORKLOADS)}")
    parser.add_argument("--json", type=Path, help="also write the report here")
    args = parser.parse_args(argv)
    names = [w for w in args.workloads.split(",") if w]
    unknown = [w for w in names if w not in WORKLOADS]
    if unknown or not names:
        parser.error(f"--workloads takes names of {', '.join(WORKLOADS)}, got {args.workloads!r}")
    if args.max_new_tokens < 1:
        parser.error("--max-new-tokens takes a positive count")
    if args.model is None:
        from shardlm_server.gateway.serve.default_model import default_model_path
        args.model = default_model_path()
    costs = None
    if args.costs is not None:
        try:
            costs = Costs.from_verify_steps(json.loads(args.costs.read_text()))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            parser.error(f"--costs {args.costs}: {exc}")
    answers = {name: greedy_answers(args.model, WORKLOADS[name], args.max_new_tokens)
               for name in names}
    if costs is None:
        from bench.verify_steps import measure

        context = mean_context([a for runs in answers.values() for a in runs])
        print(f"timing the steps at {context} tokens cached (the answers' mean)")
        costs = Costs.from_verify_steps(measure(args.model, COST_ROWS, context=context,
                                                rounds=3, repeats=5))
    print(f"costs, ms: plain step {costs.plain_ms:.2f}; verify pass "
          + ", ".join(f"{r} rows {ms:.2f}" for r, ms in sorted(costs.verify_ms.items())))
    rows = {name: workload_row(runs, costs) for name, runs in answers.items()}
    print_rows(rows)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"costs": {"plain_ms": costs.plain_ms,
                                                   "verify_ms": costs.verify_ms},
                                         "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
