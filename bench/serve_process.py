"""`shardlm serve` in a subprocess for the benchmarks, with its output drained, its address and
startup time known, and its memory and Prometheus metrics readable from outside; the process
handling (`ServerProcess`) is shared with bench.llama_server."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Self

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A server in a subprocess: its output drained into `output` (each line also shown to
    `on_line`), stopped with SIGTERM and, past a timeout, SIGKILL; a context manager."""

    def __init__(self, cmd: list[str], **popen) -> None:
        self.output: list[str] = []
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, **popen)
        threading.Thread(target=self._drain, daemon=True).start()

    def on_line(self, line: str) -> None:
        """A subclass's look at each line of output, on the draining thread."""

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.output.append(line)
            self.on_line(line)

    def wait_until(self, up: Callable[[], bool], timeout_s: float, name: str) -> None:
        """Returns once `up()` holds; stops the process and raises if it exits or `timeout_s`
        passes first."""
        deadline = time.monotonic() + timeout_s
        while not up():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{name} did not come up:\n" + "".join(self.output[-30:]))
            time.sleep(0.1)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self, timeout_s: float = 30.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class Server(ServerProcess):
    """`shardlm serve` (`python -m shardlm serve`) in a subprocess."""

    def __init__(self, model: Path, *, kv_cache_mb: int = 64, tp: int = 1, device: str = "cpu",
                 dtype: str = "float32", extra: tuple[str, ...] = (),
                 start_timeout_s: float = 180.0) -> None:
        self.metrics_port = free_port()
        cmd = [sys.executable, "-m", "shardlm", "serve", "--host", "127.0.0.1", "--port", "0",
               "--model", str(model), "--device", device, "--dtype", dtype, "--tp", str(tp),
               "--kv-cache-mb", str(kv_cache_mb), "--metrics-port", str(self.metrics_port),
               "--drain-grace", "5", *extra]
        self.address = ""
        self._ready = threading.Event()
        started = time.perf_counter()
        super().__init__(cmd, cwd=REPO, env=dict(os.environ, PYTHONUNBUFFERED="1"))
        self.wait_until(lambda: self._ready.is_set() and bool(self.address), start_timeout_s,
                        "the gateway")
        self.startup_s = time.perf_counter() - started

    def on_line(self, line: str) -> None:
        if line.startswith("ShardLM gateway on "):
            self.address = line.split()[3]
        if line.startswith("ready:"):
            self._ready.set()

    def rss_bytes(self) -> int:
        """VmRSS of the gateway process alone (its workers are separate processes)."""
        return _vm_rss(self.pid)

    def workers_rss_bytes(self) -> int:
        return sum(_vm_rss(pid) for pid in _children(self.pid))

    def metrics(self) -> dict[str, float]:
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as reply:
            return parse_prometheus(reply.read().decode())


def _vm_rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return found


def parse_prometheus(text: str) -> dict[str, float]:
    """`name{labels}` -> value for every sample of a Prometheus text exposition."""
    samples = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        try:
            samples[key] = float(value)
        except ValueError:
            continue
    return samples


def metric_sum(samples: dict[str, float], name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    total = 0.0
    for key, value in samples.items():
        base, _, rest = key.partition("{")
        if base != name:
            continue
        if all(f'{k}="{v}"' in rest for k, v in labels.items()):
            total += value
    return total
