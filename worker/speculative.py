"""Speculative decoding without a draft model: a step feeds each sequence its pending token and
the drafts its own history proposes (worker/drafting.py), computes logits for every one of
those rows in one packed forward pass (the prefill path: each row attends to the cache and the
rows before it), samples every row, and keeps each sequence's tokens up to the first row whose
sample differs from the draft that row fed.

Why the kept tokens are exactly what decoding one token per step would give: row j's logits are
those of the sequence extended by the drafts before it, and row j is sampled as the plain step
would sample that position, with the same penalties (its history includes the drafts before it),
the same grammar mask (a matcher advanced through them) and, for a seeded sequence, the same
noise (a seeded draw is keyed by the position it draws, worker/sampling.py). Greedy
output is therefore identical token for token, a seeded run repeats itself and matches the plain
run, and an unseeded one samples each position from the target distribution: a draft is kept
exactly when the target's own draw at that position picks it, which for a deterministic proposal
is standard speculative sampling's acceptance, min(1, p(draft) / 1).

The K/V of drafts that were not kept stays in cache slots past the sequence's length, where
nothing reads it, and the next step overwrites it. Tensor-parallel ranks propose the same drafts
from the same tokens; rank 0 alone decides how many each sequence verifies (its acceptance
gate, its timings, its grammar) and broadcasts the counts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from shardlm.constants import SPECULATION_MODES

from shardlm_server.worker.batch import build_packed_batch
from shardlm_server.worker.comm import Communicator
from shardlm_server.worker.drafting import DraftPlanner, NgramDrafter
from shardlm_server.worker.engine_types import DraftCount, ResidentSequence, TokenOutput
from shardlm_server.worker.grammar import GrammarRuntime
from shardlm_server.worker.kv_cache import KVCache
from shardlm_server.worker.model import TransformerModel
from shardlm_server.worker.sampling import SampledToken, SamplingRow
from shardlm_server.worker.sequences import SequenceStates
from shardlm_server.worker.step_sampler import PendingSample, StepSampler
from shardlm_server.worker.transfer import to_device


@dataclass(frozen=True)
class SpeculationConfig:
    """`mode`: one of SPECULATION_MODES; `tokens`: drafts per sequence and step when fixed (0:
    the planner chooses, up to DEFAULT_MAX_DRAFT_TOKENS). Set per Load (worker/convert.py)."""

    mode: str = SPECULATION_MODES[0]
    tokens: int = 0

    def enabled(self, device: torch.device) -> bool:
        return self.mode == "ngram" or (self.mode == "auto" and device.type == "cpu")


@dataclass
class Verified:
    """A speculative step's samples: per sequence, one token per row it fed."""

    tokens: list[list[SampledToken]]
    pending: PendingSample


class Speculator:
    """Proposes, verifies and accepts the drafts of one engine's decode steps."""

    def __init__(self, config: SpeculationConfig, model: TransformerModel, comm: Communicator,
                 sampler: StepSampler, states: SequenceStates) -> None:
        self.config = config
        self.model = model
        self.comm = comm
        self.sampler = sampler
        self.states = states
        self.planner = DraftPlanner(config.tokens)

    # ----------------------------------------------------------------- drafts
    def propose(self, seqs: list[ResidentSequence], room: list[int],
                plain_rows: int) -> list[list[int]]:
        """Each sequence's drafts for this step; `room`: tokens it may still emit in the call;
        `plain_rows`: the rows a step without drafts would compute."""
        max_positions = self.model.cfg.max_position_embeddings
        proposals = []
        for seq, left in zip(seqs, room, strict=True):
            limit = min(left, max_positions - seq.num_cached) - 1
            if seq.stop.max_new_tokens:
                limit = min(limit, seq.stop.max_new_tokens - seq.generated - 1)
            proposal = _drafter(seq).propose(min(limit, self.planner.max_per_sequence))
            if proposal and seq.matcher is not None:  # what the grammar refuses is not proposed
                proposal = proposal[: seq.matcher.validate_tokens(proposal)]
            proposals.append(proposal)
        counts = self._counts(seqs, proposals, plain_rows)
        for seq, proposal, count in zip(seqs, proposals, counts, strict=True):
            seq.acceptance.shadow = proposal if not count else []
        return [p[:c] for p, c in zip(proposals, counts, strict=True)]

    def _counts(self, seqs: list[ResidentSequence], proposals: list[list[int]],
                plain_rows: int) -> list[int]:
        counts = (self.planner.plan([s.acceptance.rate for s in seqs], [len(p) for p in proposals],
                                    plain_rows)
                  if self.comm.rank == 0 else [0] * len(seqs))
        if self.comm.world_size > 1:  # rank 0's timings and grammars decide for every rank
            shared = to_device(counts, torch.int64, self.model.device)
            self.comm.broadcast(shared, src=0)
            counts = shared.tolist()
        return counts

    def observe(self, rows: int, seconds: float, verify: bool) -> None:
        self.planner.costs.observe(rows, seconds, verify)

    # ----------------------------------------------------------------- verify
    def verify(self, seqs: list[ResidentSequence], drafts: list[list[int]],
               cache: KVCache) -> Verified:
        """One forward pass over every sequence's pending token and drafts; every row sampled."""
        batch = build_packed_batch(
            [([s.pending, *d], s.num_cached) for s, d in zip(seqs, drafts, strict=True)],  # type: ignore[list-item]
            [s.block_table for s in seqs], cache.block_size, self.model.device, every_row=True)
        sampling_rows: list[SamplingRow] = []
        masks = None
        if self.comm.rank == 0:
            sampling_rows = [row for s, d in zip(seqs, drafts, strict=True)
                             for row in _sampling_rows(s, d)]
            if self.states.grammar is not None:
                masks = self.states.grammar.start_masks(
                    [m for s, d in zip(seqs, drafts, strict=True) for m in _matchers(s, d)])
        logits = self.model.forward(batch.input_ids, batch.meta, cache.layers)
        pending = self.sampler.launch_rows(logits, sampling_rows, list(range(logits.shape[0])),
                                           masks)
        flat = self.sampler.collect(pending, record=False)
        tokens, start = [], 0
        for d in drafts:
            tokens.append(flat[start:start + len(d) + 1])
            start += len(d) + 1
        return Verified(tokens, pending)

    def accept(self, seqs: list[ResidentSequence], drafts: list[list[int]], verified: Verified,
               room: list[int]) -> tuple[list[TokenOutput], list[DraftCount]]:
        """Keep each sequence's tokens up to its first refused draft (and within its room and
        stop conditions); the cache then holds them all but the new pending one."""
        outputs: list[TokenOutput] = []
        counts: list[DraftCount] = []
        row = 0
        for seq, draft, sampled, left in zip(seqs, drafts, verified.tokens, room, strict=True):
            accepted = 0
            while accepted < len(draft) and sampled[accepted].token_id == draft[accepted]:
                accepted += 1
            kept = self._emit(seq, sampled[: min(accepted + 1, left)], verified.pending, row)
            outputs.extend(kept)
            if draft:
                seq.acceptance.record(len(draft), accepted)
                counts.append(DraftCount(seq.sequence_id, len(draft), min(accepted, len(kept))))
            row += len(draft) + 1
        return outputs, counts

    def _emit(self, seq: ResidentSequence, tokens: list[SampledToken], pending: PendingSample,
              row: int) -> list[TokenOutput]:
        """Advance `seq` by `tokens` (sampled at rows row, row + 1, ...) until it finishes."""
        kept = []
        for j, token in enumerate(tokens):
            seq.tokens.append(seq.pending)  # type: ignore[arg-type]  # its K/V is cached now
            kept.extend(self.states.advance([seq], [token]))
            if seq.history is not None and self.comm.rank == 0:
                seq.history.add_output(pending.ids[row + j])
            if seq.finished is not None:
                break
        self.after_step(seq, [t.token.token_id for t in kept])
        return kept

    @staticmethod
    def after_step(seq: ResidentSequence, emitted: list[int]) -> None:
        """Index a step's new tokens, and score a proposal that was not verified against them."""
        if seq.drafter is not None:
            seq.drafter.extend(emitted)
        seq.acceptance.score_shadow(emitted)


def _drafter(seq: ResidentSequence) -> NgramDrafter:
    """The sequence's index over its tokens and its pending one (built at its first step)."""
    length = seq.num_cached + 1
    if seq.drafter is None or len(seq.drafter.tokens) != length:
        seq.drafter = NgramDrafter()
        seq.drafter.extend([*seq.tokens, seq.pending])  # type: ignore[list-item]
    return seq.drafter


def _sampling_rows(seq: ResidentSequence, draft: list[int]) -> list[SamplingRow]:
    """Row j samples the position after draft[:j]: penalties count those drafts as generated,
    and a seeded row draws with that position's key."""
    history = seq.history
    position = seq.draw_position
    rows = [SamplingRow(seq.sampling, history, position)]
    for j, token in enumerate(draft, 1):  # each row's history is the previous row's plus its input
        history = history.with_outputs([token]) if history is not None else None
        rows.append(SamplingRow(seq.sampling, history, position + j))
    return rows


def _matchers(seq: ResidentSequence, draft: list[int]) -> list:
    """Row j's grammar matcher: the sequence's, advanced through draft[:j] (None: free row)."""
    matcher = seq.matcher
    chain = [matcher]
    for token in draft:
        if matcher is not None:
            matcher = matcher.deep_copy()
            GrammarRuntime.consume(matcher, token)
        chain.append(matcher)
    return chain
