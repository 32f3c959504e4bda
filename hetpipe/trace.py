"""A job's timeline as a Chrome trace (Perfetto, chrome://tracing).

Each stage reports its spans (:mod:`hetpipe.timeline`); here they become complete events
(``ph: "X"``) on one track per device, named by device, virtual worker and stage, with the
minibatch and wave in their arguments. The Gantt picture of a trace is :mod:`hetpipe.gantt`.

The last stage of a virtual worker runs forward, loss and backward of a minibatch as one
compute call, so its timeline holds one "forward" span for all three. The stage also counts
its forward and backward seconds apart; the trace cuts each such span in that proportion
into a forward and a backward event (``args.fused = true``), so the picture shows the last
stage's backward as a backward.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

__all__ = ["chrome_trace"]

_WHERE = re.compile(r"vw(\d+)/stage(\d+)")


def _last_stages(keys: list[str]) -> set[str]:
    """The ``vwV/stageS`` keys that are the last stage of their virtual worker."""
    last: dict[str, tuple[int, str]] = {}
    for key in keys:
        m = _WHERE.fullmatch(key)
        if m is not None and (m[1] not in last or int(m[2]) > last[m[1]][0]):
            last[m[1]] = (int(m[2]), key)
    return {key for _, key in last.values()}


def chrome_trace(stages: Mapping[str, Mapping[str, Any]], devices: Mapping[str, str],
                 job: str) -> dict[str, Any]:
    """Trace events of every stage; ``stages`` maps ``"vw0/stage1"`` to its final stats."""
    events: list[dict[str, Any]] = [{"name": "process_name", "ph": "M", "pid": 1,
                                     "args": {"name": f"hetpipe job {job}"}}]
    t0 = min((s[1] for st in stages.values() for s in st.get("spans", [])), default=0.0)
    last = _last_stages(list(stages))
    for tid, (where, st) in enumerate(sorted(stages.items()), start=1):
        events.append({"name": "thread_name", "ph": "M", "pid": 1, "tid": tid,
                       "args": {"name": f"{devices.get(where, '?')} ({where})"}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": 1, "tid": tid,
                       "args": {"sort_index": tid}})
        fwd, bwd = st.get("forward_s") or 0.0, st.get("backward_s") or 0.0
        split = fwd / (fwd + bwd) if where in last and fwd + bwd > 0 else None
        for kind, start, end, p, wave in st.get("spans", []):
            args = {"minibatch": p, "wave": wave, "stage": where}
            parts = [(kind, start, end, args)]
            if split is not None and kind == "forward":
                mid = start + (end - start) * split
                fused = {**args, "fused": True}
                parts = [("forward", start, mid, fused), ("backward", mid, end, fused)]
            for k, a, b, arg in parts:
                events.append({"name": k if p is None else f"{k} {p}", "cat": k, "ph": "X",
                               "pid": 1, "tid": tid, "ts": (a - t0) * 1e6,
                               "dur": max(b - a, 0.0) * 1e6, "args": arg})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"job": job, "t0_unix_s": t0}}
