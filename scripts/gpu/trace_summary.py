"""Summarise the worker traces ``sitecustomize.py`` wrote: how busy the GPU was.

Per process: its kernels, the share of the window they kept the GPU busy, the median
kernel, and the CUDA runtime calls that took the most time (launches, synchronisations,
copies). Across processes: the union of all kernels over the window. Several stages on one
GPU that time-slice it show a union near the sum of their shares; stages starved by their
host threads show a low union.

    python scripts/gpu/trace_summary.py DIR
"""

from __future__ import annotations

import glob
import json
import sys
from collections import Counter


def busy_union(spans: list[tuple[float, float]]) -> float:
    """Time covered by at least one of ``spans``."""
    total, start, end = 0.0, None, None
    for a, b in sorted(spans):
        if end is None or a > end:
            if end is not None:
                total += end - start
            start, end = a, b
        else:
            end = max(end, b)
    return total + (end - start if end is not None else 0.0)


def main(folder: str) -> None:
    every: list[tuple[float, float]] = []
    for path in sorted(glob.glob(f"{folder}/trace-*.json")):
        with open(path) as f:
            events = json.load(f)["traceEvents"]
        kernels = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "kernel"]
        name = path.rsplit("/", 1)[1]
        if not kernels:
            print(f"{name}: no kernels")
            continue
        runtime: Counter[str] = Counter()
        for e in events:
            if e.get("cat") == "cuda_runtime":
                runtime[e["name"]] += e.get("dur", 0)
        t0, t1 = min(a for a, _ in kernels), max(b for _, b in kernels)
        durations = sorted(b - a for a, b in kernels)
        top = [(k, round(v / 1e3, 1)) for k, v in runtime.most_common(5)]
        print(
            f"{name}: {len(kernels)} kernels over {(t1 - t0) / 1e3:.0f} ms, "
            f"busy {busy_union(kernels) / (t1 - t0):.2f}, "
            f"median kernel {durations[len(durations) // 2]:.1f} us, runtime ms {top}"
        )
        every += kernels
    if every:
        t0, t1 = min(a for a, _ in every), max(b for _, b in every)
        print(
            f"all processes: GPU busy (union of kernels) {busy_union(every) / (t1 - t0):.2f} "
            f"of {(t1 - t0) / 1e3:.0f} ms"
        )


if __name__ == "__main__":
    main(sys.argv[1])
