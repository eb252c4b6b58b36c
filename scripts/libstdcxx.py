"""The ops library must use the process's shared libstdc++, never a private copy of it.

A compiler wrapper can put a folder holding only `libstdc++.a` ahead of the compiler's own
library folder (one GPU image's `CXX` does, through `-B`). The linker then takes the static
library, and the ops library carries its own copy of the C++ stream and locale code, which
torch's shared libstdc++ has set up and this copy has not: the first error message that formats
a number (`TORCH_CHECK(..., "got ", n)`) crashes the process with a segmentation fault instead of
raising. setup.py uses both functions: `shared_library_dir` to put the folder of the shared
libstdc++ first on the link line, and `private_copies` to refuse a built library that has one.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

# What libstdc++ itself defines and a library that only uses it never does: the stream
# inserters for numbers and the locale machinery behind them.
PRIVATE_MARKERS = ("_ZNSo9_M_insert", "_ZNSt6locale")


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
