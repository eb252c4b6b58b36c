"""What every test shares: the tiny checkpoints, the `cuda` marker and which tests are `slow`."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.checkpoints import LLAMA, QWEN2, build_checkpoint

# The slow tests (tens of seconds to minutes each): installs, Compose, Node, SMG, several hosts,
# fuzzing, load, the full-size default model and the README's examples. `make test` (CI) runs
# them; `make test-fast` collects only its unit-test paths and leaves out `slow` among those too.
SLOW_TESTS = frozenset({
    "tests/deploy/test_server_install.py",
    "tests/deploy/test_install_quiet.py",
    "tests/clients/test_sdk_isolated.py",
    "tests/deploy/test_compose.py",
    "tests/clients/test_node_client.py",
    "tests/gateway/test_smg_e2e.py",
    "tests/gateway/test_smg_port.py",
    "tests/gateway/serve/test_openai_port.py",
    "tests/gateway/api/test_smg_optional.py",
    "tests/gateway/test_multihost.py",
    "tests/gateway/test_fuzz.py",
    "tests/gateway/test_load.py",
    "tests/bench/test_bench_smoke.py",
    "tests/test_default_model.py",
    "tests/docs/test_readme_examples.py",
})


def pytest_configure(config):
    # scripts/gpu_check.sh selects the GPU tests with `-m cuda`; each also skips itself without CUDA.
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU; run by scripts/gpu_check.sh")
    # A renamed or moved file would silently stop being marked: name it here again.
    missing = sorted(p for p in SLOW_TESTS if not (config.rootpath / p).is_file())
    if missing:
        raise pytest.UsageError(f"tests/conftest.py SLOW_TESTS names missing files: {missing}")


def pytest_collection_modifyitems(config, items):
    for item in items:
        path = Path(item.path)
        if path.is_relative_to(config.rootpath) and \
                path.relative_to(config.rootpath).as_posix() in SLOW_TESTS:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("llama"), LLAMA, shard=True)


@pytest.fixture(scope="session")
def qwen2_dir(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("qwen2"), QWEN2)


@pytest.fixture(scope="session", params=["llama", "qwen2"])
def model_dir(request):
    return request.getfixturevalue(f"{request.param}_dir")
