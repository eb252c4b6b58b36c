"""A LoadRequest's EngineOptions become the engine's: zero values keep the worker's defaults."""

from __future__ import annotations

import pytest
import torch
from shardlm.constants import DEFAULT_CUDA_GRAPH_MAX_BATCH, DEFAULT_CUDA_GRAPH_MAX_CONTEXT
from shardlm.worker.v1 import worker_pb2

from shardlm_server.worker import convert, ops
from shardlm_server.worker.decode_runner import GraphConfig
from shardlm_server.worker.engine import Engine, EngineOptions
from shardlm_server.worker.errors import InvalidRequestError
from shardlm_server.worker.kv_cache import CacheConfig
from shardlm_server.worker.speculative import SpeculationConfig


def test_empty_options_are_the_defaults():
    options = convert.engine_options_from_proto(worker_pb2.EngineOptions())
    assert options == EngineOptions()
    assert options.graphs == GraphConfig(True, DEFAULT_CUDA_GRAPH_MAX_BATCH,
                                         DEFAULT_CUDA_GRAPH_MAX_CONTEXT)
    assert options.cpu_simd is True
    assert options.activation_precision == "exact"
    assert options.speculation == SpeculationConfig("auto", 0)


def test_set_options_are_taken():
    options = convert.engine_options_from_proto(worker_pb2.EngineOptions(
        disable_cuda_graphs=True, cuda_graph_max_batch=16, cuda_graph_max_context=2048,
        disable_cpu_simd=True, activation_precision="int8", speculation="ngram",
        speculative_tokens=5))
    assert options == EngineOptions(graphs=GraphConfig(False, 16, 2048), cpu_simd=False,
                                    activation_precision="int8",
                                    speculation=SpeculationConfig("ngram", 5))


def test_an_unknown_activation_precision_is_refused_naming_the_field():
    with pytest.raises(InvalidRequestError, match="exact, int8") as info:
        convert.engine_options_from_proto(worker_pb2.EngineOptions(activation_precision="fp4"))
    assert info.value.metadata["field"] == "engine.activation_precision"


@pytest.mark.parametrize(("options", "field"), [
    (worker_pb2.EngineOptions(speculation="eagle"), "engine.speculation"),
    (worker_pb2.EngineOptions(speculative_tokens=33), "engine.speculative_tokens"),
])
def test_bad_speculation_options_are_refused_naming_the_field(options, field):
    with pytest.raises(InvalidRequestError) as info:
        convert.engine_options_from_proto(options)
    assert info.value.metadata["field"] == field


@pytest.mark.parametrize(("mode", "device", "enabled"), [
    ("auto", "cpu", True), ("auto", "cuda", False), ("ngram", "cuda", True), ("off", "cpu", False),
])
def test_auto_speculation_is_on_where_it_is_measured(mode, device, enabled):
    assert SpeculationConfig(mode).enabled(torch.device(device)) is enabled


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
