"""What a served model holds: the default KV pool sized for the sequences the gateway runs (and
capped by memory), its dtype (auto = the serving dtype, or a half-precision cache under a float32
model), and the weight and KV bytes model information reports."""

from __future__ import annotations

import pytest
import torch
from shardlm.common.v1 import common_pb2
from shardlm.constants import DEFAULT_CPU_MEMORY_FRACTION, DEFAULT_MAX_RUNNING

from shardlm_server.worker import convert, kv_cache
from shardlm_server.worker.engine import DecodeItem, Engine, PrefillItem, StopParams
from shardlm_server.worker.errors import InvalidRequestError
from shardlm_server.worker.kv_cache import CacheConfig, KVCache, cache_dtype, needed_blocks

SHAPE = dict(num_layers=2, kv_heads=2, head_dim=16, device=torch.device("cpu"))
PER_BLOCK = 2 * 2 * 16 * 2 * 16 * 4  # K+V, layers, block, kv heads, head dim, float32



def _cache(config: CacheConfig, max_model_len: int = 100,
           dtype: torch.dtype = torch.float32) -> KVCache:
    return KVCache(config, dtype=dtype, max_model_len=max_model_len, **SHAPE)


def _rss() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS"))


def test_the_default_pool_holds_the_running_sequences_at_full_context():
    cache = _cache(CacheConfig(sequences=3))
    assert cache.num_blocks == needed_blocks(CacheConfig(sequences=3), 100) == 3 * (7 + 1)
    assert cache.nbytes == cache.num_blocks * PER_BLOCK
    # 0 sequences: the gateway's default --max-running, the one shared constant.
    assert _cache(CacheConfig()).num_blocks == DEFAULT_MAX_RUNNING * 8


def test_the_default_pool_is_capped_by_the_memory_at_hand(monkeypatch):
    monkeypatch.setattr(kv_cache, "_available_bytes", lambda _device: 40 * PER_BLOCK)
    cache = _cache(CacheConfig(sequences=100))
    assert cache.num_blocks == int(40 * PER_BLOCK * DEFAULT_CPU_MEMORY_FRACTION) // PER_BLOCK


def test_explicit_sizes_win_over_the_default():
    assert _cache(CacheConfig(sequences=3, num_blocks=5)).num_blocks == 5
    assert _cache(CacheConfig(sequences=3, memory_bytes=4 * PER_BLOCK)).num_blocks == 4


def test_a_cpu_pool_is_resident_only_where_written():
    before = _rss()
    cache = _cache(CacheConfig(num_blocks=32768))  # 256 MiB of K and V
    assert cache.nbytes == 256 << 20
    assert _rss() - before < 64 << 20
    assert not cache.layers[1][1][-1].any()  # zeros all the same


def test_the_cache_dtype_is_the_serving_dtype_unless_configured():
    assert cache_dtype(CacheConfig(), torch.bfloat16) is torch.bfloat16
    assert cache_dtype(CacheConfig(dtype=torch.float32), torch.float32) is torch.float32
    with pytest.raises(InvalidRequestError, match="dtype must be one of") as err:
        CacheConfig(dtype=torch.int8).validate()
    assert err.value.metadata["field"] == "kv_cache.dtype"


def test_the_kv_config_crosses_the_proto():
    config = convert.cache_config_from_proto(common_pb2.KvCacheConfig(
        dtype=common_pb2.DTYPE_BFLOAT16, max_running_sequences=8))
    assert (config.dtype, config.sequences) == (torch.bfloat16, 8)
    assert convert.cache_config_from_proto(common_pb2.KvCacheConfig()).dtype is None


def test_model_info_reports_weight_and_kv_bytes(llama_dir):
    engine = Engine.load(llama_dir, dtype="float32", cache_config=CacheConfig(num_blocks=8))
    info = convert.model_info_to_proto(engine)
    params = sum(t.numel() for t in _tensors(engine))
    assert info.weight_bytes == engine.weight_bytes == 4 * params
    assert info.kv_cache_bytes == 8 * engine.capacity.bytes_per_block
    assert info.kv_cache_dtype == common_pb2.DTYPE_FLOAT32


def _tensors(engine: Engine) -> list[torch.Tensor]:
    """Every weight of the tiny dense Llama, by hand (its head is tied or its own tensor)."""
    model = engine.model
    found = [model.embed.weight, model.norm]
    if model.lm_head.weight is not model.embed.weight:
        found.append(model.lm_head.weight)
    for layer in model.layers:
        found += [layer.input_norm, layer.post_norm, layer.qkv.weight, layer.o_proj.weight,
                  layer.gate_up.weight, layer.down.weight]
        found += [b for b in (layer.qkv.bias, layer.o_proj.bias, layer.gate_up.bias,
                              layer.down.bias) if b is not None]
    return found


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16])
def test_a_float32_model_runs_on_a_half_precision_cache(llama_dir, kv_dtype):
    def greedy(config: CacheConfig) -> tuple[torch.Tensor, list[int]]:
        engine = Engine.load(llama_dir, dtype="float32", cache_config=config)
        assert engine.cache.dtype == (config.dtype or torch.float32)
        out = engine.prefill([PrefillItem(0, list(range(3, 40)), 0, list(range(8)),
                                          stop=StopParams(max_new_tokens=8))], taps=["logits"])
        tokens = [out.tokens[0].token.token_id]
        for step in engine.decode([DecodeItem(0, list(range(8)), 7)], 7):
            tokens += [t.token.token_id for t in step.tokens]
        return out.taps["logits"][0], tokens

    logits, tokens = greedy(CacheConfig(num_blocks=8, dtype=kv_dtype))
    reference, reference_tokens = greedy(CacheConfig(num_blocks=8))
    torch.testing.assert_close(logits, reference, atol=0.05, rtol=0.05)
    assert tokens[:3] == reference_tokens[:3]
