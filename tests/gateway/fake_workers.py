"""A worker pool without processes, for scheduler tests: it keeps each sequence's cached tokens
as a worker does, checks what the scheduler sends (start positions, block tables) and "samples"
a token that is a fixed function of the history, so a sequence rebuilt after eviction or
preemption must continue exactly as it would have."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from shardlm.common.v1 import common_pb2
from shardlm.errors import ShardLMError
from shardlm.worker.v1 import worker_pb2


def next_token(history: list[int]) -> int:
    """The fake model: deterministic, and different for different histories."""
    return (history[-1] * 7 + len(history) * 3) % 97 + 3


def greedy(prompt: list[int], n: int) -> list[int]:
    """The n tokens the fake model generates after `prompt`."""
    history = list(prompt)
    for _ in range(n):
        history.append(next_token(history))
    return history[len(prompt):]


@dataclass
class FakeSequence:
    cached: list[int]
    pending: int | None = None
    generated: int = 0
    stop: common_pb2.StopConditions = field(default_factory=common_pb2.StopConditions)
    finished: bool = False


class FakeWorkerPool:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.sequences: dict[int, FakeSequence] = {}
        self.prefills: list[worker_pb2.PrefillRequest] = []
        self.decodes: list[worker_pb2.DecodeRequest] = []
        self.resets: list[int] = []
        # (block, offset) -> the history whose last token's K/V the slot holds
        self.slots: dict[tuple[int, int], list[int]] = {}
        self.fail_next_decode: ShardLMError | None = None
        self.step_delay_s = 0.0  # a decode step's duration, for tests that act mid-call
        self.prefill_gate: asyncio.Event | None = None  # a prefill waits for it when set
        # Speculative decoding: a sequence's step also yields 0..max_accepted accepted drafts
        # (chosen by `drafts`), within the tokens the call allows it.
        self.drafts: random.Random | None = None
        self.max_accepted = 0

    def _write_blocks(self, item: worker_pb2.PrefillSequence, prefix: list[int]) -> None:
        """Record which token each written cache slot holds, refusing to overwrite a slot with
        a different token than it holds for a sequence that shares the block."""
        history = prefix + list(item.token_ids)
        for position in range(item.start_position, len(history)):
            block = item.block_table[position // self.block_size]
            self.slots[(block, position % self.block_size)] = history[:position + 1]

    def _check_prefix_blocks(self, item: worker_pb2.PrefillSequence) -> None:
        """A cached prefix's blocks must hold exactly the prefix's tokens."""
        prefix = list(item.prefix_token_ids)
        for position in range(item.start_position):
            block = item.block_table[position // self.block_size]
            assert self.slots.get((block, position % self.block_size)) == prefix[:position + 1], \
                f"block {block} does not hold the prefix at position {position}"

    def _check_table(self, table, tokens: int) -> None:
        assert len(table) * self.block_size >= tokens, (list(table), tokens)
        assert len(set(table)) == len(table)

    def _sample(self, seq: FakeSequence) -> worker_pb2.SequenceToken:
        token = next_token(seq.cached)
        seq.pending = token
        seq.generated += 1
        # As a worker does: the sequence takes no more steps of this call after a stop id or its
        # last allowed token (the gateway applies the same limits to each token itself).
        seq.finished = token in seq.stop.stop_token_ids or bool(
            seq.stop.max_new_tokens and seq.generated >= seq.stop.max_new_tokens)
        return worker_pb2.SequenceToken(token_id=token)

    async def prefill(self, request: worker_pb2.PrefillRequest) -> worker_pb2.PrefillResponse:
        self.prefills.append(request)
        if self.prefill_gate is not None:
            await self.prefill_gate.wait()
        reply = worker_pb2.PrefillResponse()
        for item in request.sequences:
            known = self.sequences.get(item.sequence_id)
            if item.prefix_token_ids:  # a cached prefix: its blocks are written already
                assert len(item.prefix_token_ids) == item.start_position
                self._check_prefix_blocks(item)
                prefix = list(item.prefix_token_ids)
            else:
                if item.start_position:
                    assert known is not None and len(known.cached) >= item.start_position, \
                        "prefill from a position the worker does not hold"
                prefix = known.cached[:item.start_position] if known else []
            self._write_blocks(item, prefix)
            seq = FakeSequence(prefix + list(item.token_ids), stop=item.stop)
            self._check_table(item.block_table, len(seq.cached))
            self.sequences[item.sequence_id] = seq
            if item.sample:
                token = self._sample(seq)
                token.sequence_id = item.sequence_id
                reply.tokens.append(token)
        return reply

    async def decode(self, request: worker_pb2.DecodeRequest) -> AsyncIterator[worker_pb2.DecodeResponse]:
        self.decodes.append(request)
        if self.fail_next_decode is not None:
            error, self.fail_next_decode = self.fail_next_decode, None
            raise error
        plan = []
        item_tables: dict[int, list[int]] = {}
        for item in request.sequences:
            seq = self.sequences[item.sequence_id]
            assert seq.pending is not None, "decode of a sequence with no pending token"
            if item.HasField("stop"):
                seq.stop, seq.generated, seq.finished = item.stop, 0, False
            assert not seq.finished, "decode of a finished sequence"
            tokens = item.max_steps or request.num_steps  # at most, drafts accepted included
            self._check_table(item.block_table, len(seq.cached) + tokens)
            plan.append((item.sequence_id, seq, tokens))
            item_tables[item.sequence_id] = list(item.block_table)
        made = dict.fromkeys(item_tables, 0)
        # A stream interval makes a real worker send a few steps to a message; here every
        # step of the call goes in one, the most the interval can hold back.
        held = worker_pb2.DecodeResponse()
        for step in range(request.num_steps):
            reply = worker_pb2.DecodeResponse(step=step)
            for sid, seq, tokens in plan:
                accepted = self.drafts.randint(0, self.max_accepted) if self.drafts else 0
                for _ in range(1 + accepted):
                    if seq.finished or made[sid] >= tokens:
                        break
                    seq.cached.append(seq.pending)
                    position = len(seq.cached) - 1
                    block = item_tables[sid][position // self.block_size]
                    self.slots[(block, position % self.block_size)] = list(seq.cached)
                    token = self._sample(seq)
                    token.sequence_id = sid
                    reply.tokens.append(token)
                    made[sid] += 1
            if not reply.tokens:
                break
            await asyncio.sleep(self.step_delay_s)
            if request.stream_interval_ms:
                held.MergeFrom(reply)
            else:
                yield reply
        if request.stream_interval_ms and held.tokens:
            yield held

    async def reset(self, request: worker_pb2.ResetCacheRequest) -> worker_pb2.ResetCacheResponse:
        for sid in request.sequence_ids:
            self.sequences.pop(sid, None)
            self.resets.append(sid)
        return worker_pb2.ResetCacheResponse()

    def stop_ids_sent(self, sequence_id: int) -> set[int]:
        """Every stop id the scheduler sent this sequence, in any step."""
        sent = set()
        for request in self.prefills + self.decodes:
            for item in request.sequences:
                if item.sequence_id == sequence_id:
                    sent.update(item.stop.stop_token_ids)
        return sent
