"""The container deployment: docker-compose.yml is valid for Compose (both profiles) and has the
structure the GPU and CPU set-ups need; the Dockerfile and the health-check script agree with it.

No Docker engine runs here, so nothing is built or started: Compose's `config` validates the file,
and scripts/healthcheck.py is run against real local processes.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"
VALIDATE = ROOT / "scripts" / "validate_compose.sh"
HEALTHCHECK = ROOT / "scripts" / "healthcheck.py"
NO_TOOL = 3  # validate_compose.sh: no Compose could be found or installed


def run_validate(*args: str) -> subprocess.CompletedProcess:
    done = subprocess.run(["bash", str(VALIDATE), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    if done.returncode == NO_TOOL:
        pytest.skip(f"no Docker Compose could be found or installed: {done.stderr.strip()}")
    return done


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE_FILE.read_text(encoding="utf-8"))


def services_of(compose: dict, profile: str) -> dict:
    return {name: s for name, s in compose["services"].items() if profile in s.get("profiles", [])}


def option(command: list[str], flag: str) -> str:
    assert flag in command, f"{flag} missing from {command}"
    return command[command.index(flag) + 1]


# ---------------------------------------------------------------- real Compose tooling
def test_compose_file_is_valid_for_both_profiles():
    done = run_validate()
    assert done.returncode == 0, done.stdout + done.stderr
    assert "docker-compose.yml is valid" in done.stdout
    if "version v2." in done.stderr:  # Compose v1 (a fallback) does not list services by profile
        assert "profile cpu: gateway-cpu" in done.stdout
        assert "profile gpu: gateway worker0 worker1" in done.stdout


def test_validation_rejects_an_invalid_file(tmp_path):
    bad = tmp_path / "docker-compose.yml"
    text = COMPOSE_FILE.read_text(encoding="utf-8")
    assert "\n  worker0:\n" in text
    bad.write_text(text.replace("\n  worker0:\n", "\n  worker0:\n    not_a_compose_key: 1\n"),
                   encoding="utf-8")
    done = run_validate(str(bad))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "not_a_compose_key" in done.stderr


# ---------------------------------------------------------------- structure
def test_profiles(compose):
    assert set(services_of(compose, "gpu")) == {"gateway", "worker0", "worker1"}
    assert set(services_of(compose, "cpu")) == {"gateway-cpu"}
    for name, service in compose["services"].items():
        assert service.get("profiles"), f"{name} has no profile: it would start with every profile"


@pytest.mark.parametrize(("name", "gpu"), [("worker0", "0"), ("worker1", "1")])
def test_gpu_workers(compose, name, gpu):
    worker = compose["services"][name]
    devices = worker["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "device_ids": [gpu], "capabilities": ["gpu"]}]
    command = worker["command"]
    assert command[:2] == ["shardlm", "worker"]
    assert option(command, "--host") == "0.0.0.0"
    assert option(command, "--port") == "50061"
    assert worker.get("ipc") == "host" or worker.get("shm_size")
    memlock = worker["ulimits"]["memlock"]
    assert memlock in (-1, {"soft": -1, "hard": -1})
    env = worker["environment"]
    for key in ("NCCL_DEBUG", "NCCL_SOCKET_IFNAME", "NCCL_P2P_DISABLE"):
        assert key in env, f"{name} does not set {key}"
    assert "50061" in worker["healthcheck"]["test"][-2]
    assert worker["healthcheck"]["test"][-1] == "--worker"


def test_gpu_gateway(compose):
    gateway = compose["services"]["gateway"]
    command = gateway["command"]
    assert command[:2] == ["shardlm", "serve"]
    assert option(command, "--host") == "0.0.0.0"
    assert option(command, "--workers") == "worker0:50061,worker1:50061"
    assert option(command, "--device") == "cuda"
    assert option(command, "--model").startswith("/models/")
    assert "deploy" not in gateway, "the gateway needs no GPU: the workers compute"
    assert gateway["depends_on"] == {"worker0": {"condition": "service_healthy"},
                                     "worker1": {"condition": "service_healthy"}}
    assert any(str(p).endswith(":50051") for p in gateway["ports"])


def test_cpu_gateway(compose):
    gateway = compose["services"]["gateway-cpu"]
    command = gateway["command"]
    assert command[:2] == ["shardlm", "serve"]
    assert option(command, "--device") == "cpu"
    assert option(command, "--tp") == "1"
    assert option(command, "--host") == "0.0.0.0"
    assert "--workers" not in command
    assert "deploy" not in gateway, "the CPU profile must run without GPUs"
    assert gateway["build"].get("args", {}).get("SHARDLM_NO_CUDA", "1") == "1"


def test_healthchecks_and_model_volume(compose):
    for name, service in compose["services"].items():
        test = service["healthcheck"]["test"]
        assert test[0] == "CMD" and "/opt/shardlm/healthcheck.py" in test, name
        port = option(service["command"], "--port")
        assert test[3] == f"127.0.0.1:{port}", f"{name} checks another port than it serves"
        mounts = [v for v in service["volumes"] if isinstance(v, dict) and v["target"] == "/models"]
        assert mounts == [{"type": "bind", "source": "${SHARDLM_MODEL_DIR:-./models}",
                           "target": "/models", "read_only": True}], name
        if "--model" in service["command"]:
            assert option(service["command"], "--model").startswith("/models/"), name
            assert option(service["command"], "--model-root") == "/models", name


def test_dockerfile_matches_compose():
    dockerfile = (ROOT / "Dockerfile").read_text(encoding="utf-8")
    assert re.search(r"^FROM \$\{BASE_IMAGE\} AS runtime$", dockerfile, re.M)
    assert "ARG BASE_IMAGE=python:3.11-slim" in dockerfile
    assert "EXPOSE 50051" in dockerfile
    assert 'CMD ["shardlm", "serve", "--host", "0.0.0.0"]' in dockerfile
    assert "COPY scripts/healthcheck.py /opt/shardlm/healthcheck.py" in dockerfile
    assert "pip install --no-build-isolation" in dockerfile
    for path in ("Dockerfile", "docker-compose.yml", ".dockerignore"):
        assert "://" not in (ROOT / path).read_text(encoding="utf-8"), f"a URL in {path}"


# ---------------------------------------------------------------- scripts/healthcheck.py
def healthcheck(*args: str) -> int:
    return subprocess.run([sys.executable, str(HEALTHCHECK), *args, "--timeout", "5"],
                          capture_output=True, timeout=30).returncode


def start(args: list[str], ready: str) -> tuple[subprocess.Popen, list[str]]:
    proc = subprocess.Popen([sys.executable, "-m", *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + 60
    for line in proc.stdout:
        lines.append(line)
        if line.startswith(ready) or time.monotonic() > deadline:
            break
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    if not lines or not lines[-1].startswith(ready):
        proc.kill()
        raise AssertionError("process did not come up:\n" + "".join(lines))
    return proc, lines


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.mark.timeout(120)
def test_healthcheck_script(llama_dir):
    worker, lines = start(["worker", "--host", "127.0.0.1", "--port", "0"], "READY ")
    try:
        address = lines[-1].split()[1]
        assert healthcheck(address, "--worker") == 0
        assert healthcheck(address) == 1  # a worker is no gateway
    finally:
        stop(worker)
    assert healthcheck(address, "--worker") == 1  # nothing listens any more

    gateway, lines = start(["shardlm_server.gateway.serve.cli", "serve", "--port", "0", "--model", str(llama_dir),
                            "--dtype", "float32"], "ready:")
    try:
        address = next(x.split()[3] for x in lines if x.startswith("ShardLM gateway on "))
        assert healthcheck(address) == 0
    finally:
        stop(gateway)
