from __future__ import annotations

import pytest

from tests.checkpoints import LLAMA, QWEN2, build_checkpoint


def pytest_configure(config):
    # scripts/gpu_check.sh selects the GPU tests with `-m cuda`; each also skips itself without CUDA.
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU; run by scripts/gpu_check.sh")


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("llama"), LLAMA, shard=True)


@pytest.fixture(scope="session")
def qwen2_dir(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("qwen2"), QWEN2)


@pytest.fixture(scope="session", params=["llama", "qwen2"])
def model_dir(request):
    return request.getfixturevalue(f"{request.param}_dir")
