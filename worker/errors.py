"""Typed errors raised by the worker engine.

Each carries a stable `reason` (the ErrorReason names of proto/shardlm/common/v1/common.proto) so
the service layer can map it to a gRPC status without parsing messages.
"""

from __future__ import annotations


class EngineError(Exception):
    """Base class: `reason` is stable, `message` is safe to show to a client."""

    reason = "INTERNAL"

    def __init__(self, message: str, **metadata: str) -> None:
        super().__init__(message)
        self.message = message
        self.metadata = {k: str(v) for k, v in metadata.items()}


class CheckpointError(EngineError):
    """The checkpoint folder is unreadable, incomplete or inconsistent with its config."""

    reason = "CHECKPOINT_INVALID"


class UnsupportedArchitectureError(CheckpointError):
    reason = "UNSUPPORTED_ARCHITECTURE"


class TensorParallelError(EngineError):
    """The model cannot be split over the requested number of ranks."""

    reason = "TENSOR_PARALLEL_MISMATCH"


class InvalidRequestError(EngineError):
    """A request to the engine is malformed (bad block table, unknown sequence, bad token id)."""

    reason = "INVALID_FIELD"


class SequenceNotCachedError(EngineError):
    """A continued prefill or decode names a sequence whose cache state this worker lacks."""

    reason = "SEQUENCE_NOT_CACHED"


class CacheCapacityError(EngineError):
    """The KV cache cannot hold what was asked (budget too small, block out of range)."""

    reason = "KV_CACHE_FULL"


class DeviceOutOfMemoryError(EngineError):
    reason = "OUT_OF_MEMORY"
