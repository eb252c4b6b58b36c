"""Build script for ShardLM: the package layout and the compiled ops (``shardlm_server.worker._C``).

Project metadata lives in pyproject.toml. This file maps the repository's folders onto the
installed package names (``gateway/`` -> ``shardlm_server.gateway``, ``worker/`` ->
``shardlm_server.worker``, and the SDK with the generated stubs, ``clients/python/src/shardlm``
-> ``shardlm``, so the server installs alone) and declares the C++ / CUDA extension. Install
with::

    pip install --no-build-isolation -e .

Environment knobs:
    SHARDLM_NO_CUDA=1       build the CPU kernels only, even if CUDA is available
    TORCH_CUDA_ARCH_LIST    GPU architectures (default "8.0;9.0" when no GPU is visible)
    MAX_JOBS                parallel compile jobs (honoured by torch's ninja builder)
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent
DEFAULT_ARCHS = "8.0;9.0"


def _die(message: str) -> None:
    # sys.exit with a string prints it to stderr and exits 1, without a traceback.
    sys.exit("\n" + message.strip() + "\n")


def _log(message: str) -> None:
    print(f"shardlm setup: {message}", flush=True)


def _has_cudart(home: Path) -> bool:
    return any(any((home / d).glob("libcudart.so*")) for d in ("lib64", "lib"))


def _pick_cuda_home() -> None:
    """Point torch at a CUDA toolkit that has both nvcc and the runtime library.

    torch guesses CUDA_HOME as dirname(dirname(which nvcc)), which is wrong when
    `nvcc` on PATH is a wrapper script (e.g. /usr/local/bin/nvcc): the link then
    fails with "cannot find -lcudart". Must run before cpp_extension is imported.
    """
    if os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH"):
        return
    candidates = []
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(Path(os.path.realpath(nvcc)).parent.parent)
    candidates.append(Path("/usr/local/cuda"))
    for home in candidates:
        if (home / "bin" / "nvcc").exists() and _has_cudart(home):
            os.environ["CUDA_HOME"] = str(home)
            return


_pick_cuda_home()

try:
    import torch
    from torch.utils.cpp_extension import (
        CUDA_HOME,
        BuildExtension,
        CppExtension,
        CUDAExtension,
    )
except ImportError as exc:
    _die(
        f"ShardLM's compiled ops are built against PyTorch, which could not be imported "
        f"({exc}). Install torch into this environment first, then run "
        f"`pip install --no-build-isolation -e .` so the build uses that torch."
    )


def _load_libstdcxx():
    # scripts/ is no package: the module is loaded from its file, as its tests do.
    import importlib.util

    spec = importlib.util.spec_from_file_location("libstdcxx", ROOT / "scripts" / "libstdcxx.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


libstdcxx = _load_libstdcxx()


class ShardLMBuildExtension(BuildExtension):
    """torch's builder, then a check that the library links libstdc++ shared
    (scripts/libstdcxx.py says what a private copy breaks)."""

    def build_extension(self, ext) -> None:
        super().build_extension(ext)
        built = Path(self.get_ext_fullpath(ext.name))
        copies = libstdcxx.private_copies(built) if built.exists() else None
        if copies:
            _die(
                f"The C++ compiler ({_find_cxx()}) linked a private copy of libstdc++ into "
                f"{built.name} (it defines {copies[0]} and {len(copies) - 1} more of libstdc++'s "
                "symbols), so its error messages would crash the process. Build with a compiler "
                "that links the shared libstdc++, e.g. CXX=/usr/bin/g++."
            )


def _find_cxx() -> str | None:
    candidates = [os.environ.get("CXX", "").split(" ")[0], "c++", "g++", "clang++"]
    for cand in candidates:
        if cand and shutil.which(cand):
            return cand
    return None


def _want_cuda() -> bool:
    if os.environ.get("SHARDLM_NO_CUDA", "").strip() not in ("", "0"):
        _log("SHARDLM_NO_CUDA is set -> building CPU-only kernels (no CUDA).")
        return False
    if torch.version.cuda is None:
        _log(f"torch {torch.__version__} has no CUDA support -> building CPU-only kernels.")
        return False
    home = Path(CUDA_HOME) if CUDA_HOME else None
    if home is None or not (home / "bin" / "nvcc").exists() or not _has_cudart(home):
        _log(
            f"no CUDA toolkit with nvcc and libcudart found (CUDA_HOME={CUDA_HOME}) "
            "-> building CPU-only kernels. Set CUDA_HOME to build the GPU kernels."
        )
        return False
    return True


def _set_arch_list() -> None:
    archs = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if archs:
        _log(f"TORCH_CUDA_ARCH_LIST={archs}")
    elif torch.cuda.is_available():
        _log("TORCH_CUDA_ARCH_LIST unset -> building for the visible GPU(s).")
    else:
        os.environ["TORCH_CUDA_ARCH_LIST"] = DEFAULT_ARCHS
        _log(f"TORCH_CUDA_ARCH_LIST unset and no GPU visible -> using {DEFAULT_ARCHS!r}.")


def _sources(folder: str, pattern: str) -> list[str]:
    # setuptools wants paths relative to the project root.
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / folder).glob(pattern))


def _extension():
    if _find_cxx() is None:
        _die(
            "No C++ compiler was found (looked for $CXX, c++, g++ and clang++). ShardLM's "
            "ops are compiled C++/CUDA code, so building them needs a C++ compiler "
            "supported by your PyTorch (e.g. `apt-get install build-essential` on "
            "Debian/Ubuntu, or set CXX to your compiler), and nvcc from the CUDA toolkit "
            "for the GPU kernels. Install one and re-run "
            "`pip install --no-build-isolation -e .`."
        )
    sources = ["csrc/ops.cpp", "csrc/checks.cpp", "csrc/checks_linear.cpp",
               *_sources("csrc/cpu", "*.cpp")]
    # -fopenmp: at::parallel_for is a header template that only runs in
    # parallel when the including file is compiled with OpenMP (the .so then
    # links libgomp.so.1, which resolves to the copy torch already loaded).
    # -ffp-contract=off: no FMA contraction, so float32 rotary matches HF bit
    # for bit even with -march=native.
    # -g0: Python's own CFLAGS (which setuptools passes first) hold -g, whose debug info is 90%
    # of the library (16 MB instead of 1.6): too big to carry back from a lent GPU machine
    # (scripts/gpu_check.sh), and nothing a user of the ops needs. The last -g flag wins.
    cxx_flags = ["-O3", "-DNDEBUG", "-fopenmp", "-ffp-contract=off", "-g0"]
    link_flags = ["-fopenmp"]
    # The shared libstdc++'s folder first, so that a wrapper's folder holding only the static
    # library is not taken; failing that, the distribution's compiler (scripts/libstdcxx.py).
    cxx = _find_cxx()
    chosen, flags = libstdcxx.choose(cxx)
    link_flags += flags
    if chosen != cxx:
        _log(f"{cxx} links a private copy of libstdc++ into libraries -> building with {chosen}.")
        os.environ["CXX"] = chosen
        c_compiler = libstdcxx.c_compiler_beside(chosen)
        if c_compiler:
            os.environ["CC"] = c_compiler
    if _want_cuda():
        _set_arch_list()
        sources += [*_sources("csrc/cuda", "*.cu"), "csrc/cuda/registration.cpp"]
        # No --use_fast_math: softmax / norm accuracy matters more than the
        # few cycles saved by approximate exp and division.
        nvcc_flags = ["-O3", "-DNDEBUG"]
        _log(f"building CUDA + CPU kernels (torch CUDA {torch.version.cuda}, {CUDA_HOME}).")
        return CUDAExtension(
            name="shardlm_server.worker._C",
            sources=sources,
            define_macros=[("SHARDLM_WITH_CUDA", "1")],
            extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags},
            extra_link_args=link_flags,
        )
    _log("building CPU-only kernels.")
    return CppExtension(
        name="shardlm_server.worker._C",
        sources=sources,
        define_macros=[("SHARDLM_WITH_CUDA", "0")],
        extra_compile_args={"cxx": cxx_flags},
        extra_link_args=link_flags,
    )


# Installed package -> folder in the repository. The server's packages live under one name of
# their own instead of claiming generic top-level names such as `gateway` in site-packages.
PACKAGE_FOLDERS = {
    "shardlm_server.gateway": "gateway",
    "shardlm_server.worker": "worker",
    "shardlm": "clients/python/src/shardlm",
}


def _packages() -> list[str]:
    names = []
    for package, folder in PACKAGE_FOLDERS.items():
        names += [package, *(f"{package}.{sub}" for sub in find_packages(folder))]
    return names


setup(
    packages=_packages(),
    package_dir=PACKAGE_FOLDERS,
    package_data={"": ["py.typed", "*.pyi"]},
    ext_modules=[_extension()],
    cmdclass={"build_ext": ShardLMBuildExtension},
)
