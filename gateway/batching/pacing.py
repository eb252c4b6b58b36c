"""How many decode steps the batch loop asks of the workers in one call.

Few while prompts wait, so that they are admitted soon; otherwise as many as fit in about
`decode_call_s` at the recent step time, up to `max_decode_steps`. Long calls save round trips
to the workers; short ones let a prompt that arrives during one in sooner.
"""

from __future__ import annotations

from shardlm_server.gateway.config import Limits

_DEFAULTS = Limits()  # the serve settings' defaults (gateway/config.py)
# Decode steps per call while prompts wait, so that they are admitted soon.
BUSY_DECODE_STEPS = 2


class DecodePacer:
    def __init__(self, *, max_decode_steps: int = _DEFAULTS.max_decode_steps,
                 decode_call_s: float = _DEFAULTS.decode_call_s,
                 busy_decode_steps: int = BUSY_DECODE_STEPS) -> None:
        self.max_decode_steps = max_decode_steps
        self.decode_call_s = decode_call_s
        self.busy_decode_steps = busy_decode_steps
        self.step_s = 0.0  # seconds per decode step, a running average (0: none timed yet)

    def steps(self, *, prompts_waiting: bool) -> int:
        """Steps for the next decode call."""
        if prompts_waiting or self.step_s <= 0:
            return self.busy_decode_steps
        fit = int(self.decode_call_s / self.step_s)
        return max(self.busy_decode_steps, min(self.max_decode_steps, fit))

    def timed(self, seconds: float, steps: int) -> None:
        """A call streamed `steps` steps in `seconds` (a call that streamed none changes
        nothing)."""
        if steps > 0:
            step = seconds / steps
            self.step_s = step if self.step_s <= 0 else (self.step_s + step) / 2
