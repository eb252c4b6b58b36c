"""Hold a gateway's worker processes still (SIGSTOP until SIGCONT) while a test makes a call, so
that the call's deadline passes mid-generation for certain, however fast the model runs.

A held worker answers nothing, not even the gateway's keepalive pings: hold it for seconds, well
inside the WORKER_KEEPALIVE_TIMEOUT_MS after which the gateway would count it as lost."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from shardlm_server.gateway.workers.processes import WORKER_MODULE

# Short beside the worker keepalive (5 s of pings plus 5 s for the answer), long beside the
# milliseconds the gateway takes to admit a request and send its prefill to the held workers.
HELD_CALL_DEADLINE_S = 2.0


@contextmanager
def workers_held(pids: list[int]) -> Iterator[None]:
    """Stop the processes `pids` for the duration of the block, then let them go on."""
    stopped: list[int] = []
    try:
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
            stopped.append(pid)
        yield
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)


def worker_pids(gateway_pid: int) -> list[int]:
    """The worker processes (`python -m WORKER_MODULE`) a gateway process started, read from
    /proc (Linux)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # The parent's pid follows the command name, which is in parentheses.
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            command = (entry / "cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):  # the process ended meanwhile
            continue
        if parent == gateway_pid and WORKER_MODULE.encode() in command:
            pids.append(int(entry.name))
    if not pids:
        raise AssertionError(f"gateway process {gateway_pid} has no worker processes")
    return pids
