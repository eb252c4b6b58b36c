"""bench.random_gguf: a random-weight GGUF of a bench shape with the default model's tokenizer
loads in the engine, decodes, and tokenizes like the default model."""

from __future__ import annotations

import gguf
import torch

from bench.random_gguf import write_random_llama
from shardlm_server.gateway.serve.default_model import default_model_path
from shardlm_server.worker.engine import DecodeItem, Engine, PrefillItem, StopParams
from shardlm_server.worker.kv_cache import CacheConfig


def test_random_file_has_the_shape_and_the_default_tokenizer(tmp_path):
    path = write_random_llama(tmp_path / "tiny-random.F16.gguf", "tiny", default_model_path())
    assert not list(tmp_path.glob("*.partial"))
    reader = gguf.GGUFReader(path)
    source = gguf.GGUFReader(default_model_path())
    assert reader.fields["tokenizer.ggml.tokens"].contents() == \
        source.fields["tokenizer.ggml.tokens"].contents()
    assert reader.fields["llama.block_count"].contents() == 2
    types = {t.name: t.tensor_type for t in reader.tensors}
    assert types["blk.0.ffn_down.weight"] == gguf.GGMLQuantizationType.F16
    assert "output.weight" not in types  # tied, as Llama-3.2-1B's
    assert types["rope_freqs.weight"] == gguf.GGMLQuantizationType.F32  # its llama3 rope

    engine = Engine.load(path, dtype=torch.float32, device=torch.device("cpu"),
                         cache_config=CacheConfig(block_size=16, num_blocks=8))
    assert engine.cfg.vocab_size == 49152 and engine.cfg.hidden_size == 64
    assert engine.cfg.rope_scaling["rope_type"] == "freq_factors"
    table = list(range(4))
    first = engine.prefill([PrefillItem(0, [1, 2, 3, 4], 0, table,
                                        stop=StopParams(max_new_tokens=8))])
    steps = list(engine.decode([DecodeItem(0, table, 4)], 4))
    assert first and sum(len(s.tokens) for s in steps) == 4  # drafts may join steps
