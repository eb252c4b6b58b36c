"""`shardlm serve --openai-port`: one command serves OpenAI's HTTP API through SMG, a supervised
child of the gateway. Chats (streamed or not) give ShardLM's own greedy text; a killed SMG is
restarted while the server's overall health says NOT_SERVING (and the gRPC API's own does not);
a model loaded later (`--no-model`) is served once loaded; and SMG outlives neither a stopped nor
a SIGKILLed gateway. The `openai` package is not a dependency: plain HTTP, as its client sends.
Every process started here carries a marker in its environment (test_serve_startup.py), so that
what is left afterwards is found whoever its parent is; SMG rewrites the memory that
/proc/PID/environ shows (setproctitle), so it is found by the pids the gateway logs instead."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from shardlm.gateway.v1 import gateway_pb2, gateway_pb2_grpc

from shardlm_server.gateway.serve.openai_router import free_port, smg_command
from tests.gateway.serve.test_serve_startup import (
    MARKER_VARIABLE,
    marked_processes,
    wait_until_none_left,
)
from tests.gateway.smg_fixtures import chat_checkpoint

try:
    smg_command()
except ValueError:
    pytest.skip("the smg router (PyPI smg) is not installed", allow_module_level=True)

CHAT = [{"role": "user", "content": "To be, or not to be"}]
MAX_TOKENS = 12
SERVICE = "shardlm.gateway.v1.GatewayService"
STARTED = re.compile(r"started SMG \(pid (\d+)\)")
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class Serve:
    """`shardlm serve` in a child process, its output (stdout and log) read as it comes."""

    def __init__(self, *args: str) -> None:
        self.marker = uuid.uuid4().hex
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "shardlm", "serve", "--device", "cpu", "--port", "0",
             "--openai-port", "0", *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env=dict(os.environ, PYTHONUNBUFFERED="1", **{MARKER_VARIABLE: self.marker}))
        self.lines: list[str] = []
        self._ended = False
        self._changed = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()
        ready = self.wait_for(lambda line: line.startswith(("ready:", "no model:")), 180)
        self.address = self.wait_for(lambda line: line.startswith("ShardLM gateway on "),
                                     1).split()[3]
        self.base = ready.split("openai: ")[1].strip()  # http://HOST:PORT/v1

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                self._changed.notify_all()
        with self._changed:
            self._ended = True
            self._changed.notify_all()

    def wait_for(self, match, timeout_s: float = 60, after: int = 0) -> str:
        """The first line from `after` on for which `match(line)`."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while True:
                found = next((x for x in self.lines[after:] if match(x)), None)
                if found is not None:
                    return found
                left = deadline - time.monotonic()
                assert left > 0 and not self._ended, \
                    "no such line; the output:\n" + "\n".join(self.lines[-40:])
                self._changed.wait(left)

    def smg_pids(self) -> list[int]:
        return [int(m.group(1)) for line in list(self.lines) if (m := STARTED.search(line))]

    def left_running(self, timeout_s: float = 30.0) -> list[int]:
        """The workers and SMG routers still running once `timeout_s` is over (or none is)."""
        deadline = time.monotonic() + timeout_s
        while (left := [p for p in self.smg_pids() if alive(p)]) and time.monotonic() < deadline:
            time.sleep(0.1)
        return left + wait_until_none_left(self.marker, max(deadline - time.monotonic(), 0))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for pid in marked_processes(self.marker) + [p for p in self.smg_pids() if alive(p)]:
            os.kill(pid, signal.SIGKILL)


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie has ended)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _http(url: str, body: dict | None = None, timeout: float = 60):
    data = None if body is None else json.dumps(body).encode()
    return urllib.request.urlopen(urllib.request.Request(
        url, data=data, headers={"content-type": "application/json"}), timeout=timeout)


def _chat(base: str, model: str) -> str:
    body = {"model": model, "messages": CHAT, "max_tokens": MAX_TOKENS, "temperature": 0}
    return json.load(_http(f"{base}/chat/completions", body))["choices"][0]["message"]["content"]


def _chat_streamed(base: str, model: str) -> str:
    body = {"model": model, "messages": CHAT, "max_tokens": MAX_TOKENS, "temperature": 0,
            "stream": True}
    parts = []
    with _http(f"{base}/chat/completions", body) as response:
        for raw in response:
            line = raw.decode().strip()
            if line.startswith("data:") and line != "data: [DONE]":
                for choice in json.loads(line[len("data:"):])["choices"]:
                    parts.append(choice.get("delta", {}).get("content") or "")
    return "".join(parts)


def _visible(text: str) -> str:
    """ShardLM ends a text cut inside a character with U+FFFD; SMG drops the incomplete bytes."""
    return text.rstrip("\ufffd")


def _reference(address: str) -> str:
    with grpc.insecure_channel(address) as channel:
        reply = gateway_pb2_grpc.GatewayServiceStub(channel).Generate(gateway_pb2.GenerateRequest(
            messages={"messages": CHAT}, sampling={"temperature": 0},
            stop={"max_new_tokens": MAX_TOKENS}))
        return "".join(m.text for m in reply)


def _models(base: str) -> list[str]:
    try:
        return [m["id"] for m in json.load(_http(f"{base}/models", timeout=5))["data"]]
    except (urllib.error.URLError, OSError, KeyError, ValueError):
        return []


def _metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return float(re.search(rf"^{name} (\S+)$", text, re.MULTILINE).group(1))


class HealthWatch:
    """Every status grpc.health.v1's Watch streams for one service name."""

    def __init__(self, address: str, service: str) -> None:
        self.channel = grpc.insecure_channel(address)
        self.statuses: list[int] = []
        self._stream = health_pb2_grpc.HealthStub(self.channel).Watch(
            health_pb2.HealthCheckRequest(service=service))
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for reply in self._stream:
                self.statuses.append(reply.status)
        except grpc.RpcError:
            pass  # cancelled by close()

    def wait_until(self, condition, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition(self.statuses):
            assert time.monotonic() < deadline, f"health went {self.statuses}"
            time.sleep(0.02)

    def close(self) -> None:
        self._stream.cancel()
        self.channel.close()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return chat_checkpoint(tmp_path_factory.mktemp("openai-port-llama"))


@pytest.fixture(scope="module")
def served(model):
    metrics_port = free_port("127.0.0.1")
    serve = Serve("--model", str(model), "--metrics-port", str(metrics_port))
    serve.metrics_port = metrics_port
    yield serve
    serve.close()


def test_the_ready_line_names_the_openai_url_and_smg_lists_the_model(served, model):
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+/v1", served.base)
    assert _models(served.base) == [model.name]


def test_chats_through_the_openai_port_match_shardlm(served, model):
    expected = _visible(_reference(served.address))
    assert expected
    assert _visible(_chat(served.base, model.name)) == expected
    assert _visible(_chat_streamed(served.base, model.name)) == expected


def test_a_killed_router_is_restarted_and_health_is_degraded_meanwhile(served, model):
    overall, api = HealthWatch(served.address, ""), HealthWatch(served.address, SERVICE)
    try:
        overall.wait_until(lambda s: s == [SERVING])
        api.wait_until(lambda s: s == [SERVING])
        (first,) = served.smg_pids()
        mark = len(served.lines)
        os.kill(first, signal.SIGKILL)
        served.wait_for(lambda line: "the OpenAI router is back on" in line, after=mark)
        overall.wait_until(lambda s: s == [SERVING, NOT_SERVING, SERVING])
        assert api.statuses == [SERVING]  # the gRPC API served on
    finally:
        overall.close()
        api.close()
    second = served.smg_pids()[-1]
    assert second != first and not alive(first) and alive(second)
    assert _metric(served.metrics_port, "shardlm_openai_router_restarts_total") == 1
    assert _metric(served.metrics_port, "shardlm_openai_router_up") == 1
    assert _visible(_chat(served.base, model.name)) == _visible(_reference(served.address))


def test_a_stopped_gateway_stops_its_router(served):
    served.proc.send_signal(signal.SIGTERM)
    assert served.proc.wait(60) == 0
    assert served.left_running() == []  # workers and SMG
    assert "stopped" in served.lines


def test_a_model_loaded_later_is_served_and_a_killed_gateway_leaves_no_router(model):
    serve = Serve("--no-model")
    try:
        assert serve.smg_pids()
        with grpc.insecure_channel(serve.address) as channel:
            for _ in gateway_pb2_grpc.GatewayServiceStub(channel).Load(
                    gateway_pb2.LoadRequest(model_path=str(model))):
                pass
        deadline = time.monotonic() + 60
        while _models(serve.base) != [model.name]:  # SMG restarted for the model
            assert time.monotonic() < deadline, _models(serve.base)
            time.sleep(0.2)
        assert _visible(_chat(serve.base, model.name)) == _visible(_reference(serve.address))
        assert len(serve.smg_pids()) == 2
        serve.proc.kill()
        serve.proc.wait()
        assert serve.left_running() == []  # SMG died with it (PR_SET_PDEATHSIG)
    finally:
        serve.close()
