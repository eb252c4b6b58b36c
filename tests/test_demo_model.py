"""The bundled demo checkpoint, models/shakespeare-tiny: it loads in the engine and the gateway's
tokenizer, matches transformers token for token, and writes English rather than noise.

The English check is deliberately simple: most words of a greedy continuation must be among a few
hundred common English / Shakespearean words, and there must be some variety. A model with random
weights of the same shape fails it (checked below for several seeds), so passing it means the
weights learned something.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from shardlm_server.gateway.text.tokenizer import Tokenizer
from shardlm_server.worker.engine import DecodeItem, Engine, PrefillItem, StopParams
from shardlm_server.worker.kv_cache import CacheConfig

MODEL_DIR = Path(__file__).resolve().parent.parent / "models" / "shakespeare-tiny"
NEW_TOKENS = 40
BLOCK = 16
TABLE = list(range(8))  # 128 token slots, more than prompt + NEW_TOKENS

COMMON_WORDS = frozenset("""
a about after again against all am an and any are art as at away ay be bear been before being
best better blood body both brother but by call came can cannot come comes could country crown
day dead dear death did die do does done doth down duke each earth else end enough er even ever
eyes face fair faith false father fear fellow find fire first fly follow fool for fortune forth
friend friends from gentle give go god good grace great had hand hands has hast hath have he head
hear heart heaven her here high him himself his hold home honour house how i if in is it its joy
keep kind king know lady land last lay leave let life like little live long look lord lords love
made make man many mark marry master may me mean men might mind mine more most mother much must
my name nature nay ne never new night no noble none nor not nothing now o of off old on once one
only or other our out own part peace play poor power pray prince queen rest right royal said same
say see seek self set shall she should sir so some son soul speak spirit stand still such sweet
take tell than thank thanks that the thee their them then there therefore these they thine thing
think this those thou though thought three thus thy time tis to too true truth tongue two unto up
upon us very was way we well were what when where which while who whom whose why wife will wilt
wind with within without woman word words world would ye yea yes yet you young your
""".split())

ENTER_WORDS = frozenset("enter exit exeunt re scene act".split())


def english_report(text: str, prompt: str) -> tuple[float, int, int]:
    """(share of words that are common or from the prompt, word count, distinct words)."""
    known = COMMON_WORDS | ENTER_WORDS | {w.lower() for w in re.findall(r"[A-Za-z]+", prompt)}
    words = [w.lower().strip("'") for w in re.findall(r"[A-Za-z']+", text)]
    words = [w for w in words if len(w) >= 2 or w in ("a", "i", "o")]
    if not words:
        return 0.0, 0, 0
    hits = sum(w in known or w.removesuffix("'s") in known for w in words)
    return hits / len(words), len(words), len(set(words))


def looks_like_english(text: str, prompt: str) -> bool:
    share, count, distinct = english_report(text, prompt)
    return share >= 0.6 and count >= 12 and distinct >= 6


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine.load(MODEL_DIR, dtype="float32",
                       cache_config=CacheConfig(block_size=BLOCK, num_blocks=len(TABLE)))


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_pretrained(MODEL_DIR)


@pytest.fixture(scope="module")
def reference():
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32).eval()


def engine_greedy(engine: Engine, ids: list[int], n: int = NEW_TOKENS) -> list[int]:
    engine.reset()
    stop = StopParams(max_new_tokens=n)
    first = engine.prefill([PrefillItem(0, ids, 0, TABLE, stop=stop)])
    tokens = [first.tokens[0].token.token_id]
    for step in engine.decode([DecodeItem(0, TABLE, n - 1)], n - 1):
        tokens += [t.token.token_id for t in step.tokens]
    return tokens


def hf_greedy(model, ids: list[int], n: int = NEW_TOKENS) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


def test_folder_is_a_small_llama_checkpoint():
    files = {p.name: p.stat().st_size for p in MODEL_DIR.iterdir() if p.is_file()}
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json", "README.md"):
        assert name in files, name
    assert sum(files.values()) <= 20_000_000
    config = json.loads((MODEL_DIR / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["tie_word_embeddings"] is True
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    header_len = int.from_bytes((MODEL_DIR / "model.safetensors").read_bytes()[:8], "little")
    with open(MODEL_DIR / "model.safetensors", "rb") as f:
        f.seek(8)
        header = json.loads(f.read(header_len))
    dtypes = {v["dtype"] for k, v in header.items() if k != "__metadata__"}
    assert dtypes <= {"BF16", "F32"} and len(dtypes) == 1
    tok_config = json.loads((MODEL_DIR / "tokenizer_config.json").read_text())
    assert (tok_config["bos_token"], tok_config["eos_token"]) == ("<s>", "</s>")
    assert tok_config["add_bos_token"] is True


def test_tokenizer_adds_one_bos_and_round_trips(tokenizer):
    text = "ROMEO:\nBut, soft! what light through yonder window breaks?"
    ids = tokenizer.encode(text)
    assert ids[0] == tokenizer.bos_token_id == 1
    assert ids.count(1) == 1
    assert 2 in tokenizer.eos_token_ids
    assert tokenizer.decode(ids) == text
    assert tokenizer.encode(text, add_special_tokens=False) == ids[1:]


@pytest.mark.parametrize("prompt", ["ROMEO:", "To be, or not to be"])
def test_greedy_continuation_is_english(engine, tokenizer, prompt):
    tokens = engine_greedy(engine, tokenizer.encode(prompt))
    text = tokenizer.decode(tokens)
    share, count, distinct = english_report(text, prompt)
    assert looks_like_english(text, prompt), (text, share, count, distinct)
    if prompt == "ROMEO:":
        assert "\n" in text  # play-script form: the speech starts on the next line


def test_engine_matches_transformers_generate(engine, tokenizer, reference):
    for prompt in ("ROMEO:", "JULIET:\nO Romeo, Romeo!"):
        ids = tokenizer.encode(prompt)
        assert engine_greedy(engine, ids) == hf_greedy(reference, ids)


def test_noise_fails_the_english_check(tokenizer, reference):
    """The check above is not vacuous: untrained weights of the same shape, and random tokens of
    this vocabulary, both fail it."""
    transformers = pytest.importorskip("transformers")
    ids = tokenizer.encode("ROMEO:")
    for seed in range(3):
        torch.manual_seed(seed)
        model = transformers.LlamaForCausalLM(reference.config).eval()
        text = tokenizer.decode(hf_greedy(model, ids))
        assert not looks_like_english(text, "ROMEO:"), (seed, text)
        generator = torch.Generator().manual_seed(seed)
        noise = torch.randint(3, tokenizer.vocab_size, (NEW_TOKENS,), generator=generator)
        text = tokenizer.decode(noise.tolist())
        assert not looks_like_english(text, "ROMEO:"), (seed, text)
