"""The constraint compiler on its own: the time limit, the size limit, the cache (failures and
late finishers included) and what each kind compiles to."""

from __future__ import annotations

import asyncio
import json

import pytest
from shardlm.common.v1 import common_pb2
from shardlm.errors import InvalidArgumentError, ResourceExhaustedError

from shardlm_server.gateway.constraints.compiler import ConstraintCompiler
from shardlm_server.gateway.metrics import Metrics
from tests.checkpoints import LLAMA, write_tokenizer


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tokenizer")
    write_tokenizer(folder, LLAMA["vocab_size"])
    return (folder / "tokenizer.json").read_text()


def compiler(tokenizer_json, *, timeout_s=5.0, max_bytes=1 << 16) -> ConstraintCompiler:
    return ConstraintCompiler.for_vocabulary(tokenizer_json, LLAMA["vocab_size"], [2], Metrics(),
                                             timeout_s=timeout_s, max_bytes=max_bytes)


def heavy_schema(properties: int) -> str:
    """A schema whose compile takes a while: many properties, each with its own pattern."""
    return json.dumps({"type": "object", "properties": {
        f"p{i}": {"type": "string", "pattern": f"^[a-z]{{{i % 7 + 1},{i % 7 + 9}}}[0-9]{{2}}$"}
        for i in range(properties)}, "required": [f"p{i}" for i in range(properties)]})


def test_a_slow_compile_is_refused_and_its_result_kept_for_later(tokenizer_json):
    slow = common_pb2.Constraint(json_schema=heavy_schema(300))
    c = compiler(tokenizer_json, timeout_s=1e-4)

    async def run():
        with pytest.raises(ResourceExhaustedError) as caught:
            await c.compile(slow)
        assert caught.value.reason == "CONSTRAINT_COMPILE_TIMEOUT"
        for _ in range(400):  # the compile goes on and lands in the cache
            if not c._inflight:
                break
            await asyncio.sleep(0.05)
        return await c.compile(slow)

    assert asyncio.run(run()).kind == "json_schema"


def test_catastrophic_backtracking_regexes_compile_fast(tokenizer_json):
    """Patterns that take exponential time in backtracking engines are automata here."""
    c = compiler(tokenizer_json, timeout_s=1.0)
    for pattern in ("(a+)+$", "(a|aa)+b", "(x+x+)+y", "^(([a-z])+.)+[A-Z]([a-z])+$"):
        assert asyncio.run(c.compile(common_pb2.Constraint(regex=pattern))).kind == "regex"


def test_too_large_is_refused_before_compiling(tokenizer_json):
    c = compiler(tokenizer_json, max_bytes=100)
    with pytest.raises(InvalidArgumentError) as caught:
        asyncio.run(c.compile(common_pb2.Constraint(choice={"choices": ["x" * 60, "y" * 60]})))
    assert caught.value.reason == "CONSTRAINT_TOO_LARGE"


def test_results_and_failures_are_cached_by_content(tokenizer_json):
    c = compiler(tokenizer_json)
    good = common_pb2.Constraint(regex="[a-z]{3}")

    async def run():
        first = await c.compile(good)
        assert await c.compile(common_pb2.Constraint(regex="[a-z]{3}")) is first
        for _ in range(2):
            with pytest.raises(InvalidArgumentError, match="unclosed"):
                await c.compile(common_pb2.Constraint(regex="(x"))

    asyncio.run(run())
    assert c.metrics.value("shardlm_constraint_compile_seconds_count", {"kind": "regex"}) == 2
    assert c.metrics.value("shardlm_constraint_failures_total",
                           {"reason": "INVALID_CONSTRAINT"}) == 2


def test_no_kind_is_no_constraint(tokenizer_json):
    assert asyncio.run(compiler(tokenizer_json).compile(common_pb2.Constraint())) is None


def test_a_tokenizer_llguidance_cannot_read_turns_constraints_off_not_the_model(tokenizer_json):
    """A tokenizer.json without a decoder (llguidance cannot tell how tokens map to bytes): the
    model is served, its constraints are refused with CONSTRAINTS_UNAVAILABLE; the worker side
    holds no grammar runtime."""
    from shardlm.errors import FailedPreconditionError

    from shardlm_server.worker.grammar import GrammarRuntime

    spec = json.loads(tokenizer_json)
    spec["decoder"] = None
    odd = json.dumps(spec)
    c = ConstraintCompiler.for_vocabulary(odd, LLAMA["vocab_size"], [2], Metrics(),
                                          timeout_s=1.0, max_bytes=1 << 16)
    with pytest.raises(FailedPreconditionError) as caught:
        asyncio.run(c.compile(common_pb2.Constraint(regex="a+")))
    assert caught.value.reason == "CONSTRAINTS_UNAVAILABLE"
    assert asyncio.run(c.compile(common_pb2.Constraint())) is None
    assert GrammarRuntime.for_tokenizer(odd, LLAMA["vocab_size"], (2,)) is None
    assert GrammarRuntime.for_tokenizer(tokenizer_json, LLAMA["vocab_size"], (2,)) is not None
