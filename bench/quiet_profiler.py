"""torch.profiler's own chatter, kept off a benchmark's output. The profiler library (Kineto)
marks every start and stop on stderr, and a CUDA build of torch on a machine without a GPU adds an
ERROR line saying it found no device. Around our own profiled runs only, stderr is captured at the
file-descriptor level (Kineto writes from C++) and replayed without exactly those lines: anything
else written there meanwhile, a real error included, still reaches the terminal, in order."""

from __future__ import annotations

import os
import re
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

import torch

# Kineto's log line: "LEVEL:YYYY-MM-DD HH:MM:SS pid:tid File.cpp:line] message".
_KINETO = r"[A-Z]+:\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \d+:\d+ \w+\.cpp:\d+\] "
_START_STOP = re.compile(_KINETO + r"profiler_(?:start|stop)\s*")
_NO_GPU = re.compile(_KINETO + r"gpuGetDeviceCount failed with code \d+\s*")


def is_chatter(line: str, gpu_present: bool) -> bool:
    """Whether `line` is the profiler's start/stop marker, or (where no GPU is present) its
    report that it found none."""
    return bool(_START_STOP.fullmatch(line) or (not gpu_present and _NO_GPU.fullmatch(line)))


@contextmanager
def quiet_profiler() -> Iterator[None]:
    """Run the block with stderr captured; afterwards write out all of it but the chatter."""
    gpu_present = torch.cuda.is_available()
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as capture:
        os.dup2(capture.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            lines = capture.read().decode("utf-8", "replace").splitlines(keepends=True)
            kept = "".join(line for line in lines if not is_chatter(line, gpu_present))
            if kept:
                sys.stderr.write(kept)
                sys.stderr.flush()
