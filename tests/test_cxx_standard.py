"""The C++ sources are C++17, the standard torch's extension builder uses up to 2.13 (the GPU
image's torch 2.11 among them; pyproject allows torch >= 2.4). A newer torch builds in C++20, so
a C++20-only construct (a float template parameter, say) compiles here and fails there: each
source is parsed as C++17, and only diagnostics in csrc/ count, since a torch that needs C++20
has C++20 in its own headers."""

from __future__ import annotations

import os
import shutil
import subprocess
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "csrc"
SOURCES = sorted([*CSRC.glob("*.cpp"), *CSRC.glob("cpu/*.cpp"), *CSRC.glob("cuda/*.cpp")])
GXX = shutil.which("g++")


def ours(diagnostics: str) -> list[str]:
    """The error lines whose file is under csrc/."""
    return [line for line in diagnostics.splitlines()
            if " error: " in line and line.startswith((str(CSRC), "csrc/"))]


@pytest.mark.skipif(GXX is None, reason="needs g++")
def test_every_cpp_source_is_cxx17():
    torch = pytest.importorskip("torch")
    include = Path(torch.__file__).parent / "include"
    cuda = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "include"
    flags = ["-std=c++17", "-fsyntax-only", "-fopenmp", "-DSHARDLM_WITH_CUDA=1",
             "-DTORCH_API_INCLUDE_EXTENSION_H", "-DTORCH_EXTENSION_NAME=_C",
             f"-I{include}", f"-I{include / 'torch/csrc/api/include'}",
             f"-I{sysconfig.get_paths()['include']}"]
    if not cuda.is_dir():  # csrc/cuda/registration.cpp needs the CUDA headers
        flags[3] = "-DSHARDLM_WITH_CUDA=0"
    else:
        flags.append(f"-I{cuda}")

    def parse(source: Path) -> list[str]:
        done = subprocess.run([GXX, *flags, str(source)], capture_output=True, text=True,
                              timeout=300, cwd=ROOT)
        return ours(done.stderr)

    sources = [s for s in SOURCES if cuda.is_dir() or "cuda" not in s.parent.name]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        errors = [e for found in pool.map(parse, sources) for e in found]
    assert errors == []


def test_the_filter_keeps_only_our_errors():
    diagnostics = "\n".join([
        f"{CSRC}/cpu/nibble_layouts.h:37:38: error: 'float' is not a valid type for a template "
        "non-type parameter",
        "/site/torch/include/c10/util/intrusive_ptr.h:775:27: error: 'strong_ordering' in "
        "namespace 'std' does not name a type",
        f"{CSRC}/cpu/q4x8.cpp:12:1: warning: unused",
    ])
    assert ours(diagnostics) == [diagnostics.splitlines()[0]]
