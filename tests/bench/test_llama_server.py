"""bench.llama_server's client against a stand-in server speaking llama-server's streaming
/completion protocol, its binary lookup, and bench.model_stack's target lines."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from bench import llama_server, model_stack, stack_bench


class _Completion(BaseHTTPRequestHandler):
    """Streams one event per token, then a final event with timings, as llama-server does."""

    requests: list[dict] = []

    def do_POST(self) -> None:  # noqa: N802 - the http.server hook's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _Completion.requests.append(body)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for i in range(body["n_predict"]):
            event = {"content": f"t{i}", "tokens": [100 + i], "stop": False,
                     "tokens_predicted": i + 1}
            self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
            self.wfile.flush()
        final = {"content": "", "tokens": [], "stop": True,
                 "timings": {"prompt_ms": 12.0, "predicted_per_second": 50.0,
                             "predicted_per_token_ms": 20.0}}
        self.wfile.write(f"data: {json.dumps(final)}\n\n".encode())

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def fake_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Completion)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _Completion.requests.clear()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_streams_are_recorded_like_shardlm_streams(fake_server):
    rows = stack_bench.run_round(fake_server, [[5, 6, 7], [8, 9]], 6, llama_server.stream)
    assert [sum(k for _t, k in r["arrivals"]) for r in rows] == [6, 6]
    assert rows[0]["server"]["ttft_s"] == pytest.approx(0.012)
    summary = stack_bench.summarize(2, rows)
    assert summary["tokens"] == 12 and summary["tokens_per_s"] > 0
    request = _Completion.requests[0]
    assert request["ignore_eos"] and request["stream"] and not request["cache_prompt"]
    assert request["prompt"] in ([5, 6, 7], [8, 9]) and request["top_k"] == 1


def test_binary_lookup(tmp_path, monkeypatch):
    exe = tmp_path / "llama-server"
    exe.write_text("")
    monkeypatch.setenv("LLAMA_SERVER", str(exe))
    assert llama_server.binary() == exe
    monkeypatch.setenv("LLAMA_SERVER", str(tmp_path / "missing"))
    assert llama_server.binary() is None  # a named binary that is not there is not replaced


def _row(n: int, ours: float, theirs: float | None) -> dict:
    return {"streams": n, "shardlm": {"tokens_per_s": ours},
            "llama_cpp": {"tokens_per_s": theirs} if theirs else None}


def test_stack_targets():
    got = {name: (value, goal) for name, value, goal in model_stack.targets(
        {"rows": [_row(1, 60.0, 40.0), _row(8, 200.0, 100.0), _row(32, 300.0, 100.0)]})}
    assert got["full stack, 1 stream vs llama-server (tok/s) >= 1.2x"] == (1.5, 1.2)
    assert got["full stack, 32 streams vs llama-server with 32 slots (total tok/s) >= 2x"] == (3.0, 2.0)
    alone = model_stack.targets({"rows": [_row(1, 60.0, None)]})
    assert alone == [("full stack, 1 stream vs llama-server (tok/s) >= 1.2x", None, 1.2)]


def test_build_script_is_wired_to_make():
    repo = Path(__file__).resolve().parents[2]
    assert "scripts/build_llama_server.sh" in (repo / "Makefile").read_text()
    assert (repo / "scripts" / "build_llama_server.sh").stat().st_mode & 0o111
