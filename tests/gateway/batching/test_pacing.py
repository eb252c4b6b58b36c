"""The decode pacer: few steps a call while prompts wait, else as many as fit the call time."""

from __future__ import annotations

from shardlm_server.gateway.batching.pacing import DecodePacer


def test_decode_calls_take_few_steps_while_prompts_wait_then_as_many_as_fit_the_call_time():
    pacer = DecodePacer(max_decode_steps=32, decode_call_s=0.1, busy_decode_steps=2)
    assert pacer.steps(prompts_waiting=False) == 2  # no step timed yet
    pacer.timed(0.05, 10)  # 5 ms a step: 20 fit in 100 ms
    assert pacer.steps(prompts_waiting=False) == 20
    pacer.timed(0.0, 0)  # a call that streamed no step changes nothing
    assert pacer.steps(prompts_waiting=False) == 20
    pacer.timed(0.001, 10)  # faster steps: averaged, then capped
    assert pacer.steps(prompts_waiting=False) == 32
    pacer.timed(2.0, 2)  # slow steps (a big batch): never below the busy count
    assert pacer.steps(prompts_waiting=False) == 2
    pacer.step_s = 0.005
    assert pacer.steps(prompts_waiting=True) == 2  # a prompt waits: admit it soon
