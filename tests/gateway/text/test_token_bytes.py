"""TokenizeResponse.token_bytes: each token's bytes with the tokenizer's internal mapping undone,
for byte-level BPE (glyphs such as "Ġ", "Ã") and for sentencepiece ("▁", "<0xNN>")."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers

from shardlm_server.gateway.text.token_bytes import TokenBytes, byte_level_alphabet
from shardlm_server.gateway.text.tokenizer import Tokenizer

TINY_MODEL = Path(__file__).resolve().parents[3] / "models" / "shakespeare-tiny"
TEXT = "héllo wörld ✓"


def test_byte_level_alphabet_covers_every_byte_once():
    alphabet = byte_level_alphabet()
    assert sorted(alphabet.values()) == list(range(256))
    assert alphabet["Ġ"] == ord(" ") and alphabet["a"] == ord("a")


def test_byte_level_bpe_tokens_read_as_their_bytes():
    tokenizer = Tokenizer.from_pretrained(TINY_MODEL)
    ids = tokenizer.encode(TEXT)
    pieces, raw = tokenizer.token_strings(ids), tokenizer.token_bytes(ids)
    assert len(raw) == len(ids)
    assert "Ã" in pieces and b"\xc3" in raw  # the glyph of byte 0xC3 comes back as that byte
    assert raw[0] == b"<s>"  # a special token gives its text
    assert b"".join(raw[1:]).decode() == TEXT == tokenizer.decode(ids)


def _sentencepiece_backend() -> Backend:
    pieces = ["<unk>", "<s>", "▁", "h", "e", "l", "o", "▁hello"]
    vocab = {p: i for i, p in enumerate(pieces)}
    vocab.update({f"<0x{b:02X}>": len(pieces) + b for b in range(256)})
    backend = Backend(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return backend


@pytest.mark.parametrize(("piece", "expected"), [("▁hello", b" hello"), ("<0xC3>", b"\xc3"),
                                                 ("l", b"l")])
def test_sentencepiece_pieces_read_as_their_bytes(piece, expected):
    backend = _sentencepiece_backend()
    assert TokenBytes(backend).of([backend.token_to_id(piece)]) == [expected]


def test_sentencepiece_text_survives_the_round_trip():
    backend = _sentencepiece_backend()
    ids = backend.encode("hello é").ids
    assert b"".join(TokenBytes(backend).of(ids)).decode() == " hello é"
