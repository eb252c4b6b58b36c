"""The two server halves and the SDK stay apart: the gateway never imports worker code, the
workers never import gateway code, and the SDK imports neither (it names the server's modules
only as strings, for `shardlm serve` / `shardlm worker`). Inside the gateway, calls go one way
between its rooms: `serve` starts the `api`, the API calls `batching`, batching calls `kv`,
`workers`, `text` and `constraints`, and never the reverse; rooms of one level (kv, workers,
text, constraints) stay apart,
and the modules at the gateway's top (settings, metrics, error details) are for every room and
import none. Every import counts, also those inside functions."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.import_statements import file_package, import_statements

ROOT = Path(__file__).resolve().parents[1]
SDK = ROOT / "clients" / "python" / "src" / "shardlm"
GATEWAY, WORKER = "shardlm_server.gateway", "shardlm_server.worker"
FORBIDDEN = {GATEWAY: {WORKER}, WORKER: {GATEWAY}, "shardlm": {GATEWAY, WORKER}}
PACKAGES = {GATEWAY: ROOT / "gateway", WORKER: ROOT / "worker", "shardlm": SDK}


def imported_modules(path: Path, package_dir: Path, package: str) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import statement in the file."""
    return [(s.line, s.module)
            for s in import_statements(path, file_package(path, package_dir, package))]


def crossings(package: str) -> list[str]:
    package_dir = PACKAGES[package]
    bad = []
    for path in sorted(package_dir.rglob("*.py")):
        for line, module in imported_modules(path, package_dir, package):
            if any(module == other or module.startswith(other + ".")
                   for other in FORBIDDEN[package]):
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    return bad


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_no_imports_across_the_boundary(package):
    assert crossings(package) == []


def test_the_walk_sees_imports_inside_functions(tmp_path):
    module = tmp_path / "gateway" / "sub" / "m.py"
    module.parent.mkdir(parents=True)
    module.write_text("def f():\n    from shardlm_server.worker.engine import Engine\n"
                      "    from .. import x\nimport shardlm_server.worker\n")
    found = imported_modules(module, tmp_path / "gateway", GATEWAY)
    assert found == [(2, WORKER + ".engine"), (3, GATEWAY), (4, WORKER)]


# The gateway's rooms, by level: a room may import its own modules and those of lower levels.
ROOM_LEVELS = {"serve": 4, "api": 3, "batching": 2, "kv": 1, "workers": 1, "text": 1,
               "constraints": 1}
BASE_LEVEL = 0  # gateway/*.py: config, metrics, details


def room_of(module: str) -> str | None:
    """The room of a gateway module ("" for the top-level ones), None outside the gateway."""
    if not module.startswith(GATEWAY + "."):
        return None if module != GATEWAY else ""
    first = module[len(GATEWAY) + 1:].split(".")[0]
    return first if first in ROOM_LEVELS else ""


def level(room: str) -> int:
    return ROOM_LEVELS.get(room, BASE_LEVEL)


def wrong_way_imports() -> list[str]:
    bad = []
    gateway_dir = PACKAGES[GATEWAY]
    for path in sorted(gateway_dir.rglob("*.py")):
        parts = path.relative_to(gateway_dir).parts
        here = parts[0] if len(parts) > 1 else ""
        for line, module in imported_modules(path, gateway_dir, GATEWAY):
            there = room_of(module)
            if there is None or there == here or module == GATEWAY:
                continue
            if level(there) >= level(here):
                bad.append(f"{path.relative_to(ROOT)}:{line} ({here or 'top'}) imports {module}")
    return bad


def test_the_gateways_rooms_call_one_way():
    assert wrong_way_imports() == []


def test_every_gateway_module_is_in_a_known_room():
    gateway_dir = PACKAGES[GATEWAY]
    folders = {p.name for p in gateway_dir.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == set(ROOM_LEVELS)


def test_batching_reaches_the_kv_cache_only_through_the_kv_manager():
    """The scheduler's one interface to KV blocks is gateway/kv/manager.py: no batching module
    imports the allocator (or any other KV module) itself."""
    gateway_dir = PACKAGES[GATEWAY]
    kv = GATEWAY + ".kv"
    bad = [f"{path.relative_to(ROOT)}:{line} imports {module}"
           for path in sorted((gateway_dir / "batching").rglob("*.py"))
           for line, module in imported_modules(path, gateway_dir, GATEWAY)
           if (module == kv or module.startswith(kv + ".")) and module != kv + ".manager"]
    assert bad == []
