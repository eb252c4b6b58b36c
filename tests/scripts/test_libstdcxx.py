"""The ops library links the shared libstdc++: a compiler wrapper whose first library folder holds
only libstdc++.a (as one GPU image's has) makes a private copy, which the shared library's folder
first on the link line avoids; a compiler that no link flag mends gives way to the distribution's
(`choose`, which setup.py asks); and the library CI built has none."""

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


@pytest.fixture
def always_static_wrapper(tmp_path: Path) -> Path:
    """A g++ that links libstdc++ statically whatever folders come first: no link flag helps."""
    wrapper = tmp_path / "static" / "g++"
    wrapper.parent.mkdir()
    wrapper.write_text(f'#!/bin/sh\nexec {GXX} -static-libstdc++ "$@"\n')
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


@needs_gxx
def test_choose_keeps_a_compiler_that_the_link_folder_mends(static_only_wrapper):
    assert libstdcxx.links_shared(str(static_only_wrapper), []) is False
    chosen, flags = libstdcxx.choose(str(static_only_wrapper), fallbacks=(GXX,))
    assert chosen == str(static_only_wrapper) and flags[0].startswith("-L")
    assert libstdcxx.links_shared(chosen, flags) is True


@needs_gxx
def test_choose_falls_back_to_a_compiler_that_links_shared(always_static_wrapper):
    assert libstdcxx.choose(str(always_static_wrapper), fallbacks=(GXX,))[0] == GXX
    # With no fallback it keeps the compiler; setup.py's check after the build then refuses.
    assert libstdcxx.choose(str(always_static_wrapper), fallbacks=()) == (
        str(always_static_wrapper), [])


def test_the_c_compiler_beside(tmp_path):
    for name in ("g++", "gcc", "clang++"):
        (tmp_path / name).write_text("#!/bin/sh\n")
        (tmp_path / name).chmod(0o755)
    assert libstdcxx.c_compiler_beside(str(tmp_path / "g++")) == str(tmp_path / "gcc")
    assert libstdcxx.c_compiler_beside(str(tmp_path / "clang++")) is None  # no clang beside it
    assert libstdcxx.c_compiler_beside(str(tmp_path / "icpx")) is None


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
