"""A test's way to run decode steps that a CUDA graph would replay eagerly instead, on the graph's
own padded buffers: the same shapes, hence the same kernels, so the tokens must equal the
replay's exactly (how the graphs are checked). Production code has no switch for it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from shardlm_server.worker.decode_runner import DecodeCall
from shardlm_server.worker.model import Taps


@contextmanager
def graph_steps_run_eagerly() -> Iterator[None]:
    """Inside, every decode step runs `StepBuffers.forward` on its call's buffers (a graph's
    bucket-sized ones where a graph serves the call) instead of replaying a graph."""
    def eager(call: DecodeCall, taps: Taps | None = None) -> torch.Tensor:
        return call.buffers.forward(call.runner.model, call.runner.kv_caches, call.rows,
                                    call.max_context, taps)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(DecodeCall, "run", eager)
        yield
