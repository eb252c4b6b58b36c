"""KV events: the prefix cache's changes, published so that routers (SMG's SubscribeKvEvents, in
the message formats of `smg-grpc-proto`'s common.proto) see what each replica holds.

What is published. A block the prefix cache starts sharing under the routable salt (the salt of
a request with neither an identity nor a salt of its own: what a router's requests get) is
`stored`, with its tokens and its parent (the block before it in its chain); such a block
reclaimed for other work is `removed`; the whole cache going (ResetCache, FlushCache, a new
Load, lost workers) is `cleared`. Blocks shared only among one identity's or one salt's requests
are never published: the isolation rules that keep them from other callers keep them from the
routers too. A block's hash is the first 8 bytes of its chain key (gateway/kv/allocator.py), so
it names the block's whole prefix; routers hash the tokens themselves.

Batches. The changes of one scheduler iteration form one batch with the next sequence number.
Numbers start at the gateway's start time in seconds << 20, so a restarted gateway never reuses
a number a subscriber of the previous one holds. A bounded history of recent batches lets a
subscriber resume from its last number without losing or repeating one; from 0 it gets a state
snapshot (a clear and every live block, parents first) and then the live batches. A subscriber
whose number the history no longer reaches gets a snapshot numbered to fill the gap, or, past
that, DATA_LOSS (resubscribe from 0). Each subscriber reads from a bounded queue of its own: one
that falls behind is dropped to a snapshot, never waited for. While nothing changes, each stream
gets a load record every second (`load_only`).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc
from shardlm.errors import ShardLMError
from smg_grpc_proto.generated import common_pb2 as kv_pb2

HISTORY_BATCHES = 4096  # batches kept for subscribers resuming from a sequence number
QUEUE_BATCHES = 1024  # batches one subscriber may fall behind before it is resynced
SNAPSHOT_BLOCKS = 2048  # blocks per snapshot chunk (keeps messages far below gRPC's 4 MiB)
MAX_GAP_CHUNKS = 4 * HISTORY_BATCHES  # past this, a lost subscriber resubscribes from 0
HEARTBEAT_S = 1.0


def block_hash(key: bytes) -> int:
    """The published hash of a block: the first 8 bytes of its chain key, as a signed int64."""
    return int.from_bytes(key[:8], "little", signed=True)


@dataclass
class _Block:
    hash: int
    parent: int | None
    tokens: list[int]
    depth: int  # its index in its chain: a snapshot lists parents first


class _Subscriber:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.queue: deque[kv_pb2.KvEventBatch] = deque()
        self.lagged = False
        self.wake = asyncio.Event()

    def offer(self, batch: kv_pb2.KvEventBatch) -> None:
        if not self.lagged:
            if len(self.queue) >= self.limit:
                self.lagged = True  # resynced with a snapshot: the scheduler never waits
                self.queue.clear()
            else:
                self.queue.append(batch)
        self.wake.set()


class KvEventLog:
    """The publisher: fed by the allocator, flushed by the batch loop, read by subscribers."""

    def __init__(self, *, enabled: bool = True, history_batches: int = HISTORY_BATCHES,
                 queue_batches: int = QUEUE_BATCHES, heartbeat_s: float = HEARTBEAT_S) -> None:
        self.enabled = enabled
        self.withdrawn = False  # the gateway is shutting down: nothing more is stored
        self.routable_salt: bytes | None = None  # set for each loaded model
        # The load record each batch carries while anyone subscribes (gateway/api/load_report).
        self.load: Callable[[], kv_pb2.EngineLoad] | None = None
        self.heartbeat_s = heartbeat_s
        self._queue_batches = queue_batches
        self._base = int(time.time()) << 20
        self._last = self._base  # the newest batch's number
        self._history: deque[kv_pb2.KvEventBatch] = deque(maxlen=history_batches)
        self._pending: list[kv_pb2.KvCacheEvent] = []
        self._live: dict[int, _Block] = {}
        self._subscribers: set[_Subscriber] = set()
        self._event_id = 0
        self._sample = 0

    @property
    def last_sequence_number(self) -> int:
        return self._last

    @property
    def live_blocks(self) -> int:
        return len(self._live)

    # ----------------------------------------------------------------- the allocator's side
    def stored(self, salt: bytes, key: bytes, parent: bytes | None, tokens: list[int],
               depth: int) -> None:
        """A block now shared under `salt` with chain key `key` (`parent`: the key of the block
        before it; None for a chain's first)."""
        if not self.enabled or self.withdrawn or salt != self.routable_salt:
            return
        block = _Block(block_hash(key), None if parent is None else block_hash(parent),
                       list(tokens), depth)
        if block.hash in self._live:
            return
        self._live[block.hash] = block
        last = self._pending[-1] if self._pending else None
        proto = kv_pb2.KvBlock(block_hash=block.hash, token_ids=block.tokens,
                               block_size=len(block.tokens))
        if (last is not None and last.WhichOneof("data") == "stored"
                and last.stored.blocks[-1].block_hash == block.parent):
            last.stored.blocks.append(proto)  # the next block of the same chain
            return
        self._pending.append(self._event(stored=_stored([proto], block.parent)))

    def removed(self, key: bytes) -> None:
        """A block was reclaimed: its prefix is no longer cached."""
        h = block_hash(key)
        if self._live.pop(h, None) is None:
            return
        last = self._pending[-1] if self._pending else None
        if last is not None and last.WhichOneof("data") == "removed":
            last.removed.block_hashes.append(h)
            return
        self._pending.append(self._event(removed=kv_pb2.KvBlocksRemoved(block_hashes=[h])))

    def cleared(self) -> None:
        """Every cached prefix is gone."""
        if not self.enabled:
            return
        self._live.clear()
        self._pending = [self._event(cleared=kv_pb2.KvCacheCleared())]

    def withdraw(self) -> None:
        """Shutdown: tell the routers at once that nothing here is worth routing to (a clear),
        and publish no block from now on, so prefix hits stop pointing at this replica."""
        if not self.enabled or self.withdrawn:
            return
        self.withdrawn = True
        self.cleared()
        self.flush()

    def _event(self, **data) -> kv_pb2.KvCacheEvent:
        self._event_id += 1
        return kv_pb2.KvCacheEvent(event_id=self._event_id, **data)

    # ----------------------------------------------------------------- the batch loop's side
    def flush(self) -> None:
        """The changes since the last flush become one batch, sent to every subscriber."""
        if not self._pending:
            return
        self._last += 1
        batch = kv_pb2.KvEventBatch(sequence_number=self._last, timestamp=time.time(),
                                    events=self._pending)
        self._pending = []
        if self._subscribers:  # else computed when a resumed subscriber first reads it
            self._with_load(batch)
        self._history.append(batch)
        for sub in self._subscribers:
            sub.offer(batch)

    def _with_load(self, batch: kv_pb2.KvEventBatch) -> kv_pb2.KvEventBatch:
        """The batch with its load record, taken the first time anyone reads it and kept with it
        (a replay sends the same batch again); a load report costs a pass over the queue, so a
        batch nobody reads never pays for one."""
        if self.load is not None and not batch.HasField("load"):
            batch.load.CopyFrom(self._record())
        return batch

    def _record(self, load_only: bool = False) -> kv_pb2.EngineLoad:
        assert self.load is not None
        self._sample += 1
        record = self.load()
        record.sample, record.load_only = self._sample, load_only
        return record

    # ----------------------------------------------------------------- subscribers
    async def subscribe(self, start: int) -> AsyncIterator[kv_pb2.KvEventBatch]:
        """Batches after `start` (0: a state snapshot first), then live ones, until the caller
        stops reading. DATA_LOSS when `start` is not one this publisher can continue from."""
        sub = _Subscriber(self._queue_batches)
        self._subscribers.add(sub)  # before the first batch is chosen: no await in between
        try:
            sent = start
            for batch in self._catch_up(start):
                yield batch
                sent = batch.sequence_number
            while True:
                if sub.lagged:
                    sub.lagged = False
                    for batch in self._snapshot(sent + 1, self._last):
                        yield batch
                        sent = batch.sequence_number
                elif sub.queue:
                    batch = sub.queue.popleft()
                    yield batch
                    sent = batch.sequence_number
                else:
                    sub.wake.clear()
                    try:
                        await asyncio.wait_for(sub.wake.wait(), self.heartbeat_s)
                    except TimeoutError:
                        if self.load is not None:
                            yield kv_pb2.KvEventBatch(sequence_number=sent,
                                                      timestamp=time.time(),
                                                      load=self._record(load_only=True))
        finally:
            self._subscribers.discard(sub)

    def _catch_up(self, start: int) -> list[kv_pb2.KvEventBatch]:
        last = self._last
        if start == 0:
            return self._snapshot(None, last)
        if self._base <= start <= last:
            oldest = self._history[0].sequence_number if self._history else last + 1
            if start + 1 >= oldest:
                return [self._with_load(b) for b in self._history if b.sequence_number > start]
            if last - start <= MAX_GAP_CHUNKS:
                return self._snapshot(start + 1, last)
        raise ShardLMError(
            f"KV event sequence {start} cannot be continued (this publisher numbers from "
            f"{self._base + 1}, its newest batch is {last}); resubscribe from zero for a state "
            "snapshot", reason="KV_EVENTS_RESUBSCRIBE", code=grpc.StatusCode.DATA_LOSS,
            metadata={"start_sequence_number": start, "last_sequence_number": last})

    def _snapshot(self, first: int | None, last: int) -> list[kv_pb2.KvEventBatch]:
        """The live blocks as chunks numbered up to `last`: from `first` (filling a
        subscriber's gap), or as many as the blocks need (a new subscriber, `first` None)."""
        blocks = sorted(self._live.values(), key=lambda b: b.depth)
        per_chunk = [blocks[i:i + SNAPSHOT_BLOCKS] for i in range(0, len(blocks), SNAPSHOT_BLOCKS)]
        count = max(1, len(per_chunk)) if first is None else last - first + 1
        first = last - count + 1
        chunks = []
        for index in range(count):
            events = [kv_pb2.KvCacheEvent(cleared=kv_pb2.KvCacheCleared())] if index == 0 else []
            mine = per_chunk[index] if index < len(per_chunk) else []
            if index == count - 1:  # fewer chunks than parts: the last takes the rest
                mine = [b for part in per_chunk[index:] for b in part]
            events += [kv_pb2.KvCacheEvent(stored=_stored(
                [kv_pb2.KvBlock(block_hash=b.hash, token_ids=b.tokens,
                                block_size=len(b.tokens))], b.parent)) for b in mine]
            chunks.append(kv_pb2.KvEventBatch(
                sequence_number=first + index, timestamp=time.time(), events=events,
                snapshot=kv_pb2.KvSnapshotChunk(index=index, count=count, blocks=len(blocks))))
        if self.load is not None:
            chunks[-1].load.CopyFrom(self._record())
        return chunks


def _stored(blocks: list[kv_pb2.KvBlock], parent: int | None) -> kv_pb2.KvBlocksStored:
    stored = kv_pb2.KvBlocksStored(blocks=blocks, tier=kv_pb2.KV_CACHE_TIER_DEVICE,
                                   locality=kv_pb2.KV_CACHE_LOCALITY_LOCAL)
    if parent is not None:
        stored.parent_block_hash = parent
    return stored
