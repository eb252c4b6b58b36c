"""Everything the GPU check runs can import on the GPU machine: a walk over the imports of the
test files scripts/gpu_check.sh selects, of the processes they start (`shardlm serve`, its
workers, the SMG engine API) and of the benchmark, following the project's own modules, finds
every third-party package they need; each must be one the probe knows (the machine's own,
carried as a wheel, or named as not needed, scripts/gpu_probe.py). So the next missing package
fails here, in CI, and not at collection time on a lent GPU."""

from __future__ import annotations

import importlib.metadata
import re
import shlex
import sys
from pathlib import Path

from tests.import_statements import import_statements
from tests.scripts.test_gpu_check import SCRIPT, probe

ROOT = Path(__file__).resolve().parents[2]
# The project's import names and the folders that hold them.
FIRST_PARTY = {"shardlm_server.gateway": ROOT / "gateway", "shardlm_server.worker": ROOT / "worker",
               "shardlm": ROOT / "clients/python/src/shardlm", "tests": ROOT / "tests",
               "bench": ROOT / "bench", "shardlm_server": None}
# Modules started by name rather than imported: the CLI and what it hands commands to, the worker
# processes, the SMG engine API (imported when the gateway starts), the benchmark.
ENTRY_MODULES = ["shardlm.cli", "shardlm_server.gateway.serve.cli", "shardlm_server.worker.worker_server",
                 "shardlm_server.gateway.api.smg_service", "bench.run"]


def selected_test_files() -> list[Path]:
    """The test files (and the conftest.py files above them) the script's selections collect."""
    text = SCRIPT.read_text()
    paths = []
    for name in ("KERNEL_TESTS", "STACK_TESTS"):
        words = shlex.split(re.search(rf"^{name}=\((.*?)\)", text, re.M).group(1))
        paths += [ROOT / w for w in words if not w.startswith("-") and w != "cuda"]
    files = set()
    for path in paths:
        found = sorted(path.rglob("test_*.py")) if path.is_dir() else [path]
        for file in found:
            files.add(file)
            for folder in file.relative_to(ROOT).parents:
                if (ROOT / folder / "conftest.py").exists():
                    files.add(ROOT / folder / "conftest.py")
    return sorted(files)


def module_file(name: str) -> Path | None:
    """The source file of a first-party module, or None (compiled, or not first-party)."""
    for prefix, folder in sorted(FIRST_PARTY.items(), key=lambda item: -len(item[0])):
        if folder is None or not (name == prefix or name.startswith(prefix + ".")):
            continue
        base = folder.joinpath(*name[len(prefix):].lstrip(".").split(".")) if name != prefix \
            else folder
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.exists():
                return candidate
        return None
    return None


def is_first_party(name: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in FIRST_PARTY)


def module_name(path: Path) -> str:
    for prefix, folder in FIRST_PARTY.items():
        if folder is not None and path.is_relative_to(folder):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            return ".".join([prefix, *parts])
    raise AssertionError(f"{path} is in no first-party folder")


def imports_of(path: Path) -> set[str]:
    """The full names each import statement of the file may load (anywhere in the file)."""
    here = module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    names = set()
    for statement in import_statements(path, package):
        names.add(statement.module)
        names |= {f"{statement.module}.{n}" for n in statement.names}  # may be submodules
    return names


def third_party_imports() -> dict[str, set[str]]:
    """Third-party module -> the first-party files that import it, over the whole walk."""
    queue = [*selected_test_files(), *(module_file(m) for m in ENTRY_MODULES)]
    seen: set[Path] = set()
    found: dict[str, set[str]] = {}
    while queue:
        path = queue.pop()
        if path is None or path in seen:
            continue
        seen.add(path)
        for name in imports_of(path):
            top = name.split(".")[0]
            if top in sys.stdlib_module_names or top == "__future__":
                continue
            if is_first_party(name):
                parts = name.split(".")
                queue += [module_file(".".join(parts[:i])) for i in range(1, len(parts) + 1)]
            else:
                found.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    return found


def provided_by(distribution: str) -> list[str]:
    """The module paths (a/b/c, without suffix) a distribution installed here provides."""
    try:
        files = importlib.metadata.files(distribution) or []
    except importlib.metadata.PackageNotFoundError:
        return []
    return [str(f) for f in files]


def covered(module: str, files: list[str]) -> bool:
    path = module.replace(".", "/")
    return any(f == path + ".py" or f.startswith(path + "/") or
               (f.startswith(path + ".") and f.endswith(".so")) for f in files)


def test_the_walk_sees_what_it_must():
    """The walk itself reaches the files and packages it is meant to (so it cannot pass empty)."""
    files = {str(p.relative_to(ROOT)) for p in selected_test_files()}
    assert {"tests/worker/ops/test_ops.py", "tests/worker/test_gguf.py",
            "tests/gateway/test_serve_cuda.py", "tests/gateway/conftest.py",
            "tests/conftest.py"} <= files
    found = third_party_imports()
    for module in ("torch", "grpc", "gguf", "smg_grpc_proto.generated.vllm_engine_pb2",
                   "google.protobuf", "tokenizers", "pytest"):
        assert any(name == module or name.startswith(module + ".") for name in found), module


def test_every_package_the_gpu_check_imports_is_known_to_the_probe():
    known = probe.known_distributions()
    known_files = [f for name in known for f in provided_by(name)]
    every_file = [str(f) for d in importlib.metadata.distributions() for f in d.files or []]
    by_top = importlib.metadata.packages_distributions()
    unknown: dict[str, str] = {}
    for name, importers in sorted(third_party_imports().items()):
        parts = name.split(".")
        # `from a.b import c` names a.b.c, which may be a class: judge the longest prefix that is
        # a module some installed package provides.
        module = next((".".join(parts[:i]) for i in range(len(parts), 0, -1)
                       if covered(".".join(parts[:i]), every_file)), None)
        if module is None:  # installed nowhere here: an optional package, known by name
            if probe.normalize(NOT_INSTALLED_HERE.get(parts[0], "?")) in known:
                continue
        elif covered(module, known_files):
            continue
        owners = sorted(by_top.get(parts[0], [])) or ["no installed package"]
        unknown.setdefault(module or name, f"{module or name} (from {', '.join(owners)}; "
                           f"imported by {', '.join(sorted(importers)[:3])})")
    assert not unknown, ("imported by what the GPU check runs, but in neither the probe's "
                         "MACHINE_PACKAGES, scripts/gpu_wheels.txt nor NOT_NEEDED:\n"
                         + "\n".join(unknown.values()))


# Optional packages this CI environment does not install, by import name.
NOT_INSTALLED_HERE = {"cupy": "cupy-cuda13x", "llama_cpp": "llama-cpp-python"}
