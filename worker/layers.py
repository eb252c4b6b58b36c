"""Tensor-parallel building blocks. Each layer owns its shard: it knows which slice of the
checkpoint tensor belongs to this rank and which collective restores the full result.

Column-parallel layers split output features (no communication: the next row-parallel layer
consumes the shard). Row-parallel layers split input features and all-reduce the partial sums.
The vocabulary is split by rows for both the embedding and the lm_head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from shardlm_server.worker import ops
from shardlm_server.worker.checkpoint import CheckpointReader
from shardlm_server.worker.comm import Communicator
from shardlm_server.worker.errors import TensorParallelError
from shardlm_server.worker.quant import (
    KERNEL_LAYOUTS,
    QuantizedWeight,
    dequantize_rows,
    fuse_rows,
    read_blocks,
    read_linear,
    regrouped,
)

#: A linear layer's weight: dense, or kept in GGML blocks on CPU (worker.quant).
LinearWeight = torch.Tensor | QuantizedWeight


@dataclass(frozen=True)
class Parallel:
    """Where this rank sits in the tensor-parallel group."""

    comm: Communicator

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def world_size(self) -> int:
        return self.comm.world_size

    def split(self, size: int, what: str) -> int:
        """This rank's share of `size`; a clear error if it does not divide."""
        if size % self.world_size:
            raise TensorParallelError(
                f"{what} ({size}) is not divisible by the tensor-parallel size ({self.world_size})",
                what=what,
                size=size,
                world_size=self.world_size,
            )
        return size // self.world_size


class ColumnParallelLinear:
    """y = x W^T + b with W's rows (output features) split over ranks.

    Several checkpoint tensors may be fused into one GEMM (q/k/v, gate/up): each source is sliced
    by rank and the slices are concatenated, so one matmul per layer replaces two or three.
    """

    def __init__(self, weight: LinearWeight, bias: torch.Tensor | None) -> None:
        self.weight = weight
        self.bias = bias

    @classmethod
    def load(
        cls,
        reader: CheckpointReader,
        parallel: Parallel,
        names: list[str],
        out_features: list[int],
        in_features: int,
        bias: bool,
    ) -> ColumnParallelLinear:
        read = dict(shard_dim=0, rank=parallel.rank, world_size=parallel.world_size)
        weights = [
            read_linear(reader, f"{n}.weight", (o, in_features), regroup=False, **read)
            for n, o in zip(names, out_features, strict=True)
        ]
        biases = (
            [reader.read(f"{n}.bias", (o,), **read) for n, o in zip(names, out_features, strict=True)]
            if bias
            else None
        )
        return cls(
            fuse_rows(weights, reader.dtype), torch.cat(biases).contiguous() if biases else None
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return ops.linear(x, self.weight, self.bias)


class RowParallelLinear:
    """y = sum_over_ranks(x_r W_r^T) + b with W's columns (input features) split over ranks."""

    def __init__(self, weight: LinearWeight, bias: torch.Tensor | None, parallel: Parallel) -> None:
        self.weight = weight
        self.bias = bias
        self.parallel = parallel

    @classmethod
    def load(
        cls,
        reader: CheckpointReader,
        parallel: Parallel,
        name: str,
        out_features: int,
        in_features: int,
        bias: bool,
    ) -> RowParallelLinear:
        weight = read_linear(
            reader,
            f"{name}.weight",
            (out_features, in_features),
            shard_dim=1,
            rank=parallel.rank,
            world_size=parallel.world_size,
        )
        b = reader.read(f"{name}.bias", (out_features,)) if bias else None
        return cls(weight, b, parallel)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(ops.linear(x, self.weight, self.fused_bias))

    @property
    def fused_bias(self) -> torch.Tensor | None:
        """The bias a kernel may add to this rank's product: all of it on a single rank, none
        where the partial sums still have to be reduced (see `reduce`)."""
        return self.bias if self.parallel.world_size == 1 else None

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """This rank's product (with `fused_bias` added) -> the layer's output, in place."""
        if self.parallel.world_size > 1:
            self.parallel.comm.all_reduce(partial)
            if self.bias is not None:  # added once, after the sum, not once per rank
                partial += self.bias
        return partial


class VocabParallelEmbedding:
    """Embedding whose vocabulary rows are split over ranks; ids outside a rank's range give zero
    rows there, so the all-reduce yields each id's row exactly once.

    A table the checkpoint stores in kernel-type blocks (worker.quant.read_blocks) stays packed:
    a lookup dequantizes only the rows it reads (B per decode step), to the values the dense
    table would hold, so no float copy of it is ever resident. A tied lm_head shares those blocks
    (`tied_head`)."""

    def __init__(self, weight: LinearWeight, parallel: Parallel, dtype: torch.dtype) -> None:
        self.weight = weight
        self.parallel = parallel
        self.dtype = dtype  # of the rows a lookup returns: the serving dtype
        self.start = parallel.rank * weight.shape[0]
        self.end = self.start + weight.shape[0]

    @classmethod
    def load(
        cls, reader: CheckpointReader, parallel: Parallel, name: str, vocab_size: int, hidden: int
    ) -> VocabParallelEmbedding:
        parallel.split(vocab_size, "vocab_size")
        read = dict(shard_dim=0, rank=parallel.rank, world_size=parallel.world_size)
        weight = read_blocks(reader, name, (vocab_size, hidden), **read)
        if weight is None:
            weight = reader.read(name, (vocab_size, hidden), **read)
        return cls(weight, parallel, reader.dtype)

    def tied_head(self) -> QuantizedWeight | None:
        """The weight of an lm_head tied to this embedding when the table is packed: the same
        blocks, 4-bit ones regrouped once for the head's kernel (`regrouped`; the lookup reads
        that layout too), so one copy serves both. None for a dense table (the head then
        decides: worker.quant.read_linear with `dense=`)."""
        if not isinstance(self.weight, QuantizedWeight):
            return None
        self.weight = regrouped(self.weight)
        return self.weight

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if not isinstance(self.weight, QuantizedWeight):
            return F.embedding(ids, self.weight)
        flat = ids.reshape(-1).to(torch.int64)
        if flat.device.type == "cpu" and self.weight.qtype in KERNEL_LAYOUTS:
            rows = ops.quant_rows(self.weight, flat.contiguous())  # one compiled call a step
        else:
            rows = dequantize_rows(self.weight, flat)
        return rows.to(self.dtype).reshape(*ids.shape, rows.shape[-1])

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        if self.parallel.world_size == 1:
            return self._lookup(ids)
        inside = (ids >= self.start) & (ids < self.end)
        local = torch.where(inside, ids - self.start, torch.zeros_like(ids))
        out = self._lookup(local)
        out.mul_(inside.unsqueeze(-1).to(out.dtype))
        self.parallel.comm.all_reduce(out)
        return out


class ParallelLMHead:
    """Logits over the vocabulary: each rank computes its rows' logits, all-gather restores all."""

    def __init__(self, weight: LinearWeight, parallel: Parallel) -> None:
        self.weight = weight
        self.parallel = parallel

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = ops.linear(hidden, self.weight)
        if self.parallel.world_size > 1:
            logits = self.parallel.comm.all_gather(logits)
        return logits
