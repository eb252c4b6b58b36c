"""llama.cpp in-process through `llama-cpp-python` (the optional `bench` extra), timed the way
bench.model_bench times ShardLM: batch-1 greedy decode steps after a short prompt, one prefill of a
long prompt, and the argmax next token at every position of a teacher-forced text.

`available()` is False when the package is absent; the benchmark then prints one line and leaves
the llama.cpp columns out.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

INSTALL_HINT = 'CMAKE_ARGS="-DGGML_NATIVE=ON" pip install "llama-cpp-python[server]"'


def available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


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
