"""Keep freed memory in a daemon's process: glibc malloc settings for per-minibatch work.

A stage allocates and frees the same tensors every minibatch (activations, gradients, a new
weight version per step, predicted weights). With glibc's defaults, a large block is mapped
fresh from the OS for each allocation until the dynamic mmap threshold catches up, and a heap
whose top holds more than twice that threshold free is handed back (trimmed) after a pass:
the next pass faults the same pages in again, on the compute thread, as CPU time. On an
emulated device that CPU time is padded too (:func:`hetpipe.emulate.pad`), ten times at speed
0.1. :func:`keep_freed_memory` fixes the mmap threshold at glibc's maximum (32 MiB: every
smaller block comes from the heaps, which keep it) and trims only past 1 GiB free, so a
daemon's memory stays at its peak instead of shrinking between passes, as PyTorch's CUDA
caching allocator keeps GPU memory. Measured on 2 cores (cnn, k = 8 stages at speed 0.1):
the bottleneck stage's compute per minibatch 2-9 % lower; plain PyTorch and our stages alike
ran 15-30 % faster with the same settings (``bench_sync.py`` (a)).

A user's own ``MALLOC_TRIM_THRESHOLD_`` or ``MALLOC_MMAP_THRESHOLD_`` in the environment is
left as it is; on a C library without ``mallopt`` (musl, macOS) this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

__all__ = ["keep_freed_memory"]

M_TRIM_THRESHOLD = -1  # glibc's malloc.h
M_MMAP_THRESHOLD = -3
TRIM_BYTES = 1 << 30
MMAP_BYTES = 32 << 20  # glibc's largest (HEAP_MAX_SIZE / 2 on 64 bits)
USER_SETTINGS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_")


def keep_freed_memory() -> bool:
    """Apply the settings above to this process (call once at start-up, before the work);
    whether they were applied."""
    if not sys.platform.startswith("linux") or any(k in os.environ for k in USER_SETTINGS):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return False
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(mallopt(M_TRIM_THRESHOLD, TRIM_BYTES)) and bool(
        mallopt(M_MMAP_THRESHOLD, MMAP_BYTES))
