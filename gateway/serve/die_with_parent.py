"""Run a command that dies with its parent:

    python -m shardlm_server.gateway.serve.die_with_parent PARENT_PID COMMAND [ARG ...]

For the children of `serve` that are not ShardLM's code (the SMG router of `--openai-port`), so
cannot watch their parent themselves as the workers do (worker/parent_watch.py): this asks the
kernel to SIGKILL the process when its parent dies (PR_SET_PDEATHSIG, Linux, kept across exec),
checks that the parent has not died already, then execs COMMAND in its place. A gateway killed
without warning (SIGKILL, a crash) so leaves no router behind.

Why not subprocess's preexec_fn: it runs Python in the forked child of a process with threads
(the gateway has grpc's), which may deadlock. The kernel's signal fires when the *thread* that
started the child ends, so the gateway starts it from its event loop's thread, which lives as long
as the gateway. Elsewhere than Linux the command runs unguarded.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # from <sys/prctl.h>


def die_with_parent() -> None:
    """Have the kernel SIGKILL this process when its parent (thread) ends; Linux only."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")


def main(argv: list[str]) -> None:
    if len(argv) < 2 or not argv[0].isdigit():
        sys.exit("usage: python -m shardlm_server.gateway.serve.die_with_parent PARENT_PID "
                 "COMMAND [ARG ...]")
    parent, command = int(argv[0]), argv[1:]
    die_with_parent()
    if os.getppid() != parent:  # the parent died before prctl: nobody to serve
        sys.exit(1)
    os.execvp(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
