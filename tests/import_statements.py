"""The import statements of a Python file, read from its syntax tree: one walk for the tests that
check imports (the boundaries between the halves and the gateway's rooms, the import circles, and
what the GPU check needs on its machine). Every statement counts, also those inside functions;
each says whether it sits under `if TYPE_CHECKING:` (it never runs), for the tests that care."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ImportStatement:
    line: int
    module: str  # absolute: `from ..x import y` resolved against the file's package
    names: tuple[str, ...]  # what `from module import ...` takes; () for `import module`
    type_checking_only: bool


def file_package(path: Path, package_dir: Path, package: str) -> str:
    """The package a file's relative imports start from: its folder under `package_dir`, named
    from `package` (an `__init__.py` is its own package)."""
    return ".".join([*package.split("."), *path.parent.relative_to(package_dir).parts])


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _walk(node: ast.AST, guarded: bool) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    if isinstance(node, ast.Import | ast.ImportFrom):
        yield node, guarded
        return
    if isinstance(node, ast.If) and _is_type_checking(node.test):
        for child in node.body:
            yield from _walk(child, True)
        for child in node.orelse:  # the `else` of `if TYPE_CHECKING:` runs
            yield from _walk(child, guarded)
        return
    for child in ast.iter_child_nodes(node):
        yield from _walk(child, guarded)


def import_statements(path: Path, package: str) -> list[ImportStatement]:
    """Every import statement of the file at `path`, whose package is `package`, by line."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    found = []
    for node, guarded in _walk(tree, False):
        if isinstance(node, ast.Import):
            found += [ImportStatement(node.lineno, alias.name, (), guarded) for alias in node.names]
            continue
        if node.level:
            parts = package.split(".")
            base = parts[:len(parts) - node.level + 1]
            module = ".".join([*base, *([node.module] if node.module else [])])
        else:
            module = node.module or ""
        names = tuple(alias.name for alias in node.names)
        found.append(ImportStatement(node.lineno, module, names, guarded))
    return sorted(found, key=lambda s: s.line)
