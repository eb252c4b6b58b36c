"""Sampling of one step's tokens across a tensor-parallel group, split in two halves so a step
can be queued before the previous one's tokens are read: `launch` samples on rank 0 and shares
the ids with every rank without waiting for the device; `collect` waits, records the tokens in
the penalty histories and returns them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardlm_server.worker.comm import Communicator
from shardlm_server.worker.engine_types import ResidentSequence
from shardlm_server.worker.grammar import PendingMasks, finish_masks
from shardlm_server.worker.sampling import (
    DeviceSample,
    SampledToken,
    SamplingRow,
    record_outputs,
    sample_on_device,
)


@dataclass
class PendingSample:
    """A sampling queued on the device: `chosen` there, `host` its copy once `done` has fired."""

    rows: list[int]  # the step-buffer row (or logits row) of each sampled sequence
    sampling_rows: list[SamplingRow]  # empty on ranks other than 0, which do not sample
    chosen: DeviceSample
    host: DeviceSample
    done: torch.cuda.Event | None
    mask_seconds: float = 0.0  # making and applying constrained rows' masks (rank 0)

    @property
    def ids(self) -> torch.Tensor:
        return self.chosen.ids


class StepSampler:
    def __init__(self, comm: Communicator, device: torch.device) -> None:
        self.comm = comm
        self.device = device

    def launch(self, logits: torch.Tensor, seqs: list[ResidentSequence], rows: list[int],
               masks: PendingMasks | None = None) -> PendingSample:
        """Sample one token per row of `logits` on rank 0 and share the ids with every rank.
        `masks`: those of the constrained rows, being made since before the forward pass."""
        sampling_rows = ([SamplingRow(s.sampling, s.history, s.draw_position) for s in seqs]
                         if self.comm.rank == 0 else [])
        return self.launch_rows(logits, sampling_rows, rows, masks)

    def launch_rows(self, logits: torch.Tensor, sampling_rows: list[SamplingRow],
                    rows: list[int], masks: PendingMasks | None = None) -> PendingSample:
        """`launch` with each row's sampling state given (on rank 0; empty elsewhere)."""
        chosen: DeviceSample | None = None
        mask_seconds = 0.0
        if self.comm.rank == 0:
            step_masks = finish_masks(masks, logits.shape[1], self.device)
            chosen = sample_on_device(logits, sampling_rows, step_masks)
            mask_seconds = step_masks.seconds if step_masks is not None else 0.0
        if self.comm.world_size > 1:
            ids = (chosen.ids if chosen is not None
                   else torch.zeros(len(rows), dtype=torch.int64, device=self.device))
            self.comm.broadcast(ids, src=0)
            chosen = chosen or DeviceSample(ids)
        assert chosen is not None
        host = chosen.to_host()
        done = None
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
        return PendingSample(rows, sampling_rows, chosen, host, done, mask_seconds)

    def collect(self, pending: PendingSample, record: bool = True) -> list[SampledToken]:
        """Wait for a launched sampling, record it in the penalty histories (unless the caller
        keeps only some rows' tokens and records those), return its tokens."""
        if self.comm.world_size > 1:
            self.comm.synchronize()  # bounded wait: a dead peer raises instead of hanging here
        elif pending.done is not None:
            pending.done.synchronize()
        if self.comm.rank != 0:
            return [SampledToken(t) for t in pending.host.ids.tolist()]
        if record:
            record_outputs(pending.ids, pending.sampling_rows)
        return pending.host.tokens(pending.sampling_rows)
