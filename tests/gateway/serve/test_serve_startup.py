"""`shardlm serve` that cannot start, or is stopped while starting, leaves no process behind and
says why in one line; workers outlive neither a failed start nor a SIGKILLed gateway.

Every process started here carries a unique marker in its environment (workers inherit it), so
the test can find every one of them afterwards, whoever their parent is now."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

MARKER_VARIABLE = "SHARDLM_TEST_MARKER"
pytestmark = pytest.mark.skipif(not Path("/proc/self/environ").exists(),
                                reason="finds processes through /proc")


def marked_processes(marker: str) -> list[int]:
    """Pids of live processes (zombies have no environment) that carry `marker`."""
    needle = f"{MARKER_VARIABLE}={marker}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if needle in (entry / "environ").read_bytes().split(b"\0"):
                    pids.append(int(entry.name))
            except OSError:
                continue  # gone meanwhile, or not ours
    return pids


def wait_until_none_left(marker: str, timeout_s: float = 30.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while (left := marked_processes(marker)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


@pytest.fixture
def marker():
    marker = uuid.uuid4().hex
    yield marker
    for pid in marked_processes(marker):  # whatever a failed test left behind
        os.kill(pid, signal.SIGKILL)


def start_serve(marker: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "shardlm", "serve", "--device", "cpu", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1",
                                     **{MARKER_VARIABLE: marker}))


def finish(proc: subprocess.Popen) -> tuple[int, str, str]:
    """Exit code and output; returns only once every holder of the pipes has closed them (a
    worker left running would keep them open, as it kept `serve | tail` waiting)."""
    out, err = proc.communicate(timeout=120)
    return proc.returncode, out, err


def error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("error:")]


def test_a_busy_port_is_reported_before_any_worker_starts(marker, llama_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = start_serve(marker, "--port", str(port), "--model", str(llama_dir))
        code, out, err = finish(proc)
    assert code == 1
    assert error_lines(err) == [f"error: the gateway cannot listen on 127.0.0.1:{port}: "
                                "Address already in use"]
    assert "Traceback" not in err
    assert "worker" not in err.lower()  # none was started
    assert marked_processes(marker) == []


def test_a_missing_model_is_reported_before_any_worker_starts(marker, tmp_path):
    proc = start_serve(marker, "--port", "0", "--model", str(tmp_path / "missing"))
    code, _out, err = finish(proc)
    assert code == 1
    assert error_lines(err) == [f"error: model path {tmp_path / 'missing'} does not exist"]
    assert "Traceback" not in err
    assert marked_processes(marker) == []


def test_a_failed_load_stops_the_workers(marker, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "no-such-architecture"}')
    proc = start_serve(marker, "--port", "0", "--model", str(broken))
    code, out, err = finish(proc)
    assert code == 1
    assert "ShardLM gateway on" in out  # workers and gateway were up when Load failed
    assert len(error_lines(err)) == 1 and f"could not load {broken}" in err
    assert "Traceback" not in err
    assert marked_processes(marker) == []


def test_sigint_while_workers_start_stops_them(marker, llama_dir):
    proc = start_serve(marker, "--port", "0", "--model", str(llama_dir), "--tp", "2")
    deadline = time.monotonic() + 60
    while not [p for p in marked_processes(marker) if p != proc.pid]:  # a worker is starting
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    code, _out, err = finish(proc)
    assert "Traceback" not in err
    assert (code, error_lines(err)) == (1, ["error: stopped by a signal during start-up"])
    assert marked_processes(marker) == []


def test_workers_end_when_their_gateway_is_killed(marker, llama_dir):
    proc = start_serve(marker, "--port", "0", "--model", str(llama_dir), "--tp", "2")
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("ready:"):
            break
    workers = [p for p in marked_processes(marker) if p != proc.pid]
    assert len(workers) == 2
    proc.kill()
    proc.wait()
    assert wait_until_none_left(marker) == []
