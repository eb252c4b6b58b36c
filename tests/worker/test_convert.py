"""worker/convert.py: a Decode call's messages from its steps, one a step or several steps to a
message under a stream interval, with nothing lost or reordered."""

from __future__ import annotations

import torch

from shardlm_server.worker import convert
from shardlm_server.worker.engine_types import DraftCount, StepOutput, TokenOutput
from shardlm_server.worker.sampling import SampledToken


def step(tokens: list[tuple[int, int]], mask_s: float = 0.0, drafts=(), taps=None) -> StepOutput:
    return StepOutput([TokenOutput(sid, SampledToken(tid)) for sid, tid in tokens],
                      taps or {}, mask_s, [DraftCount(*d) for d in drafts])


STEPS = [step([(1, 10), (2, 20)]), step([(1, 11), (2, 21)], mask_s=0.002),
         step([(1, 12), (1, 13), (2, 22)], drafts=[(1, 2, 1)]), step([(2, 23)]),
         step([(2, 24)], mask_s=0.001)]


class Clock:
    """Each reading is `tick` seconds after the one before (a step of that length)."""

    def __init__(self, tick: float) -> None:
        self.now, self.tick = 0.0, tick

    def __call__(self) -> float:
        self.now += self.tick
        return self.now


def flat(messages) -> list[tuple[int, int]]:
    return [(t.sequence_id, t.token_id) for m in messages for t in m.tokens]


def test_every_step_is_a_message_without_an_interval():
    messages = list(convert.decode_responses(STEPS, samples=True, interval_ms=0))
    assert [m.step for m in messages] == [0, 1, 2, 3, 4]
    assert [len(m.tokens) for m in messages] == [2, 2, 3, 1, 1]
    assert [list(m.constraint_mask_seconds) for m in messages] == [[], [0.002], [], [], [0.001]]
    assert [(d.sequence_id, d.proposed, d.accepted) for d in messages[2].drafts] == [(1, 2, 1)]


def test_an_interval_puts_fast_steps_together_in_order():
    # 3 ms a step, 7 ms interval: a message goes out at the third step after the previous one.
    messages = list(convert.decode_responses(STEPS, samples=True, interval_ms=7,
                                             clock=Clock(0.003)))
    assert [m.step for m in messages] == [2, 4]  # 9 ms after the start, then the call's end
    assert flat(messages) == flat(convert.decode_responses(STEPS, samples=True, interval_ms=0))
    assert [list(m.constraint_mask_seconds) for m in messages] == [[0.002], [0.001]]
    assert [len(m.drafts) for m in messages] == [1, 0]


def test_slow_steps_each_go_out_at_once_and_the_last_is_never_held():
    messages = list(convert.decode_responses(STEPS, samples=True, interval_ms=7,
                                             clock=Clock(0.050)))
    assert [m.step for m in messages] == [0, 1, 2, 3, 4]
    held = list(convert.decode_responses(STEPS[:2], samples=True, interval_ms=10_000,
                                         clock=Clock(0.003)))
    assert [m.step for m in held] == [1] and len(held[0].tokens) == 4


def test_taps_keep_one_message_a_step():
    tapped = [step([(1, 10 + i)], taps={"logits": torch.ones(1, 3)}) for i in range(3)]
    messages = list(convert.decode_responses(tapped, samples=True, interval_ms=10_000, taps=True,
                                             clock=Clock(0.001)))
    assert [m.step for m in messages] == [0, 1, 2]
    assert all(len(m.taps) == 1 for m in messages)


def test_a_rank_that_does_not_sample_sends_only_its_steps():
    messages = list(convert.decode_responses(STEPS, samples=False, interval_ms=7,
                                             clock=Clock(0.003)))
    assert [m.step for m in messages] == [2, 4]
    assert not any(m.tokens or m.drafts or m.constraint_mask_seconds for m in messages)
