"""A checkpoint's tokenizer: tokenizer.json through the `tokenizers` library, plus the bits of
tokenizer_config.json, generation_config.json and config.json that serving needs (BOS/EOS policy,
stop ids, the jinja2 chat template). A GGUF checkpoint's comes from its metadata
(`gateway.text.gguf_tokenizer`); both arrive as `TokenizerParts`."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

from shardlm_server.gateway.text.gguf_tokenizer import find_gguf_file, gguf_tokenizer_parts
from shardlm_server.gateway.text.token_bytes import TokenBytes
from shardlm_server.gateway.text.tokenizer_parts import TokenizerError, TokenizerParts

ALLOWED_ROLES = frozenset({"system", "user", "assistant", "tool"})


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


def _read_json(path: Path) -> dict[str, Any]:
    """The JSON object in `path`, or {} when the file is absent (all these files are optional)."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TokenizerError(f"cannot read {path.name}: {exc}") from exc
    if not isinstance(data, dict):
        raise TokenizerError(f"{path.name} must hold a JSON object")
    return data


def _token_text(value: Any) -> str | None:
    """Special tokens are stored either as plain strings or as AddedToken dicts with "content"."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _int_list(value: Any) -> list[int]:
    if isinstance(value, bool):  # bool is an int subclass; never a token id
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _pick_template(value: Any) -> str | None:
    """tokenizer_config's chat_template: a string, or a list of {name, template} (use "default")."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
        chosen = named.get("default", next(iter(named.values()), None))
        return chosen if isinstance(chosen, str) else None
    return None


def _raise_exception(message: str) -> None:
    raise TokenizerError(str(message))


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    # Unlike jinja2's own tojson, HF's keeps non-ASCII text and does not HTML-escape.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)


def _template_env() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _uses_byte_fallback(decoder: Any) -> bool:
    return "ByteFallback" in json.dumps(decoder)


def _hf_folder_parts(root: Path) -> TokenizerParts:
    """The tokenizer files of a Hugging Face folder, parsed."""
    path = root / "tokenizer.json"
    if not path.is_file():
        raise TokenizerError(f"no tokenizer.json in {root}")
    try:
        text = path.read_text(encoding="utf-8")
        spec = json.loads(text)
        backend = tokenizers.Tokenizer.from_str(text)
    except Exception as exc:  # the Rust side raises plain Exception subclasses
        raise TokenizerError(f"cannot load {path}: {exc}") from exc
    tok_config = _read_json(root / "tokenizer_config.json")
    template = _pick_template(tok_config.get("chat_template"))
    if template is None:  # newer transformers save the template beside the config
        template = _pick_template(_read_json(root / "chat_template.json").get("chat_template"))
    jinja_file = root / "chat_template.jinja"
    if template is None and jinja_file.is_file():
        template = jinja_file.read_text(encoding="utf-8")
    return TokenizerParts(backend, tokenizer_config=tok_config,
                          special_tokens_map=_read_json(root / "special_tokens_map.json"),
                          generation_config=_read_json(root / "generation_config.json"),
                          model_config=_read_json(root / "config.json"), chat_template=template,
                          byte_fallback=_uses_byte_fallback(spec.get("decoder")))


class Tokenizer:
    """Use `Tokenizer.from_pretrained(folder)`; the constructor takes already-parsed parts."""

    def __init__(self, parts: TokenizerParts) -> None:
        self._backend = backend = parts.backend
        # tokenizer.json may carry truncation/padding settings; HF turns them off per call.
        backend.no_truncation()
        backend.no_padding()
        self._bos_text = _token_text(parts.tokenizer_config.get("bos_token")) or _token_text(
            parts.special_tokens_map.get("bos_token"))
        eos_text = _token_text(parts.tokenizer_config.get("eos_token")) or _token_text(
            parts.special_tokens_map.get("eos_token"))
        self._bos_id = self._lookup(self._bos_text)
        if self._bos_id is None:
            ids = _int_list(parts.generation_config.get("bos_token_id")) or _int_list(
                parts.model_config.get("bos_token_id"))
            self._bos_id = ids[0] if ids else None
        eos_from_text = self._lookup(eos_text)
        candidates = (_int_list(parts.generation_config.get("eos_token_id"))
                      + _int_list(parts.model_config.get("eos_token_id"))
                      + ([eos_from_text] if eos_from_text is not None else []))
        self._eos_ids = tuple(dict.fromkeys(candidates))  # ordered de-duplication
        self._eos_text = eos_text or (self.id_to_token(self._eos_ids[0]) if self._eos_ids else None)
        self._eos_append_id = eos_from_text if eos_from_text is not None else (
            self._eos_ids[0] if self._eos_ids else None)
        add_bos = parts.tokenizer_config.get("add_bos_token")
        add_eos = parts.tokenizer_config.get("add_eos_token")
        self._add_bos = add_bos if isinstance(add_bos, bool) else None
        self._add_eos = add_eos if isinstance(add_eos, bool) else None
        special = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
        special.update(self._eos_ids)
        if self._bos_id is not None:
            special.add(self._bos_id)
        self._special_ids = frozenset(special)
        byte_ids = ((backend.token_to_id(f"<0x{b:02X}>") for b in range(256))
                    if parts.byte_fallback else ())
        self._byte_ids = frozenset(i for i in byte_ids if i is not None)
        self._template = None
        self._template_source = parts.chat_template
        if parts.chat_template is not None:
            try:
                self._template = _template_env().from_string(parts.chat_template)
            except jinja2.TemplateError as exc:
                raise TokenizerError(f"the checkpoint's chat template does not compile: {exc}") from exc

    @classmethod
    def from_pretrained(cls, folder: str | os.PathLike[str]) -> Tokenizer:
        """The tokenizer of a Hugging Face folder, or of a GGUF file (or a folder holding one)."""
        gguf_file = find_gguf_file(folder)
        if gguf_file is not None:
            return cls(gguf_tokenizer_parts(gguf_file))
        return cls(_hf_folder_parts(Path(folder)))

    def hf_files(self) -> dict[str, str]:
        """This tokenizer as a Hugging Face folder's files (tokenizer.json, and
        tokenizer_config.json with the special tokens, BOS/EOS flags and chat template), for a
        router that rebuilds it elsewhere; a GGUF checkpoint's included."""
        bos = self._bos_text or (self.id_to_token(self._bos_id) if self._bos_id is not None
                                 else None)
        config = {"bos_token": bos, "eos_token": self._eos_text, "add_bos_token": self._add_bos,
                  "add_eos_token": self._add_eos, "chat_template": self._template_source}
        config = {key: value for key, value in config.items() if value is not None}
        return {"tokenizer.json": self.backend_json(),
                "tokenizer_config.json": json.dumps(config, ensure_ascii=False, indent=2)}

    def backend_json(self) -> str:
        """The tokenizer as Hugging Face `tokenizers` JSON (tokenizer.json's content): what
        llguidance builds its token table from, in the gateway and on the sampling worker."""
        return self._backend.to_str()

    def _lookup(self, text: str | None) -> int | None:
        return self._backend.token_to_id(text) if text else None

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos_ids

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_id

    @property
    def special_token_ids(self) -> frozenset[int]:
        return self._special_ids

    @property
    def byte_fallback_ids(self) -> frozenset[int]:
        """Ids of `<0xNN>` byte tokens when the decoder fuses them (sentencepiece byte fallback)."""
        return self._byte_ids

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TokenizerError("text to encode must be a string")
        # encode_batch releases the GIL (encode does not): a long prompt tokenized in a worker
        # thread then does not stall the gateway's event loop.
        encoding = self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0]
        ids = list(encoding.ids)
        if not add_special_tokens:
            return ids
        bos = self._bos_id
        if bos is not None and self._add_bos is True and (not ids or ids[0] != bos):
            ids.insert(0, bos)  # sentencepiece-Llama: BOS comes from the config flag
        elif (bos is not None and self._add_bos is False and ids and ids[0] == bos
              and encoding.special_tokens_mask[0]):
            ids.pop(0)  # the post-processor added a BOS the config asks us not to add
        eos = self._eos_append_id
        if eos is not None and self._add_eos is True and (not ids or ids[-1] != eos):
            ids.append(eos)
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        try:
            return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        except (OverflowError, TypeError) as exc:
            raise TokenizerError(f"invalid token id: {exc}") from exc

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary string of `token_id`, or None for an id outside the vocabulary."""
        try:
            return self._backend.id_to_token(token_id) if token_id >= 0 else None
        except OverflowError:
            return None

    def token_strings(self, ids: Iterable[int]) -> list[str]:
        """Vocabulary strings of `ids` ("" for ids outside the vocabulary)."""
        return [self.id_to_token(i) or "" for i in ids]

    def token_bytes(self, ids: Iterable[int]) -> list[bytes]:
        """The bytes each of `ids` stands for in decoded text (see gateway.token_bytes)."""
        return self._token_bytes.of(ids)

    @cached_property
    def _token_bytes(self) -> TokenBytes:
        return TokenBytes(self._backend)

    def apply_chat_template(self, messages: Sequence[ChatMessage | Mapping[str, Any]],
                            add_generation_prompt: bool = True) -> str:
        """Render `messages` with the checkpoint's template. Without one, the plain fallback is
        one "<role>: <content>" line per message, then "assistant:" if a reply is requested."""
        checked = [_check_message(m) for m in messages]
        if self._template is None:
            lines = "".join(f"{m['role']}: {m['content']}\n" for m in checked)
            return lines + ("assistant:" if add_generation_prompt else "")
        try:
            return self._template.render(
                messages=checked, bos_token=self._bos_text or "", eos_token=self._eos_text or "",
                add_generation_prompt=add_generation_prompt,
            )
        except jinja2.TemplateError as exc:
            raise TokenizerError(f"chat template failed: {exc}") from exc

    def encode_chat(self, messages: Sequence[ChatMessage | Mapping[str, Any]],
                    add_generation_prompt: bool = True) -> list[int]:
        """Prompt ids for a chat. A template writes its own special tokens (BOS included), so,
        as in HF, its text is encoded without adding any; the plain fallback gets them added."""
        text = self.apply_chat_template(messages, add_generation_prompt)
        return self.encode(text, add_special_tokens=not self.has_chat_template)


def _check_message(message: ChatMessage | Mapping[str, Any]) -> dict[str, str]:
    if isinstance(message, ChatMessage):
        role, content = message.role, message.content
    elif isinstance(message, Mapping):
        role, content = message.get("role"), message.get("content")
    else:
        raise TokenizerError("each chat message needs a role and a content")
    if role not in ALLOWED_ROLES:
        allowed = ", ".join(sorted(ALLOWED_ROLES))
        raise TokenizerError(f"unknown chat role {role!r}; allowed roles: {allowed}")
    if not isinstance(content, str):
        raise TokenizerError(f"content of a {role!r} message must be a string")
    return {"role": role, "content": content}
