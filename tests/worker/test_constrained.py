"""Constrained decoding in the engine against a plain masked-argmax loop: transformers' logits of
the same checkpoint, a fresh llguidance matcher's mask, the highest allowed logit. Greedy tokens
must be equal token for token, for every kind of grammar, in a batch that mixes constrained and
free sequences, across prefill and multi-step decode, and for a sequence rebuilt mid-constraint.
"""

from __future__ import annotations

import json

import llguidance
import numpy as np
import pytest
import torch

from shardlm_server.worker.engine import DecodeItem, Engine, PrefillItem, StopParams
from shardlm_server.worker.errors import InvalidRequestError
from shardlm_server.worker.grammar import (
    PendingMasks,
    SequenceConstraint,
    apply_masks,
    finish_masks,
)
from tests.checkpoints import load_reference
from tests.worker.greedy_runs import prompt

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "n": {"type": "integer"}},
          "required": ["name", "n"], "additionalProperties": False}
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
GRAMMARS = {
    "json_schema": llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults=JSON_OPTIONS),
    "regex": llguidance.LLMatcher.grammar_from_regex(r"(to|be|or)( (to|be|not)){2,5}\."),
    "choice": llguidance.LLMatcher.grammar_from_lark('start: "question" | "nobler" | "sea"'),
    "lark": llguidance.LLMatcher.grammar_from_lark(
        'start: "(" item (", " item)* ")"\nitem: /[a-z]{1,4}/ | NUMBER\nNUMBER: /[0-9]{1,3}/'),
}
STEPS = 24


@pytest.fixture(scope="module")
def setup(llama_dir):
    tokenizer_json = (llama_dir / "tokenizer.json").read_text()
    engine = Engine.load(llama_dir, dtype="float32", tokenizer_json=tokenizer_json)
    reference = load_reference(llama_dir)
    table = llguidance.LLTokenizer(tokenizer_json, n_vocab=engine.cfg.vocab_size,
                                   eos_token=list(engine.eos_token_ids))
    return engine, reference, table


def reference_tokens(reference, table, grammar: str, ids: list[int], n: int) -> list[int]:
    """The masked-argmax loop: at each step the highest logit among the tokens the grammar
    allows, until the grammar allows nothing more or n tokens."""
    matcher = llguidance.LLMatcher(table, grammar)
    assert not matcher.is_error(), matcher.get_error()
    vocab = table.vocab_size
    out: list[int] = []
    with torch.no_grad():
        while len(out) < n and not matcher.is_stopped():
            logits = reference(torch.tensor([ids + out])).logits[0, -1].float()
            bits = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
            allowed = torch.from_numpy(np.unpackbits(bits, bitorder="little")[:vocab].copy())
            masked = torch.where(allowed.bool()[: logits.shape[0]], logits,
                                 torch.tensor(float("-inf")))
            token = int(masked.argmax())
            assert matcher.consume_token(token)
            out.append(token)
    return out


def engine_tokens(engine: Engine, runs: list[tuple[int, list[int], str | None]],
                  n: int) -> dict[int, tuple[list[int], bool]]:
    """Greedy tokens of several sequences decoded in one batch: (tokens, constraint completed)."""
    blocks = iter(range(engine.capacity.num_blocks))
    tables = {sid: [next(blocks) for _ in range(4)] for sid, _ids, _g in runs}
    stop = StopParams(max_new_tokens=n)
    items = [PrefillItem(sid, ids, 0, tables[sid], stop=stop,
                         constraint=SequenceConstraint(g, len(ids)) if g else None)
             for sid, ids, g in runs]
    out = {t.sequence_id: ([t.token.token_id], t.constraint_complete)
           for t in engine.prefill(items).tokens}
    live = [DecodeItem(sid, tables[sid], n) for sid, _ids, _g in runs if not out[sid][1]]
    if live:
        for step in engine.decode(live, n):
            for t in step.tokens:
                tokens, _done = out[t.sequence_id]
                out[t.sequence_id] = (tokens + [t.token.token_id], t.constraint_complete)
    engine.reset()
    return out


@pytest.mark.parametrize("kind", sorted(GRAMMARS))
def test_greedy_equals_the_masked_argmax_loop(setup, kind):
    engine, reference, table = setup
    ids = prompt(12, 900, seed=3)
    expected = reference_tokens(reference, table, GRAMMARS[kind], ids, STEPS)
    tokens, complete = engine_tokens(engine, [(1, ids, GRAMMARS[kind])], STEPS)[1]
    assert tokens == expected
    matcher = llguidance.LLMatcher(table, GRAMMARS[kind])
    assert matcher.consume_tokens(tokens)
    assert complete == matcher.is_stopped()
    if kind == "choice":  # short enough to finish: the output is one of the choices
        assert complete and table.decode_str(tokens) in ("question", "nobler", "sea")


def test_constrained_and_free_sequences_share_a_batch(setup):
    engine, reference, table = setup
    a, b, c = prompt(9, 900, seed=5), prompt(14, 900, seed=6), prompt(5, 900, seed=7)
    out = engine_tokens(engine, [(1, a, GRAMMARS["json_schema"]), (2, b, None),
                                 (3, c, GRAMMARS["lark"])], STEPS)
    assert out[1][0] == reference_tokens(reference, table, GRAMMARS["json_schema"], a, STEPS)
    assert out[3][0] == reference_tokens(reference, table, GRAMMARS["lark"], c, STEPS)
    with torch.no_grad():
        free = reference.generate(torch.tensor([b]), max_new_tokens=STEPS, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)[0, len(b):].tolist()
    assert out[2][0] == free


def test_a_sequence_prefilled_again_mid_constraint_continues_exactly(setup):
    """A recompute: the history (prompt and the constrained tokens so far) is prefilled again
    with the constraint's start position; the matcher replays the tokens and goes on."""
    engine, reference, table = setup
    ids = prompt(10, 900, seed=11)
    grammar = GRAMMARS["regex"]
    expected = reference_tokens(reference, table, grammar, ids, STEPS)
    cut = 4
    history = ids + expected[:cut]
    table_blocks = list(range(8))
    first = engine.prefill([PrefillItem(9, history, 0, table_blocks,
                                        stop=StopParams(max_new_tokens=STEPS),
                                        constraint=SequenceConstraint(grammar, len(ids)))])
    tokens = [first.tokens[0].token.token_id]
    if not first.tokens[0].constraint_complete:
        for step in engine.decode([DecodeItem(9, table_blocks, STEPS - cut - 1)],
                                  STEPS - cut - 1):
            tokens += [t.token.token_id for t in step.tokens]
    engine.reset()
    assert expected[:cut] + tokens == expected[: cut + len(tokens)]
    assert len(tokens) > 0


def test_a_decode_can_change_the_constraint_and_a_bad_replay_is_refused(setup):
    engine, reference, table = setup
    ids = prompt(8, 900, seed=13)
    blocks = list(range(8))
    engine.prefill([PrefillItem(4, ids, 0, blocks, stop=StopParams(max_new_tokens=20))])
    pending = engine.sequences[4].pending
    choice = GRAMMARS["choice"]
    steps = list(engine.decode([DecodeItem(4, blocks, 12, stop=StopParams(max_new_tokens=12),
                                           constraint=SequenceConstraint(choice, len(ids) + 1))],
                               12))
    tokens = [t.token.token_id for s in steps for t in s.tokens]
    expected = reference_tokens(reference, table, choice, ids + [pending], 12)
    assert tokens == expected and steps[-1].tokens[-1].constraint_complete
    engine.reset()
    with pytest.raises(InvalidRequestError, match="do not follow its constraint"):
        engine.prefill([PrefillItem(5, ids, 0, blocks,
                                    constraint=SequenceConstraint(choice, 0))])
    with pytest.raises(InvalidRequestError, match="does not compile"):
        engine.prefill([PrefillItem(5, ids, 0, blocks, constraint=SequenceConstraint(
            json.dumps({"grammars": [{"lark_grammar": "start: nothing_here"}]}), len(ids)))])
    engine.reset()


@pytest.mark.parametrize("rows, batch", [([0, 1, 2], 3), ([1, 3], 5), ([0], 1), ([2], 4)])
def test_masks_unpack_and_apply_as_the_plain_reference(rows, batch):
    """llguidance's bit layout (bit i of word w is token 32 w + i) unpacked and applied to the
    constrained rows only, against a per-token loop."""
    vocab = 1000
    g = torch.Generator().manual_seed(len(rows) * 7 + batch)
    words = torch.randint(-2**31, 2**31 - 1, (len(rows), (vocab + 31) // 32), generator=g,
                          dtype=torch.int64).to(torch.int32).numpy()
    pending = PendingMasks(rows, batch, words, _done(0.0))
    logits = torch.randn(batch, vocab, generator=g)
    masked = apply_masks(logits, finish_masks(pending, vocab, torch.device("cpu")))
    expected = logits.clone()
    for k, row in enumerate(rows):
        for token in range(vocab):
            if not (int(words[k, token // 32]) >> (token % 32)) & 1:
                expected[row, token] = float("-inf")
    assert torch.equal(masked, expected)
    assert torch.isfinite(logits).all()  # the raw logits are left as they were


def _done(value):
    from concurrent.futures import Future
    future: Future = Future()
    future.set_result(value)
    return future
