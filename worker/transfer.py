"""Host-to-device copies of the small per-step inputs without stalling the host.

`torch.tensor(values, device="cuda")` copies from pageable memory, which makes the host wait until
the device has finished every kernel queued before the copy. Staging the values in page-locked
(pinned) memory lets the copy be queued like a kernel (`non_blocking=True`), so the host can go on
preparing the next step while the device works. On CPU there is nothing to copy.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def pinned_if_cuda(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed host tensor, page-locked when `device` is a GPU (so copies to it can be async)."""
    return torch.zeros(shape, dtype=dtype, pin_memory=device.type == "cuda")


def to_device(values: Sequence | torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`values` as a tensor on `device`; on a GPU through pinned memory and a non-blocking copy.

    torch's caching host allocator keeps the pinned block alive until the copy has run, so the
    staging tensor may go out of scope at once.
    """
    host = values.to(dtype) if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def to_host_async(tensor: torch.Tensor) -> torch.Tensor:
    """A host copy of `tensor`, queued without waiting on a GPU; read it only after the stream (or an
    event recorded after this call) has been synchronised."""
    if tensor.device.type != "cuda":
        return tensor
    out = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    out.copy_(tensor, non_blocking=True)
    return out
