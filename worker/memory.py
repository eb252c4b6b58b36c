"""What a loaded model holds in memory, and giving back what loading it no longer needs.

`weight_bytes` counts the tensors a model keeps (each storage once: a tied head sharing the
embedding's blocks counts once), as model information reports them. `release_load_memory` runs
after a load: it closes the GGUF file's memory map (the weights were copied out of it) and hands
the heap memory the load freed (dequantized temporaries, the layouts a regroup replaced) back to
the OS, which glibc otherwise keeps for later allocations, counted in the worker's RSS.
`trim_after_prefill` does the same after a long prefill on CPU: its activations (tens of MB per
2,048-token chunk) are freed into glibc's arenas, which kept ~140 MB of a 135M model's worker
after 8 prompts of 8,100 tokens; a trim costs a few milliseconds against a prefill's seconds.
"""

from __future__ import annotations

import ctypes
import ctypes.util

import torch

from shardlm_server.worker.gguf.file import drop_cache
from shardlm_server.worker.quant import QuantizedWeight

# Model attributes that hold no weights: the rotary tables ("cos_sin", "layer_cos_sin", ...,
# derived at load), the communicator, the native stack (it binds the layers' own tensors).
_NOT_WEIGHTS = frozenset({"cfg", "parallel", "comm", "device", "stack"})


def _holds_weights(name: str) -> bool:
    return name not in _NOT_WEIGHTS and "cos_sin" not in name


def weight_bytes(model: object) -> int:
    """Bytes of the distinct tensor storages reachable from `model`'s layers (dense tensors at
    their dtype, packed weights at their block size)."""
    seen: set[int] = set()
    visited: set[int] = set()

    def walk(value: object) -> int:
        if isinstance(value, QuantizedWeight):
            value = value.blocks
        if isinstance(value, torch.Tensor):
            storage = value.untyped_storage()
            key = storage.data_ptr()
            if key in seen or not storage.nbytes():
                return 0
            seen.add(key)
            return storage.nbytes()
        if isinstance(value, list | tuple):
            return sum(walk(v) for v in value)
        if id(value) in visited or not type(value).__module__.startswith("shardlm_server.worker"):
            return 0  # communicators and the like: no weights
        visited.add(id(value))
        fields = getattr(value, "__dict__", {})
        return sum(walk(v) for k, v in fields.items() if _holds_weights(k))

    return walk(model)


# Prefill steps of at least this many tokens on CPU trim the heap afterwards (module notes);
# shorter ones free too little to be worth a trim (~10 ms, 1% of a 1,024-token prefill).
TRIM_AFTER_PREFILL_TOKENS = 1024


def _find_malloc_trim():
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None


_MALLOC_TRIM = _find_malloc_trim()


def trim_heap() -> None:
    """Hand the heap memory glibc keeps for later allocations back to the OS (a no-op where the
    C library has no malloc_trim)."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def release_load_memory() -> None:
    """After a load (module notes)."""
    drop_cache()
    trim_heap()


def trim_after_prefill(device: torch.device, tokens: int) -> None:
    """After a prefill step of `tokens` tokens (module notes); GPU memory is torch's own."""
    if device.type == "cpu" and tokens >= TRIM_AFTER_PREFILL_TOKENS:
        trim_heap()
