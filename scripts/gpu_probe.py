"""The GPU check's environment probe: what the machine has, and what stops a run there.

    python scripts/gpu_probe.py check [--out env.txt] [--report-only]
    python scripts/gpu_probe.py wheels [--dir .whl]

`check` prints the GPU, driver, torch, CUDA, cupy, NCCL, nvcc, ninja and compiler versions as
`key: value` lines (and writes them to --out), then every problem that would stop
scripts/gpu_check.sh, each with what to do about it. Exit status 3 when there is one, unless
--report-only (the dry run) is given. The GPU is looked at first, so a machine without one fails
in a moment, before torch is imported.

`wheels` prints the wheel files in --dir to install before the check: one for each package of
scripts/gpu_wheels.txt, at its listed version, whatever this machine has (see
`wheels_to_install`). Exit status 3 when one of them has no wheel there.

Versions, not just imports: `check` also holds every package the GPU check imports to what
pyproject.toml asks of it, and every carried package to its own requirements. The packages it
knows are `MACHINE_PACKAGES` (the machine's own), the wheel list (carried) and `NOT_NEEDED`;
tests/scripts/test_gpu_imports.py walks the imports of what the GPU check runs and fails when
one of them is in none of the three.

Standard library only (plus the `packaging` that pip carries): it runs before anything is
installed.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import os
import platform
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

try:
    from packaging.requirements import InvalidRequirement, Requirement
except ImportError:  # pip's own copy: there wherever pip is
    from pip._vendor.packaging.requirements import InvalidRequirement, Requirement

ROOT = Path(__file__).resolve().parent.parent
WHEEL_LIST = ROOT / "scripts" / "gpu_wheels.txt"
PYPROJECT = ROOT / "pyproject.toml"
FATAL = 3
# Distributions the GPU machine must have itself (too big, or compiled against its CUDA, to
# carry), with the module whose import proves each.
MACHINE_PACKAGES = {
    "torch": "torch", "numpy": "numpy", "safetensors": "safetensors",
    "tokenizers": "tokenizers", "transformers": "transformers", "pytest": "pytest",
    "pyyaml": "yaml", "requests": "requests", "tqdm": "tqdm",
    "typing-extensions": "typing_extensions",
}
# Distributions pyproject.toml names or the checked code imports, that the GPU check does not
# need: imported only on paths it does not take, or development tools nothing it runs imports.
_DEV_TOOL = "a development tool of the test extra: nothing the GPU check runs imports it"
NOT_NEEDED = {
    "cupy-cuda13x": "the NCCL tests need CuPy and skip without it",
    "cupy-cuda12x": "the NCCL tests need CuPy and skip without it",
    "llama-cpp-python": "only `bench.run --model`, the CPU comparison with llama.cpp",
    "hypothesis": "only the fuzz tests, which the GPU check does not select",
    "smg": "only `serve --openai-port` (a child process the GPU check does not start) and the "
           "SMG router tests, which it does not select",
    "openai": "only the OpenAI-client tests through SMG, which the GPU check does not select",
    "jsonschema": "only the deployment-manifest tests, which the GPU check does not select",
    "kubernetes-validate": "only the deployment-manifest tests, which the GPU check does not select",
    "accelerate": "transformers' optional loading helper: the test checkpoints load without it",
    **dict.fromkeys(("ruff", "buf-bin", "mypy", "types-grpcio", "types-protobuf"), _DEV_TOOL),
}
CARRY_HINT = ("run `make gpu-wheels` where pip reaches a registry and name .whl in the device "
              "call's carry (README, GPU verification)")


# ----------------------------------------------------------------------------- what is wanted
def wheel_list(path: Path | None = None) -> list[tuple[str, str, str]]:
    """(distribution, version, module) for each line of gpu_wheels.txt."""
    path = path or WHEEL_LIST
    entries = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        match = re.fullmatch(r"([A-Za-z0-9._-]+)==([A-Za-z0-9.]+)\s+([A-Za-z0-9_.]+)", line)
        if not match:
            raise SystemExit(f"{path}:{number}: expected `name==version module`, got {line!r}")
        entries.append(match.groups())
    return entries


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def project_requirements(path: Path = PYPROJECT) -> dict[str, Requirement]:
    """pyproject.toml's dependencies and test extra, by normalized distribution name."""
    project = tomllib.loads(path.read_text(encoding="utf-8"))["project"]
    lines = project["dependencies"] + project["optional-dependencies"]["test"]
    return {normalize(r.name): r for r in map(Requirement, lines)}


def known_distributions() -> set[str]:
    """Every distribution the probe accounts for: the machine's, the carried and the unneeded."""
    names = set(MACHINE_PACKAGES) | {name for name, _v, _m in wheel_list()} | set(NOT_NEEDED)
    return {normalize(n) for n in names}


# ----------------------------------------------------------------------------- what is here
def importable(module: str) -> bool:
    """Imports it: a broken or too-old package (a generated stub's version check) is missing."""
    try:
        importlib.import_module(module)
    except Exception:  # noqa: BLE001 - any failure to import means "not usable here"
        return False
    return True


def installed(module: str) -> bool:
    """Finds it without importing it (transformers alone takes seconds to import)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def version_of(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def unmet(requirement: Requirement, versions: dict[str, str | None]) -> str | None:
    """Why `versions` (normalized name -> version, None = absent) fails `requirement`."""
    if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
        return None  # an extra's or another platform's requirement
    have = versions.get(normalize(requirement.name), version_of(requirement.name))
    if have is None:
        return f"{requirement} is not installed"
    if not requirement.specifier.contains(have, prereleases=True):
        return f"{requirement} is needed, {requirement.name} {have} is here"
    return None


def requirements_of(distribution: str) -> list[Requirement]:
    try:
        lines = importlib.metadata.requires(distribution) or []
    except importlib.metadata.PackageNotFoundError:
        return []
    found = []
    for line in lines:
        try:
            found.append(Requirement(line))
        except InvalidRequirement:
            continue  # metadata we cannot read is no reason to stop a run
    return found


# ----------------------------------------------------------------------------- carried wheels
def wheels_to_install(directory: Path) -> tuple[list[Path], list[str]]:
    """The wheel file of every listed package, and the listed packages with none there.

    All of them, not only those missing here: the grpc and protobuf family must be one tested
    set (an add-on's generated code and bounds hold only with the runtimes it was built for),
    and installed ahead of the machine's own copies they make every run the same as CI's."""
    files = sorted(directory.glob("*.whl")) if directory.is_dir() else []
    paths, lacking = [], []
    for name, version, _module in wheel_list():
        # A wheel's file name starts with its distribution name and version: NAME-VERSION-...
        match = [f for f in files if normalize(f.name.split("-")[0]) == normalize(name)
                 and f.name.split("-")[1] == version]
        if match:
            paths.append(match[0])
        else:
            lacking.append(f"{name}=={version}")
    return paths, lacking


def version_problems() -> list[str]:
    """What pyproject.toml asks of each package the check uses, and each carried package's own
    requirements, against what is installed (the carried wheels included, once installed)."""
    wanted = project_requirements()
    problems = []
    for name in sorted(known_distributions() - {normalize(n) for n in NOT_NEEDED}):
        if name in wanted and version_of(name) is not None and (why := unmet(wanted[name], {})):
            problems.append(f"pyproject.toml: {why}")
    for name, _version, _module in wheel_list():
        if version_of(name) is None:
            continue  # reported as missing
        problems += [f"{name} {version_of(name)}: {why}" for r in requirements_of(name)
                     if (why := unmet(r, {}))]
    return problems


# ----------------------------------------------------------------------------- facts
def _run(*cmd: str) -> str | None:
    if shutil.which(cmd[0]) is None:
        return None
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def find_nvcc() -> str | None:
    for candidate in (shutil.which("nvcc"),
                      *(str(Path(os.environ[v]) / "bin" / "nvcc")
                        for v in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(v)),
                      "/usr/local/cuda/bin/nvcc"):
        if candidate and Path(candidate).exists():
            return candidate
    return None


def gpu_facts() -> tuple[dict[str, str], list[str]]:
    smi = _run("nvidia-smi", "--query-gpu=name,driver_version,memory.total",
               "--format=csv,noheader")
    if smi is None:
        return {"gpu": "none"}, [
            "no NVIDIA GPU visible: nvidia-smi is missing or failed. The GPU check runs on a "
            "machine with an NVIDIA GPU and its driver; use --dry-run to check the script "
            "elsewhere"]
    gpus = [line.strip() for line in smi.splitlines() if line.strip()]
    if not gpus:
        return {"gpu": "none"}, ["no NVIDIA GPU visible: nvidia-smi lists none"]
    name, driver, memory = ([*gpus[0].split(","), "", ""][:3])
    return {"gpu": name.strip(), "gpu_count": str(len(gpus)), "driver": driver.strip(),
            "gpu_memory": memory.strip()}, []


def tool_facts() -> tuple[dict[str, str], list[str]]:
    facts, problems = {}, []
    nvcc = find_nvcc()
    if nvcc is None:
        problems.append("no nvcc: the CUDA kernels cannot be built. Put the CUDA toolkit's bin "
                        "folder on PATH or set CUDA_HOME")
        facts["nvcc"] = "none"
    else:
        release = re.search(r"release ([0-9.]+)", _run(nvcc, "--version") or "")
        facts["nvcc"] = f"{release.group(1) if release else 'unknown'} ({nvcc})"
    cxx = next((c for c in (os.environ.get("CXX", "").split(" ")[0], "c++", "g++", "clang++")
                if c and shutil.which(c)), None)
    if cxx is None:
        problems.append("no C++ compiler (looked for $CXX, c++, g++, clang++)")
    facts["cxx"] = ((_run(cxx, "--version") or "").splitlines() or ["none"])[0] if cxx else "none"
    ninja = _run("ninja", "--version")
    facts["ninja"] = ninja or "none (the build runs one file at a time)"
    facts["cpus"] = str(os.cpu_count())
    return facts, problems


def python_facts() -> tuple[dict[str, str], list[str]]:
    facts = {"python": f"{platform.python_version()} ({sys.executable})"}
    problems = []
    missing = [pkg for pkg, module in MACHINE_PACKAGES.items() if not installed(module)]
    missing += [f"{name}=={version}" for name, version, module in wheel_list()
                if not importable(module)]
    if missing:
        problems.append(f"missing Python packages: {', '.join(missing)}; {CARRY_HINT}")
    problems += [f"{p}; {CARRY_HINT}" for p in version_problems()]
    if installed("torch"):
        import torch

        facts["torch"] = torch.__version__
        facts["torch_cuda"] = str(torch.version.cuda)
        if torch.version.cuda is None:
            problems.append(f"torch {torch.__version__} has no CUDA support: run the check with "
                            "a CUDA build of torch (PYTHON=...)")
        elif not torch.cuda.is_available():
            problems.append(f"torch {torch.__version__} sees no GPU (torch.cuda.is_available() "
                            "is False): check the driver and CUDA_VISIBLE_DEVICES")
        else:
            major, minor = torch.cuda.get_device_capability(0)
            facts["capability"] = f"{major}.{minor}"
            facts["torch_nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    if installed("cupy"):
        try:
            import cupy
            from cupy.cuda import nccl

            facts["cupy"] = cupy.__version__
            facts["cupy_nccl"] = str(nccl.get_version())
        except Exception as exc:  # noqa: BLE001 - reported, not fatal: the NCCL tests skip
            facts["cupy_nccl"] = f"none ({type(exc).__name__}: {exc})"[:200]
    else:
        facts["cupy"] = "none (the NCCL tests skip)"
    for distribution in ("transformers", "grpcio", "protobuf", "smg-grpc-proto", "gguf",
                         "setuptools", "tokenizers", "safetensors"):
        facts[distribution] = version_of(distribution) or "none"
    return facts, problems


def check(out: Path | None, report_only: bool) -> int:
    facts, problems = gpu_facts()
    if problems and not report_only:  # fail in a moment: no torch import on a GPU-less machine
        return _report(facts, problems, out, report_only)
    for probe in (tool_facts, python_facts):
        more, found = probe()
        facts.update(more)
        problems += found
    return _report(facts, problems, out, report_only)


def _report(facts: dict[str, str], problems: list[str], out: Path | None,
            report_only: bool) -> int:
    lines = [f"{key}: {value}" for key, value in facts.items()]
    lines += [f"problem: {p}" for p in problems]
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if out is not None:
        out.write_text(text, encoding="utf-8")
    if not problems:
        return 0
    verb = "a real run would stop here" if report_only else "GPU check stopped"
    for p in problems:
        print(f"{verb}: {p}", file=sys.stderr)
    return 0 if report_only else FATAL


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("check", help="print the environment; fail on what stops a run")
    p.add_argument("--out", type=Path, help="also write the facts here")
    p.add_argument("--report-only", action="store_true", help="print problems, exit 0")
    p = sub.add_parser("wheels", help="wheel files to install for missing or old packages")
    p.add_argument("--dir", type=Path, default=ROOT / ".whl")
    args = parser.parse_args(argv)
    if args.command == "check":
        return check(args.out, args.report_only)
    chosen, lacking = wheels_to_install(args.dir)
    for path in chosen:
        print(path)
    if lacking:
        print(f"Python packages needed here with no wheel in {args.dir}: {', '.join(lacking)}; "
              f"{CARRY_HINT}", file=sys.stderr)
        return FATAL
    return 0


if __name__ == "__main__":
    sys.exit(main())
