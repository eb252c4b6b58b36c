"""Phi-3-family GGUF files' tokenizers with their chat templates: Phi-3's sentencepiece vocabulary
("llama", whose prefix space transformers' conversion takes from a normalizer for phi3, so it
also lands after every special token of a rendered chat) and Phi-4-mini's byte-level one ("gpt2",
gpt-4o split). The gateway's tokenizer renders and encodes a conversation as transformers does
for the same file."""

from __future__ import annotations

import gguf
import pytest

from shardlm_server.gateway.text.tokenizer import Tokenizer
from tests.gateway.text.test_gguf_tokenizer import (
    _assert_same,
    _close,
    _model_keys,
    _reference,
    sentencepiece_vocab,
)
from tests.gguf_files import CHAT_TEMPLATE, byte_level_vocab

# Phi-3-mini-instruct's template, as its GGUF files carry it.
PHI3_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'system' %}"
    "{{'<|system|>\n' + message['content'] + '<|end|>\n'}}{% elif message['role'] == 'user' %}"
    "{{'<|user|>\n' + message['content'] + '<|end|>\n'}}{% elif message['role'] == 'assistant' %}"
    "{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}")
PHI3_CONTROL = ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
MESSAGES = [{"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": " What is  the capital of France?"},
            {"role": "assistant", "content": "Paris."},
            {"role": "user", "content": "你好 🙂"}]


def write_phi3(path, kind: str) -> None:
    writer = gguf.GGUFWriter(str(path), "phi3")
    _model_keys(writer)
    if kind == "llama":  # Phi-3: sentencepiece, its chat markers as control tokens, EOS <|end|>
        tokens, scores, types = sentencepiece_vocab()
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens + PHI3_CONTROL)
        writer.add_token_scores(scores + [0.0] * len(PHI3_CONTROL))
        writer.add_token_types(types + [3] * len(PHI3_CONTROL))
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(len(tokens) + 3)
        writer.add_unk_token_id(0)
        writer.add_add_bos_token(False)
        writer.add_chat_template(PHI3_TEMPLATE)
    else:  # Phi-4-mini: byte-level BPE with the gpt-4o split
        tokens, merges, types = byte_level_vocab()
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("gpt-4o")
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_merges(merges)
        writer.add_bos_token_id(0)
        writer.add_eos_token_id(2)
        writer.add_chat_template(CHAT_TEMPLATE)
    _close(writer)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_a_phi3_file_encodes_text_and_chats_as_transformers(tmp_path, kind):
    path = tmp_path / "m.gguf"
    write_phi3(path, kind)
    ours, reference = Tokenizer.from_pretrained(path), _reference(path)
    _assert_same(ours, reference)
    assert ours.has_chat_template
    for prompt in (True, False):
        expected = reference.apply_chat_template(MESSAGES, add_generation_prompt=prompt,
                                                 tokenize=True)
        expected = expected["input_ids"] if not isinstance(expected, list) else expected
        assert ours.encode_chat(MESSAGES, add_generation_prompt=prompt) == expected, prompt
