"""llama.cpp in-process through `llama-cpp-python` (the optional `bench` extra), timed the way
bench.model_bench times ShardLM: batch-1 greedy decode steps after a short prompt, one prefill of a
long prompt, and the argmax next token at every position of a teacher-forced text.

`available()` is False when the package is absent, and `crash_reason()` says when its build dies on
this machine and file (a child process tries it first, so a crash inside llama.cpp cannot take the
benchmark down); the benchmark then prints one line and leaves the llama.cpp columns out.

`INSTALL_HINT` builds it for the machine's own SIMD without its AMX int8 path: on CPUs with AMX
(Intel Xeon from Sapphire Rapids on) that path segfaults in `ggml_backend_amx_mul_mat` at the first
prompt in the llama.cpp that llama-cpp-python 0.3.36 vendors (seen here on a 2-core Xeon VM; the
upstream report is ggml-org/llama.cpp#20824). Elsewhere `-mno-amx-int8` changes nothing.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import numpy as np

# The native build minus AMX int8 (see the module docstring); scripts/build_llama_server.sh builds
# llama-server and llama-quantize with the same flags.
NATIVE_CMAKE_ARGS = "-DGGML_NATIVE=ON -DCMAKE_C_FLAGS=-mno-amx-int8 -DCMAKE_CXX_FLAGS=-mno-amx-int8"
INSTALL_HINT = f'CMAKE_ARGS="{NATIVE_CMAKE_ARGS}" pip install "llama-cpp-python[server]"'
REBUILD_HINT = (f'CMAKE_ARGS="{NATIVE_CMAKE_ARGS}" pip install --force-reinstall --no-deps '
                '--no-cache-dir "llama-cpp-python[server]"')
# A prompt long enough for llama.cpp's batched matrix paths, then one decode step: what the
# benchmark asks of it, in a child process.
_PROBE = """
import sys
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=128, n_batch=128, n_threads=int(sys.argv[2]),
            n_threads_batch=int(sys.argv[2]), verbose=False)
llm.eval(list(range(1, 65)))
llm.eval([1])
"""


def available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def crash_reason(gguf: Path, threads: int) -> str | None:
    """None when llama.cpp loads `gguf` and runs a prompt and a decode step in a child process;
    else why not, in one line. A file llama.cpp refuses is not a crash: LlamaCpp says so itself."""
    try:
        done = subprocess.run([sys.executable, "-c", _PROBE, str(gguf), str(threads)],
                              capture_output=True, timeout=300, check=False)
    except subprocess.TimeoutExpired:
        return "llama.cpp did not finish a 64-token prompt in 300 s"
    if done.returncode >= 0:
        return None
    return (f"llama.cpp died by signal {-done.returncode} on this machine; rebuild it with "
            f"{REBUILD_HINT}")


def version() -> str | None:
    try:
        import llama_cpp
    except ImportError:
        return None
    return getattr(llama_cpp, "__version__", "unknown")


class LlamaCpp:
    """One llama.cpp context on `gguf` with `threads` threads for decode and for prompts."""

    def __init__(self, gguf: Path, threads: int, n_ctx: int, logits_all: bool = False) -> None:
        from llama_cpp import Llama

        self.llm = Llama(model_path=str(gguf), n_ctx=n_ctx, n_batch=min(n_ctx, 512),
                         n_threads=threads, n_threads_batch=threads, logits_all=logits_all,
                         verbose=False)

    def _next_token(self) -> int:
        """The argmax of the last evaluated position's logits. Read from the context itself:
        without logits_all, llama-cpp-python keeps no copy in `scores`."""
        logits = np.ctypeslib.as_array(self.llm._ctx.get_logits_ith(-1), shape=(self.llm.n_vocab(),))
        return int(logits.argmax())

    def decode_seconds(self, prompt: list[int], steps: int) -> float:
        """Seconds of `steps` greedy batch-1 decode steps after `prompt` (prefill excluded)."""
        llm = self.llm
        llm.reset()
        llm.eval(prompt)
        token = self._next_token()
        start = time.perf_counter()
        for _ in range(steps):
            llm.eval([token])
            token = self._next_token()
        return time.perf_counter() - start

    def prefill_seconds(self, prompt: list[int]) -> float:
        """Seconds of one pass over `prompt` from an empty cache (last logits only)."""
        llm = self.llm
        llm.reset()
        start = time.perf_counter()
        llm.eval(prompt)
        return time.perf_counter() - start

    def top1(self, ids: list[int]):
        """The argmax next token at every position of `ids` (needs logits_all=True)."""
        import torch

        llm = self.llm
        llm.reset()
        llm.eval(ids)
        return torch.from_numpy(llm.scores[: len(ids)].argmax(-1)).to(torch.int64)
