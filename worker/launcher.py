"""Start a tensor-parallel group of workers, wait until each is healthy, and load a model on all.

Local workers are child processes (one per GPU on CUDA, each seeing only its own device; N ranks
on CPU). Workers on other hosts are given by address instead. Load goes to every rank at once,
because ranks block in the communicator's rendezvous until all have joined; with NCCL, rank 0's
Load stream first yields the NCCL unique id, which is then passed to the other ranks.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from shardlm.common.v1 import common_pb2
from shardlm.errors import ShardLMError, UnavailableError
from shardlm.worker.v1 import worker_pb2, worker_pb2_grpc

MAX_MESSAGE_BYTES = 256 << 20  # debug taps of large models are big
CHANNEL_OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]


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


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class WorkerHandle:
    rank: int
    address: str
    device: str  # as the worker names it ("cpu", "cuda:0")
    process: subprocess.Popen | None = None
    tls: WorkerTLS | None = None
    channel: grpc.Channel = field(init=False)
    stub: worker_pb2_grpc.WorkerServiceStub = field(init=False)

    def __post_init__(self) -> None:
        self.channel = (
            grpc.secure_channel(self.address, self.tls.channel_credentials(), CHANNEL_OPTIONS)
            if self.tls else grpc.insecure_channel(self.address, options=CHANNEL_OPTIONS))
        self.stub = worker_pb2_grpc.WorkerServiceStub(self.channel)

    @property
    def alive(self) -> bool:
        return self.process is None or self.process.poll() is None


def _spawn(rank: int, env_extra: dict[str, str], host: str, timeout_s: float,
           tls: WorkerTLS | None) -> tuple[subprocess.Popen, str]:
    env = dict(os.environ, **env_extra, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "worker", "--host", host, "--port", "0",
         *(tls.worker_args() if tls else [])],
        stdout=subprocess.PIPE, stderr=None, env=env, text=True,
    )
    ready: list[str] = []

    def read_ready() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("READY "):
                ready.append(line.split()[1])
                break

    reader = threading.Thread(target=read_ready, daemon=True)
    reader.start()
    reader.join(timeout_s)
    if not ready:
        proc.kill()
        raise UnavailableError(f"worker rank {rank} did not start within {timeout_s:.0f}s",
                               reason="WORKER_UNAVAILABLE", metadata={"rank": rank})
    return proc, ready[0]


class WorkerGroup:
    def __init__(self, handles: list[WorkerHandle], tls: WorkerTLS | None = None) -> None:
        self.handles = handles
        self.tls = tls
        # How every Load keeps linear weights (worker LoadRequest.quantize; serve --quantize).
        self.quantize = ""

    @property
    def world_size(self) -> int:
        return len(self.handles)

    @classmethod
    def spawn(
        cls,
        num_workers: int = 1,
        *,
        device: str = "cpu",
        devices: list[int] | None = None,
        host: str = "127.0.0.1",
        start_timeout_s: float = 120.0,
        tls: WorkerTLS | None = None,
    ) -> WorkerGroup:
        """Start local workers: on CUDA one per entry of `devices` (default 0..N-1), each seeing
        only its GPU; on CPU `num_workers` ranks."""
        handles: list[WorkerHandle] = []
        try:
            if device == "cuda":
                gpus = devices if devices is not None else list(range(num_workers))
                for rank, gpu in enumerate(gpus):
                    proc, address = _spawn(rank, {"CUDA_VISIBLE_DEVICES": str(gpu)}, host,
                                           start_timeout_s, tls)
                    handles.append(WorkerHandle(rank, address, "cuda:0", proc, tls))
            else:
                threads = max(1, (os.cpu_count() or 1) // num_workers)
                env = {"OMP_NUM_THREADS": str(threads)}
                # The ranks share the cores with each other, the gateway and often the clients:
                # OpenMP threads that spin between parallel regions would take cores the others
                # need for every token. An operator's own setting wins.
                if "OMP_WAIT_POLICY" not in os.environ:
                    env["OMP_WAIT_POLICY"] = "PASSIVE"
                for rank in range(num_workers):
                    proc, address = _spawn(rank, env, host, start_timeout_s, tls)
                    handles.append(WorkerHandle(rank, address, "cpu", proc, tls))
        except BaseException:
            cls(handles).close()
            raise
        group = cls(handles, tls)
        group.wait_healthy(start_timeout_s)
        return group

    @classmethod
    def connect(cls, addresses: list[str], device: str = "cpu",
                tls: WorkerTLS | None = None) -> WorkerGroup:
        """Workers started elsewhere (other hosts), in rank order."""
        return cls([WorkerHandle(rank, a, device, None, tls) for rank, a in enumerate(addresses)],
                   tls)

    def wait_healthy(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        for h in self.handles:
            while True:
                try:
                    h.stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=2.0)
                    break
                except grpc.RpcError as exc:
                    if time.monotonic() > deadline or not h.alive:
                        raise UnavailableError(
                            f"worker rank {h.rank} at {h.address} is not answering",
                            reason="WORKER_UNAVAILABLE",
                            metadata={"rank": h.rank, "address": h.address}) from exc
                    time.sleep(0.2)

    def load(
        self,
        model_path: str,
        *,
        dtype: int = common_pb2.DTYPE_UNSPECIFIED,
        kv_cache: common_pb2.KvCacheConfig | None = None,
        comm_timeout_s: float = 60.0,
        comm_port: int = 0,
        progress: Callable[[common_pb2.LoadProgress], None] = lambda _p: None,
    ) -> worker_pb2.LoadComplete:
        """Load on every rank at once; returns rank 0's LoadComplete or raises the first error."""
        world = self.world_size
        cuda = self.handles[0].device.startswith("cuda")
        backend = worker_pb2.COMM_BACKEND_NCCL if cuda else worker_pb2.COMM_BACKEND_GLOO
        rank0_host = self.handles[0].address.rsplit(":", 1)[0]
        init_address = ""
        if world > 1 and not cuda:
            init_address = f"{rank0_host}:{comm_port or free_port(rank0_host)}"

        def request(rank: int, unique_id: bytes = b"") -> worker_pb2.LoadRequest:
            return worker_pb2.LoadRequest(
                model_path=model_path, dtype=dtype, device=self.handles[rank].device,
                rank=rank, world_size=world, kv_cache=kv_cache, quantize=self.quantize,
                comm=worker_pb2.CommunicatorConfig(backend=backend, init_address=init_address,
                                                   nccl_unique_id=unique_id,
                                                   timeout_seconds=comm_timeout_s))

        results: list[worker_pb2.LoadComplete | None] = [None] * world
        errors: list[BaseException] = []
        streams = []

        def consume(rank: int, stream) -> None:
            try:
                for event in stream:
                    if event.HasField("complete"):
                        results[rank] = event.complete
                    elif event.HasField("progress") and rank == 0:
                        progress(event.progress)
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.CANCELLED:
                    errors.append(ShardLMError.from_rpc_error(exc))
                for other in streams:  # the others would wait for a peer that is not coming
                    other.cancel()

        first = self.handles[0].stub.Load(request(0))
        streams.append(first)
        unique_id = b""
        if cuda and world > 1:
            try:
                event = next(first)
            except grpc.RpcError as exc:
                raise ShardLMError.from_rpc_error(exc) from None
            unique_id = event.nccl_unique_id
        threads = [threading.Thread(target=consume, args=(0, first), daemon=True)]
        for rank in range(1, world):
            stream = self.handles[rank].stub.Load(request(rank, unique_id))
            streams.append(stream)
            threads.append(threading.Thread(target=consume, args=(rank, stream), daemon=True))
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        assert results[0] is not None
        return results[0]

    def close(self, grace_s: float = 5.0) -> None:
        for h in self.handles:
            h.channel.close()
            if h.process is not None and h.process.poll() is None:
                h.process.terminate()
        for h in self.handles:
            if h.process is not None:
                try:
                    h.process.wait(grace_s)
                except subprocess.TimeoutExpired:
                    h.process.kill()
                    h.process.wait()
