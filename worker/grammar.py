"""Constrained decoding on the sampling rank: each constrained sequence's llguidance matcher, the
token masks made from them, and their application to a step's logits.

Only rank 0 samples, so only rank 0 holds matchers (the other ranks of a tensor-parallel group
do no grammar work). A matcher follows its sequence's tokens: it is built when a sequence gets a
constraint, by replaying the tokens generated under it so far (a recomputed or rebuilt sequence
continues exactly where it was), and it consumes each sampled token as the step ends.

A step's masks are made on a thread of their own while the forward pass runs (llguidance
releases the GIL), then unpacked (one bit per token) and applied to the constrained rows only,
so unconstrained rows of the same batch pay nothing. A mask allows the model's EOS ids only where
the grammar may end; a matcher that allows nothing more has completed its constraint.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import llguidance
import numpy as np
import torch

from shardlm_server.worker.errors import InvalidRequestError
from shardlm_server.worker.transfer import to_device

log = logging.getLogger(__name__)

TEMPLATE_CACHE = 64  # compiled grammars kept per worker, by content


@dataclass(frozen=True)
class SequenceConstraint:
    """A sequence's constraint as the gateway sends it: llguidance's grammar, and the position of
    the first token generated under it."""

    grammar: str
    start_position: int


@dataclass
class PendingMasks:
    """Masks being made for the constrained rows of one step."""

    rows: list[int]  # the rows (of the step's logits) they are for
    batch: int  # the step's rows in all
    words: np.ndarray  # int32 [len(rows), ceil(V / 32)], filled by the mask thread
    made: Future  # its result: seconds spent making them


class GrammarRuntime:
    """The vocabulary's token table, compiled grammars, and the mask thread of one engine."""

    @classmethod
    def for_tokenizer(cls, tokenizer_json: str, vocab_size: int,
                      eos_ids: tuple[int, ...]) -> GrammarRuntime | None:
        """The runtime for a tokenizer (Hugging Face tokenizers JSON); None, with a warning,
        when llguidance cannot read it (the gateway then refuses constraints for the model)."""
        eos = list(eos_ids) or None
        try:
            try:
                table = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos)
            except ValueError as exc:
                if "vocab size too small" not in str(exc):
                    raise
                # The tokenizer has more ids than the model has logits: take its size.
                table = llguidance.LLTokenizer(tokenizer_json, eos_token=eos)
        except Exception as exc:  # noqa: BLE001 - llguidance raises plain exceptions
            log.warning("constrained decoding is off: llguidance cannot read the tokenizer (%s)",
                        str(exc).splitlines()[0][:200])
            return None
        return cls(table)

    def __init__(self, table: llguidance.LLTokenizer) -> None:
        self.table = table
        self.words_per_row = (self.table.vocab_size + 31) // 32
        self._templates: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._executor = llguidance.LLExecutor(num_threads=1)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="shardlm-masks")

    def matcher(self, constraint: SequenceConstraint, tokens: list[int],
                sequence_id: int) -> llguidance.LLMatcher:
        """A matcher for `constraint` that has consumed `tokens[start_position:]` (the sequence's
        tokens so far, its pending one included)."""
        template = self._templates.get(constraint.grammar)
        if template is None:
            template = llguidance.LLMatcher(self.table, constraint.grammar, log_level=0)
            if template.is_error():
                raise InvalidRequestError(
                    f"sequence {sequence_id}: the constraint does not compile: "
                    f"{template.get_error()[:300]}", field="constraint")
            self._templates[constraint.grammar] = template
            while len(self._templates) > TEMPLATE_CACHE:
                self._templates.popitem(last=False)
        else:
            self._templates.move_to_end(constraint.grammar)
        if constraint.start_position > len(tokens):
            raise InvalidRequestError(
                f"sequence {sequence_id}: constraint start_position {constraint.start_position} "
                f"is past its {len(tokens)} tokens", field="constraint.start_position")
        matcher = template.deep_copy()
        replay = tokens[constraint.start_position:]
        if replay and not matcher.consume_tokens(replay):
            raise InvalidRequestError(
                f"sequence {sequence_id}: its tokens from position {constraint.start_position} "
                "do not follow its constraint", field="constraint")
        return matcher

    def start_masks(self, matchers: list[llguidance.LLMatcher | None]) -> PendingMasks | None:
        """Begin making the masks of the rows that have a matcher (None when no row has)."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return None
        words = np.empty((len(rows), self.words_per_row), dtype=np.int32)
        pairs = [(matchers[row], k) for k, row in enumerate(rows)]
        return PendingMasks(rows, len(matchers), words,
                            self._thread.submit(self._fill, pairs, words))

    def _fill(self, pairs: list[tuple[llguidance.LLMatcher, int]], words: np.ndarray) -> float:
        started = time.perf_counter()
        self._executor.unsafe_compute_mask_ptr(pairs, words.ctypes.data, words.shape[1] * 4,
                                               words.shape[0])
        return time.perf_counter() - started

    @staticmethod
    def consume(matcher: llguidance.LLMatcher, token_id: int) -> bool:
        """Advance with the sampled token; True when the constraint is now complete (nothing more
        is allowed, or the grammar consumed an EOS where it could end)."""
        if not matcher.consume_token(token_id):  # only a token its mask allowed is sampled
            log.warning("a constrained sequence sampled a token its grammar refuses: %s",
                        matcher.get_error()[:200])
            return True
        return matcher.is_stopped()


@dataclass
class StepMasks:
    """A step's masks, ready to apply: `refused` (bool [len(rows), V], on the logits' device) for
    the logits rows `rows` (None: every row, in order)."""

    rows: torch.Tensor | None
    refused: torch.Tensor
    seconds: float  # making and unpacking them


def finish_masks(pending: PendingMasks | None, vocab_size: int,
                 device: torch.device) -> StepMasks | None:
    """Wait for a step's masks and unpack them to one bool per token (bit i of word w is token
    32 w + i, llguidance's layout)."""
    if pending is None:
        return None
    made = pending.made.result()
    started = time.perf_counter()
    bits = np.unpackbits(pending.words.view(np.uint8), axis=1, bitorder="little")
    refused = torch.from_numpy(bits[:, :vocab_size] == 0)
    if device.type != "cpu":
        refused = refused.to(device, non_blocking=True)
    every = len(pending.rows) == pending.batch  # rows are 0..batch-1, in order
    rows = None if every else to_device(pending.rows, torch.int64, device)
    return StepMasks(rows, refused, made + time.perf_counter() - started)


def apply_masks(logits: torch.Tensor, masks: StepMasks) -> torch.Tensor:
    """`logits` with every token a constrained row's mask refuses at -inf (a new tensor: the raw
    logits stay for logprobs)."""
    refused = masks.refused[:, : logits.shape[1]]
    if masks.rows is None:
        return logits.masked_fill(refused, float("-inf"))
    picked = logits.index_select(0, masks.rows).masked_fill(refused, float("-inf"))
    return logits.index_copy(0, masks.rows, picked)

