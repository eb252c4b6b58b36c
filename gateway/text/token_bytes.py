"""The bytes each token stands for in decoded text (TokenizeResponse.token_bytes).

A vocabulary string is the tokenizer's internal form, not text: byte-level BPE maps every byte to
a printable glyph ("Ġ" is a space, "Ã©" is the two bytes of "é"), sentencepiece writes a space as
"▁" and a byte-fallback token as "<0xNN>". This module undoes those mappings per token, so a
client can read what each token contributes. A UTF-8 character spread over several tokens stays
spread over their byte strings; their concatenation is the decoded text.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from functools import cache

import tokenizers

SENTENCEPIECE_SPACE = "▁"


@cache
def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-to-glyph table, inverted: glyph -> byte. Printable Latin-1 bytes stand for
    themselves; the other 68 bytes take the code points from 256 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    glyphs = {b: b for b in printable}
    extra = 0
    for b in range(256):
        if b not in glyphs:
            glyphs[b] = 256 + extra
            extra += 1
    return {chr(glyph): b for b, glyph in glyphs.items()}


def _decoder_types(spec: object) -> set[str]:
    """Every decoder type named in a (possibly nested Sequence) decoder spec."""
    if isinstance(spec, dict):
        found = {spec["type"]} if isinstance(spec.get("type"), str) else set()
        for value in spec.values():
            found |= _decoder_types(value)
        return found
    if isinstance(spec, list):
        return set().union(*(_decoder_types(item) for item in spec)) if spec else set()
    return set()


class TokenBytes:
    """Per-token bytes for one tokenizer; build once per loaded model."""

    def __init__(self, backend: tokenizers.Tokenizer) -> None:
        self._backend = backend
        decoder = backend.decoder
        spec = json.loads(decoder.__getstate__()) if decoder is not None else None
        kinds = _decoder_types(spec)
        self._byte_level = "ByteLevel" in kinds
        self._byte_fallback = "ByteFallback" in kinds
        self._metaspace = bool(kinds & {"Metaspace", "Replace"})
        self._added = {i: t.content for i, t in backend.get_added_tokens_decoder().items()}

    def of(self, ids: Iterable[int]) -> list[bytes]:
        return [self._one(i) for i in ids]

    def _one(self, token_id: int) -> bytes:
        if token_id in self._added:
            return self._added[token_id].encode()
        piece = self._backend.id_to_token(token_id) if token_id >= 0 else None
        if piece is None:
            return b""
        if self._byte_level:
            alphabet = byte_level_alphabet()
            return b"".join(bytes([alphabet[c]]) if c in alphabet else c.encode() for c in piece)
        if (self._byte_fallback and len(piece) == 6 and piece.startswith("<0x")
                and piece.endswith(">")):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        if self._metaspace:
            return piece.replace(SENTENCEPIECE_SPACE, " ").encode()
        return self._backend.decode([token_id], skip_special_tokens=False).encode()
