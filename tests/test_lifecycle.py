"""Issue 46: worker processes die with their parent (fedskew/lifecycle.py); a kill -9 of a run with --workers 2 left
its workers alive for ever."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from fedskew.lifecycle import die_with_parent

CHILD = """
import os, sys, time
from fedskew.lifecycle import die_with_parent
pid = os.fork()
if pid == 0:
    die_with_parent({parent})
    print("ready", flush=True)
    time.sleep(600)
    os._exit(0)
print(pid, flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie has died; it only waits to be reaped
        return f.read().split()[2] != "Z"


def _spawn(with_pid: bool) -> tuple[subprocess.Popen, int] | str:
    """A parent process and its forked worker's pid, or why the parent gave no pid (its exit status and stderr)."""
    parent = subprocess.Popen(
        [sys.executable, "-c", CHILD.format(parent="os.getppid()" if with_pid else "None")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines = {parent.stdout.readline().strip() for _ in range(2)}  # the worker's pid and its "ready", in either order
    if "ready" in lines and len(lines) == 2:
        return parent, int(next(line for line in lines if line != "ready"))
    parent.kill()
    _, err = parent.communicate(timeout=30)
    return f"the parent printed {sorted(lines)} and ended with status {parent.returncode}: {err[-2000:]}"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.parametrize("with_pid", [False, True])
def test_a_worker_is_killed_when_its_parent_is_killed(with_pid):
    # once in a full suite on the loaded 2-core machine the parent printed nothing (stdout at EOF, cause not seen):
    # a parent that never started its worker is started again, once, and its exit status and stderr are reported
    spawned = _spawn(with_pid)
    if isinstance(spawned, str):
        spawned = _spawn(with_pid)
    assert not isinstance(spawned, str), spawned
    parent, worker = spawned
    assert _alive(worker)
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    for _ in range(100):  # the kernel's signal arrives at once; poll briefly rather than assume
        if not _alive(worker):
            break
        time.sleep(0.05)
    assert not _alive(worker)


def test_it_is_a_no_op_answer_elsewhere_and_true_on_linux():
    assert die_with_parent() is sys.platform.startswith("linux")
