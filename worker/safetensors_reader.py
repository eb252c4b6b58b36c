"""Lazy, shard-aware reading of safetensors checkpoints.

A rank opens every file once and reads only the slices it owns (`get_slice`), so a tensor-parallel
rank never materialises another rank's weights. Every tensor the model asks for is recorded, so at
the end `check_all_consumed` can name tensors the model did not expect.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open

from shardlm_server.worker.config import load_config
from shardlm_server.worker.errors import CheckpointError
from shardlm_server.worker.fused import FusedRows

# Buffers some exporters write that carry no weights the engine needs (it recomputes them).
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
# A multimodal checkpoint (Gemma3ForConditionalGeneration) wraps its language model: older
# exports as `language_model.model.*` / `language_model.lm_head.*`, transformers 5 as
# `model.language_model.*`. Served under the usual names; the vision tower is not served.
LANGUAGE_MODEL_PREFIXES = {"language_model.model.": "model.", "language_model.lm_head.": "lm_head.",
                           "model.language_model.": "model."}
VISION_PREFIXES = ("vision_tower.", "model.vision_tower.", "multi_modal_projector.",
                   "model.multi_modal_projector.")


def served_names(stored: list[str]) -> dict[str, str]:
    """ShardLM's name -> the stored name, for every stored tensor the model may read."""
    if not any(n.startswith(tuple(LANGUAGE_MODEL_PREFIXES)) for n in stored):
        return {n: n for n in stored}
    names = {}
    for name in stored:
        if name.startswith(VISION_PREFIXES):
            continue
        prefix = next((p for p in LANGUAGE_MODEL_PREFIXES if name.startswith(p)), None)
        names[LANGUAGE_MODEL_PREFIXES[prefix] + name[len(prefix):] if prefix else name] = name
    return names


class SafetensorsReader:
    """The `worker.checkpoint.CheckpointReader` of a Hugging Face folder: maps tensor names to the
    safetensors file holding them and reads (slices of) them."""

    format = "safetensors"

    def __init__(self, model_dir: str | Path, device: torch.device, dtype: torch.dtype) -> None:
        self.model_dir = Path(model_dir)
        self.device = device
        self.dtype = dtype
        self.quantize = ""  # set by open_checkpoint
        self._stack = ExitStack()
        self._handles: dict[str, object] = {}
        where = self._index()
        self._stored = served_names(list(where))  # ShardLM's name -> the stored name
        self._where: dict[str, str] = {n: where[s] for n, s in self._stored.items()}
        # Phi-3's fused q/k/v and gate/up tensors, served as their parts (worker/fused.py).
        self._fused = FusedRows(self._where, lambda: load_config(self.model_dir))
        self._consumed: set[str] = set()

    def _index(self) -> dict[str, str]:
        index_path = self.model_dir / "model.safetensors.index.json"
        if index_path.exists():
            try:
                weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise CheckpointError(f"model.safetensors.index.json is unreadable: {exc}") from exc
            if not isinstance(weight_map, dict):
                raise CheckpointError("model.safetensors.index.json: weight_map must be an object")
            return {str(k): str(v) for k, v in weight_map.items()}
        files = sorted(p.name for p in self.model_dir.glob("*.safetensors"))
        if not files:
            if any(self.model_dir.glob("*.bin")) or any(self.model_dir.glob("*.pt")):
                raise CheckpointError(
                    "only pickle checkpoints (*.bin/*.pt) found; ShardLM loads safetensors only"
                )
            raise CheckpointError(f"no *.safetensors files in '{self.model_dir}'")
        where: dict[str, str] = {}
        for name in files:
            for key in self._open(name).keys():
                where[key] = name
        return where

    def _open(self, filename: str):
        handle = self._handles.get(filename)
        if handle is None:
            path = self.model_dir / filename
            if Path(filename).name != filename:
                raise CheckpointError(f"weight file name '{filename}' must not contain a path")
            try:
                handle = self._stack.enter_context(safe_open(str(path), framework="pt"))
            except FileNotFoundError as exc:
                raise CheckpointError(f"weight file '{filename}' is missing") from exc
            except Exception as exc:  # safetensors raises its own error types for corrupt headers
                raise CheckpointError(f"weight file '{filename}' is unreadable: {exc}") from exc
            self._handles[filename] = handle
        return handle

    @property
    def tensor_types(self) -> list[str]:
        """The distinct stored dtypes (safetensors spelling, e.g. "BF16"), most frequent first."""
        counts: dict[str, int] = {}
        for name in self._where:
            dtype = self._slice(name).get_dtype()
            counts[dtype] = counts.get(dtype, 0) + 1
        return sorted(counts, key=lambda d: (-counts[d], d))

    def read_packed(self, name: str, expected_shape: tuple[int, ...], **_slice: int | None) -> None:
        """Safetensors checkpoints hold no block-quantized tensors."""
        return None

    def has(self, name: str) -> bool:
        return name in self._where or self._fused.get(name) is not None

    def shape(self, name: str) -> list[int]:
        return list(self._slice(name).get_shape())

    def _slice(self, name: str):
        if name not in self._where:
            raise CheckpointError(f"checkpoint lacks tensor '{name}'", tensor=name)
        return self._open(self._where[name]).get_slice(self._stored[name])

    def read(
        self,
        name: str,
        expected_shape: tuple[int, ...],
        *,
        shard_dim: int | None = None,
        rank: int = 0,
        world_size: int = 1,
    ) -> torch.Tensor:
        """Read `name` (its `rank`-th of `world_size` slices along `shard_dim`), checked and cast.

        `expected_shape` is the full, unsharded shape the config implies; a mismatch is a clear
        error rather than a silent broadcast later. A name held by a fused tensor is read as its
        row range of that tensor, and the rank's slice cut inside that range.
        """
        part = None if name in self._where else self._fused.get(name)
        stored = part.stored if part else name
        view = self._slice(stored)
        shape = tuple(view.get_shape())
        want = tuple(expected_shape) if part is None else (part.rows, *expected_shape[1:])
        if shape != want:
            raise CheckpointError(
                f"tensor '{stored}' has shape {list(shape)}, config implies {list(want)}",
                tensor=stored,
            )
        self._consumed.add(name)
        index = [slice(None)] * len(shape)
        if part is not None:
            index[0] = slice(part.start, part.stop)
        if shard_dim is not None and world_size > 1:
            size = expected_shape[shard_dim] // world_size
            base = index[shard_dim].start or 0
            index[shard_dim] = slice(base + rank * size, base + (rank + 1) * size)
        try:
            sliced = any(i != slice(None) for i in index)
            tensor = view[tuple(index)] if sliced else view[:]
        except Exception as exc:
            raise CheckpointError(f"tensor '{stored}' could not be read: {exc}",
                                  tensor=stored) from exc
        return tensor.to(device=self.device, dtype=self.dtype).contiguous()

    def check_all_consumed(self, optional: Callable[[str], bool] = lambda _name: False) -> None:
        leftover = sorted(
            n
            for n in self._where
            if n not in self._consumed and not self._fused.used(n, self._consumed)
            and not n.endswith(IGNORED_SUFFIXES) and not optional(n)
        )
        if leftover:
            shown = ", ".join(leftover[:5]) + (" ..." if len(leftover) > 5 else "")
            raise CheckpointError(
                f"checkpoint has {len(leftover)} unexpected tensor(s): {shown}", tensor=leftover[0]
            )

    def close(self) -> None:
        self._stack.close()
        self._handles.clear()

    def __enter__(self) -> SafetensorsReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
