"""Small helpers the benchmark scripts share: arguments, timing, a table, one JSON line.

Every benchmark prints a human-readable table; with ``--json`` its last stdout line is one
JSON object holding every figure, so that a caller can ``tail -n 1`` the output.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from hetpipe.localcluster import free_ports

__all__ = [
    "HostCpu",
    "cpu_seconds",
    "emit_json",
    "free_port",
    "machine",
    "median",
    "parser",
    "print_table",
    "retain_freed_as_daemons",
    "timed",
]


def parser(doc: str | None) -> argparse.ArgumentParser:
    """An argument parser whose description is the script's first doc line, with ``--json``."""
    first = (doc or "").strip().splitlines()
    ap = argparse.ArgumentParser(description=first[0] if first else None)
    ap.add_argument("--json", action="store_true", help="end with one JSON line of figures")
    return ap


def cpu_seconds(pids: Sequence[int]) -> float:
    """User + system CPU seconds used so far by these processes (all their threads)."""
    import os
    from pathlib import Path

    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return total


class HostCpu:
    """The host's CPU utilisation between :meth:`start` and :meth:`stop` (``/proc/stat``):
    the busy fraction of all its cores, whoever used them.

    Emulated devices share the host's real cores: a benchmark whose figures are meant to
    describe the cluster modelled (not this host's contention) reports this next to them,
    and slows every emulated device by a global speed scale until it stays well below 1.
    """

    def __init__(self) -> None:
        self._t0 = self._read()

    @staticmethod
    def _read() -> tuple[float, float]:
        try:
            with open("/proc/stat") as f:
                fields = [float(v) for v in f.readline().split()[1:]]
        except OSError:
            return (0.0, 0.0)
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)  # idle + iowait
        return sum(fields), idle

    def start(self) -> HostCpu:
        self._t0 = self._read()
        return self

    def stop(self) -> float:
        """Busy fraction since :meth:`start` (0 where ``/proc/stat`` cannot be read)."""
        total0, idle0 = self._t0
        total1, idle1 = self._read()
        dt = total1 - total0
        return 1.0 - (idle1 - idle0) / dt if dt > 0 else 0.0


def median(values: Sequence[float]) -> float:
    """The median of measurements (robust to one run disturbed by another process)."""
    return float(statistics.median(values))


def timed(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> list[float]:
    """Wall-clock seconds of ``repeats`` calls of ``fn`` after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (bound to port 0, then released)."""
    return free_ports(1, host)[0]


def retain_freed_as_daemons() -> None:
    """Keep freed memory in this process as every daemon does by default (``[runtime]
    retain_freed_mib``, :mod:`hetpipe.hostmem`): a side measured beside the runtime's, or a
    probe of its stages, then runs with the same allocator."""
    from hetpipe import hostmem
    from hetpipe.config import RuntimeSpec

    hostmem.retain_freed(RuntimeSpec().retain_freed_mib)


def machine() -> dict[str, Any]:
    """What the figures were measured on."""
    import os

    import torch

    return {
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """Print rows under headers, columns right-aligned; floats with 3 significant decimals."""

    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.3f}" if abs(v) < 1000 else f"{v:.0f}"
        return str(v)

    cells = [[cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    print("  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True)))
    for r in cells:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)))
    sys.stdout.flush()


def emit_json(obj: dict[str, Any]) -> None:
    """Print ``obj`` as the one final JSON line."""
    sys.stdout.flush()
    print(json.dumps(obj, separators=(",", ":")), flush=True)
