"""No import circles inside the gateway or the workers: following the imports between the
project's own modules never leads back to where it started. A circle only works while its imports
sit in a lucky order (a bottom-of-file import, a reach into a half-initialised module, an import
moved into a function to break it); the shared piece belongs in a module both sides import.
Imports inside functions count (they run, just later); those under `if TYPE_CHECKING:` never run
and do not."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.import_statements import import_statements

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"shardlm_server.gateway": ROOT / "gateway", "shardlm_server.worker": ROOT / "worker"}


def module_name(path: Path, package_dir: Path, package: str) -> str:
    parts = [*package.split("."), *path.relative_to(package_dir).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_imports(path: Path, name: str, known: set[str]) -> set[str]:
    """The project modules (of `known`) that the module `name` at `path` imports.
    `from package import module` counts as importing the module, not the package (a package is
    always imported before its modules; only what the statement asks of it counts)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for statement in import_statements(path, package):
        if statement.type_checking_only:
            continue
        if not statement.names:
            found.add(statement.module)
            continue
        modules = {f"{statement.module}.{n}" for n in statement.names} & known
        found |= modules
        if len(modules) < len(statement.names):  # some names are the package's own attributes
            found.add(statement.module)
    return {m for m in found if m in known and m != name}


def import_graph(packages: dict[str, Path]) -> dict[str, set[str]]:
    paths = {module_name(p, d, pkg): p for pkg, d in packages.items() for p in d.rglob("*.py")}
    known = set(paths)
    return {name: module_imports(path, name, known) for name, path in paths.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_no_import_circles(package):
    assert cycles(import_graph({package: PACKAGES[package]})) == []


def test_the_finder_sees_a_circle_and_what_it_ignores(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .sub import b\n")  # a module: not pkg.sub itself
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text(
        "try:\n    from pkg import c\nexcept ImportError:\n    pass\n")
    (pkg / "c.py").write_text("import pkg\nfrom typing import TYPE_CHECKING\n"
                              "if TYPE_CHECKING:\n    from pkg.d import D\n")
    (pkg / "d.py").write_text("from .sub import b, VALUE\n")
    (pkg / "e.py").write_text("def f():\n    from pkg import d\n")
    graph = import_graph({"pkg": pkg})
    assert graph["pkg"] == {"pkg.sub.b"}
    assert graph["pkg.sub.b"] == {"pkg.c"}
    assert graph["pkg.c"] == {"pkg"}  # not pkg.d: only for the type checker
    assert graph["pkg.d"] == {"pkg.sub", "pkg.sub.b"} and graph["pkg.e"] == {"pkg.d"}
    assert cycles(graph) == [["pkg", "pkg.c", "pkg.sub.b"]]
    # An import that runs later, when f is called, still closes a circle.
    (pkg / "sub" / "__init__.py").write_text("def f():\n    import pkg.e\n")
    assert ["pkg.d", "pkg.e", "pkg.sub"] in cycles(import_graph({"pkg": pkg}))
