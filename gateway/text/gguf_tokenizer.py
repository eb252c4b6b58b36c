"""The tokenizer of a GGUF file, built from its `tokenizer.ggml.*` metadata (read by the shared
`shardlm.gguf_header`, as the workers read the rest).

A GGUF carries no tokenizer.json: it stores the vocabulary, merges (or scores), token types and
special ids under llama.cpp's keys. They are rebuilt here as a `tokenizers` tokenizer the way
transformers converts them (byte-level BPE for "gpt2", sentencepiece-style BPE with byte fallback
for "llama"), so encoding and decoding match transformers loading the same file.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from shardlm.gguf_header import GGUFFormatError, SeveralGGUFFiles, find_gguf, read_gguf_header
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

from shardlm_server.gateway.text.tokenizer_parts import TokenizerError, TokenizerParts

CONTROL, USER_DEFINED = 3, 4  # llama.cpp token types

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Mistral's "tekken" (Mistral Nemo, Mistral Small 3, Ministral): GPT-4o's case-aware words
# without the contractions, and one digit at a time.
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# `tokenizer.ggml.pre` kinds whose split differs from GPT-2's byte-level default (which every
# other kind, e.g. "default", "gpt-2" or "smollm", gets, as in transformers' conversion).
PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "dbrx", "smaug-bpe"),
                    _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT),
    **dict.fromkeys(("gpt-4o", "llama4"), _GPT4O_SPLIT),
    "tekken": _TEKKEN_SPLIT,
}
TOKENIZER_KINDS = ("gpt2", "llama")
# Architectures whose sentencepiece files transformers converts Gemma's way (no prefix space).
GEMMA_STYLE = ("gemma", "gemma2", "gemma3")


def find_gguf_file(path: str | os.PathLike[str]) -> Path | None:
    """The GGUF file `path` names: itself, or the one `.gguf` in a folder without a config.json."""
    try:
        return find_gguf(path)
    except SeveralGGUFFiles as exc:
        raise TokenizerError(str(exc)) from exc


def _metadata(path: Path) -> dict[str, Any]:
    try:
        return read_gguf_header(path).metadata
    except (GGUFFormatError, OSError) as exc:
        raise TokenizerError(f"'{path.name}' is not a readable GGUF file (corrupt or truncated): "
                             f"{exc}") from exc


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable spelling of each byte (the byte-level BPE alphabet)."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    spelled = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in spelled:
            spelled[b] = chr(256 + extra)
            extra += 1
    return spelled


def _merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """A sentencepiece vocabulary's merges: every split of a token into two vocabulary tokens,
    best-scored token first (the order transformers' `generate_merges` gives)."""
    vocab = {token: index for index, token in enumerate(tokens)}
    merges = []
    for token, score in dict(zip(tokens, scores, strict=False)).items():
        pairs = [(token[:i], token[i:], score) for i in range(1, len(token))
                 if token[:i] in vocab and token[i:] in vocab]
        merges.extend(sorted(pairs, key=lambda p: (vocab[p[0]], vocab[p[1]])))
    merges.sort(key=lambda p: (p[2], len(p[0]), len(p[1])), reverse=True)
    return [(a, b) for a, b, _ in merges]


def _merges(meta: dict[str, Any], tokens: list[str]) -> list[tuple[str, str]]:
    merges = meta.get("tokenizer.ggml.merges")
    if merges is not None:
        return [tuple(m.split(" ")) for m in merges]
    scores = meta.get("tokenizer.ggml.scores")
    if scores is None:
        raise TokenizerError("the GGUF tokenizer has neither merges nor scores")
    return _merges_from_scores(tokens, list(scores))


def _byte_level(meta: dict[str, Any], tokens: list[str]) -> Backend:
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
             for i, t in enumerate(tokens)}
    backend = Backend(models.BPE(vocab=vocab, merges=_merges(meta, tokens), dropout=None,
                                 continuing_subword_prefix="", end_of_word_suffix="",
                                 fuse_unk=False, byte_fallback=False))
    split = PRE_TOKENIZER_SPLITS.get(meta.get("tokenizer.ggml.pre"))
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    return backend


def _sentencepiece(meta: dict[str, Any], tokens: list[str]) -> Backend:
    """Sentencepiece-style BPE with byte fallback. Llama's marks the start of the text with a
    space (Metaspace); Gemma's (GEMMA_STYLE) and Phi-3's differ, as transformers'
    conversion of their files does."""
    style = meta.get("general.architecture")
    if style in GEMMA_STYLE:
        # A run of spaces is stored as spaces, but looked up (after the normalizer) as "▁"s; the
        # file lists no merges, and its token order, not its scores, is the merge order.
        tokens = ["▁" * len(t) if " " in t and not t.strip() else t for t in tokens]
    merges = (_merges_from_scores(tokens, [-float(i) for i in range(len(tokens))])
              if style in GEMMA_STYLE and meta.get("tokenizer.ggml.merges") is None
              else _merges(meta, tokens))
    backend = Backend(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                                 dropout=None, fuse_unk=True, byte_fallback=True))
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if style in GEMMA_STYLE:  # no prefix space to add or to strip
        backend.normalizer = normalizers.Replace(" ", "▁")
        backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
        backend.decoder = decoders.Sequence(steps)
        return backend
    if style == "phi3":  # the prefix space comes from a normalizer, before every other space
        backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                                   normalizers.Replace(" ", "▁")])
    else:
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first",
                                                         split=False)
    backend.decoder = decoders.Sequence([*steps, decoders.Strip(" ", 1, 0)])
    return backend


def _token(tokens: list[str], meta: dict[str, Any], key: str) -> str | None:
    index = meta.get(f"tokenizer.ggml.{key}")
    return tokens[index] if isinstance(index, int) and 0 <= index < len(tokens) else None


def _add_special_tokens(backend: Backend, meta: dict[str, Any], tokens: list[str],
                        byte_level: bool) -> None:
    """Control tokens (and the named special ones) stay whole and are special; user-defined ones
    stay whole and are not. A control token outside the byte alphabet of a byte-level vocabulary
    is a converter mislabel and is left alone, as transformers does."""
    types = list(meta.get("tokenizer.ggml.token_type") or ())
    alphabet = set(_bytes_to_unicode().values()) if byte_level else None
    special = [t for t, kind in zip(tokens, types, strict=False)
               if kind == CONTROL and (alphabet is None or set(t) <= alphabet)]
    named = [_token(tokens, meta, k) for k in ("bos_token_id", "eos_token_id",
                                               "unknown_token_id", "padding_token_id")]
    special += [t for t in named if t is not None and t not in special]
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in special])
    user = [t for t, kind in zip(tokens, types, strict=False) if kind == USER_DEFINED]
    if user:
        backend.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])


def gguf_tokenizer_parts(path: str | os.PathLike[str]) -> TokenizerParts:
    """The serving tokenizer (and chat template) of the GGUF file at `path`, as parts."""
    path = Path(path)
    meta = _metadata(path)
    kind = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if kind not in TOKENIZER_KINDS:
        raise TokenizerError(f"GGUF tokenizer kind {kind!r} is not supported "
                             f"(supported: {', '.join(TOKENIZER_KINDS)})")
    if not tokens:
        raise TokenizerError("the GGUF file has no tokenizer.ggml.tokens")
    tokens = list(tokens)
    try:
        backend = _byte_level(meta, tokens) if kind == "gpt2" else _sentencepiece(meta, tokens)
        _add_special_tokens(backend, meta, tokens, byte_level=kind == "gpt2")
    except TokenizerError:
        raise
    except Exception as exc:  # the Rust side rejects inconsistent vocabularies / merges
        raise TokenizerError(f"the GGUF tokenizer of '{path.name}' is inconsistent: {exc}") from exc
    add_bos = meta.get("tokenizer.ggml.add_bos_token", kind == "llama")
    config = {"bos_token": _token(tokens, meta, "bos_token_id"),
              "eos_token": _token(tokens, meta, "eos_token_id"),
              "add_bos_token": bool(add_bos),
              "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False))}
    end_ids = [meta.get(f"tokenizer.ggml.{k}") for k in ("eos_token_id", "eot_token_id")]
    template = meta.get("tokenizer.chat_template")
    return TokenizerParts(backend, tokenizer_config=config, special_tokens_map={},
                          generation_config={}, model_config={"eos_token_id": [
                              i for i in end_ids if isinstance(i, int)]},
                          chat_template=template if isinstance(template, str) else None,
                          byte_fallback=kind == "llama")
