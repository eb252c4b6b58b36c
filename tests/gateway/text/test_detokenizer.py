from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, normalizers

from shardlm_server.gateway.text.detokenizer import IncrementalDetokenizer
from shardlm_server.gateway.text.tokenizer import Tokenizer
from tests.checkpoints import write_tokenizer

SENTENCE = "Hello 世界! 你好，天气很好。🙂🚀 café naïve 👩‍👩‍👧"
ALPHABET = "ab ,.\n你好世界天气é🙂🚀👩‍"


def byte_fallback_dir(folder: Path, strip_leading_space: bool = False) -> Path:
    """A sentencepiece-Llama-like tokenizer built by hand: "▁" for spaces, a few merges, and
    <0xNN> tokens for every character outside the small vocabulary (emoji, most Chinese)."""
    folder.mkdir(parents=True, exist_ok=True)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    pieces = list("▁abcdefghijklmnopqrstuvwxyzHW!,.你好")
    merges = [("▁", "h"), ("▁h", "e"), ("l", "l"), ("▁he", "ll"), ("▁hell", "o"), ("▁", "w"),
              ("▁w", "o"), ("r", "l"), ("▁wo", "rl"), ("▁worl", "d"), ("你", "好")]
    pieces += ["".join(pair) for pair in merges]
    for piece in pieces:
        vocab.setdefault(piece, len(vocab))
    backend = BackendTokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    backend.add_special_tokens(["<unk>", "<s>", "</s>"])
    backend.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if strip_leading_space:  # what Llama-2's tokenizer.json does
        steps.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(steps)
    backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True}))
    return folder


@pytest.fixture(scope="module")
def byte_level(tmp_path_factory) -> Tokenizer:
    folder = tmp_path_factory.mktemp("byte_level")
    write_tokenizer(folder, 300)
    return Tokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def byte_fallback(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_pretrained(byte_fallback_dir(tmp_path_factory.mktemp("byte_fallback")))


@pytest.fixture(scope="module", params=["byte_level", "byte_fallback"])
def any_tokenizer(request) -> Tokenizer:
    return request.getfixturevalue(request.param)


def stream(tok: Tokenizer, prompt: list[int], ids: list[int], skip: bool = True) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    return [detok.push(i) for i in ids] + [detok.flush()]


def test_sentence_streams_whole_characters(any_tokenizer):
    tok = any_tokenizer
    prompt = tok.encode("A question: ")
    ids = tok.encode(SENTENCE, add_special_tokens=False)
    expected = tok.decode(ids)
    assert expected.lstrip(" ") == SENTENCE  # sentencepiece-style: "▁Hello" decodes as " Hello"
    deltas = stream(tok, prompt, ids)
    assert "".join(deltas) == expected
    assert not any("\ufffd" in d for d in deltas)
    assert "" in deltas[:-1]  # some characters took several tokens and were held back
    # A run of <0xNN> tokens is final only once a non-byte token ends it: the closing emoji
    # sequence (all bytes, joiners included) comes out of flush. Byte-level text is final as
    # soon as a character is whole.
    assert deltas[-1] == ("👩\u200d👩\u200d👧" if tok.byte_fallback_ids else "")


def test_byte_fallback_tokens_in_use(byte_fallback):
    ids = byte_fallback.encode("🙂", add_special_tokens=False)
    assert [byte_fallback.id_to_token(i) for i in ids][-4:] == ["<0xF0>", "<0x9F>", "<0x99>",
                                                                 "<0x82>"]
    assert set(ids[-4:]) <= byte_fallback.byte_fallback_ids
    assert len(byte_fallback.byte_fallback_ids) == 256


def test_first_token_keeps_its_leading_space(tmp_path):
    tok = Tokenizer.from_pretrained(byte_fallback_dir(tmp_path, strip_leading_space=True))
    prompt = tok.encode("hello")
    world = tok.encode(" world", add_special_tokens=False)[1:]  # drop the lone "▁" piece
    assert tok.id_to_token(world[0]) == "▁world"
    assert tok.decode(world) == "world"  # decoded alone, Strip eats the space
    assert "".join(stream(tok, prompt, world)) == " world"
    assert "".join(stream(tok, [], world)) == "world"


def test_decode_window_stays_small(byte_level):
    calls: list[int] = []
    real_decode = byte_level.decode

    class Spy:
        def __getattr__(self, name):
            return getattr(byte_level, name)

        def decode(self, ids, skip_special_tokens=True):
            calls.append(len(ids))
            return real_decode(ids, skip_special_tokens)

    ids = byte_level.encode(SENTENCE * 20, add_special_tokens=False)
    assert "".join(stream(Spy(), [1], ids)) == SENTENCE * 20
    assert len(ids) > 300 and max(calls) <= 12


@settings(max_examples=150, deadline=None)
@given(text=st.text(ALPHABET, max_size=40), prompt=st.text(ALPHABET, max_size=10))
def test_encoded_text_roundtrips(byte_level, byte_fallback, text, prompt):
    for tok in (byte_level, byte_fallback):
        ids = tok.encode(text, add_special_tokens=False)
        deltas = stream(tok, tok.encode(prompt), ids)
        assert "".join(deltas) == tok.decode(ids)
        assert not any("\ufffd" in d for d in deltas)


@settings(max_examples=300, deadline=None)
@given(data=st.data(), skip=st.booleans())
def test_random_ids_join_to_decode(byte_level, byte_fallback, data, skip):
    # Random ids include special tokens, lone UTF-8 continuation bytes and truncated
    # characters: whatever they decode to (U+FFFD included) the stream must reproduce.
    for tok in (byte_level, byte_fallback):
        id_lists = st.lists(st.integers(0, tok.vocab_size - 1), max_size=30)
        prompt, ids = data.draw(id_lists), data.draw(id_lists)
        deltas = stream(tok, prompt, ids, skip)
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)
