"""A LoadRequest's EngineOptions become the engine's: zero values keep the worker's defaults."""

from __future__ import annotations

import pytest
from shardlm.constants import DEFAULT_CUDA_GRAPH_MAX_BATCH, DEFAULT_CUDA_GRAPH_MAX_CONTEXT
from shardlm.worker.v1 import worker_pb2

from shardlm_server.worker import convert, ops
from shardlm_server.worker.decode_runner import GraphConfig
from shardlm_server.worker.engine import Engine, EngineOptions
from shardlm_server.worker.errors import InvalidRequestError
from shardlm_server.worker.kv_cache import CacheConfig


def test_empty_options_are_the_defaults():
    options = convert.engine_options_from_proto(worker_pb2.EngineOptions())
    assert options == EngineOptions()
    assert options.graphs == GraphConfig(True, DEFAULT_CUDA_GRAPH_MAX_BATCH,
                                         DEFAULT_CUDA_GRAPH_MAX_CONTEXT)
    assert options.cpu_simd is True
    assert options.activation_precision == "exact"


def test_set_options_are_taken():
    options = convert.engine_options_from_proto(worker_pb2.EngineOptions(
        disable_cuda_graphs=True, cuda_graph_max_batch=16, cuda_graph_max_context=2048,
        disable_cpu_simd=True, activation_precision="int8"))
    assert options == EngineOptions(graphs=GraphConfig(False, 16, 2048), cpu_simd=False,
                                    activation_precision="int8")


def test_an_unknown_activation_precision_is_refused_naming_the_field():
    with pytest.raises(InvalidRequestError, match="exact, int8") as info:
        convert.engine_options_from_proto(worker_pb2.EngineOptions(activation_precision="fp4"))
    assert info.value.metadata["field"] == "engine.activation_precision"


def test_engine_load_switches_the_cpu_kernels(llama_dir, monkeypatch):
    monkeypatch.setenv("SHARDLM_CPU_SIMD", "0")  # no longer read by anything in the worker
    supported = ops.cpu_simd_active()
    cache = CacheConfig(block_size=8, num_blocks=16)
    try:
        Engine.load(llama_dir, dtype="float32", cache_config=cache,
                    options=EngineOptions(cpu_simd=False, activation_precision="int8"))
        assert ops.cpu_simd_active() is False
        assert ops.activation_precision() == "int8"
        Engine.load(llama_dir, dtype="float32", cache_config=cache)
        assert ops.cpu_simd_active() is supported
        assert ops.activation_precision() == "exact"
    finally:
        ops.set_cpu_simd(True)
        ops.set_activation_precision("exact")
