"""``hetpipe.launch``: which daemons of a run directory are still alive."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from hetpipe import launch

# forks a child that exits at once and never reaps it: a zombie whose parent is not us
_ZOMBIE_MAKER = """
import os, time
pid = os.fork()
if pid == 0:
    os._exit(0)
print(pid, flush=True)
time.sleep(60)
"""


def test_an_exited_process_that_nobody_reaped_is_not_alive() -> None:
    """``down`` finds the daemons of ``up`` re-parented to init, which reaps them late: one
    that has exited is gone though its zombie is still there."""
    parent = subprocess.Popen(
        [sys.executable, "-c", _ZOMBIE_MAKER], stdout=subprocess.PIPE, text=True
    )
    try:
        assert parent.stdout is not None
        pid = int(parent.stdout.readline())
        deadline = time.monotonic() + 10
        while launch.pid_alive(pid):
            assert time.monotonic() < deadline, f"{pid} still counts as alive"
            time.sleep(0.05)
        assert Path(f"/proc/{pid}").exists()  # not reaped: its parent sleeps
        assert launch.pid_alive(parent.pid)
    finally:
        parent.kill()
        parent.wait(timeout=10)
