"""worker/convert.py: a Decode call's messages from its groups of steps (EngineThread.stream groups
them under the stream interval), one a group, with nothing lost or reordered; and the interval a
call's steps are grouped under."""

from __future__ import annotations

import torch
from shardlm.worker.v1 import worker_pb2

from shardlm_server.worker import convert
from shardlm_server.worker.engine_types import DraftCount, StepOutput, TokenOutput
from shardlm_server.worker.sampling import SampledToken


def step(tokens: list[tuple[int, int]], mask_s: float = 0.0, drafts=(), taps=None) -> StepOutput:
    return StepOutput([TokenOutput(sid, SampledToken(tid)) for sid, tid in tokens],
                      taps or {}, mask_s, [DraftCount(*d) for d in drafts])


STEPS = [step([(1, 10), (2, 20)]), step([(1, 11), (2, 21)], mask_s=0.002),
         step([(1, 12), (1, 13), (2, 22)], drafts=[(1, 2, 1)]), step([(2, 23)]),
         step([(2, 24)], mask_s=0.001)]


def flat(messages) -> list[tuple[int, int]]:
    return [(t.sequence_id, t.token_id) for m in messages for t in m.tokens]


def test_one_step_a_group_is_a_message_a_step():
    messages = list(convert.decode_responses([[s] for s in STEPS], samples=True))
    assert [m.step for m in messages] == [0, 1, 2, 3, 4]
    assert [len(m.tokens) for m in messages] == [2, 2, 3, 1, 1]
    assert [list(m.constraint_mask_seconds) for m in messages] == [[], [0.002], [], [], [0.001]]
    assert [(d.sequence_id, d.proposed, d.accepted) for d in messages[2].drafts] == [(1, 2, 1)]


def test_a_group_of_steps_is_one_message_in_order():
    messages = list(convert.decode_responses([STEPS[:3], STEPS[3:]], samples=True))
    assert [m.step for m in messages] == [2, 4]  # a message is numbered by its last step
    assert flat(messages) == flat(convert.decode_responses([[s] for s in STEPS], samples=True))
    assert [list(m.constraint_mask_seconds) for m in messages] == [[0.002], [0.001]]
    assert [len(m.drafts) for m in messages] == [1, 0]


def test_taps_travel_with_their_step():
    tapped = [step([(1, 10 + i)], taps={"logits": torch.ones(1, 3)}) for i in range(3)]
    messages = list(convert.decode_responses([[s] for s in tapped], samples=True))
    assert [m.step for m in messages] == [0, 1, 2]
    assert all(len(m.taps) == 1 for m in messages)


def test_a_rank_that_does_not_sample_sends_only_its_steps():
    messages = list(convert.decode_responses([STEPS[:3], STEPS[3:]], samples=False))
    assert [m.step for m in messages] == [2, 4]
    assert not any(m.tokens or m.drafts or m.constraint_mask_seconds for m in messages)


def test_the_gather_time_is_the_requests_interval_or_the_devices_default_and_0_with_taps():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert convert.stream_gather_s(worker_pb2.DecodeRequest(stream_interval_ms=7), cuda) == 0.007
    assert convert.stream_gather_s(worker_pb2.DecodeRequest(stream_interval_ms=0), cpu) == 0
    assert convert.stream_gather_s(worker_pb2.DecodeRequest(), cpu) == 0.02
    assert convert.stream_gather_s(worker_pb2.DecodeRequest(), cuda) == 0
    tapped = worker_pb2.DecodeRequest(stream_interval_ms=7, debug_taps=["logits"])
    assert convert.stream_gather_s(tapped, cpu) == 0
