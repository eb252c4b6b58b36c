"""The stream writer: turns a sequence's token events into the chunks a client receives.

Text is detokenized incrementally (never half a character) and passed through the stop-sequence
matcher (never text at or past a stop). Each chunk carries the token ids it covers; the final
chunk also carries the finish reason, usage and timings. The reason is the scheduler's (its
finish policy judged each token), except that a stop sequence found in the text ends the stream
with FINISH_REASON_STOP_SEQUENCE after `count` tokens; the handler then has the scheduler end
the call there. The writer only reads the sequence; it never changes it.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from shardlm.common.v1 import common_pb2

from shardlm_server.gateway.batching.sequence import (
    ErrorEvent,
    FinishEvent,
    SequenceState,
    TokenEvent,
)
from shardlm_server.gateway.metrics import Metrics
from shardlm_server.gateway.text.detokenizer import IncrementalDetokenizer
from shardlm_server.gateway.text.stop import StopSequenceMatcher
from shardlm_server.gateway.text.tokenizer import Tokenizer


@dataclass
class ResponseChunk:
    """A part of a Decode or Generate reply stream (the SDK's Chunk is what a client reads)."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[common_pb2.Logprobs] = field(default_factory=list)
    finish_reason: int = common_pb2.FINISH_REASON_UNSPECIFIED
    usage: common_pb2.Usage | None = None
    timings: common_pb2.Timings | None = None

    def fill(self, message) -> None:
        """Copy into a DecodeResponse / GenerateResponse (same field set)."""
        message.token_ids.extend(self.token_ids)
        message.text = self.text
        message.logprobs.extend(self.logprobs)
        message.finish_reason = self.finish_reason
        if self.usage is not None:
            message.usage.CopyFrom(self.usage)
        if self.timings is not None:
            message.timings.CopyFrom(self.timings)


class TokenStream:
    def __init__(self, tokenizer: Tokenizer, seq: SequenceState, *, stop_sequences: list[str],
                 usage: common_pb2.Usage, metrics: Metrics, started_at: float) -> None:
        self.tokenizer = tokenizer
        self.seq = seq
        self.detok = IncrementalDetokenizer(tokenizer, seq.tokens[-8:])
        self.stops = StopSequenceMatcher(stop_sequences)
        self.usage = usage
        self.metrics = metrics
        self.started_at = started_at
        self.token_times: list[float] = []
        self.text_parts: list[str] = []

    def _text_logprobs(self, logprobs: common_pb2.Logprobs | None) -> list[common_pb2.Logprobs]:
        if logprobs is None:
            return []
        decode = self.tokenizer.id_to_token
        logprobs.chosen.text = decode(logprobs.chosen.token_id) or ""
        for alt in logprobs.top:
            alt.text = decode(alt.token_id) or ""
        return [logprobs]

    async def chunks(self) -> AsyncIterator[ResponseChunk]:
        """Chunks until the call finishes; raises the scheduler's error if the step failed.

        The tokens already waiting when the writer runs go out in one chunk (a step verifying
        drafts yields several, and a writer that fell behind catches up): fewer, larger messages,
        and no token waits for one that has not arrived."""
        while True:
            chunk = ResponseChunk()
            event = await self.seq.events.get()
            while isinstance(event, TokenEvent):
                if self._add(chunk, event):
                    yield chunk
                    return
                if self.seq.events.empty():
                    break
                event = self.seq.events.get_nowait()
            else:
                if chunk.token_ids:  # the tokens before the end go out first
                    yield chunk
                if isinstance(event, ErrorEvent):
                    raise event.error
                assert isinstance(event, FinishEvent)
                yield ResponseChunk(text=self.stops.flush(), finish_reason=event.finish_reason,
                                    usage=self._final_usage(), timings=self.timings())
                return
            yield chunk

    def _add(self, chunk: ResponseChunk, event: TokenEvent) -> bool:
        """Add a token and its text to `chunk`; True when it ends the stream (the chunk then
        carries the finish reason, usage and timings)."""
        self._timestamp()
        chunk.token_ids.append(event.token_id)
        chunk.logprobs += self._text_logprobs(event.logprobs)
        text, stopped = self.stops.push(self.detok.push(event.token_id))
        finish = event.finish_reason
        if stopped:
            finish = common_pb2.FINISH_REASON_STOP_SEQUENCE
        if finish != common_pb2.FINISH_REASON_UNSPECIFIED and not stopped:
            tail, stopped_late = self.stops.push(self.detok.flush())
            text += tail + ("" if stopped_late else self.stops.flush())
            if stopped_late or self.stops.stopped:
                finish = common_pb2.FINISH_REASON_STOP_SEQUENCE
        chunk.text += text
        self.text_parts.append(text)
        if finish == common_pb2.FINISH_REASON_UNSPECIFIED:
            return False
        chunk.finish_reason = finish
        chunk.usage, chunk.timings = self._final_usage(), self.timings()
        return True

    @property
    def count(self) -> int:
        """Tokens streamed so far."""
        return len(self.token_times)

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    def _timestamp(self) -> None:
        now = time.monotonic()
        if not self.token_times:
            self.metrics.time_to_first_token.observe(now - self.started_at)
        else:
            self.metrics.inter_token.observe(now - self.token_times[-1])
        self.token_times.append(now)
        self.metrics.generated_tokens.inc()

    def _final_usage(self) -> common_pb2.Usage:
        usage = common_pb2.Usage()
        usage.CopyFrom(self.usage)
        usage.cached_tokens = self.seq.cached_prompt_tokens  # known once its prefill ran
        usage.generated_tokens = len(self.token_times)
        usage.draft_tokens = self.seq.draft_tokens
        usage.accepted_draft_tokens = self.seq.accepted_draft_tokens
        return usage

    def timings(self) -> common_pb2.Timings:
        now = time.monotonic()
        seq, times = self.seq, self.token_times
        t = common_pb2.Timings(total_seconds=now - self.started_at)
        if seq.admitted_at is not None:
            t.queue_seconds = max(0.0, seq.admitted_at - seq.enqueued_at)
        if times:
            t.time_to_first_token_seconds = times[0] - self.started_at
            if len(times) > 1:
                t.mean_inter_token_seconds = (times[-1] - times[0]) / (len(times) - 1)
            t.tokens_per_second = len(times) / max(now - self.started_at, 1e-9)
        return t
