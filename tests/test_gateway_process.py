"""The boundary between the halves, checked on running processes: `shardlm serve` with no
`--device` on a machine without a GPU picks the CPU without loading torch into the gateway
process (torch is the workers' business: about 0.6 GB and seconds of start-up), while its
workers do load it. tests/test_import_boundaries.py checks the imports; this checks what the
processes have actually mapped."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from shardlm_server.gateway.workers import processes
from tests.gateway.held_workers import worker_pids
from tests.gateway.test_serve import start_serve

pytestmark = pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux /proc")


def maps_torch(pid: int) -> bool:
    """Whether the process has torch's C++ library mapped."""
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text(errors="replace")


@pytest.mark.skipif(processes.nvidia_driver_present(), reason="this machine has an NVIDIA driver")
def test_serve_without_a_device_keeps_torch_out_of_the_gateway():
    proc, _address = start_serve("--no-model")
    try:
        workers = worker_pids(proc.pid)  # raises when serve started none
        assert not maps_torch(proc.pid)
        assert all(maps_torch(pid) for pid in workers)  # the check can see torch where it is
    finally:
        proc.terminate()
        proc.wait(30)


def test_without_a_driver_the_cpu_is_chosen_without_asking_torch(monkeypatch):
    monkeypatch.setattr(processes, "nvidia_driver_present", lambda: False)

    def no_child(*_args, **_kwargs):
        raise AssertionError("no process may be started to answer")

    monkeypatch.setattr(processes.subprocess, "run", no_child)
    assert processes.local_device() == "cpu"


@pytest.mark.parametrize("answer,device", [("1\n", "cuda"), ("0\n", "cpu"), ("", "cpu")])
def test_with_a_driver_the_workers_python_is_asked(monkeypatch, answer, device):
    monkeypatch.setattr(processes, "nvidia_driver_present", lambda: True)
    asked = []

    def run(cmd, **kwargs):
        asked.append(cmd)
        return subprocess.CompletedProcess(cmd, 0 if answer else 1, stdout=answer, stderr="")

    monkeypatch.setattr(processes.subprocess, "run", run)
    assert processes.local_device() == device
    assert "torch.cuda.is_available()" in asked[0][-1]


def test_a_hung_question_falls_back_to_the_cpu(monkeypatch):
    monkeypatch.setattr(processes, "nvidia_driver_present", lambda: True)

    def hang(cmd, **kwargs):
        raise subprocess.TimeoutExpired(cmd, kwargs["timeout"])

    monkeypatch.setattr(processes.subprocess, "run", hang)
    assert processes.local_device() == "cpu"
