"""What the batch loop counts for load reports (GetLoads, the KV events' load records): the
generation rate over the last seconds and the share of prompt tokens the prefix cache served."""

from __future__ import annotations

import time
from collections import deque

RATE_WINDOW_S = 10.0


class LoadStats:
    def __init__(self, window_s: float = RATE_WINDOW_S) -> None:
        self.window_s = window_s
        self._generated: deque[tuple[float, int]] = deque()  # (time, tokens) of each step
        self.prompt_tokens = 0  # of every call's first prefill
        self.cached_prompt_tokens = 0  # of those, served by the prefix cache

    def generated(self, tokens: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self._generated.append((now, tokens))
        self._expire(now)

    def admitted(self, prompt_tokens: int, cached_tokens: int) -> None:
        self.prompt_tokens += prompt_tokens
        self.cached_prompt_tokens += cached_tokens

    def tokens_per_second(self, now: float | None = None) -> float:
        """Tokens generated per second over the window (0 when none were). Safe to call from
        another thread (the metrics exporter's): it reads a copy and changes nothing."""
        now = time.monotonic() if now is None else now
        recent = [(t, n) for t, n in tuple(self._generated) if now - t <= self.window_s]
        if not recent:
            return 0.0
        span = max(now - recent[0][0], 1.0)  # a lone burst is not a rate of millions
        return sum(n for _t, n in recent) / span

    @property
    def cache_hit_rate(self) -> float:
        """Prompt tokens served from the prefix cache over all prompt tokens admitted."""
        return self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def _expire(self, now: float) -> None:
        while self._generated and now - self._generated[0][0] > self.window_s:
            self._generated.popleft()
