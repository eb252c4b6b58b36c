"""Tokenizer.hf_files: a tokenizer written out as a Hugging Face folder's files (what the SMG
engine service's GetTokenizer sends) is the same tokenizer, a GGUF checkpoint's included."""

from __future__ import annotations

import pytest

from shardlm_server.gateway.serve.default_model import DefaultModelMissing, default_model_path
from shardlm_server.gateway.text.tokenizer import Tokenizer

TEXTS = ["What is the capital of France?", "  spaces, café 🙂 and 你好\n", "<|im_start|>x"]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]


def _round_trip(original: Tokenizer, folder) -> Tokenizer:
    folder.mkdir()
    for name, text in original.hf_files().items():
        (folder / name).write_text(text, encoding="utf-8")
    return Tokenizer.from_pretrained(folder)


def _assert_same(original: Tokenizer, rebuilt: Tokenizer) -> None:
    for text in TEXTS:
        for special in (True, False):
            ids = original.encode(text, add_special_tokens=special)
            assert rebuilt.encode(text, add_special_tokens=special) == ids
            assert rebuilt.decode(ids) == original.decode(ids)
    assert rebuilt.eos_token_ids[:1] == original.eos_token_ids[:1]
    assert rebuilt.bos_token_id == original.bos_token_id
    assert rebuilt.has_chat_template == original.has_chat_template
    if original.has_chat_template:
        assert rebuilt.encode_chat(CHAT) == original.encode_chat(CHAT)


def test_hugging_face_folder_round_trips(llama_dir, tmp_path):
    original = Tokenizer.from_pretrained(llama_dir)
    _assert_same(original, _round_trip(original, tmp_path / "exported"))


def test_gguf_tokenizer_round_trips(tmp_path):
    try:
        model = default_model_path()
    except DefaultModelMissing as exc:
        pytest.skip(str(exc))
    original = Tokenizer.from_pretrained(model)
    assert original.has_chat_template
    _assert_same(original, _round_trip(original, tmp_path / "exported"))
