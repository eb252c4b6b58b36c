"""The proto comments are the API reference: the defaults and rules they state must be the ones
the code applies. Each test reads a field's comment from the .proto source and checks it against
the constant or behaviour it describes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from shardlm_server.worker.errors import InvalidRequestError
from shardlm_server.worker.kv_cache import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_CPU_MEMORY_FRACTION,
    DEFAULT_GPU_MEMORY_FRACTION,
    DEFAULT_MAX_RUNNING,
    CacheConfig,
    CacheMode,
)
from shardlm_server.worker.worker_servicer import DEFAULT_COMM_TIMEOUT_S

PROTO = Path(__file__).resolve().parents[2] / "proto" / "shardlm"
COMMON = (PROTO / "common" / "v1" / "common.proto").read_text(encoding="utf-8")
WORKER = (PROTO / "worker" / "v1" / "worker.proto").read_text(encoding="utf-8")


def comment_of(source: str, declaration: str) -> str:
    """The `//` comment block right above the line that declares `declaration`."""
    lines = source.splitlines()
    index = next(i for i, line in enumerate(lines) if line.strip().startswith(declaration))
    block: list[str] = []
    for line in reversed(lines[:index]):
        if not line.strip().startswith("//"):
            break
        block.insert(0, line.strip().removeprefix("//").strip())
    return " ".join(block)


def test_comm_timeout_default_matches_the_worker():
    comment = comment_of(WORKER, "float timeout_seconds")
    stated = float(re.search(r"default \((\d+(?:\.\d+)?)\)", comment).group(1))
    assert stated == DEFAULT_COMM_TIMEOUT_S


def test_kv_cache_defaults_match_the_worker():
    assert f"default, {DEFAULT_BLOCK_SIZE}" in comment_of(COMMON, "uint32 block_size")
    fraction = comment_of(COMMON, "float gpu_memory_fraction")
    assert f"at most {DEFAULT_GPU_MEMORY_FRACTION} of the free memory" in fraction
    assert "free memory" in fraction and "total memory" not in fraction
    assert "max_running_sequences" in comment_of(COMMON, "uint64 memory_bytes")
    sequences = comment_of(COMMON, "uint32 max_running_sequences")
    assert f"0 means {DEFAULT_MAX_RUNNING}." in sequences
    assert DEFAULT_CPU_MEMORY_FRACTION == 0.5 and "on CPU half of" in sequences


@pytest.mark.parametrize("field", ["static_max_sequences", "static_max_sequence_length"])
def test_static_cache_fields_say_zero_is_rejected_and_it_is(field):
    assert "0 is rejected" in comment_of(COMMON, f"uint32 {field}")
    settings = {"static_max_sequences": 2, "static_max_sequence_length": 64, field: 0}
    with pytest.raises(InvalidRequestError):
        CacheConfig(mode=CacheMode.STATIC, **settings).validate()


def test_gpu_memory_fraction_range_matches_validation():
    assert "Valid range [0, 1)" in comment_of(COMMON, "float gpu_memory_fraction")
    with pytest.raises(InvalidRequestError):
        CacheConfig(gpu_memory_fraction=1.0).validate()
    CacheConfig(gpu_memory_fraction=0.0).validate()
