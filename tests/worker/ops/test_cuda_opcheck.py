"""torch.library.opcheck on the CUDA kernels: schema, fake (meta) implementations, autograd
registration and dispatch checked for every op that has a CUDA implementation.

The CPU side runs in test_ops.py on the same cases; this file needs a GPU and a CUDA build of
shardlm_server.worker._C, and is selected by `pytest -m cuda` (scripts/gpu_check.sh).
"""

from __future__ import annotations

import pytest
import torch

from tests.worker.ops.test_ops import CUDA_OK, _opcheck_cases

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not CUDA_OK, reason="needs a GPU and a CUDA build of shardlm_server.worker._C"),
]

# skinny_linear is a CPU kernel: on a GPU the layers call cuBLAS through F.linear.
CUDA_OPS = sorted(set(_opcheck_cases()) - {"skinny_linear"})


def on_cuda(args: tuple) -> tuple:
    return tuple(a.cuda() if isinstance(a, torch.Tensor) else a for a in args)


@pytest.mark.parametrize("name", CUDA_OPS)
def test_opcheck_cuda(name):
    torch.manual_seed(0)
    op = getattr(torch.ops.shardlm, name).default
    torch.library.opcheck(op, on_cuda(_opcheck_cases()[name]))
