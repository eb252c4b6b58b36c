from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import processors

from shardlm_server.gateway.text.tokenizer import ChatMessage, Tokenizer, TokenizerError
from tests.checkpoints import write_tokenizer

LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)

CHATML_TEMPLATE = """{% for message in messages %}
{% if loop.first and message['role'] != 'system' %}
<|im_start|>system
You are a helpful assistant.<|im_end|>
{% endif %}
<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}
"""

LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                   "<|end_header_id|>", "<|eot_id|>"]


def write_json(path: Path, data) -> None:
    path.write_text(json.dumps(data), encoding="utf-8")


@pytest.fixture(scope="module")
def plain_dir(tmp_path_factory) -> Path:
    """write_tokenizer's folder: sentencepiece-Llama style, BOS via add_bos_token, no template."""
    folder = tmp_path_factory.mktemp("plain")
    write_tokenizer(folder, 300)
    return folder


def llama3_dir(folder: Path, template: str = LLAMA3_TEMPLATE, **config) -> Path:
    """A Llama-3-style folder: BOS added by the post-processor, no add_bos_token flag."""
    folder.mkdir(parents=True, exist_ok=True)
    write_tokenizer(folder, 300)
    backend = BackendTokenizer.from_file(str(folder / "tokenizer.json"))
    backend.add_special_tokens(LLAMA3_SPECIALS)
    bos = backend.token_to_id("<|begin_of_text|>")
    backend.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A $B",
        special_tokens=[("<|begin_of_text|>", bos)])
    backend.save(str(folder / "tokenizer.json"))
    write_json(folder / "tokenizer_config.json", {
        "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
        "chat_template": template, **config})
    write_json(folder / "generation_config.json",
               {"eos_token_id": [backend.token_to_id("<|end_of_text|>"), 2]})
    return folder


def chatml_dir(folder: Path) -> Path:
    """A Qwen2-style folder: no BOS at all, ChatML template given in the list form."""
    folder.mkdir(parents=True, exist_ok=True)
    write_tokenizer(folder, 300)
    backend = BackendTokenizer.from_file(str(folder / "tokenizer.json"))
    backend.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    backend.save(str(folder / "tokenizer.json"))
    write_json(folder / "tokenizer_config.json", {
        "bos_token": None, "eos_token": "<|im_end|>", "add_bos_token": False,
        "chat_template": [{"name": "tool_use", "template": "unused"},
                          {"name": "default", "template": CHATML_TEMPLATE}]})
    return folder


def test_missing_and_unreadable_tokenizer(tmp_path):
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        Tokenizer.from_pretrained(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(TokenizerError, match="cannot load"):
        Tokenizer.from_pretrained(tmp_path)


def test_basic_properties(plain_dir):
    tok = Tokenizer.from_pretrained(plain_dir)
    assert tok.vocab_size == 300
    assert tok.bos_token_id == 1
    assert tok.eos_token_ids == (2,)
    assert {0, 1, 2} <= tok.special_token_ids
    assert tok.byte_fallback_ids == frozenset()
    assert not tok.has_chat_template
    ids = tok.encode("你好，世界 🙂", add_special_tokens=False)
    assert tok.decode(ids) == "你好，世界 🙂"
    assert tok.token_strings([1, 10**9]) == ["<s>", ""]
    assert tok.id_to_token(2) == "</s>" and tok.id_to_token(-1) is None
    with pytest.raises(TokenizerError):
        tok.decode([-5])


def test_eos_ids_union_in_order(tmp_path):
    write_tokenizer(tmp_path, 300)
    write_json(tmp_path / "generation_config.json", {"eos_token_id": [7, 2]})
    write_json(tmp_path / "config.json", {"eos_token_id": 9, "bos_token_id": 1})
    assert Tokenizer.from_pretrained(tmp_path).eos_token_ids == (7, 2, 9)
    write_json(tmp_path / "generation_config.json", {"eos_token_id": 5})
    # AddedToken-object form of the special tokens, as older transformers saved them
    write_json(tmp_path / "tokenizer_config.json", {
        "bos_token": {"__type": "AddedToken", "content": "<s>"},
        "eos_token": {"__type": "AddedToken", "content": "</s>"}})
    assert Tokenizer.from_pretrained(tmp_path).eos_token_ids == (5, 9, 2)


def test_bos_from_config_flag_not_doubled(plain_dir):
    tok = Tokenizer.from_pretrained(plain_dir)
    assert tok.encode("hello")[0] == 1
    assert tok.encode("hello")[1] != 1
    assert tok.encode("<s>hello") == tok.encode("hello")
    assert 1 not in tok.encode("hello", add_special_tokens=False)


def test_bos_from_post_processor_not_doubled(tmp_path):
    tok = Tokenizer.from_pretrained(llama3_dir(tmp_path))
    bos = tok.bos_token_id
    ids = tok.encode("hello")
    assert ids[0] == bos and ids.count(bos) == 1
    chat = tok.encode_chat([ChatMessage("user", "hi")])
    assert chat[0] == bos and chat.count(bos) == 1
    # add_bos_token both ways on top of a BOS-adding post-processor
    write_json(tmp_path / "tokenizer_config.json",
               {"bos_token": "<|begin_of_text|>", "add_bos_token": True})
    assert Tokenizer.from_pretrained(tmp_path).encode("hello").count(bos) == 1
    write_json(tmp_path / "tokenizer_config.json",
               {"bos_token": "<|begin_of_text|>", "add_bos_token": False})
    assert bos not in Tokenizer.from_pretrained(tmp_path).encode("hello")


def test_llama3_template(tmp_path):
    tok = Tokenizer.from_pretrained(llama3_dir(tmp_path))
    assert tok.has_chat_template
    backend = BackendTokenizer.from_file(str(tmp_path / "tokenizer.json"))
    end_of_text, eot = backend.token_to_id("<|end_of_text|>"), backend.token_to_id("<|eot_id|>")
    assert tok.eos_token_ids == (end_of_text, 2, eot)  # generation_config first, then the config
    messages = [ChatMessage("system", "Be brief."), {"role": "user", "content": " 你好 "}]
    text = tok.apply_chat_template(messages)
    assert text == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\n你好<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert not tok.apply_chat_template(messages, add_generation_prompt=False).endswith("\n\n")


def test_chatml_template(tmp_path):
    tok = Tokenizer.from_pretrained(chatml_dir(tmp_path))
    assert tok.bos_token_id is None
    text = tok.apply_chat_template([ChatMessage("user", "hi")])
    assert text == ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
                    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    ids = tok.encode_chat([ChatMessage("user", "hi")])
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_templates_match_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    messages = [{"role": "system", "content": "Sé breve."}, {"role": "user", "content": "你好 🙂"},
                {"role": "assistant", "content": "Hi"}, {"role": "user", "content": "again"}]
    for folder in (llama3_dir(tmp_path / "l3"), chatml_dir(tmp_path / "qw")):
        ours = Tokenizer.from_pretrained(folder)
        ref = transformers.PreTrainedTokenizerFast.from_pretrained(folder)
        ref_text = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert ours.apply_chat_template(messages) == ref_text
        assert ours.encode_chat(messages) == ref(ref_text, add_special_tokens=False)["input_ids"]


@pytest.fixture
def make_templated(tmp_path):
    def make(template: str) -> Tokenizer:
        write_tokenizer(tmp_path, 300)
        write_json(tmp_path / "tokenizer_config.json",
                   {"bos_token": "<s>", "eos_token": "</s>", "chat_template": template})
        return Tokenizer.from_pretrained(tmp_path)
    return make


def test_template_helpers(make_templated):
    tok = make_templated("{{ messages | tojson }}|{{ strftime_now('%Y') | length }}"
                         "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
                         "[{{ m.role }}]{% endfor %}")
    text = tok.apply_chat_template([ChatMessage("user", "<你好>"), ChatMessage("tool", "x")])
    assert text == ('[{"role": "user", "content": "<你好>"}, {"role": "tool", "content": "x"}]'
                    "|4[user]")


def test_raise_exception_becomes_tokenizer_error(make_templated):
    tok = make_templated("{% if messages[0]['role'] == 'system' %}"
                         "{{ raise_exception('System role not supported') }}{% endif %}ok")
    assert tok.apply_chat_template([ChatMessage("user", "hi")]) == "ok"
    with pytest.raises(TokenizerError, match="System role not supported"):
        tok.apply_chat_template([ChatMessage("system", "hi")])


def test_sandbox_and_syntax_errors(make_templated):
    tok = make_templated("{{ messages.__class__.__mro__ }}")
    with pytest.raises(TokenizerError, match="chat template failed"):
        tok.apply_chat_template([ChatMessage("user", "hi")])
    with pytest.raises(TokenizerError, match="does not compile"):
        make_templated("{% for m in messages %}")


def test_unknown_role_and_bad_content(plain_dir):
    tok = Tokenizer.from_pretrained(plain_dir)
    with pytest.raises(TokenizerError, match="'narrator'"):
        tok.apply_chat_template([ChatMessage("narrator", "Once upon a time")])
    with pytest.raises(TokenizerError, match="content"):
        tok.apply_chat_template([{"role": "user", "content": None}])


def test_plain_fallback(plain_dir):
    tok = Tokenizer.from_pretrained(plain_dir)
    messages = [ChatMessage("system", "Be brief."), ChatMessage("user", "hi")]
    assert tok.apply_chat_template(messages) == "system: Be brief.\nuser: hi\nassistant:"
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == (
        "system: Be brief.\nuser: hi\n")
    ids = tok.encode_chat(messages)
    assert ids[0] == 1 and ids.count(1) == 1
