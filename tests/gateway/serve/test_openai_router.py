"""`serve --openai-port`'s parts that need no model and no real SMG: the tool-call parser chosen
per checkpoint, the `smg launch` arguments, the message when smg is missing, the --openai-host
rule under --auth-tokens, and the supervision of the child, run against a stand-in `smg` (a few
lines of Python that answer HTTP) so that starting, restarting, following a new model and
stopping are checked in seconds."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from shardlm_server.gateway.config import ConfigError, is_loopback
from shardlm_server.gateway.metrics import Metrics
from shardlm_server.gateway.serve import lifecycle, openai_router
from shardlm_server.gateway.serve.config_sources import add_serve_arguments, resolve
from shardlm_server.gateway.serve.openai_router import (
    OpenAIRouter,
    RouterError,
    RouterSettings,
    choose_tool_call_parser,
    clean_line,
    free_port,
    tool_call_parser_of,
    url_host,
)

# Each family's chat template, as far as the choice reads it.
SMOLLM2 = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
           "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}")
LLAMA3 = "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
MISTRAL_V3 = "{{ '[AVAILABLE_TOOLS] ' + tools|tojson + '[/AVAILABLE_TOOLS]' }}{{ '[TOOL_CALLS] ' }}"
LLAMA2 = "{{ '[INST] ' + message['content'] + ' [/INST]' }}"


@pytest.mark.parametrize(("architecture", "template", "parser"), [
    ("LlamaForCausalLM", SMOLLM2, "json"),  # the default model: ChatML, no tool-call syntax
    ("LlamaForCausalLM", LLAMA3, "llama"),
    ("LlamaForCausalLM", MISTRAL_V3, "mistral"),  # a Mistral GGUF file is a `llama` model
    ("MistralForCausalLM", None, "mistral"),
    ("LlamaForCausalLM", LLAMA2, "json"),
    ("Qwen2ForCausalLM", "<|im_start|>{{ '<tool_call>' }}", "qwen"),
    ("Qwen3ForCausalLM", None, "qwen"),
    ("LlamaForCausalLM", None, "json"),
    ("", None, "json"),
])
def test_the_tool_call_parser_follows_the_checkpoint(architecture, template, parser):
    assert choose_tool_call_parser(architecture, template) == parser


def _model(architecture: str, template: str | None, path: str = "/models/m"):
    config = {"chat_template": template} if template is not None else {}
    tokenizer = SimpleNamespace(
        hf_files=lambda: {"tokenizer.json": "{}", "tokenizer_config.json": json.dumps(config)})
    return SimpleNamespace(info=SimpleNamespace(architecture=architecture, model_path=path),
                           tokenizer=tokenizer)


def test_the_parser_of_a_loaded_model_reads_its_tokenizers_template(llama_dir):
    from shardlm_server.gateway.text.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained(llama_dir)
    model = SimpleNamespace(info=SimpleNamespace(architecture="LlamaForCausalLM"),
                            tokenizer=tokenizer)
    assert tool_call_parser_of(model) == "json"
    assert tool_call_parser_of(_model("LlamaForCausalLM", LLAMA3)) == "llama"
    assert tool_call_parser_of(None) == "json"  # serve --no-model


def test_smg_launch_arguments():
    settings = RouterSettings(host="::1", port=8000, engine_url="grpc://127.0.0.1:4321",
                              tool_call_parser=None, start_timeout_s=5)
    args = settings.launch_args("qwen", 29001)
    assert args[0] == "launch"
    pairs = dict(zip(args[1::2], args[2::2], strict=True))
    assert pairs["--host"] == "::1" and pairs["--port"] == "8000"
    assert pairs["--worker-urls"] == "grpc://127.0.0.1:4321"
    assert pairs["--tool-call-parser"] == "qwen"
    assert (pairs["--prometheus-host"], pairs["--prometheus-port"]) == ("127.0.0.1", "29001")
    assert settings.url == "http://[::1]:8000/v1"
    assert url_host("127.0.0.1") == "127.0.0.1"


def test_smgs_colours_and_logo_are_dropped_from_its_log_lines():
    assert clean_line("\u2800\u28ff\u2847  version  1.13.0\n".encode()) == "version  1.13.0"
    assert clean_line(b"\x1b[2m2026\x1b[0m \x1b[33m WARN\x1b[0m x\n") == "2026  WARN x"


def test_a_missing_smg_fails_the_start_saying_how_to_install_it(monkeypatch):
    monkeypatch.setattr(openai_router.importlib.util, "find_spec", lambda _name: None)
    monkeypatch.setattr(openai_router.shutil, "which", lambda _name: None)
    with pytest.raises(RouterError, match=r"pip install 'smg>=1\.13'"):
        openai_router.smg_command()
    cfg = _config("--port", "0", "--openai-port", "0")
    with pytest.raises(ValueError, match="Shepherd Model Gateway"):
        lifecycle._check_before_start(cfg)


def _config(*argv: str, environ: dict[str, str] | None = None):
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = parser.parse_args(list(argv))
    return resolve(vars(args), args.config, environ or {})


def test_the_settings_and_the_auth_rule(tmp_path):
    cfg = _config("--openai-port", "8000")
    assert (cfg.openai_port, cfg.openai_host, cfg.tool_call_parser) == (8000, "127.0.0.1", None)
    assert _config(environ={"SHARDLM_OPENAI_PORT": "9000"}).openai_port == 9000
    assert _config().openai_port is None
    tokens = tmp_path / "tokens"
    tokens.write_text("secret me admin\n")
    _config("--openai-port", "8000", "--auth-tokens", str(tokens))  # loopback: allowed
    with pytest.raises(ConfigError, match="--openai-host must be a loopback address"):
        _config("--openai-port", "8000", "--openai-host", "0.0.0.0", "--auth-tokens", str(tokens))
    assert is_loopback("localhost") and is_loopback("::1") and is_loopback("127.0.0.2")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.0.0.1")


def test_the_engine_api_for_smg_is_on_a_loopback_port_of_its_own():
    assert lifecycle._engine_listener(_config("--openai-port", "8000")) == \
        {"smg_port": 0, "smg_host": "127.0.0.1"}
    assert lifecycle._engine_listener(_config("--openai-port", "8000", "--smg-port", "50052")) \
        == {"smg_port": 50052}
    assert lifecycle._engine_listener(_config()) == {"smg_port": None}


# ------------------------------------------------------------------ supervision, with a stand-in
FAKE_SMG = textwrap.dedent("""
    import http.server, os, sys
    args = sys.argv[1:]
    print("args:", " ".join(args), flush=True)
    if os.environ.get("FAKE_SMG_FAIL"):
        print("\\x1b[31mboom\\x1b[0m: cannot start", flush=True)
        sys.exit(3)
    host, port = args[args.index("--host") + 1], int(args[args.index("--port") + 1])

    class Answer(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()

        def log_message(self, *a):
            pass

    http.server.HTTPServer((host, port), Answer).serve_forever()
""")


class FakeRuntime:
    """What the router uses of Runtime: the model, the metrics and the part-down marks."""

    def __init__(self) -> None:
        self.model = None
        self.metrics = Metrics()
        self.marks: list[str | None] = []

    async def set_part_down(self, part: str, why: str | None) -> None:
        assert part == "openai"
        self.marks.append(why)


def _router(tmp_path: Path, runtime: FakeRuntime, parser: str | None = "json") -> OpenAIRouter:
    script = tmp_path / "fake_smg.py"
    script.write_text(FAKE_SMG)
    settings = RouterSettings(host="127.0.0.1", port=free_port("127.0.0.1"),
                              engine_url="grpc://127.0.0.1:1", tool_call_parser=parser,
                              start_timeout_s=20)
    return OpenAIRouter(settings, runtime, command=[sys.executable, str(script)],
                        backoff_s=0.05, max_backoff_s=0.1)


async def _until(condition, timeout_s: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.02)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return Path(f"/proc/{pid}/stat").exists() and \
        Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"


def test_a_killed_router_is_restarted_and_marked_down_meanwhile(tmp_path):
    runtime = FakeRuntime()
    router = _router(tmp_path, runtime)

    async def scenario() -> tuple[int, int]:
        await router.start()
        first = router.process.pid
        assert runtime.marks == ["starting", None]
        assert runtime.metrics.value("shardlm_openai_router_up") == 1
        os.kill(first, signal.SIGKILL)
        await _until(lambda: len(runtime.marks) == 4)
        second = router.process.pid
        await router.stop()
        return first, second

    first, second = asyncio.run(scenario())
    assert runtime.marks == ["starting", None, "smg killed by SIGKILL", None]
    assert first != second
    assert runtime.metrics.value("shardlm_openai_router_restarts_total") == 1
    assert runtime.metrics.value("shardlm_openai_router_up") == 1
    assert router.process.returncode is not None and _gone(second)


def test_a_router_that_does_not_start_fails_with_its_last_lines(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_SMG_FAIL", "1")
    router = _router(tmp_path, FakeRuntime())
    with pytest.raises(RouterError) as caught:
        asyncio.run(router.start())
    message = str(caught.value)
    assert "did not come up" in message and "smg exited with code 3" in message
    assert "boom: cannot start" in message  # colours dropped


def test_a_newly_loaded_model_restarts_the_router_with_its_parser(tmp_path):
    runtime = FakeRuntime()
    router = _router(tmp_path, runtime, parser=None)

    async def scenario() -> list[str]:
        await router.start()  # no model yet: json
        seen = [next(line for line in router.lines if line.startswith("args:"))]
        runtime.model = _model("Qwen2ForCausalLM", None, "/models/qwen")
        await _until(lambda: len(runtime.marks) == 4)
        seen.append(next(line for line in router.lines if line.startswith("args:")))
        await router.stop()
        return seen

    before, after = asyncio.run(scenario())
    assert "--tool-call-parser json" in before and "--tool-call-parser qwen" in after
    assert runtime.marks == ["starting", None, "the gateway now serves /models/qwen", None]
