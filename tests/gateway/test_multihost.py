"""One replica across hosts, each "host" a network namespace on a private bridge.

Worker rank 0, worker rank 1 and the gateway (`shardlm serve --workers ...`) each run in their own
namespace with their own address; a fourth namespace holds the bridge. Nothing has a route out and
the root namespace gets no interface or address, so no packet leaves these namespaces. The client
runs in the gateway's namespace (tests/gateway/netns_client.py). Checked: TP=2 across the hosts
gives TP=1's greedy tokens; unplugging rank 1's cable mid-stream ends the stream with UNAVAILABLE
and turns health NOT_SERVING; plugging it back in, the replica recovers and answers exactly again.

Needs root (CI runs as root); skipped with the reason otherwise. Select with `-m netns`.
"""

from __future__ import annotations

import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from shardlm.common.v1 import common_pb2
from shardlm.gateway.v1 import gateway_pb2

from shardlm_server.gateway.api.runtime import Limits
from tests.gateway.conftest import LiveGateway
from tests.gateway.test_e2e import collect, greedy

pytestmark = pytest.mark.netns

ROOT = Path(__file__).resolve().parents[2]
WORKER_PORT = 50061
GATEWAY_PORT = 50051
COMM_PORT = 29511  # rank 0's rendezvous port, fixed as behind a firewall (worker --comm-port)
PROMPT = [1, 9, 8, 7, 6, 5]
ANSWER_TOKENS = 24
STREAM_TOKENS = 480  # long enough to still be running when the cable is pulled


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=10)


class PrivateNetwork:
    """Namespaces `<tag>-a` (rank 0), `-b` (rank 1), `-g` (gateway), each with an `eth0` on a bridge
    in `<tag>-br`. Names carry the pid, so parallel runs never meet."""

    HOSTS = {"a": 1, "b": 2, "g": 3}

    def __init__(self) -> None:
        pid = os.getpid()
        self.tag = f"shardlm{pid}"
        self.subnet = f"10.77.{pid % 250}"
        self.bridge_ns = f"{self.tag}-br"
        self.namespaces: list[str] = []

    def ns(self, host: str) -> str:
        return f"{self.tag}-{host}"

    def address(self, host: str) -> str:
        return f"{self.subnet}.{self.HOSTS[host]}"

    def _add_namespace(self, name: str) -> None:
        ip("netns", "add", name)
        self.namespaces.append(name)
        ip("-n", name, "link", "set", "lo", "up")

    def create(self) -> None:
        self._add_namespace(self.bridge_ns)
        ip("-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
        ip("-n", self.bridge_ns, "link", "set", "br0", "up")
        for host in self.HOSTS:
            ns = self.ns(host)
            self._add_namespace(ns)
            ip("-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", f"port-{host}",
               "netns", self.bridge_ns)
            ip("-n", self.bridge_ns, "link", "set", f"port-{host}", "master", "br0")
            ip("-n", self.bridge_ns, "link", "set", f"port-{host}", "up")
            ip("-n", ns, "addr", "add", f"{self.address(host)}/24", "dev", "eth0")
            ip("-n", ns, "link", "set", "eth0", "up")

    def cable(self, host: str, plugged: bool) -> None:
        """Unplug / plug `host`'s cable at the bridge: its packets are dropped, no reset is sent."""
        ip("-n", self.bridge_ns, "link", "set", f"port-{host}", "up" if plugged else "down")

    def pids(self) -> list[str]:
        found = []
        for ns in self.namespaces:
            out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True,
                                 timeout=10).stdout
            found += out.split()
        return found

    def remove(self) -> None:
        for ns in reversed(self.namespaces):  # a veth goes with either of its namespaces
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)
        self.namespaces.clear()

    def leftovers(self) -> list[str]:
        out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                             timeout=10).stdout
        return [line for line in out.splitlines() if self.tag in line]


class Process:
    """A command in a namespace, its stdout read line by line on a thread, its stderr in a file."""

    def __init__(self, net: PrivateNetwork, host: str, args: list[str], log: Path,
                 env: dict[str, str]) -> None:
        self.log = log
        with open(log, "w") as stderr:
            self.popen = subprocess.Popen(
                ["ip", "netns", "exec", net.ns(host), sys.executable, *args], cwd=ROOT,
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=stderr, text=True,
                env=env, start_new_session=True)
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def next_line(self, timeout_s: float) -> str | None:
        """The next stdout line; None at the end of the output. Fails after `timeout_s`."""
        try:
            return self.lines.get(timeout=timeout_s)
        except queue.Empty:
            pytest.fail(f"no output within {timeout_s:.0f}s\n{self.log_tail()}")

    def expect(self, prefix: str, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while (line := self.next_line(max(deadline - time.monotonic(), 0.1))) is not None:
            if line.startswith(prefix):
                return line
        pytest.fail(f"ended before printing {prefix!r} (code {self.popen.wait(5)})\n"
                    f"{self.log_tail()}")

    def log_tail(self) -> str:
        return f"--- {self.log.name} ---\n" + "\n".join(self.log.read_text().splitlines()[-30:])

    def stop(self) -> None:
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGKILL)
        self.popen.wait(10)
        if self.popen.stdout is not None:
            self.popen.stdout.close()


def _skip_reason() -> str:
    if not sys.platform.startswith("linux"):
        return "network namespaces are a Linux feature"
    if os.geteuid() != 0:
        return "creating network namespaces needs root (CI runs as root)"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    return ""


@pytest.fixture
def network():
    if reason := _skip_reason():
        pytest.skip(reason)
    net = PrivateNetwork()
    try:
        net.create()
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        net.remove()
        detail = getattr(exc, "stderr", "") or exc
        pytest.skip(f"the kernel refused a private network namespace/bridge: {detail}")
    yield net
    net.remove()
    assert net.leftovers() == []


@pytest.fixture
def cluster(network, llama_dir, tmp_path):
    """Two workers started by hand on hosts a and b, and `shardlm serve --workers` on host g."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "clients/python/src"),
                                                       str(ROOT)]),
               PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="eth0")
    processes: list[Process] = []

    def start(host: str, args: list[str], log: str) -> Process:
        processes.append(Process(network, host, args, tmp_path / log, env))
        return processes[-1]

    try:
        workers = [start(host, ["-m", "shardlm_server.worker", "--host", network.address(host),
                                "--port", str(WORKER_PORT), *extra], f"worker-{host}.log")
                   for host, extra in (("a", ["--comm-port", str(COMM_PORT)]), ("b", []))]
        for worker in workers:
            worker.expect("READY ", 90)
        addresses = ",".join(f"{network.address(h)}:{WORKER_PORT}" for h in ("a", "b"))
        gateway = start("g", ["-m", "shardlm", "serve", "--workers", addresses,
                              "--model", str(llama_dir), "--dtype", "float32",
                              "--host", "127.0.0.1", "--port", str(GATEWAY_PORT),
                              "--kv-cache-mb", "16"], "shardlm_server.gateway.log")
        gateway.expect("ready: ", 120)

        def client(*args: str) -> Process:
            return start("g", ["-m", "tests.gateway.netns_client", args[0],
                               f"127.0.0.1:{GATEWAY_PORT}", *args[1:]], "client.log")

        yield network, client, gateway, workers
    finally:
        for process in reversed(processes):  # the gateway before the workers it calls
            process.stop()
        assert network.pids() == []  # nothing left running in any namespace


def answer(client, max_new: int = ANSWER_TOKENS) -> list[int]:
    reply = client("generate", ",".join(map(str, PROMPT)), str(max_new))
    tokens = []
    while (line := reply.next_line(60)) != "END":
        assert line is not None and not line.startswith("ERROR"), line
        tokens.append(int(line))
    return tokens


def health(client) -> str:
    return client("health").expect("", 30)


def wait_health(client, wanted: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while (status := health(client)) != wanted:
        assert time.monotonic() < deadline, f"health stayed {status}, never {wanted}"
        time.sleep(0.5)


@pytest.fixture(scope="module")
def tp1_tokens(llama_dir):
    """The same prompt, greedy, on one local worker: what the two hosts must agree with."""
    gateway = LiveGateway(1, Limits())
    try:
        list(gateway.stub.Load(gateway_pb2.LoadRequest(model_path=str(llama_dir),
                                                       dtype=common_pb2.DTYPE_FLOAT32)))
        return collect(gateway.stub.Generate(gateway_pb2.GenerateRequest(
            token_ids=gateway_pb2.TokenIds(token_ids=PROMPT), **greedy(ANSWER_TOKENS))))[0]
    finally:
        gateway.close()


def test_tp2_across_hosts_matches_tp1_and_survives_a_pulled_cable(cluster, tp1_tokens):
    network, client, gateway, workers = cluster
    assert answer(client) == tp1_tokens
    # Rank 0 opened the rendezvous on its own address and its --comm-port, not on loopback.
    rendezvous = f"rendezvous store at {network.address('a')}:{COMM_PORT}"
    assert rendezvous in workers[0].log.read_text()

    stream = client("generate", ",".join(map(str, PROMPT)), str(STREAM_TOKENS))
    for _ in range(3):
        assert stream.next_line(60) not in (None, "END")
    network.cable("b", plugged=False)
    # Bounded well below the 60 s collective timeout and the 120 s step timeout.
    while (line := stream.next_line(30)) is not None and not line.startswith(("ERROR", "END")):
        pass
    assert line is not None and line.startswith("ERROR UNAVAILABLE"), (line, gateway.log_tail())
    wait_health(client, "NOT_SERVING", 15)

    network.cable("b", plugged=True)
    wait_health(client, "SERVING", 120)
    assert answer(client) == tp1_tokens
    # Each rank's Load replaced its communicator: rank 0 opened the store (same port) again.
    assert workers[0].log.read_text().count(rendezvous) == 2
