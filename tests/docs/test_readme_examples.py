"""Every code example in every README runs as written, against a live gateway.

The fenced blocks of each README are read by their info string (its first word is the language;
GitHub highlights by that word alone):

* ```python  runs with this interpreter, from the repository root;
* ```js      runs with node as a CommonJS script from the repository root (what `node
             example.cjs` does with the file saved there);
* ```sh      runs with bash from the repository root (grpcurl and `shardlm` command examples);
* ```text    output samples, command synopses, diagrams: never run;
* ```console set-up commands for a terminal (installing, building, serving, regenerating the
             stubs), which the test run itself stands on: never run;
* a second word `fragment` (```python fragment) marks code that needs what no test provides
  (for example a TLS deployment and its certificates): python fragments are compiled, not run.

Any other info string, or none, fails `test_every_block_is_labelled`: nothing is skipped
silently. The gateway runs the bundled demo model on 127.0.0.1:50051, the address the examples
use. When that port is taken, it runs on a free port instead and every "127.0.0.1:50051" and
"localhost:50051" in a block is replaced by its address (the only substitution ever made); blocks
that reach the default address without naming it then skip, saying so. Node and grpcurl blocks
skip, with the reason, where node or grpcurl is not installed; grpcurl blocks are then still
checked statically (every request body parses as its method's request message). A block that
reaches OpenAI's HTTP API at http://127.0.0.1:8000 gets what `make serve` runs there: the default
model behind SMG (or on a free port, substituted the same way).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from google.protobuf import descriptor_pool, json_format, message_factory
from grpc_health.v1 import health_pb2  # noqa: F401 - registers grpc.health.v1 for the checks
from shardlm.common.v1 import common_pb2
from shardlm.gateway.v1 import gateway_pb2

from shardlm_server.gateway.api.runtime import Limits
from tests.clients.test_node_client import node_env  # noqa: F401 - the fixture, shared
from tests.gateway.conftest import LiveGateway
from tests.gateway.smg_fixtures import default_model_behind_smg

ROOT = Path(__file__).resolve().parents[2]
DEMO_MODEL = ROOT / "models" / "shakespeare-tiny"
EXAMPLE_PORT = 50051
EXAMPLE_ADDRESSES = (f"127.0.0.1:{EXAMPLE_PORT}", f"localhost:{EXAMPLE_PORT}")
OPENAI_PORT = 8000  # make serve's --openai-port
OPENAI_BASE = f"http://127.0.0.1:{OPENAI_PORT}"
RUN = {"python", "js", "sh"}
NEVER_RUN = {"text", "console"}
FENCE = re.compile(r"^(\s*)```(.*)$")
# Installed or built here, not the project's own (.bench: llama.cpp's tools and converter, models).
SKIP_DIRS = {"node_modules", ".venv", ".cache", ".git", ".bench", "build"}


@dataclass(frozen=True)
class Block:
    readme: Path
    line: int
    info: str
    code: str

    @property
    def language(self) -> str:
        return self.info.split()[0] if self.info else ""

    @property
    def fragment(self) -> bool:
        return "fragment" in self.info.split()[1:]

    @property
    def name(self) -> str:
        return f"{self.readme.relative_to(ROOT)}:{self.line}"


def readmes() -> list[Path]:
    return sorted(p for p in ROOT.rglob("README.md")
                  if not SKIP_DIRS & set(p.relative_to(ROOT).parts))


def blocks_of(readme: Path) -> list[Block]:
    found, lines = [], readme.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        i += 1
        if not opening:
            continue
        indent, info, start, body = opening.group(1), opening.group(2).strip(), i, []
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i].removeprefix(indent))
            i += 1
        found.append(Block(readme, start, info, "\n".join(body) + "\n"))
        i += 1
    return found


ALL_BLOCKS = [b for r in readmes() for b in blocks_of(r)]
RUNNABLE = [b for b in ALL_BLOCKS if b.language in RUN]


def test_every_block_is_labelled():
    unlabelled = [f"{b.name} ```{b.info}" for b in ALL_BLOCKS
                  if b.language not in RUN | NEVER_RUN]
    assert not unlabelled, ("label each fenced block (see this module's docstring): "
                            + ", ".join(unlabelled))
    assert any(b.language == "js" for b in RUNNABLE) and any(b.language == "python"
                                                             for b in RUNNABLE)


def _port_is_free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.fixture(scope="module")
def gateway():
    port = EXAMPLE_PORT if _port_is_free(EXAMPLE_PORT) else 0
    live = LiveGateway(1, Limits(session_idle_timeout_s=600), port=port)
    try:
        list(live.stub.Load(gateway_pb2.LoadRequest(
            model_path=str(DEMO_MODEL), dtype=common_pb2.DTYPE_FLOAT32)))
        yield live
    finally:
        live.close()


@pytest.fixture(scope="module")
def openai_base(tmp_path_factory):
    """What `make serve` runs: the default model (an instruct model with a chat template, which
    SMG renders chats with) and SMG in front of it, on 127.0.0.1:8000 when that port is free
    (else a free port, substituted into the block like the gRPC address)."""
    log = tmp_path_factory.mktemp("readme-smg") / "smg.log"
    port = OPENAI_PORT if _port_is_free(OPENAI_PORT) else None
    with default_model_behind_smg(log, port) as (base, _model_id):
        yield base


def _as_written(block: Block, address: str) -> str:
    code = block.code
    if address in EXAMPLE_ADDRESSES:
        return code
    if not any(a in code for a in EXAMPLE_ADDRESSES):
        pytest.skip(f"port {EXAMPLE_PORT} is taken, and this block reaches the default address "
                    "without naming it")
    for example in EXAMPLE_ADDRESSES:
        code = code.replace(example, address)
    return code


def _run(command: list[str], code: str, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(command, input=code, cwd=ROOT, capture_output=True, text=True,
                          timeout=180, env=env)
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"exit {done.returncode}:\n{output}"
    return output


# ----------------------------------------------------------------------------- grpcurl
def grpcurl_commands(code: str) -> list[list[str]]:
    """The arguments after the address of each grpcurl command in a shell block."""
    commands, statement = [], ""
    for line in re.sub(r"\\\n", " ", code).splitlines():
        statement += line + "\n"
        try:
            args = shlex.split(statement, comments=True)
        except ValueError:  # a quoted argument (a JSON body) runs on to the next line
            continue
        statement = ""
        if not args or args[0] != "grpcurl":
            continue
        at = next(i for i, a in enumerate(args) if re.fullmatch(r"[\w.-]+:\d+", a))
        body = args[args.index("-d") + 1] if "-d" in args else None
        commands.append([*args[at + 1:], *(["-d", body] if body is not None else [])])
    return commands


def check_grpcurl_statically(code: str) -> None:
    """Every service, method and message a grpcurl command names exists, and every request body
    parses (field names and values) as its method's request message."""
    pool = descriptor_pool.Default()
    for command in grpcurl_commands(code):
        verb = command[0]
        if verb == "list":
            continue
        if verb == "describe":
            name = command[1]
            try:
                pool.FindServiceByName(name)
            except KeyError:
                pool.FindMessageTypeByName(name)
            continue
        service, method = verb.rsplit("/", 1)
        request_type = pool.FindServiceByName(service).FindMethodByName(method).input_type
        body = command[command.index("-d") + 1] if "-d" in command else "{}"
        json_format.Parse(body, message_factory.GetMessageClass(request_type)())


def test_grpcurl_commands_are_read():
    code = ("grpcurl -plaintext -d '{\n  \"text\": \"#x\"\n}' \\\n  localhost:50051 "
            "shardlm.gateway.v1.GatewayService/Generate\n"
            "grpcurl -plaintext localhost:50051 list   # services\n# grpcurl in a comment\n")
    assert grpcurl_commands(code) == [
        ["shardlm.gateway.v1.GatewayService/Generate", "-d", '{\n  "text": "#x"\n}'], ["list"]]
    check_grpcurl_statically(code)
    with pytest.raises(json_format.ParseError):
        check_grpcurl_statically("grpcurl -d '{\"txt\": 1}' h:1 "
                                 "shardlm.gateway.v1.GatewayService/Generate\n")


# ----------------------------------------------------------------------------- the examples
@pytest.mark.timeout(300)
@pytest.mark.parametrize("block", RUNNABLE, ids=[b.name for b in RUNNABLE])
def test_example_runs(block, gateway, request):
    if block.language == "python" and block.fragment:
        compile(block.code, block.name, "exec")
        return
    if block.fragment:
        pytest.fail(f"{block.name}: only python blocks may be fragments")
    code = _as_written(block, gateway.address)
    if OPENAI_BASE in code:  # OpenAI's HTTP API: SMG in front of the same gateway
        code = code.replace(OPENAI_BASE, request.getfixturevalue("openai_base"))
    if block.language == "python":
        _run([sys.executable, "-"], code)
    elif block.language == "js":
        node = request.getfixturevalue("node_env")["node"]
        _run([node, "--input-type=commonjs", "-"], code)
    elif "grpcurl" in code and not shutil.which("grpcurl"):
        check_grpcurl_statically(code)
        pytest.skip("grpcurl is not installed (not in this Debian release's archive, and no "
                    "PyPI or npm package ships it): request bodies and methods were checked "
                    "against the protos, the commands were not run")
    else:
        bin_dir = str(Path(sys.executable).parent)
        env = dict(os.environ, PATH=bin_dir + os.pathsep + os.environ.get("PATH", ""))
        _run(["bash", "-euo", "pipefail", "-s"], code, env)
