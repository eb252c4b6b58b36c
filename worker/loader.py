"""The choice of checkpoint reader for a path, and its model configuration.

Two readers implement `worker.checkpoint.CheckpointReader`: `SafetensorsReader` (a Hugging Face
folder) and `GGUFCheckpointReader` (a llama.cpp GGUF file). Both serve tensors under ShardLM's
names (the Hugging Face ones) and layout, a tensor-parallel rank's slice at a time, so the model
never sees which format it came from. A block-quantized tensor can also be taken as its packed
blocks (`read_packed`), for a layer that keeps weights quantized.
"""

from __future__ import annotations

from pathlib import Path

import torch

from shardlm_server.worker.checkpoint import CheckpointReader
from shardlm_server.worker.config import ModelConfig, load_config
from shardlm_server.worker.gguf.config import gguf_config
from shardlm_server.worker.gguf.file import find_gguf, open_gguf
from shardlm_server.worker.gguf.reader import GGUFCheckpointReader
from shardlm_server.worker.safetensors_reader import SafetensorsReader


def checkpoint_format(path: str | Path) -> str:
    """"gguf" for a .gguf file or a folder holding one (and no config.json), else "safetensors"."""
    return "gguf" if find_gguf(path) is not None else "safetensors"


def load_checkpoint_config(path: str | Path) -> ModelConfig:
    """The model configuration of the checkpoint at `path`, whichever its format."""
    gguf_path = find_gguf(path)
    if gguf_path is None:
        return load_config(path)
    return gguf_config(open_gguf(gguf_path))


def open_checkpoint(path: str | Path, device: torch.device, dtype: torch.dtype,
                    quantize: str = "") -> CheckpointReader:
    """The reader for the checkpoint at `path` (a Hugging Face folder or a GGUF file); `quantize`
    is how the layers keep linear weights (worker.quant.read_linear)."""
    gguf_path = find_gguf(path)
    if gguf_path is None:
        reader: CheckpointReader = SafetensorsReader(path, device, dtype)
    else:
        reader = GGUFCheckpointReader(gguf_path, device, dtype)
    reader.quantize = quantize
    return reader
