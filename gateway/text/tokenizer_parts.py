"""What a serving tokenizer is built from, whichever format the checkpoint has: the `tokenizers`
backend and the bits of configuration serving reads (`TokenizerParts`), and the error every
tokenizer failure raises. The GGUF reader (gguf_tokenizer.py) produces the parts and the
tokenizer (tokenizer.py) consumes them, so neither imports the other's module to meet."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import tokenizers


class TokenizerError(Exception):
    """Tokenizer or chat-template failure; the message is safe to show to API users."""


@dataclass(frozen=True)
class TokenizerParts:
    """A checkpoint's tokenizer as parsed: the backend, and tokenizer_config.json,
    special_tokens_map.json, generation_config.json and config.json as Hugging Face spells them
    (a GGUF file's metadata rewritten so), its chat template, and whether the vocabulary decodes
    `<0xNN>` byte tokens (sentencepiece's byte fallback)."""

    backend: tokenizers.Tokenizer
    tokenizer_config: Mapping[str, Any]
    special_tokens_map: Mapping[str, Any]
    generation_config: Mapping[str, Any]
    model_config: Mapping[str, Any]
    chat_template: str | None
    byte_fallback: bool = False
