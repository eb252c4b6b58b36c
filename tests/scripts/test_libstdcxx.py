"""The ops library links the shared libstdc++: a compiler wrapper whose first library folder holds
only libstdc++.a (as one GPU image's has) makes a private copy, which setup.py's link folder
avoids and its check refuses; the library CI built has none."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("libstdcxx", ROOT / "scripts" / "libstdcxx.py")
libstdcxx = importlib.util.module_from_spec(spec)
spec.loader.exec_module(libstdcxx)

GXX = shutil.which("g++")
needs_gxx = pytest.mark.skipif(GXX is None or shutil.which("nm") is None,
                               reason="needs g++ and nm")
# Formats a number through a stream: what TORCH_CHECK's messages do.
SOURCE = '#include <sstream>\n#include <string>\n' \
         'std::string f(long v) { std::ostringstream s; s << "got " << v; return s.str(); }\n'


@pytest.fixture
def static_only_wrapper(tmp_path: Path) -> Path:
    """A g++ whose -B folder holds libstdc++.a alone, ahead of the compiler's own folders."""
    static = subprocess.run([GXX, "-print-file-name=libstdc++.a"], capture_output=True,
                            text=True, check=True).stdout.strip()
    if not Path(static).is_file():
        pytest.skip("this g++ has no static libstdc++")
    lib = tmp_path / "lib"
    lib.mkdir()
    shutil.copy(static, lib / "libstdc++.a")
    wrapper = tmp_path / "g++"
    wrapper.write_text(f'#!/bin/sh\nexec {GXX} -B{lib}/ "$@"\n')
    wrapper.chmod(0o755)
    return wrapper


def build(cxx: Path | str, tmp_path: Path, *flags: str) -> Path:
    src, out = tmp_path / "f.cpp", tmp_path / f"f{len(flags)}.so"
    src.write_text(SOURCE)
    subprocess.run([str(cxx), "-shared", "-fPIC", "-O2", str(src), "-o", str(out), *flags],
                   check=True, capture_output=True)
    return out


@needs_gxx
def test_a_static_only_folder_makes_a_private_copy_and_the_link_folder_prevents_it(
        static_only_wrapper, tmp_path):
    assert libstdcxx.private_copies(build(static_only_wrapper, tmp_path))  # the GPU image's bug
    shared = libstdcxx.shared_library_dir(str(static_only_wrapper))
    assert shared is not None and Path(shared, "libstdc++.so").exists()
    assert libstdcxx.private_copies(build(static_only_wrapper, tmp_path, f"-L{shared}")) == []


@needs_gxx
def test_a_plain_build_has_no_private_copy(tmp_path):
    assert libstdcxx.private_copies(build(GXX, tmp_path)) == []


def test_a_compiler_that_cannot_say_gives_no_folder(tmp_path):
    assert libstdcxx.shared_library_dir(str(tmp_path / "no-such-compiler")) is None
    silent = tmp_path / "silent"
    silent.write_text("#!/bin/sh\necho libstdc++.so\n")  # the bare name: not found
    silent.chmod(0o755)
    assert libstdcxx.shared_library_dir(str(silent)) is None


@pytest.mark.skipif(shutil.which("nm") is None, reason="needs nm")
def test_the_built_ops_library_has_no_private_copy():
    built = sorted((ROOT / "worker").glob("_C*.so"))
    if not built:
        pytest.skip("the ops library is not built here")
    for library in built:
        assert libstdcxx.private_copies(library) == [], library
