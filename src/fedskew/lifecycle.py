"""Worker processes die with their parent: a ``kill -9`` of a run, a sweep or a tuning search leaves no orphan.

A pool's workers (the forked client trainers of ``--workers``, a sweep's and a parallel search's run processes) call
:func:`die_with_parent` when they start. On Linux the kernel then sends the worker ``SIGKILL`` the moment its parent
process ends, however it ends (``prctl(PR_SET_PDEATHSIG)``); a worker whose parent is already gone by then exits at
once. Elsewhere it does nothing (the pools' own shutdown still stops the workers on every ordinary exit).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(parent: int | None = None) -> bool:
    """Have this process killed when its parent ends (Linux); ``parent``: the pid it must still have (the caller's
    parent at fork time), else it exits now. Returns whether the kernel took the request."""
    if not sys.platform.startswith("linux"):
        return False
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        return False
    try:
        libc = ctypes.CDLL(libc_name, use_errno=True)
        taken = libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False
    if parent is not None and os.getppid() != parent:  # the parent died between the fork and the request
        os._exit(1)
    return taken
