"""A daemon's allocator keeps freed memory, so a minibatch's tensors reuse warm pages: the
page faults of a loop that allocates and frees the same tensors, in a fresh process that
started as a daemon does with ``[runtime] retain_freed_mib`` as given."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hetpipe import hostmem
from hetpipe.localcluster import DeviceDef, cluster_toml

# what a stage does each minibatch: tensors of the same sizes made and dropped
LOOP = """
import resource, sys, torch
torch.set_num_threads(1)  # as the daemons run
from hetpipe.config import load_cluster
from hetpipe.daemon import start_daemon
start_daemon("probe", load_cluster(sys.argv[1]), None, "warning", None)
def step():
    # a minibatch's worth: 12 tensors of 8 MiB alive at once, then all freed
    held = [torch.ones(1 << 21) for _ in range(12)]
    return sum(float(t[-1]) for t in held)
for _ in range(5):
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""

glibc = pytest.mark.skipif(not hostmem.is_glibc(), reason="the setting is glibc's")


def _faults(tmp_path: Path, retain: int) -> int:
    path = tmp_path / f"cluster-{retain}.toml"
    text = cluster_toml([DeviceDef("gpu0", "fast", "1GiB", 1.0)], shards=1)
    path.write_text(text.replace("[runtime]", f"[runtime]\nretain_freed_mib = {retain}"))
    out = subprocess.run(
        [sys.executable, "-c", LOOP, str(path)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return int(out.stdout.split()[-1])


@glibc
def test_a_daemon_reuses_freed_pages(tmp_path: Path) -> None:
    # 96 MiB a step, 10 steps: 245,760 pages if every step had fresh ones
    assert _faults(tmp_path, 256) < 2_000
    # glibc's defaults give the 96 MiB back to the kernel after each step in most processes,
    # not all (its thresholds move with what the process freed before, and some processes'
    # heaps never trim): fresh processes until one shows it
    for _ in range(12):
        if _faults(tmp_path, 0) > 200_000:
            return
    pytest.fail("glibc's defaults never gave the freed pages back: nothing to compare")


def test_zero_leaves_the_allocator_alone() -> None:
    assert hostmem.retain_freed(0) is False


@glibc
def test_glibc_takes_the_largest_setting() -> None:
    """In a process of its own: this one's allocator stays as it is."""
    code = "from hetpipe import hostmem; print(hostmem.retain_freed(hostmem.MAX_RETAIN_MIB + 1))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["True"], out.stderr
