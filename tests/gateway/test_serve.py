"""`shardlm serve` as users run it: one command, real processes, SIGTERM drains."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from shardlm.common.v1 import common_pb2
from shardlm.gateway.v1 import gateway_pb2, gateway_pb2_grpc


def start_serve(*args: str, output: list[str] | None = None) -> tuple[subprocess.Popen, str]:
    """`shardlm serve` up and ready; the lines it prints after that go to `output`."""
    proc = subprocess.Popen([sys.executable, "-m", "shardlm", "serve", "--port", "0", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    address = None
    deadline = time.monotonic() + 120
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("ShardLM gateway on "):
            address = line.split()[3]
        if line.startswith(("ready:", "no model:")) or time.monotonic() > deadline:
            break
    assert address, "serve did not come up"
    lines = [] if output is None else output
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    return proc, address


def test_sigterm_announces_then_drains_in_flight_streams(llama_dir, tmp_path):
    config = tmp_path / "serve.toml"
    # The in-flight stream must still run when the refused call comes (about 2 s in), or the
    # drain has already ended and the transport refuses it uncounted: 500 tokens, one decode
    # step a worker call (300 at the default calls took under 2 s on an Intel Xeon VM).
    config.write_text(f'model = "{llama_dir}"\ndtype = "float32"\ndrain_grace = 20\n'
                      'drain_announce = 30\nmax_decode_steps = 1\n')
    output: list[str] = []
    proc, address = start_serve("--config", str(config), "--tp", "2", output=output)
    try:
        channel = grpc.insecure_channel(address)
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        health = health_pb2_grpc.HealthStub(channel)
        assert health.Check(health_pb2.HealthCheckRequest()).status == \
            health_pb2.HealthCheckResponse.SERVING
        stream = stub.Generate(gateway_pb2.GenerateRequest(
            token_ids=gateway_pb2.TokenIds(token_ids=[1, 2, 3]),
            stop=common_pb2.StopConditions(max_new_tokens=500, ignore_eos=True)))
        chunks = [next(stream)]
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        assert health.Check(health_pb2.HealthCheckRequest()).status == \
            health_pb2.HealthCheckResponse.NOT_SERVING
        # Announced: health says so, but a call a router sent before it noticed is still served.
        late = list(stub.Generate(gateway_pb2.GenerateRequest(
            text="late", stop=common_pb2.StopConditions(max_new_tokens=2))))
        assert late[-1].finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
        time.sleep(1.5)  # no call for a second: the announcement is over, new calls are refused
        try:
            list(stub.Generate(gateway_pb2.GenerateRequest(text="later")))
            raise AssertionError("a new call during drain must be refused")
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.UNAVAILABLE
        chunks += list(stream)  # the in-flight stream still completes
        assert sum(len(c.token_ids) for c in chunks) == 500
        assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert proc.wait(30) == 0
        drained = [line for line in output if line.startswith("drained: ")]
        assert drained == ["drained: 1 new calls taken while the shutdown was announced, "
                           "1 refused after\n"], output
    finally:
        if proc.poll() is None:
            proc.kill()


def test_cli_generate_chat_load_and_friendly_errors(llama_dir):
    proc, address = start_serve("--model", str(llama_dir), "--dtype", "float32")
    cli = [sys.executable, "-m", "shardlm"]
    try:
        out = subprocess.run([*cli, "generate", "To be", "--address", address,
                              "--max-new-tokens", "8"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and out.stdout.startswith("To be")
        out = subprocess.run([*cli, "chat", "--address", address, "--max-new-tokens", "5"],
                             input="hello there\nand again\n", capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 0 and out.stdout.count("bot> ") == 2
        out = subprocess.run([*cli, "load", str(llama_dir), "--address", address],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and "loaded LlamaForCausalLM" in out.stdout
        assert "100%" in out.stderr  # the progress bar
        out = subprocess.run([*cli, "generate", "x", "--address", address, "--temperature", "-1"],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 1 and "sampling.temperature" in out.stderr
        assert "Traceback" not in out.stderr
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    out = subprocess.run([*cli, "generate", "x", "--address", address], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 1 and "no ShardLM gateway answers" in out.stderr


def test_sigterm_under_load_lets_every_stream_finish(llama_dir):
    proc, address = start_serve("--model", str(llama_dir), "--dtype", "float32",
                                "--drain-grace", "30")
    results: list = [None] * 24
    started = threading.Semaphore(0)

    def stream(i: int) -> None:
        with grpc.insecure_channel(address) as channel:
            stub = gateway_pb2_grpc.GatewayServiceStub(channel)
            call = stub.Generate(gateway_pb2.GenerateRequest(
                token_ids=gateway_pb2.TokenIds(token_ids=[1, 5 + i, 9]),
                stop=common_pb2.StopConditions(max_new_tokens=60 + i, ignore_eos=True)))
            chunks = [next(call)]
            started.release()
            chunks += list(call)
            results[i] = (sum(len(c.token_ids) for c in chunks), chunks[-1].finish_reason)

    try:
        threads = [threading.Thread(target=stream, args=(i,)) for i in range(24)]
        for t in threads:
            t.start()
        for _ in threads:  # every stream is in flight before the signal
            assert started.acquire(timeout=60)
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(60)
        assert results == [(60 + i, common_pb2.FINISH_REASON_LENGTH) for i in range(24)]
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
