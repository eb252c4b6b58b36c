"""The two server halves and the SDK stay apart: the gateway never imports worker code, the
workers never import gateway code, and the SDK imports neither (it names the server's modules
only as strings, for `shardlm serve` / `shardlm worker`). Every import counts, also those inside
functions."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SDK = ROOT / "clients" / "python" / "src" / "shardlm"
GATEWAY, WORKER = "shardlm_server.gateway", "shardlm_server.worker"
FORBIDDEN = {GATEWAY: {WORKER}, WORKER: {GATEWAY}, "shardlm": {GATEWAY, WORKER}}
PACKAGES = {GATEWAY: ROOT / "gateway", WORKER: ROOT / "worker", "shardlm": SDK}


def imported_modules(path: Path, package_dir: Path, package: str) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import statement in the file."""
    here = [*package.split("."), *path.parent.relative_to(package_dir).parts]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the file's package
                base = here[:len(here) - node.level + 1]
                name = ".".join([*base, *([node.module] if node.module else [])])
            else:
                name = node.module or ""
            found.append((node.lineno, name))
    return sorted(found)


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
