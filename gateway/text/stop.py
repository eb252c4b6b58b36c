"""Stop sequences over streamed text.

The output is the generated text cut at the earliest-starting occurrence of any stop sequence
(the stop sequence itself is not part of it). Text is held back only while it could still be the
start of a stop sequence: the longest suffix of the pending text that is a proper prefix of one.
A complete match is acted on once no other stop sequence can still complete at an earlier start
(possible when one stop sequence contains another, e.g. "User:" and "\\nUser:").
"""

from __future__ import annotations

from collections.abc import Iterable


class StopSequenceMatcher:
    def __init__(self, stop_sequences: Iterable[str]) -> None:
        # An empty stop sequence would match before any text at all; it is ignored.
        self._stops = tuple(dict.fromkeys(s for s in stop_sequences if s))
        self._pending = ""  # received, not yet emitted; always shorter than the longest stop
        self._stopped = False

    @property
    def stopped(self) -> bool:
        """Whether a stop sequence matched (after `push` returned True, or found by `flush`)."""
        return self._stopped

    def push(self, text_delta: str) -> tuple[str, bool]:
        """Add streamed text; return (text safe to emit now, whether a stop sequence matched).
        After a match everything further is dropped."""
        if self._stopped:
            return "", True
        if not self._stops:
            return text_delta, False
        pending = self._pending + text_delta
        match = self._first_match(pending)
        hold_from = self._held_suffix_start(pending)
        if match is not None and match <= hold_from:
            self._pending = ""
            self._stopped = True
            return pending[:match], True
        # No match yet, or one that a stop starting earlier might still pre-empt.
        self._pending = pending[hold_from:]
        return pending[:hold_from], False

    def flush(self) -> str:
        """At the end of the stream: the held-back text, cut at a match still pending if any."""
        if self._stopped:
            return ""
        pending, self._pending = self._pending, ""
        match = self._first_match(pending)
        if match is not None:
            self._stopped = True
            return pending[:match]
        return pending

    def _first_match(self, text: str) -> int | None:
        starts = [i for i in (text.find(s) for s in self._stops) if i >= 0]
        return min(starts) if starts else None

    def _held_suffix_start(self, text: str) -> int:
        """Start of the longest suffix of `text` that is a proper prefix of some stop sequence
        (len(text) when there is none): the text before it can never be part of a match."""
        longest = 0
        for stop in self._stops:
            for length in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:length]):
                    longest = length
                    break
        return len(text) - longest
