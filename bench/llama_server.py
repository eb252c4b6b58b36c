"""llama.cpp's own HTTP server (`llama-server`) in a subprocess, and a streaming client for it that
records chunk arrivals the way bench.stack_bench does for ShardLM, so both stacks are summarized
by the same code.

The binary is optional and built by `make llama-server` (scripts/build_llama_server.sh) into
.bench/bin; `binary()` also finds one named by $LLAMA_SERVER or on PATH. Requests go to the native
`/completion` endpoint: token-id prompts, greedy, `ignore_eos`, a fixed `n_predict`, no prompt
cache (the benchmark sends fresh prompts each round, and ShardLM's prefix cache sees no repeats
either).
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import threading
import time
from pathlib import Path

from bench.serve_process import REPO, ServerProcess, free_port

BUILD_HINT = "make llama-server"


def built_tool(name: str, variable: str) -> Path | None:
    """The llama.cpp tool `name` to run: the one $`variable` names, else the one
    scripts/build_llama_server.sh built into .bench/bin, else one on PATH."""
    named = os.environ.get(variable)
    if named:
        return Path(named) if Path(named).is_file() else None
    built = REPO / ".bench" / "bin" / name
    if built.is_file():
        return built
    found = shutil.which(name)
    return Path(found) if found else None


def binary() -> Path | None:
    """The llama-server to run: $LLAMA_SERVER, else the one `make llama-server` built, else PATH."""
    return built_tool("llama-server", "LLAMA_SERVER")


class LlamaServer(ServerProcess):
    """`llama-server` on `gguf` with `slots` parallel slots of `slot_tokens` context each, and
    `threads` threads for decode and for prompts."""

    def __init__(self, exe: Path, gguf: Path, *, slots: int, slot_tokens: int, threads: int,
                 start_timeout_s: float = 120.0, extra: tuple[str, ...] = ()) -> None:
        self.port = free_port()
        super().__init__([str(exe), "-m", str(gguf), "--host", "127.0.0.1", "--port",
                          str(self.port), "-t", str(threads), "-tb", str(threads), "-np",
                          str(slots), "-c", str(slots * slot_tokens), "-b", "512", *extra])
        self.wait_until(self._healthy, start_timeout_s, "llama-server")

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _healthy(self) -> bool:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
            conn.request("GET", "/health")
            return conn.getresponse().status == 200
        except OSError:
            return False


def stream(address: str, prompt: list[int], max_new_tokens: int,
           barrier: threading.Barrier | None, *, ignore_eos: bool = True) -> dict:
    """One streaming completion: {"start", "arrivals": [(time, tokens)], "server": {}}, the shape
    bench.stack_bench.summarize reads (plus "text", what it generated)."""
    host, port = address.rsplit(":", 1)
    body = json.dumps({"prompt": prompt, "n_predict": max_new_tokens, "stream": True,
                       "ignore_eos": ignore_eos, "temperature": 0.0, "top_k": 1,
                       "cache_prompt": False, "return_tokens": True})
    conn = http.client.HTTPConnection(host, int(port), timeout=600)
    try:
        conn.connect()  # one connection per client, as separate clients would have
        if barrier is not None:
            barrier.wait()
        start = time.perf_counter()
        conn.request("POST", "/completion", body=body,
                     headers={"Content-Type": "application/json"})
        reply = conn.getresponse()
        if reply.status != 200:
            raise RuntimeError(f"llama-server answered {reply.status}: {reply.read()[:300]!r}")
        arrivals: list[tuple[float, int]] = []
        server: dict = {}
        text: list[str] = []
        for raw in reply:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            now = time.perf_counter()
            event = json.loads(line[5:])
            count = len(event.get("tokens") or [])
            text.append(event.get("content") or "")
            if count:
                arrivals.append((now, count))
            if event.get("stop"):
                timings = event.get("timings") or {}
                server = {"ttft_s": timings.get("prompt_ms", float("nan")) / 1000,
                          "tokens_per_s": timings.get("predicted_per_second", float("nan")),
                          "mean_inter_token_s": timings.get("predicted_per_token_ms",
                                                            float("nan")) / 1000}
                break
        return {"start": start, "arrivals": arrivals, "server": server, "text": "".join(text)}
    finally:
        conn.close()
