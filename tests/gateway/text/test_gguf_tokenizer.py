"""The tokenizer built from a GGUF file's metadata encodes and decodes exactly as transformers'
own GGUF conversion does: on the default model's file, and on small files written here for each
tokenizer kind (byte-level BPE with several pre-tokenizers, sentencepiece BPE from scores in
Llama's, Gemma's and Phi-3's styles)."""

from __future__ import annotations

import json
import subprocess
import sys

import gguf
import pytest

from shardlm_server.gateway.serve.default_model import DefaultModelMissing, default_model_path
from shardlm_server.gateway.text.tokenizer import Tokenizer, TokenizerError
from tests.checkpoints import TOKENIZER_TEXT
from tests.gguf_files import CHAT_TEMPLATE, byte_level_vocab

CORPUS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "It's we'll they've I'M you'd",
    "def square(x: int) -> int:\n    return x ** 2  # comment\n\n\tif x != 0: pass\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "你好，世界。天气很好。日本語のテキストと한국어",
    "emoji 🙂🚀👍🏽 family 👨‍👩‍👧 flags 🇫🇷",
    "numbers 1234567 3.14159 1e-9 0x1F 12345",
    "TheQuick oneTwo camelCase ALLCAPS (paren) 'quoted'",
    "   leading spaces, trailing   ",
    "\n\n\n   \n\t\t  \r\nmixed\rline endings",
    "café naïve résumé Ångström",
    "a" * 40 + " " + "ab" * 20,
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "x<|endoftext|>y",
    "hello</s>world <s> again",
    " ",
    "",
]


def _reference(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def _assert_same(ours: Tokenizer, reference) -> None:
    for text in CORPUS:
        ids = ours.encode(text)
        assert ids == reference.encode(text), text
        assert ours.encode(text, add_special_tokens=False) == reference.encode(
            text, add_special_tokens=False), text
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == reference.decode(
                ids, skip_special_tokens=skip), (text, skip)


def _model_keys(writer: gguf.GGUFWriter) -> None:
    writer.add_block_count(1)
    writer.add_context_length(128)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(128)
    writer.add_head_count(2)
    writer.add_layer_norm_rms_eps(1e-5)


def _close(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# Merges across the places where the pre-tokenizers' splits differ (a space before digits, digit
# runs, a lower-to-upper case change, a space before punctuation), so that each kind's split
# shows in the token ids.
SPLIT_MERGES = ["Ġ 1", "1 2", "2 3", "3 4", "4 5", "e Q", "e T", "l C", "Ġ (", "Ġ '", "' s"]


def write_byte_level(path, pre: str, arch: str = "qwen2", extra_merges: list[str] = ()) -> None:
    tokens, merges, types = byte_level_vocab()
    for merge in extra_merges:
        joined = merge.replace(" ", "")
        if joined not in tokens:
            tokens, types = tokens + [joined], types + [1]
    merges = merges + list(extra_merges)
    writer = gguf.GGUFWriter(str(path), arch)
    _model_keys(writer)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template(CHAT_TEMPLATE)
    _close(writer)


def sentencepiece_vocab() -> tuple[list[str], list[float], list[int]]:
    """A llama.cpp-style sentencepiece vocabulary: <unk>, <s>, </s>, the 256 byte tokens, then
    pieces (with the ▁ word marker) scored by merge rank; no merges stored."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, pre_tokenizers, trainers

    tok = Backend(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.train_from_iterator(TOKENIZER_TEXT * 4, trainer=trainers.BpeTrainer(
        vocab_size=300, show_progress=False))
    learned = [t for t, _ in sorted(json.loads(tok.to_str())["model"]["vocab"].items(),
                                    key=lambda kv: kv[1])]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + learned
    types = [2, 3, 3] + [6] * 256 + [1] * len(learned)
    scores = [0.0, 0.0, 0.0] + [0.0] * 256 + [-float(i) for i in range(len(learned))]
    return tokens, scores, types


def write_sentencepiece(path, arch: str = "llama") -> None:
    tokens, scores, types = sentencepiece_vocab()
    if arch == "gemma3":  # Gemma stores runs of spaces as spaces
        tokens, scores, types = tokens + ["  ", "   "], scores + [-1e3, -1e3], types + [1, 1]
    writer = gguf.GGUFWriter(str(path), arch)
    _model_keys(writer)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    _close(writer)


def test_default_model_tokenizer_matches_transformers():
    try:
        path = default_model_path()
    except DefaultModelMissing as exc:
        pytest.skip(str(exc))
    ours = Tokenizer.from_pretrained(path)
    reference = _reference(path)
    _assert_same(ours, reference)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    expected = reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    expected = expected["input_ids"] if not isinstance(expected, list) else expected
    assert ours.encode_chat(messages) == expected
    assert ours.has_chat_template and ours.eos_token_ids == (2,)


PRE_KINDS = ["qwen2", "llama-bpe", "tekken", "gpt-4o", "default"]


@pytest.mark.parametrize("pre", PRE_KINDS)
def test_byte_level_tokenizers_match_transformers(tmp_path, pre):
    path = tmp_path / "m.gguf"
    write_byte_level(path, pre, extra_merges=SPLIT_MERGES)
    ours = Tokenizer.from_pretrained(tmp_path)  # a folder holding one .gguf
    _assert_same(ours, _reference(path))
    assert ours.has_chat_template and ours.bos_token_id == 1


def test_the_split_merges_tell_the_pre_tokenizers_apart(tmp_path):
    """The test above could fail: with SPLIT_MERGES every kind encodes the corpus differently."""
    encodings = set()
    for pre in PRE_KINDS:
        path = tmp_path / pre / "m.gguf"
        path.parent.mkdir()
        write_byte_level(path, pre, extra_merges=SPLIT_MERGES)
        encodings.add(tuple(tuple(_reference(path).encode(t)) for t in CORPUS))
    assert len(encodings) == len(PRE_KINDS)


@pytest.mark.parametrize("arch", ["llama", "gemma3", "phi3"])
def test_sentencepiece_tokenizer_matches_transformers(tmp_path, arch):
    """Llama's sentencepiece files, and the two architectures transformers converts otherwise:
    Gemma's (no prefix space, space runs, merges in token order) and Phi-3's (the prefix space
    from a normalizer)."""
    path = tmp_path / "m.gguf"
    write_sentencepiece(path, arch)
    ours = Tokenizer.from_pretrained(path)
    _assert_same(ours, _reference(path))
    assert ours.encode("hi")[0] == 1  # llama.cpp's sentencepiece default: BOS added
    assert not ours.has_chat_template


def test_unsupported_tokenizer_kind_is_named(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "llama")
    _model_keys(writer)
    writer.add_tokenizer_model("bert")
    writer.add_token_list(["[PAD]", "[UNK]", "a"])
    _close(writer)
    with pytest.raises(TokenizerError, match="'bert' is not supported"):
        Tokenizer.from_pretrained(tmp_path / "m.gguf")


def test_corrupt_file_is_a_tokenizer_error(tmp_path):
    path = tmp_path / "m.gguf"
    write_byte_level(path, "qwen2")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(TokenizerError, match="corrupt or truncated"):
        Tokenizer.from_pretrained(path)


def test_a_folder_of_several_gguf_files_is_a_tokenizer_error(tmp_path):
    write_byte_level(tmp_path / "a.gguf", "qwen2")
    write_byte_level(tmp_path / "b.gguf", "qwen2")
    with pytest.raises(TokenizerError, match=r"several GGUF files \(a.gguf, b.gguf\)"):
        Tokenizer.from_pretrained(tmp_path)


def test_the_gateway_reads_a_gguf_tokenizer_without_the_gguf_package(tmp_path):
    """The metadata comes from the shared reader (shardlm.gguf_header), as the workers' does: the
    gateway process never imports the `gguf` package."""
    path = tmp_path / "m.gguf"
    write_byte_level(path, "qwen2")
    script = ("import sys\n"
              "sys.modules['gguf'] = None  # importing it now fails\n"
              "from shardlm_server.gateway.text.tokenizer import Tokenizer\n"
              f"print(Tokenizer.from_pretrained({str(path)!r}).encode('hello world'))\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == Tokenizer.from_pretrained(path).encode("hello world")
