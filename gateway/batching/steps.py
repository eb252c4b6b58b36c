"""What the workers are sent for one step: the scheduler's decisions as a PrefillRequest or a
DecodeRequest, with each sequence's block table as the KV manager holds it."""

from __future__ import annotations

from dataclasses import dataclass

from shardlm.worker.v1 import worker_pb2

from shardlm_server.gateway.batching.sequence import SequenceState
from shardlm_server.gateway.kv.manager import KvManager


@dataclass
class PrefillChunk:
    """One sequence's part of a packed prefill: `token_ids` from position `start`; the last
    chunk of its history (`final`) samples a token. `prefix_ids` are the ids of the tokens
    before `start` when they are a cached prefix the workers have not seen as this sequence's."""

    seq: SequenceState
    start: int
    token_ids: list[int]
    final: bool
    prefix_ids: list[int]


def prefill_request(batch: list[PrefillChunk], kv: KvManager) -> worker_pb2.PrefillRequest:
    return worker_pb2.PrefillRequest(sequences=[
        worker_pb2.PrefillSequence(
            sequence_id=c.seq.seq_id, token_ids=c.token_ids, start_position=c.start,
            block_table=kv.table(c.seq.seq_id), sampling=c.seq.sampling,
            stop=c.seq.worker_stop(), sample=c.final, prefix_token_ids=c.prefix_ids,
            constraint=c.seq.worker_constraint() if c.final and c.seq.constraint else None,
            output_start=c.seq.output_start)
        for c in batch])


def decode_request(num_steps: int, plan: dict[int, int], sequences: dict[int, SequenceState],
                   kv: KvManager, stream_interval_ms: int | None = None,
                   ) -> worker_pb2.DecodeRequest:
    """`num_steps` steps; `plan`: each sequence id's tokens in them at most. A sequence whose
    sampling or constraint changed since its last step carries the new ones.
    `stream_interval_ms`: how long the workers may hold a step's tokens to send them with the
    next steps' (DecodeRequest.stream_interval_ms; None leaves it to the workers)."""
    def changes(seq: SequenceState) -> dict:
        changed = {}
        if seq.sampling_changed:
            changed["sampling"] = seq.sampling
        if seq.constraint_changed:
            changed["constraint"] = seq.worker_constraint()
        return changed

    return worker_pb2.DecodeRequest(
        num_steps=num_steps, stream_interval_ms=stream_interval_ms, sequences=[
            worker_pb2.DecodeSequence(
                sequence_id=seq_id, block_table=kv.table(seq_id), max_steps=steps,
                stop=sequences[seq_id].worker_stop(), **changes(sequences[seq_id]))
            for seq_id, steps in plan.items()])
