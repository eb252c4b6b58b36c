"""End a worker whose gateway is gone, so that a gateway killed without warning (SIGKILL, a
crash) leaves no worker behind.

Only workers that a gateway started get a parent to watch (`--parent-pid`); workers started by
hand (`shardlm worker` on another host) live on their own. Two mechanisms: on Linux the kernel
signals the worker as soon as its parent dies (PR_SET_PDEATHSIG); everywhere a thread checks
every second whether the worker was re-parented. The kernel's signal also fires when merely the
thread that spawned the worker ends, so the handler re-checks the parent pid before stopping.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

PR_SET_PDEATHSIG = 1  # from <sys/prctl.h>
PARENT_DEATH_SIGNAL = signal.SIGUSR1
CHECK_INTERVAL_S = 1.0


def _ask_kernel_for_a_signal() -> None:
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, int(PARENT_DEATH_SIGNAL), 0, 0, 0)
    except (OSError, AttributeError):
        pass  # the polling thread still notices


def watch_parent(parent_pid: int, on_gone: Callable[[], None]) -> None:
    """Call `on_gone()` once the process `parent_pid` is no longer this process's parent (at
    once when that is already so). `on_gone` must be safe to call more than once."""

    def gone() -> bool:
        return os.getppid() != parent_pid

    def on_signal(_signum, _frame) -> None:
        if gone():
            on_gone()

    signal.signal(PARENT_DEATH_SIGNAL, on_signal)
    _ask_kernel_for_a_signal()

    def poll() -> None:
        while not gone():
            time.sleep(CHECK_INTERVAL_S)
        on_gone()

    # The parent may have died before prctl: the first poll happens at once.
    threading.Thread(target=poll, name="shardlm-parent-watch", daemon=True).start()
