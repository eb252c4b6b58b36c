"""What a rank remembers of each sequence between calls (`ResidentSequence`), and how the items
of a call create and change it: their checks, the prefix a prefill continues, the sampler's state
(penalty history) and, on the sampling rank, the constraint's matcher; then each step's sampled
tokens advance it. Only the sampling rank runs the grammars, so it tells the other ranks which
sequences a step's tokens completed (`_share_completions`): every rank then finishes them at the
same token and keeps stepping the same rows, as the collectives of tensor parallelism need."""

from __future__ import annotations

import torch

from shardlm_server.worker.comm import Communicator
from shardlm_server.worker.config import ModelConfig
from shardlm_server.worker.engine_types import (
    DecodeItem,
    FinishReason,
    PrefillItem,
    ResidentSequence,
    TokenOutput,
)
from shardlm_server.worker.errors import InvalidRequestError, SequenceNotCachedError
from shardlm_server.worker.grammar import GrammarRuntime, PendingMasks, SequenceConstraint
from shardlm_server.worker.kv_cache import KVCache
from shardlm_server.worker.sampling import SampledToken, TokenHistory
from shardlm_server.worker.step_checks import check_block_table, check_tokens, finish_reason
from shardlm_server.worker.transfer import to_device


class SequenceStates:
    """The sequences of one engine, by id (`by_id`); rank 0 alone samples, so only it keeps
    penalty histories and matchers."""

    def __init__(self, cfg: ModelConfig, comm: Communicator, device: torch.device,
                 grammar: GrammarRuntime | None) -> None:
        self.cfg = cfg
        self.comm = comm
        self.rank = comm.rank
        self.device = device
        self.grammar = grammar
        self.by_id: dict[int, ResidentSequence] = {}

    def for_prefill(self, item: PrefillItem, cache: KVCache) -> ResidentSequence:
        """The sequence a prefill item (re)creates."""
        if not item.token_ids:
            raise InvalidRequestError(f"sequence {item.sequence_id}: no tokens to prefill")
        check_tokens(item.token_ids, item.sequence_id, self.cfg.vocab_size)
        end = item.start_position + len(item.token_ids)
        if end > self.cfg.max_position_embeddings:
            raise InvalidRequestError(
                f"sequence {item.sequence_id}: {end} tokens exceed the context of "
                f"{self.cfg.max_position_embeddings}",
                field="token_ids",
            )
        check_block_table(item.block_table, end, item.sequence_id, cache)
        prefix = self._prefix_of(item)
        seq = ResidentSequence(
            sequence_id=item.sequence_id,
            tokens=prefix + list(item.token_ids),
            block_table=list(item.block_table),
            sampling=item.sampling,
            stop=item.stop,
            output_start=item.output_start,
        )
        self._attach_sampler_state(seq)
        if item.sample:
            seq.matcher = self._matcher(item.constraint, seq.tokens, seq.sequence_id)
            seq.constrained = _has_grammar(item.constraint)
        self.by_id[item.sequence_id] = seq
        return seq

    def _prefix_of(self, item: PrefillItem) -> list[int]:
        """The ids of the tokens before `start_position`: sent with the item when its first
        blocks hold a prefix another sequence computed, else the ones this worker remembers."""
        if item.prefix_token_ids:
            if len(item.prefix_token_ids) != item.start_position:
                raise InvalidRequestError(
                    f"sequence {item.sequence_id}: prefix_token_ids holds "
                    f"{len(item.prefix_token_ids)} tokens, start_position is "
                    f"{item.start_position}",
                    field="prefix_token_ids",
                )
            check_tokens(item.prefix_token_ids, item.sequence_id, self.cfg.vocab_size)
            return list(item.prefix_token_ids)
        known = self.by_id.get(item.sequence_id)
        if item.start_position > 0 and (known is None or known.num_cached < item.start_position):
            raise SequenceNotCachedError(
                f"sequence {item.sequence_id}: {item.start_position} tokens are not in this "
                "worker's cache; prefill the whole history from position 0",
                sequence_id=item.sequence_id,
            )
        return known.tokens[: item.start_position] if known else []

    def for_decode(self, item: DecodeItem, tokens: int, cache: KVCache) -> ResidentSequence:
        """The sequence a decode item continues for at most `tokens` tokens (its block table
        must hold them), with what the item changes."""
        seq = self.by_id.get(item.sequence_id)
        if seq is None or seq.pending is None:
            raise SequenceNotCachedError(
                f"sequence {item.sequence_id} has no pending token on this worker; prefill it first",
                sequence_id=item.sequence_id,
            )
        if seq.finished is not None and item.stop is None:
            raise InvalidRequestError(
                f"sequence {item.sequence_id} already finished ({seq.finished.value})"
            )
        check_block_table(item.block_table, seq.num_cached + tokens, item.sequence_id, cache)
        seq.block_table = list(item.block_table)
        if item.sampling is not None and item.sampling != seq.sampling:
            seq.sampling = item.sampling
            self._attach_sampler_state(seq)  # new parameters: new penalty state
        if item.stop is not None:  # a new call with its own limits: count from here
            seq.stop, seq.generated, seq.finished = item.stop, 0, None
        if item.constraint is not None:
            seq.matcher = self._matcher(item.constraint, [*seq.tokens, seq.pending],
                                        seq.sequence_id)
            seq.constrained = _has_grammar(item.constraint)
        return seq

    def _matcher(self, constraint: SequenceConstraint | None, tokens: list[int],
                 sequence_id: int):
        """The sequence's grammar matcher after `tokens` (None: unconstrained, or not rank 0)."""
        if constraint is None or not constraint.grammar or self.rank != 0:
            return None
        if self.grammar is None:
            raise InvalidRequestError(
                "constrained decoding needs the tokenizer with Load (LoadRequest.tokenizer_json)",
                field="constraint")
        return self.grammar.matcher(constraint, tokens, sequence_id)

    def start_masks(self, seqs: list[ResidentSequence]) -> PendingMasks | None:
        if self.grammar is None:
            return None
        return self.grammar.start_masks([s.matcher for s in seqs])

    def _attach_sampler_state(self, seq: ResidentSequence) -> None:
        if self.rank != 0:
            return  # only rank 0 samples
        p = seq.sampling
        seq.history = None
        if p.uses_repetition_penalty or p.uses_output_penalties:
            tokens = seq.tokens if seq.pending is None else [*seq.tokens, seq.pending]
            seq.history = TokenHistory.from_tokens(tokens, seq.output_start,
                                                   self.cfg.vocab_size, self.device)

    def advance(self, seqs: list[ResidentSequence],
                 tokens: list[SampledToken]) -> list[TokenOutput]:
        """Each sequence's new token becomes its pending one; see whether it finished."""
        outputs = []
        for seq, token in zip(seqs, tokens, strict=True):
            seq.pending = token.token_id
            seq.generated += 1
            seq.finished = finish_reason(seq, token.token_id, self.cfg.max_position_embeddings)
            complete = False
            if seq.matcher is not None:
                complete = GrammarRuntime.consume(seq.matcher, token.token_id)
            outputs.append(TokenOutput(seq.sequence_id, token, complete))
        self._share_completions(seqs, outputs)
        return outputs

    def _share_completions(self, seqs: list[ResidentSequence],
                           outputs: list[TokenOutput]) -> None:
        """Finish the sequences whose grammars this step's tokens completed, on every rank:
        rank 0 decided (its matchers), and with more ranks it broadcasts which. Only a batch
        with a constrained sequence can have one, and every rank knows which those are from
        the requests, so an unconstrained step does nothing here."""
        if not any(s.constrained for s in seqs):
            return
        if self.comm.world_size > 1:
            flags = to_device([o.constraint_complete for o in outputs], torch.int64, self.device)
            self.comm.broadcast(flags, src=0)
            for i, complete in enumerate(flags.tolist()):
                outputs[i].constraint_complete = bool(complete)
        for seq, out in zip(seqs, outputs, strict=True):
            if out.constraint_complete:
                seq.matcher, seq.constrained = None, False  # nothing more to mask
                seq.finished = seq.finished or FinishReason.CONSTRAINT_COMPLETE


def _has_grammar(constraint: SequenceConstraint | None) -> bool:
    return constraint is not None and bool(constraint.grammar)
