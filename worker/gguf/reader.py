"""Serving a GGUF file's tensors under ShardLM's names and layout, a rank's slice at a time.

A slice is cut from the packed data before anything is dequantized: output-feature (row) slices
are row ranges of the blocks, input-feature (column) slices are byte ranges when they fall on block
boundaries. Only a column slice that splits a block dequantizes its rows whole before cutting.
`read` dequantizes with the `gguf` package's numpy kernels; `read_packed` hands the blocks over
as they are, for a layer that computes on quantized weights.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import torch

from shardlm_server.worker.checkpoint import PackedTensor
from shardlm_server.worker.config import ModelConfig
from shardlm_server.worker.errors import CheckpointError
from shardlm_server.worker.fused import FusedRows
from shardlm_server.worker.gguf.config import gguf_config
from shardlm_server.worker.gguf.file import GGUFTensor, open_gguf
from shardlm_server.worker.gguf.names import hf_rows, is_rotary_permuted, shardlm_name
from shardlm_server.worker.gguf.rope_tensors import config_tensors


class GGUFCheckpointReader:
    """The `worker.checkpoint.CheckpointReader` of a GGUF file."""

    format = "gguf"

    def __init__(self, path: str | Path, device: torch.device, dtype: torch.dtype) -> None:
        self.file = open_gguf(path)
        self.config: ModelConfig = gguf_config(self.file)
        self.architecture = self.file.get("general.architecture")
        self.device = device
        self.dtype = dtype
        self.quantize = ""  # set by open_checkpoint
        # Tensors ShardLM does not know keep their GGUF name, so the leftover check can name them.
        self._tensors: dict[str, GGUFTensor] = {
            shardlm_name(t.name, self.architecture) or t.name: t
            for t in self.file.tensors.values()}
        # phi3's fused q/k/v and gate/up tensors, served as their parts (worker/fused.py).
        self._fused = FusedRows(self._tensors, lambda: self.config)
        # Tensors the configuration was read from (rope factors) are no leftovers.
        self._consumed: set[str] = set(config_tensors(self.file))

    @property
    def tensor_types(self) -> list[str]:
        return self.file.tensor_type_names()

    def has(self, name: str) -> bool:
        return name in self._tensors or self._fused.get(name) is not None

    def _stored(self, name: str) -> tuple[GGUFTensor | None, int, tuple[int, ...] | None]:
        """The tensor holding `name`, the row where `name` starts in it, and the shape it has
        where `name` is part of a fused tensor (None otherwise)."""
        part = None if name in self._tensors else self._fused.get(name)
        if part is None:
            return self._tensors.get(name), 0, None
        return self._tensors[part.stored], part.start, (part.rows,)

    def _tensor(self, name: str, expected_shape: tuple[int, ...]) -> tuple[GGUFTensor, int]:
        tensor, offset, fused_rows = self._stored(name)
        if tensor is None:
            raise CheckpointError(f"GGUF file lacks the tensor ShardLM calls '{name}'", tensor=name)
        want = tuple(expected_shape) if fused_rows is None else (*fused_rows, *expected_shape[1:])
        if tensor.shape != want:
            raise CheckpointError(f"tensor '{tensor.name}' has shape {list(tensor.shape)}, "
                                  f"the metadata implies {list(want)}", tensor=tensor.name)
        self._consumed.add(name)
        return tensor, offset

    def _rows(self, name: str, tensor: GGUFTensor, start: int, stop: int) -> slice | np.ndarray:
        """The stored rows that make up ShardLM rows [start, stop), in ShardLM's order."""
        if not is_rotary_permuted(name, self.architecture):
            return slice(start, stop)
        head_dim = self.config.head_dim
        if start % head_dim or stop % head_dim:
            raise CheckpointError(f"tensor '{tensor.name}' cannot be split inside a head",
                                  tensor=tensor.name)
        return start + hf_rows((stop - start) // head_dim, head_dim)

    def _select(self, name: str, expected_shape: tuple[int, ...], shard_dim: int | None,
                rank: int, world_size: int) -> tuple[GGUFTensor, np.ndarray, slice | None]:
        """This rank's stored data of `name` and the column slice still to cut after dequantizing
        (None when the data already is the slice). A part of a fused tensor is its row range
        (`offset` on), the rank's slice cut inside it."""
        tensor, offset = self._tensor(name, expected_shape)
        shape = tensor.shape
        split = shard_dim is not None and world_size > 1
        if len(shape) == 1:  # norms and biases: small, always float in practice
            data = tensor.data.reshape(1, -1)
            rows = self._rows(name, tensor, offset, offset + expected_shape[0])
            if split or offset or expected_shape[0] != shape[0]:
                if tensor.is_quantized:
                    raise CheckpointError(f"block-quantized 1-D tensor '{tensor.name}' cannot "
                                          "be sliced", tensor=tensor.name)
            data = data[:, rows] if not tensor.is_quantized else data
            if split:
                size = expected_shape[0] // world_size
                return tensor, data[:, rank * size:(rank + 1) * size], None
            return tensor, data, None
        start, stop = offset, offset + expected_shape[0]
        if split and shard_dim == 0:
            size = expected_shape[0] // world_size
            start, stop = offset + rank * size, offset + (rank + 1) * size
        data = tensor.data[self._rows(name, tensor, start, stop)]
        if not (split and shard_dim == 1):
            return tensor, data, None
        size = shape[1] // world_size
        columns = slice(rank * size, (rank + 1) * size)
        if not tensor.is_quantized:
            width = 2 if tensor.qtype == gguf.GGMLQuantizationType.BF16 else 1
            return tensor, data[:, columns.start * width:columns.stop * width], None
        block = tensor.block_size
        if columns.start % block or columns.stop % block:
            return tensor, data, columns  # the slice splits a block: dequantize rows whole
        per_block = gguf.GGML_QUANT_SIZES[tensor.qtype][1]
        return tensor, data[:, columns.start // block * per_block:columns.stop // block * per_block], None

    def read(self, name: str, expected_shape: tuple[int, ...], *, shard_dim: int | None = None,
             rank: int = 0, world_size: int = 1) -> torch.Tensor:
        """`name` (this rank's slice of it), dequantized and cast to the serving dtype."""
        tensor, data, columns = self._select(name, expected_shape, shard_dim, rank, world_size)
        try:
            values = gguf.quants.dequantize(np.ascontiguousarray(data), tensor.qtype)
        except Exception as exc:
            raise CheckpointError(f"tensor '{tensor.name}' could not be dequantized: {exc}",
                                  tensor=tensor.name) from exc
        if columns is not None:
            values = values[:, columns]
        if len(expected_shape) == 1:
            values = values.reshape(-1)
        out = torch.from_numpy(np.array(values, dtype=np.float32, copy=True))
        return out.to(device=self.device, dtype=self.dtype).contiguous()

    def read_packed(self, name: str, expected_shape: tuple[int, ...], *,
                    shard_dim: int | None = None, rank: int = 0,
                    world_size: int = 1) -> PackedTensor | None:
        """This rank's slice of `name` as the file's blocks, or None when `name` is not
        block-quantized or its slice splits blocks (then `read` it)."""
        tensor, _, _ = self._stored(name)
        if tensor is None or not tensor.is_quantized or len(tensor.shape) != 2:
            return None
        tensor, data, columns = self._select(name, expected_shape, shard_dim, rank, world_size)
        if columns is not None:
            self._consumed.discard(name)
            return None
        rows = data.shape[0]
        cols = data.shape[1] // gguf.GGML_QUANT_SIZES[tensor.qtype][1] * tensor.block_size
        blocks = torch.from_numpy(np.array(data, dtype=np.uint8, copy=True)).to(self.device)
        return PackedTensor(tensor.qtype.name, blocks, (rows, cols))

    def check_all_consumed(self, optional: Callable[[str], bool] = lambda _name: False) -> None:
        leftover = sorted(n for n in self._tensors if n not in self._consumed
                          and not self._fused.used(n, self._consumed) and not optional(n))
        if leftover:
            shown = ", ".join(self._tensors[n].name for n in leftover[:5])
            raise CheckpointError(
                f"GGUF file has {len(leftover)} tensor(s) ShardLM does not use: {shown}"
                + (" ..." if len(leftover) > 5 else ""), tensor=self._tensors[leftover[0]].name)

    def close(self) -> None:
        """Nothing to release: the parsed file stays cached for the next load of it."""

    def __enter__(self) -> GGUFCheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
