"""The Node.js client (clients/node) against a live `shardlm serve` on the tiny test checkpoint,
with bearer-token auth on (the client sends the token; calls without it are refused)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NODE_DIR = ROOT / "clients" / "node"


def _start_gateway(*args: str) -> tuple[subprocess.Popen, str, list[str]]:
    proc = subprocess.Popen([sys.executable, "-m", "shardlm_server.gateway.serve.cli", "serve", "--port", "0", *args],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert proc.stdout is not None
    log: list[str] = []
    address = None
    ready = False
    deadline = time.monotonic() + 60
    for line in proc.stdout:
        log.append(line)
        if line.startswith("ShardLM gateway on "):
            address = line.split()[3]
        if line.startswith("ready:"):
            ready = True
            break
        if time.monotonic() > deadline:
            break
    # Keep draining the pipe so that the server never blocks on a full one.
    threading.Thread(target=lambda: log.extend(proc.stdout), daemon=True).start()
    if not (address and ready):
        proc.kill()
        raise AssertionError("the gateway did not become ready:\n" + "".join(log))
    return proc, address, log


@pytest.fixture(scope="module")
def node_env() -> dict[str, str]:
    node, npm = shutil.which("node"), shutil.which("npm")
    if not node or not npm:
        pytest.skip("node and npm are not installed: the Node.js client cannot be tested")
    if not (NODE_DIR / "node_modules" / "@grpc" / "grpc-js").is_dir():
        done = subprocess.run([npm, "ci", "--no-audit", "--no-fund"], cwd=NODE_DIR,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"npm ci failed:\n{done.stdout}\n{done.stderr}"
    return {"node": node}


@pytest.mark.timeout(120)
def test_node_client_against_gateway(node_env, llama_dir, tmp_path):
    token = "node-client-test-token"
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{token} node-test\n", encoding="utf-8")
    proc, address, log = _start_gateway("--model", str(llama_dir), "--dtype", "float32",
                                        "--auth-tokens", str(tokens))
    try:
        done = subprocess.run([node_env["node"], "--test", "test/client.test.js"], cwd=NODE_DIR,
                              env=dict(os.environ, SHARDLM_ADDRESS=address,
                                       SHARDLM_AUTH_TOKEN=token),
                              capture_output=True, text=True, timeout=60)
        output = done.stdout + done.stderr
        assert done.returncode == 0, f"node --test failed:\n{output}\n--- gateway log ---\n" \
            + "".join(log)
        assert "# fail 0" in output and "# skipped 0" in output, output
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
