from __future__ import annotations

import pytest

from tests.checkpoints import LLAMA, QWEN2, build_checkpoint


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("llama"), LLAMA, shard=True)


@pytest.fixture(scope="session")
def qwen2_dir(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("qwen2"), QWEN2)


@pytest.fixture(scope="session", params=["llama", "qwen2"])
def model_dir(request):
    return request.getfixturevalue(f"{request.param}_dir")
