"""Host memory the C allocator keeps for reuse, so a minibatch's tensors find warm pages.

A training step allocates tensors of the same sizes every minibatch. glibc's ``malloc``
hands large freed blocks back to the kernel: a block above its mmap threshold (128 KiB
until a freed mapped block raises it) is unmapped when freed, and a heap whose free top
exceeds its trim threshold is cut back. The next minibatch's tensors then land on fresh
pages, and every 4 KiB of them costs a page fault (and the kernel's zeroing) at its first
write, inside the kernel that writes it. A daemon that calls :func:`retain_freed` once at
start keeps freed blocks in its heaps instead: the two wide stages of
``scripts/bench_sync.py``'s CNN took 1,000-1,400 page faults per iteration of 4
microbatches with glibc's defaults and none with it (``scripts/probe_stage_compute.py``).

``[runtime] retain_freed_mib`` (default 256) is the most freed memory a heap keeps at its
top; blocks up to the smaller of that and 32 MiB (glibc's largest mmap threshold on 64-bit
hosts) come from the heaps, larger ones are still mapped and unmapped each time. 0 leaves
the allocator's own behaviour. Where the C library is not glibc it changes nothing.
"""

from __future__ import annotations

import ctypes
import platform
from typing import Any

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MAX_MMAP_THRESHOLD = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX where long is 8 bytes
MAX_RETAIN_MIB = 2047  # mallopt takes an int of bytes


def is_glibc() -> bool:
    """Whether this process's C library is glibc (the only one the setting is for)."""
    return platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


def _mallopt() -> Any | None:
    """glibc's ``mallopt``, or None where the C library is another."""
    if not is_glibc():
        return None
    try:
        fn = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return fn


def retain_freed(mib: int) -> bool:
    """Keep up to ``mib`` MiB of freed memory per heap for reuse (0: leave the allocator as
    it is). Returns whether glibc took the setting."""
    if mib <= 0:
        return False
    mallopt = _mallopt()
    if mallopt is None:
        return False
    limit = min(mib, MAX_RETAIN_MIB) << 20
    # both: setting either switches glibc's own adjustment of them off, which would have
    # raised the trim threshold along with the mmap threshold
    return (
        mallopt(M_TRIM_THRESHOLD, limit) == 1
        and mallopt(M_MMAP_THRESHOLD, min(limit, MAX_MMAP_THRESHOLD)) == 1
    )
