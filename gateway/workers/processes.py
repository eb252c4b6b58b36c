"""Start and stop the gateway's local worker processes, or name workers started elsewhere.

Local workers are child processes (`python -m shardlm_server.worker`), one per GPU on CUDA (each seeing only its
own device) or N ranks on CPU. Each is told the gateway's pid (`--parent-pid`) and exits when the
gateway is gone, so a gateway killed without warning leaves no worker behind. Workers on other
hosts are given by address and are never started or stopped here. Talking to the workers (health,
Load, steps) is gateway/workers/client.py's job.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from shardlm.constants import DEFAULT_HOST, DEFAULT_WORKER_START_TIMEOUT_S
from shardlm.errors import UnavailableError

WORKER_MODULE = "shardlm_server.worker"  # run with `python -m`; the gateway never imports it
# libgomp's spins before an idle CPU worker thread sleeps (GOMP_SPINCOUNT; see start_local):
# libgomp's own default, a few ms (each spin is a `pause`, ~10-140 cycles by CPU). Against
# PASSIVE, one stream through the stack decoded ~30% faster with 5,000 (2026-11-23, AMD VM);
# on an Intel VM, whose idle vCPUs wake slowly, 5,000 (about 0.1 ms) still let the team sleep
# between a call's steps: one stream 81% of the engine in process against 89% with 300,000 (5
# alternated rounds), 32 streams 90% and 91% (bench.stack_overhead's method).
CPU_SPIN_COUNT = 300_000


@dataclass(frozen=True)
class WorkerTLS:
    """Mutual TLS between the gateway and its workers: each worker serves with `cert`/`key` and
    requires a client certificate signed by `ca`; the gateway presents the same pair."""

    ca: str
    cert: str
    key: str

    def worker_args(self) -> list[str]:
        return ["--tls-cert", self.cert, "--tls-key", self.key, "--tls-client-ca", self.ca]

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=Path(self.ca).read_bytes(), private_key=Path(self.key).read_bytes(),
            certificate_chain=Path(self.cert).read_bytes())


# Whether the workers' Python sees a usable GPU: asked in a child process, so the gateway itself
# never loads torch (about 0.6 GB and seconds of start-up it has no use for).
_CUDA_QUESTION = "import torch; print(int(torch.cuda.is_available()))"
CUDA_QUESTION_TIMEOUT_S = 120.0


def nvidia_driver_present() -> bool:
    """An NVIDIA driver on this host: its /proc entry, a device node, or nvidia-smi."""
    return (Path("/proc/driver/nvidia/version").exists() or any(Path("/dev").glob("nvidia[0-9]*"))
            or shutil.which("nvidia-smi") is not None)


def local_device() -> str:
    """The device local workers run on when none is named: "cuda" where the workers' torch can
    use a GPU, else "cpu". Without an NVIDIA driver the answer is "cpu" at once; with one, a
    child process of the workers' interpreter asks torch (which also knows whether it was built
    with CUDA and what CUDA_VISIBLE_DEVICES leaves)."""
    if not nvidia_driver_present():
        return "cpu"
    try:
        done = subprocess.run([sys.executable, "-c", _CUDA_QUESTION], capture_output=True,
                              text=True, timeout=CUDA_QUESTION_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return "cpu"
    return "cuda" if done.returncode == 0 and done.stdout.strip() == "1" else "cpu"


def free_port(host: str = DEFAULT_HOST) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class WorkerHandle:
    rank: int
    address: str
    device: str  # as the worker names it ("cpu", "cuda:0")
    process: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def alive(self) -> bool:
        return self.process is None or self.process.poll() is None


class WorkerGroupClosed(UnavailableError):
    """The group was closed (shutdown, Ctrl-C) while its workers were still starting."""

    def __init__(self) -> None:
        super().__init__("worker start-up was interrupted", reason="WORKER_UNAVAILABLE")


class WorkerGroup:
    """The ranks of one tensor-parallel group, in rank order, and the local processes behind
    them. `close()` may be called from any thread at any time, also while `start_local` is still
    starting processes: it stops those started so far and no further one is started."""

    def __init__(self, handles: list[WorkerHandle] | None = None,
                 tls: WorkerTLS | None = None) -> None:
        self.handles = list(handles or [])
        self.tls = tls
        self._lock = threading.Lock()
        self._closed = False
        self._starting: list[subprocess.Popen] = []

    @property
    def world_size(self) -> int:
        return len(self.handles)

    @property
    def devices(self) -> list[str]:
        return [h.device for h in self.handles]

    @property
    def addresses(self) -> list[str]:
        return [h.address for h in self.handles]

    def is_alive(self, rank: int) -> bool:
        return self.handles[rank].alive

    @classmethod
    def spawn(cls, num_workers: int = 1, *, device: str = "cpu", devices: list[int] | None = None,
              host: str = DEFAULT_HOST, start_timeout_s: float = DEFAULT_WORKER_START_TIMEOUT_S,
              tls: WorkerTLS | None = None) -> WorkerGroup:
        """Start local workers and return once each accepts calls."""
        group = cls(tls=tls)
        try:
            group.start_local(num_workers, device=device, devices=devices, host=host,
                              start_timeout_s=start_timeout_s)
        except BaseException:
            group.close()
            raise
        return group

    @classmethod
    def connect(cls, addresses: list[str], device: str = "cpu",
                tls: WorkerTLS | None = None) -> WorkerGroup:
        """Workers started elsewhere (other hosts), in rank order."""
        return cls([WorkerHandle(rank, a, device) for rank, a in enumerate(addresses)], tls)

    def start_local(self, num_workers: int = 1, *, device: str = "cpu",
                    devices: list[int] | None = None, host: str = DEFAULT_HOST,
                    start_timeout_s: float = DEFAULT_WORKER_START_TIMEOUT_S) -> None:
        """On CUDA one worker per entry of `devices` (default 0..N-1), each seeing only its GPU;
        on CPU `num_workers` ranks sharing the cores."""
        if device == "cuda":
            gpus = devices if devices is not None else list(range(num_workers))
            for rank, gpu in enumerate(gpus):
                address = self._spawn(rank, {"CUDA_VISIBLE_DEVICES": str(gpu)}, host,
                                      start_timeout_s)
                self._add(rank, address, "cuda:0")
            return
        threads = max(1, (os.cpu_count() or 1) // num_workers)
        env = {"OMP_NUM_THREADS": str(threads)}
        # The ranks share the cores with each other, the gateway and often the clients. Threads
        # that sleep at once (PASSIVE) pay a wake-up at each of the few hundred regions of a
        # step, and threads that sleep between a call's steps pay one (on a VM, a halted vCPU's)
        # at every step; a spin of a few ms covers both and lets go of the cores once the
        # workers are idle. An operator's own setting wins.
        if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
            env["GOMP_SPINCOUNT"] = str(CPU_SPIN_COUNT)
        for rank in range(num_workers):
            self._add(rank, self._spawn(rank, env, host, start_timeout_s), "cpu")

    def _add(self, rank: int, address: str, device: str) -> None:
        with self._lock:
            process = self._starting.pop()
            self.handles.append(WorkerHandle(rank, address, device, process))

    def _spawn(self, rank: int, env_extra: dict[str, str], host: str, timeout_s: float) -> str:
        """Start one worker and return the address it printed in its `READY <address>` line."""
        env = dict(os.environ, **env_extra, PYTHONUNBUFFERED="1")
        with self._lock:
            if self._closed:
                raise WorkerGroupClosed()
            process = subprocess.Popen(
                [sys.executable, "-m", WORKER_MODULE, "--host", host, "--port", "0",
                 "--parent-pid", str(os.getpid()), *(self.tls.worker_args() if self.tls else [])],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=None, env=env, text=True)
            self._starting.append(process)
        ready: list[str] = []

        def read_ready() -> None:
            assert process.stdout is not None
            for line in process.stdout:
                if line.startswith("READY "):
                    ready.append(line.split()[1])
                    break

        reader = threading.Thread(target=read_ready, daemon=True)
        reader.start()
        reader.join(timeout_s)
        if self._closed:
            raise WorkerGroupClosed()
        if not ready:
            code = process.poll()
            why = (f"exited with code {code}" if code is not None
                   else f"did not start within {timeout_s:.0f}s")
            raise UnavailableError(f"worker rank {rank} {why}", reason="WORKER_UNAVAILABLE",
                                   metadata={"rank": rank})
        return ready[0]

    def close(self, grace_s: float = 5.0) -> None:
        """Stop the local workers (SIGTERM, then SIGKILL after `grace_s`); remote ones are left
        running. Safe to call more than once and from any thread."""
        with self._lock:
            self._closed = True
            processes = [h.process for h in self.handles if h.process is not None]
            processes += self._starting
        for process in processes:
            if process.poll() is None:
                process.terminate()
        for process in processes:
            try:
                process.wait(grace_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            if process.stdout is not None:
                process.stdout.close()
