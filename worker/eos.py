"""The model's end-of-sequence ids, gathered once from the checkpoint at load.

Checkpoints spread them over several files: config.json's eos_token_id, generation_config.json's
(chat models often list their end-of-turn ids there) and the tokenizer's eos_token (a text,
looked up in tokenizer.json). The union, in that order, is reported in ModelInfo.eos_token_ids;
it is the only EOS set anyone uses. The engine itself never stops on it: the gateway sends each
sequence's complete stop-id set.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def checkpoint_eos_ids(model_dir: Path, config_eos: tuple[int, ...]) -> tuple[int, ...]:
    """The EOS ids of the checkpoint in `model_dir`, given config.json's (already parsed)."""
    generation = _int_list(_read_json(model_dir / "generation_config.json").get("eos_token_id"))
    from_tokenizer = _tokenizer_eos_id(model_dir)
    ids = [*config_eos, *generation, *([from_tokenizer] if from_tokenizer is not None else [])]
    return tuple(dict.fromkeys(ids))  # ordered de-duplication


def _tokenizer_eos_id(model_dir: Path) -> int | None:
    """The id of the tokenizer's eos_token (tokenizer_config.json, else special_tokens_map.json)."""
    text = (_token_text(_read_json(model_dir / "tokenizer_config.json").get("eos_token"))
            or _token_text(_read_json(model_dir / "special_tokens_map.json").get("eos_token")))
    if text is None:
        return None
    spec = _read_json(model_dir / "tokenizer.json")
    for added in spec.get("added_tokens") or []:
        if isinstance(added, dict) and added.get("content") == text and _is_id(added.get("id")):
            return added["id"]
    model = spec.get("model")
    vocab = model.get("vocab") if isinstance(model, dict) else None
    if isinstance(vocab, dict) and _is_id(vocab.get(text)):
        return vocab[text]
    return None


def _read_json(path: Path) -> dict[str, Any]:
    """The JSON object in `path`; {} when it is absent or unreadable (all of these are optional,
    and the tokenizer files are the gateway's to validate)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _token_text(value: Any) -> str | None:
    """Special tokens are stored either as plain strings or as AddedToken dicts with "content"."""
    if isinstance(value, str):
        return value or None
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"] or None
    return None


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _int_list(value: Any) -> list[int]:
    if _is_id(value):
        return [value]
    if isinstance(value, list):
        return [v for v in value if _is_id(v)]
    return []
