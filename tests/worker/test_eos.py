"""The worker's EOS set: gathered once from the checkpoint's files for ModelInfo, and never a
reason for the engine to stop a sequence on its own."""

from __future__ import annotations

import json

import pytest

from shardlm_server.worker.engine import DecodeItem, Engine, PrefillItem, StopParams
from shardlm_server.worker.eos import checkpoint_eos_ids
from shardlm_server.worker.kv_cache import CacheConfig


def write(folder, name: str, data) -> None:
    (folder / name).write_text(json.dumps(data), encoding="utf-8")


def test_eos_ids_are_the_union_of_config_generation_config_and_tokenizer(tmp_path):
    write(tmp_path, "generation_config.json", {"eos_token_id": [7, 2]})
    write(tmp_path, "tokenizer_config.json", {"eos_token": {"content": "<|end|>"}})
    write(tmp_path, "tokenizer.json", {"added_tokens": [{"id": 9, "content": "<|end|>"}],
                                       "model": {"vocab": {"a": 0}}})
    assert checkpoint_eos_ids(tmp_path, (2,)) == (2, 7, 9)


def test_tokenizer_eos_from_the_vocabulary_and_special_tokens_map(tmp_path):
    write(tmp_path, "special_tokens_map.json", {"eos_token": "</s>"})
    write(tmp_path, "tokenizer.json", {"model": {"vocab": {"</s>": 4}}})
    assert checkpoint_eos_ids(tmp_path, ()) == (4,)


def test_missing_or_broken_files_leave_config_eos(tmp_path):
    (tmp_path / "generation_config.json").write_text("{not json", encoding="utf-8")
    write(tmp_path, "tokenizer_config.json", {"eos_token": "<unknown>"})
    assert checkpoint_eos_ids(tmp_path, (2,)) == (2,)


@pytest.fixture(scope="module")
def engine(llama_dir):
    return Engine.load(llama_dir, dtype="float32", cache_config=CacheConfig(num_blocks=8))


def test_checkpoint_eos_is_reported(engine):
    assert engine.eos_token_ids == (2,)  # config.json and the tokenizer's "</s>"


def test_engine_stops_only_on_the_ids_it_is_sent(engine):
    ids, table = [1, 40, 41, 42, 43], list(range(8))

    def run(stop: StopParams) -> list[int]:
        engine.reset()
        first = engine.prefill([PrefillItem(0, ids, 0, table, stop=stop)]).tokens[0]
        steps = engine.decode([DecodeItem(0, table, 9)], 9)
        return [first.token.token_id] + [s.tokens[0].token.token_id for s in steps]

    free = run(StopParams(max_new_tokens=10))
    engine.eos_token_ids = (free[3],)  # the model's EOS: reported, not applied
    assert run(StopParams(max_new_tokens=10)) == free
    stopped = run(StopParams(max_new_tokens=10, stop_token_ids=(free[3],)))
    assert stopped == free[:free.index(free[3]) + 1]
