"""The `shardlm` command's client side: quick to start (no torch), quiet in a pipe, and a chat
that survives Ctrl-C during a reply. A fake client stands in for the gateway."""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass

import pytest
from shardlm import cli


def run_python(code: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=60, **kwargs)


def test_client_commands_do_not_import_the_server_or_torch():
    out = run_python("""
        import sys
        from shardlm.cli import main
        for argv in (["generate", "--help"], ["chat", "--help"], ["load", "--help"], ["--help"]):
            try:
                main(argv)
            except SystemExit:
                pass
        heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "shardlm_server"))
        print("HEAVY", heavy)
    """)
    assert out.returncode == 0, out.stderr
    assert "HEAVY []" in out.stdout
    for command in ("serve", "worker", "generate", "chat", "load"):  # --help lists them all
        assert f"    {command} " in out.stdout


def test_server_commands_without_the_server_say_so_in_one_line(monkeypatch, capsys):
    for name in ("shardlm_server", "shardlm_server.gateway", "shardlm_server.gateway.serve.cli",
                 "shardlm_server.worker", "shardlm_server.worker.worker_server"):
        monkeypatch.setitem(sys.modules, name, None)  # as if only the SDK were installed
    assert cli.main(["serve", "--help"]) == 2
    assert cli.main(["worker"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == ["error: `shardlm serve` needs the ShardLM server, and only the client is "
                   "installed",
                   "error: `shardlm worker` needs the ShardLM server, and only the client is "
                   "installed"]


def test_generate_into_a_closed_pipe_ends_quietly():
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import sys
        from shardlm import cli

        class Chunk:
            text = "words and more words "

        class FakeClient:
            def __init__(self, *args, **kwargs):
                pass
            def __enter__(self):
                return self
            def __exit__(self, *exc):
                return False
            def stream_generate(self, prompt, **kwargs):
                for _ in range(1_000_000):
                    yield Chunk

        cli.Client = FakeClient
        sys.exit(cli.main(["generate", "hi"]))
    """)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"))
    proc.stdout.close()  # like `| head` that has read enough
    err = proc.stderr.read()
    assert proc.wait(60) == cli.EXIT_BROKEN_PIPE
    assert "Traceback" not in err and "BrokenPipeError" not in err


@dataclass
class Token:
    text: str


@dataclass
class Turn:
    session_id: str
    first_token: Token


class FakeChatClient:
    """The first reply is interrupted by Ctrl-C after one chunk; later ones complete."""

    def __init__(self) -> None:
        self.replies = 0
        self.cancelled = 0
        self.reset: list[str] = []

    def prefill(self, messages, session_id=None, **sampling) -> Turn:
        return Turn(session_id or f"s{len(self.reset)}", Token("Hi"))

    def stream_decode(self, session_id, **kwargs):
        self.replies += 1
        interrupt = self.replies == 1
        try:
            yield Token(" there")
            if interrupt:
                raise KeyboardInterrupt
            yield Token(" friend")
        finally:
            self.cancelled += interrupt

    def reset_cache(self, session_id) -> int:
        self.reset.append(session_id)
        return 1


def chat_args() -> argparse.Namespace:
    return argparse.Namespace(max_new_tokens=8, stop=[], temperature=0.0, top_k=0, top_p=None,
                              seed=None)


def test_chat_ctrl_c_stops_the_reply_not_the_chat_and_reset_confirms(monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\nmore\n/reset\nagain\n"))
    client = FakeChatClient()
    cli.chat(chat_args(), client)
    out = capsys.readouterr().out
    assert out.splitlines() == ["bot> Hi there [stopped]", "bot> Hi there friend",
                                "(conversation reset)", "bot> Hi there friend"]
    assert client.cancelled == 1
    assert client.reset == ["s0", "s1"]  # the /reset, then the session open at the end


def test_chat_ctrl_c_at_the_prompt_ends_it(monkeypatch, capsys):
    class InterruptedInput(io.StringIO):
        def readline(self, *args):
            raise KeyboardInterrupt

    monkeypatch.setattr(sys, "stdin", InterruptedInput())
    cli.chat(chat_args(), FakeChatClient())
    assert capsys.readouterr().out == "\n"


@pytest.mark.parametrize("argv", [["generate", "x"], ["chat"], ["load", "m"]])
def test_client_commands_default_to_the_shared_gateway_address(argv):
    from shardlm.constants import DEFAULT_GATEWAY_ADDRESS

    assert cli.build_parser().parse_args(argv).address == DEFAULT_GATEWAY_ADDRESS
