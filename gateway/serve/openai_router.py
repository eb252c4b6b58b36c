"""`serve --openai-port`: OpenAI's HTTP API through the Shepherd Model Gateway (SMG, PyPI `smg`),
run as a child process of the gateway and routed to its engine API (gateway/api/smg_service.py).

`OpenAIRouter.start` runs `smg launch` once the gateway serves its model and returns when SMG
answers HTTP (GET /readiness: SMG has registered the engine and fetched its tokenizer; /health
while no model is loaded), or raises RouterError with SMG's last log lines. SMG's output goes to
the gateway's log line by line as `smg: ...` (colours and the start-up logo dropped).

Supervision, after the worker supervisor's (supervisor.py): a watch task waits for the child to
exit. Then the server's overall health ("") turns NOT_SERVING (the gRPC API's own,
shardlm.gateway.v1.GatewayService, serves on) and `shardlm_openai_router_up` 0, and SMG is
started again: at once, then with exponential backoff while it keeps failing (no attempt limit:
it holds no state, and every failure is in the log); a child that stayed up STABLE_S seconds
starts the count afresh. SMG reads a model's name, tokenizer and chat template once, when it
starts, so the watch task also restarts it when the gateway comes to serve another model (a
Load call, or the first model of `serve --no-model`), choosing the tool-call parser anew.

At shutdown SMG is stopped once the gateway has drained (what is in flight through SMG is the
gateway's, so by then nothing is): SIGTERM, then SIGKILL after STOP_GRACE_S. It never outlives
the gateway: it runs under die_with_parent.py, and in a session of its own, so that a Ctrl-C in
the terminal reaches the gateway alone, which stops it in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import logging
import os
import re
import shutil
import signal
import socket
import sys
from collections import deque
from dataclasses import dataclass

from shardlm_server.gateway.api.runtime import LoadedModel, Runtime
from shardlm_server.gateway.serve.supervisor import backoff_delay

log = logging.getLogger("shardlm.openai")

SMG_REQUIREMENT = "smg>=1.13"
INSTALL_HINT = f"python -m pip install '{SMG_REQUIREMENT}'"
GUARD_MODULE = "shardlm_server.gateway.serve.die_with_parent"
PART = "openai"  # its name in Runtime.parts_down
MODEL_CHECK_S = 1.0  # how often the watch task looks for a newly loaded model
LOG_LINES_KEPT = 5  # SMG's last lines, quoted when it fails to start
LINE_LIMIT = 1 << 20
READY_POLL_S = 0.2
PROBE_TIMEOUT_S = 2.0
# SMG's own grace for in-flight requests after SIGTERM. It is stopped after the gateway drained,
# so none is left; a longer one would only add its load-balancer settle window, min(5 s, grace).
SMG_SHUTDOWN_GRACE_S = 1
STOP_GRACE_S = 5.0  # SIGKILL this long after SIGTERM
STABLE_S = 30.0
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_LOGO = re.compile(r"^[\u2800-\u28ff\s]+")  # the braille-art logo SMG prints before its banner


class RouterError(ValueError):
    """SMG is not installed, or did not come up; the message says why."""


def smg_command() -> list[str]:
    """How to run SMG: this interpreter's `smg` package, else an `smg` command on PATH."""
    if importlib.util.find_spec("smg") is not None:
        return [sys.executable, "-m", "smg"]
    path = shutil.which("smg")
    if path:
        return [path]
    raise RouterError(f"--openai-port runs the Shepherd Model Gateway (PyPI package smg), which "
                      f"is not installed; install it with `{INSTALL_HINT}`")


def choose_tool_call_parser(architecture: str, chat_template: str | None) -> str:
    """SMG's --tool-call-parser for a model: the tool-call format its chat template teaches.
    The architecture alone does not tell: Llama 3, Mistral and SmolLM2 GGUF files are all
    `llama` models, and only their templates differ. SmolLM2's (ChatML, the default model's)
    defines no tool-call syntax: "json", which reads a reply that is one JSON call as a tool
    call."""
    arch, template = architecture.lower(), chat_template or ""
    if arch.startswith("qwen"):  # Qwen2, Qwen3: <tool_call>{...}</tool_call>
        return "qwen"
    if arch.startswith(("mistral", "mixtral")) or "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|start_header_id|>" in template:  # the Llama 3 family's template
        return "llama"
    return "json"


def tool_call_parser_of(model: LoadedModel | None) -> str:
    """`choose_tool_call_parser` for a loaded model ("json" for none)."""
    if model is None:
        return choose_tool_call_parser("", None)
    config = json.loads(model.tokenizer.hf_files()["tokenizer_config.json"])
    return choose_tool_call_parser(model.info.architecture, config.get("chat_template"))


def url_host(host: str) -> str:
    """`host` as a URL writes it (an IPv6 address in brackets)."""
    host = host.strip("[]")
    return f"[{host}]" if ":" in host else host


def reachable_host(host: str) -> str:
    """An address of this machine that reaches a listener bound to `host`."""
    host = host.strip("[]")
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    return "::1" if host == "::" else host


def free_port(host: str) -> int:
    """A port nothing listens on now (another process may take it before it is used)."""
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    with socket.socket(family) as probe:
        probe.bind((reachable_host(host), 0))
        return probe.getsockname()[1]


@dataclass(frozen=True)
class RouterSettings:
    host: str
    port: int
    engine_url: str  # grpc://HOST:PORT of the gateway's engine API
    tool_call_parser: str | None  # None: chosen from the model served when SMG starts
    start_timeout_s: float

    @property
    def url(self) -> str:
        return f"http://{url_host(self.host)}:{self.port}/v1"

    def launch_args(self, tool_call_parser: str, metrics_port: int) -> list[str]:
        """`smg launch`'s arguments. SMG serves its Prometheus metrics on a port of their own
        (default 29000, on every interface): here on loopback, on a free port."""
        return ["launch", "--host", self.host, "--port", str(self.port),
                "--worker-urls", self.engine_url, "--tool-call-parser", tool_call_parser,
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
                "--shutdown-grace-period-secs", str(SMG_SHUTDOWN_GRACE_S),
                "--log-level", "warn"]


def exit_reason(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


def clean_line(raw: bytes) -> str:
    return _LOGO.sub("", _ANSI.sub("", raw.decode(errors="replace"))).rstrip()


async def http_status(host: str, port: int, path: str,
                      timeout_s: float = PROBE_TIMEOUT_S) -> int | None:
    """The status code of GET `path`, or None when nothing answers."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout_s)
    except (OSError, TimeoutError):
        return None
    try:
        writer.write(f"GET {path} HTTP/1.1\r\nHost: {url_host(host)}:{port}\r\n"
                     f"Connection: close\r\n\r\n".encode())
        await writer.drain()
        status = (await asyncio.wait_for(reader.readline(), timeout_s)).split()
        return int(status[1]) if len(status) > 1 and status[1].isdigit() else None
    except (OSError, TimeoutError):
        return None
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


class OpenAIRouter:
    def __init__(self, settings: RouterSettings, runtime: Runtime, *,
                 command: list[str] | None = None, backoff_s: float = 1.0,
                 max_backoff_s: float = 30.0) -> None:
        self.settings = settings
        self.rt = runtime
        self.command = command if command is not None else smg_command()
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.process: asyncio.subprocess.Process | None = None
        self.lines: deque[str] = deque(maxlen=LOG_LINES_KEPT)
        self._relay: asyncio.Task | None = None
        self._watch: asyncio.Task | None = None
        self._up_since = 0.0
        self._model: str | None = None  # the model path SMG was started for

    @property
    def url(self) -> str:
        return self.settings.url

    async def start(self) -> None:
        """Start SMG and return once it answers; RouterError when it does not."""
        await self._mark_down("starting")
        await self._start_child()
        await self._mark_up()
        self._watch = asyncio.ensure_future(self._watch_loop())

    async def stop(self) -> None:
        """No more restarts; SIGTERM, then SIGKILL after STOP_GRACE_S."""
        if self._watch is not None:
            self._watch.cancel()
        await self._stop_child(STOP_GRACE_S)

    # ---------------------------------------------------------------- the child
    def _model_path(self) -> str | None:
        model = self.rt.model
        return model.info.model_path if model is not None else None

    async def _start_child(self) -> None:
        s = self.settings
        self.lines.clear()
        self._model = self._model_path()
        parser = s.tool_call_parser or await asyncio.to_thread(tool_call_parser_of, self.rt.model)
        # From the event loop's thread (die_with_parent.py says why); a session of its own.
        self.process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", GUARD_MODULE, str(os.getpid()), *self.command,
            *s.launch_args(parser, free_port("127.0.0.1")), stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            start_new_session=True, limit=LINE_LIMIT)
        assert self.process.stdout is not None
        self._relay = asyncio.ensure_future(self._relay_output(self.process.stdout))
        log.info("started SMG (pid %d) for %s: tool-call parser %s, engine API %s",
                 self.process.pid, s.url, parser, s.engine_url)
        try:
            await self._wait_ready()
        except RouterError as exc:
            await self._stop_child(2.0)
            said = " | ".join(self.lines) or "(nothing)"
            raise RouterError(f"the OpenAI router (SMG) did not come up on {s.url}: {exc}; "
                              f"its last lines: {said}") from None
        except BaseException:  # cancelled (a stop signal during start-up): leave nothing
            await self._stop_child(2.0)
            raise

    async def _wait_ready(self) -> None:
        s = self.settings
        assert self.process is not None
        path = "/readiness" if self.rt.model is not None else "/health"
        loop = asyncio.get_running_loop()
        deadline = loop.time() + s.start_timeout_s
        while True:
            if self.process.returncode is not None:
                await self._drain_relay()
                raise RouterError(f"smg {exit_reason(self.process.returncode)}")
            if await http_status(reachable_host(s.host), s.port, path) == 200:
                return
            if loop.time() > deadline:
                raise RouterError(f"GET {path} did not answer 200 within {s.start_timeout_s:g}s")
            await asyncio.sleep(READY_POLL_S)

    async def _stop_child(self, grace_s: float) -> None:
        process = self.process
        if process is None:
            return
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.terminate()
            try:
                await asyncio.wait_for(process.wait(), grace_s)
            except TimeoutError:
                log.warning("SMG did not stop within %.0fs of SIGTERM; killing it", grace_s)
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                await process.wait()
        await self._drain_relay()

    async def _relay_output(self, stream: asyncio.StreamReader) -> None:
        while True:
            try:
                raw = await stream.readline()
            except ValueError:  # a line over LINE_LIMIT: dropped
                continue
            if not raw:
                return
            line = clean_line(raw)
            if line:
                self.lines.append(line)
                log.info("smg: %s", line)

    async def _drain_relay(self) -> None:
        """Let the relay log what the exited child wrote last."""
        if self._relay is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._relay), 5.0)
            except TimeoutError:  # something else holds the pipe open
                self._relay.cancel()

    # ---------------------------------------------------------------- supervision
    async def _mark_up(self) -> None:
        self._up_since = asyncio.get_running_loop().time()
        self.rt.metrics.openai_router_up.set(1)
        await self.rt.set_part_down(PART, None)

    async def _mark_down(self, why: str) -> None:
        self.rt.metrics.openai_router_up.set(0)
        await self.rt.set_part_down(PART, why)

    async def _trouble(self) -> tuple[str, bool]:
        """Why SMG must start again, and whether it exited (else it serves an old model)."""
        assert self.process is not None
        exited = asyncio.ensure_future(self.process.wait())
        try:
            while True:
                done, _ = await asyncio.wait([exited], timeout=MODEL_CHECK_S)
                if done:
                    await self._drain_relay()
                    return f"smg {exit_reason(exited.result())}", True
                model = self._model_path()
                if model is not None and model != self._model:
                    return f"the gateway now serves {model}", False
        finally:
            exited.cancel()

    async def _watch_loop(self) -> None:
        loop = asyncio.get_running_loop()
        attempt = 0
        try:
            while True:
                why, exited = await self._trouble()
                if not exited or loop.time() - self._up_since >= STABLE_S:
                    attempt = 0
                await self._mark_down(why)
                if not exited:
                    log.info("restarting the OpenAI router: %s", why)
                    await self._stop_child(STOP_GRACE_S)
                while True:
                    # At once the first time, then backing off while SMG keeps failing.
                    delay = backoff_delay(attempt, self.backoff_s, self.max_backoff_s) \
                        if attempt else 0.0
                    if exited:
                        log.error("the OpenAI router is down (%s); restarting it%s", why,
                                  f" in {delay:.1f}s" if delay else "")
                    await asyncio.sleep(delay)
                    attempt += 1
                    try:
                        await self._start_child()
                        break
                    except RouterError as exc:
                        why, exited = str(exc), True
                self.rt.metrics.openai_router_restarts.inc()
                await self._mark_up()
                log.info("the OpenAI router is back on %s", self.url)
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - a bug here must be seen, not lost in a task
            log.exception("supervising the OpenAI router failed")
