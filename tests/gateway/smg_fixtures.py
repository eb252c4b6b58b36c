"""Shared by the SMG tests: a tiny checkpoint with a chat template (SMG renders chats itself, so
both sides need the same template), a live gateway that has loaded it, and `smg launch` routing
to gateways on loopback."""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from shardlm.gateway.v1 import gateway_pb2

from shardlm_server.gateway.api.runtime import Limits
from tests.checkpoints import LLAMA, build_checkpoint
from tests.gateway.conftest import LiveGateway

# Plain enough for both jinja2 (ShardLM) and minijinja (SMG).
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
                 "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")


def chat_checkpoint(folder: Path) -> Path:
    build_checkpoint(folder, LLAMA)
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text(encoding="utf-8"))
    config["chat_template"] = CHAT_TEMPLATE
    config_file.write_text(json.dumps(config), encoding="utf-8")
    return folder


def loaded_gateway(model: Path, workers: int = 1) -> LiveGateway:
    gateway = LiveGateway(workers, Limits())
    for _ in gateway.stub.Load(gateway_pb2.LoadRequest(model_path=str(model))):
        pass
    return gateway


SMG = shutil.which("smg", path=str(Path(sys.executable).parent)) or shutil.which("smg")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def smg_router(worker_urls: list[str], log: Path, *extra: str, port: int | None = None,
               metrics_port: int | None = None) -> Iterator[tuple[str, str]]:
    """`smg launch` on loopback port `port` (None: a free one; its metrics on `metrics_port`, or
    another free one) routing to `worker_urls`: yields its base URL and the model id it lists,
    and stops it on exit."""
    port = port or free_port()
    command = [SMG, "launch", "--host", "127.0.0.1", "--port", str(port), "--worker-urls",
               *worker_urls, "--prometheus-port", str(metrics_port or free_port()),
               "--log-level", "warn", *extra]
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        yield base, wait_for_model(base, process, log)
    finally:
        process.terminate()
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def wait_for_model(base: str, process: subprocess.Popen, log: Path) -> str:
    for _ in range(120):
        if process.poll() is not None:
            pytest.fail(f"smg exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{base}/v1/models", timeout=5) as reply:
                models = json.load(reply)["data"]
            if models:
                return models[0]["id"]
        except (urllib.error.URLError, OSError, KeyError, ValueError):
            pass
        time.sleep(0.5)
    pytest.fail(f"smg listed no model within a minute:\n{log.read_text()[-3000:]}")


@contextlib.contextmanager
def default_model_behind_smg(log: Path, port: int | None = None) -> Iterator[tuple[str, str]]:
    """What `make serve` runs: the default model (SmolLM2-135M-Instruct, whose chat template SMG
    renders) on a live gateway, SMG in front; yields SMG's base URL and model id (skips the test
    where smg or the model's package is missing)."""
    from shardlm_server.gateway.serve.default_model import DefaultModelMissing, default_model_path

    if SMG is None:
        pytest.skip("the smg router (PyPI smg) is not installed")
    try:
        model = default_model_path()
    except DefaultModelMissing as exc:
        pytest.skip(str(exc))
    gateway = LiveGateway(1, Limits())
    try:
        for _ in gateway.stub.Load(gateway_pb2.LoadRequest(model_path=str(model))):
            pass
        with smg_router([f"grpc://{gateway.address}"], log, port=port) as up:
            yield up
    finally:
        gateway.close()
