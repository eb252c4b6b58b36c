"""The finish policy: what the workers are sent, and why a call ends."""

from __future__ import annotations

import pytest
from shardlm.common.v1 import common_pb2
from shardlm.errors import InvalidArgumentError, ResourceExhaustedError

from shardlm_server.gateway.batching.finish import CallLimits, call_limits, max_new_tokens_limit
from shardlm_server.gateway.kv.allocator import BlockAllocator
from shardlm_server.gateway.kv.manager import KvManager
from shardlm_server.gateway.metrics import Metrics

C = common_pb2


def limits_for(stop: C.StopConditions, history: int, *, strict: bool, blocks: int = 64):
    return call_limits(stop, history=history, max_context=100, default_max_new_tokens=30,
                       eos_ids=frozenset({2, 9}),
                       kv=KvManager(BlockAllocator(blocks, 4), Metrics(), namespace="model"),
                       strict=strict)


def test_reasons_in_order_eos_stop_token_length_context():
    call = CallLimits(5, 20, stop_token_ids=frozenset({7, 9}), eos_ids=frozenset({9}))
    assert call.finish_reason(9, 10, 1) == C.FINISH_REASON_EOS  # an id in both sets is EOS
    assert call.finish_reason(7, 10, 1) == C.FINISH_REASON_STOP_TOKEN
    assert call.finish_reason(3, 20, 5) == C.FINISH_REASON_LENGTH  # both limits: the caller's
    assert call.finish_reason(3, 20, 4) == C.FINISH_REASON_CONTEXT_LENGTH
    assert call.finish_reason(3, 19, 4) == C.FINISH_REASON_UNSPECIFIED


def test_workers_get_every_stop_id_and_the_remaining_budget():
    call = limits_for(C.StopConditions(max_new_tokens=50, stop_token_ids=[5]), 60, strict=False)
    stop = call.worker_stop(history=60, generated=0)
    assert list(stop.stop_token_ids) == [2, 5, 9] and stop.max_new_tokens == 40  # the context
    assert call.worker_stop(history=95, generated=35).max_new_tokens == 5
    assert not stop.ignore_eos  # nothing for the workers to interpret
    ignoring = limits_for(C.StopConditions(ignore_eos=True, stop_token_ids=[5]), 10, strict=True)
    assert list(ignoring.worker_stop(10, 0).stop_token_ids) == [5]
    assert ignoring.max_new_tokens == 30  # the server default


def test_generate_refuses_what_cannot_fit_and_decode_runs_to_the_context():
    with pytest.raises(InvalidArgumentError) as err:
        limits_for(C.StopConditions(max_new_tokens=50), 60, strict=True)
    assert err.value.reason == "PROMPT_TOO_LONG"
    with pytest.raises(InvalidArgumentError):
        limits_for(C.StopConditions(), 100, strict=True)  # not even one token fits
    assert limits_for(C.StopConditions(), 90, strict=True).budget(90, 0) == 10  # default: clamp
    full = limits_for(C.StopConditions(max_new_tokens=50), 100, strict=False)
    assert full.budget(100, 0) == 0


def test_a_call_the_cache_could_never_hold_is_refused():
    with pytest.raises(ResourceExhaustedError) as err:
        limits_for(C.StopConditions(max_new_tokens=20), 10, strict=True, blocks=5)
    assert err.value.reason == "KV_CACHE_FULL"


def test_max_new_tokens_limit_fits_the_context():
    assert max_new_tokens_limit(4096, 512) == 511
    assert max_new_tokens_limit(256, 512) == 256
