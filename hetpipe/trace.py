"""A job's timeline as a Chrome trace (Perfetto, chrome://tracing).

Each stage reports its spans (:mod:`hetpipe.timeline`); here they become complete events
(``ph: "X"``) on one track per device, named by device, virtual worker and stage, with the
minibatch and wave in their arguments. The Gantt picture of a trace is :mod:`hetpipe.gantt`.

Every stage, the last one included, times its forward and its backward apart (a last stage
runs them in one hand-off to its compute thread, but records one span each), and the
synchronous schedules' optimizer step at the end of an iteration is a ``step`` span, so
microbatches, flushes and steps show as they ran.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

__all__ = ["chrome_trace"]

_WHERE = re.compile(r"vw(\d+)/stage(\d+)")


def chrome_trace(
    stages: Mapping[str, Mapping[str, Any]], devices: Mapping[str, str], job: str
) -> dict[str, Any]:
    """Trace events of every stage; ``stages`` maps ``"vw0/stage1"`` to its final stats."""
    events: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": 1, "args": {"name": f"hetpipe job {job}"}}
    ]
    t0 = min((s[1] for st in stages.values() for s in st.get("spans", [])), default=0.0)
    for tid, (where, st) in enumerate(sorted(stages.items()), start=1):
        events.append(
            {
                "name": "thread_name",
                "ph": "M",
                "pid": 1,
                "tid": tid,
                "args": {"name": f"{devices.get(where, '?')} ({where})"},
            }
        )
        events.append(
            {
                "name": "thread_sort_index",
                "ph": "M",
                "pid": 1,
                "tid": tid,
                "args": {"sort_index": tid},
            }
        )
        for kind, start, end, p, wave in st.get("spans", []):
            args = {"minibatch": p, "wave": wave, "stage": where}
            events.append(
                {
                    "name": kind if p is None else f"{kind} {p}",
                    "cat": kind,
                    "ph": "X",
                    "pid": 1,
                    "tid": tid,
                    "ts": (start - t0) * 1e6,
                    "dur": max(end - start, 0.0) * 1e6,
                    "args": args,
                }
            )
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"job": job, "t0_unix_s": t0},
    }
