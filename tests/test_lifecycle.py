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


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.parametrize("with_pid", [False, True])
def test_a_worker_is_killed_when_its_parent_is_killed(with_pid):
    parent = subprocess.Popen(
        [sys.executable, "-c", CHILD.format(parent="os.getppid()" if with_pid else "None")],
        stdout=subprocess.PIPE,
        text=True,
    )
    lines = {parent.stdout.readline().strip() for _ in range(2)}  # the worker's pid and its "ready", in either order
    worker = int(next(line for line in lines if line != "ready"))
    assert "ready" in lines and _alive(worker)
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    for _ in range(100):  # the kernel's signal arrives at once; poll briefly rather than assume
        if not _alive(worker):
            break
        time.sleep(0.05)
    assert not _alive(worker)


def test_it_is_a_no_op_answer_elsewhere_and_true_on_linux():
    assert die_with_parent() is sys.platform.startswith("linux")
