"""The ops library must use the process's shared libstdc++, never a private copy of it.

A compiler wrapper can put a folder holding only `libstdc++.a` ahead of the compiler's own
library folder (one GPU image's `CXX` does, through `-B`). The linker then takes the static
library, and the ops library carries its own copy of the C++ stream and locale code, which
torch's shared libstdc++ has set up and this copy has not: the first error message that formats
a number (`TORCH_CHECK(..., "got ", n)`) crashes the process with a segmentation fault instead of
raising. setup.py asks `choose` for the compiler and link flags (the shared libstdc++'s folder
first on the link line, or failing that another compiler), and refuses a built library that has a
private copy all the same (`private_copies`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

# What libstdc++ itself defines and a library that only uses it never does: the stream
# inserters for numbers and the locale machinery behind them.
PRIVATE_MARKERS = ("_ZNSo9_M_insert", "_ZNSt6locale")
# A library that formats a number through a stream, as TORCH_CHECK's messages do.
PROBE = ('#include <sstream>\n#include <string>\n'
         'std::string f(long v) { std::ostringstream s; s << v; return s.str(); }\n')
# Where a distribution keeps its own compiler, whose libstdc++ is the one Python loads.
FALLBACKS = ("/usr/bin/g++", "/usr/bin/clang++")


def shared_library_dir(cxx: str) -> str | None:
    """The folder of the shared libstdc++ that `cxx` would link, or None when it does not say."""
    try:
        found = subprocess.run([cxx, "-print-file-name=libstdc++.so"], capture_output=True,
                               text=True, timeout=30, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    # A compiler that knows no such file prints the bare name back.
    return os.path.dirname(found) if os.path.isabs(found) and os.path.exists(found) else None


def private_copies(library: Path) -> list[str] | None:
    """The libstdc++ symbols `library` defines itself (empty: none), or None without `nm`."""
    nm = shutil.which("nm")
    if nm is None:
        return None
    listed = subprocess.run([nm, "-D", "--defined-only", str(library)], capture_output=True,
                            text=True, timeout=120, check=True).stdout
    names = (line.split()[-1] for line in listed.splitlines() if line.strip())
    return sorted({n for n in names if n.startswith(PRIVATE_MARKERS)})


def links_shared(cxx: str, flags: list[str]) -> bool | None:
    """Whether a library that `cxx` links with `flags` uses the shared libstdc++; None when the
    probe does not build or `nm` is missing."""
    with tempfile.TemporaryDirectory() as tmp:
        source, library = Path(tmp, "probe.cpp"), Path(tmp, "probe.so")
        source.write_text(PROBE)
        try:
            subprocess.run([cxx, "-shared", "-fPIC", str(source), "-o", str(library), *flags],
                           capture_output=True, timeout=120, check=True)
        except (OSError, subprocess.SubprocessError):
            return None
        copies = private_copies(library)
        return None if copies is None else not copies


def choose(cxx: str, fallbacks: tuple[str, ...] = FALLBACKS) -> tuple[str, list[str]]:
    """The compiler to build with and the link flags that make it use the shared libstdc++:
    `cxx` with its shared library's folder first, or else the first fallback that links it
    shared. `cxx` as it is when nothing can tell (no `nm`, a probe that does not build)."""
    for candidate in (cxx, *(f for f in fallbacks if f != cxx and os.path.exists(f))):
        shared = shared_library_dir(candidate)
        flags = [f"-L{shared}"] if shared else []
        verdict = links_shared(candidate, flags)
        if verdict or (verdict is None and candidate == cxx):
            return candidate, flags
    return cxx, []


def c_compiler_beside(cxx: str) -> str | None:
    """The C compiler of the same toolchain as `cxx` (setuptools links with CC), if it exists."""
    for cpp, c in (("clang++", "clang"), ("g++", "gcc"), ("c++", "cc")):
        if cxx.endswith(cpp):
            sibling = cxx[: -len(cpp)] + c
            return sibling if shutil.which(sibling) else None
    return None
