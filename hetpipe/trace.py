"""A job's timeline as a Chrome trace (Perfetto, chrome://tracing) and as a Gantt chart.

Each stage reports its spans (:mod:`hetpipe.timeline`); here they become complete events
(``ph: "X"``) on one track per device, named by device, virtual worker and stage, with the
minibatch and wave in their arguments. The PNG needs matplotlib (the ``plot`` extra).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["chrome_trace", "gantt_png"]

COLORS = {"forward": "#4c78a8", "backward": "#f58518", "send": "#72b7b2", "push": "#54a24b",
          "merge": "#b279a2", "gate": "#e45756", "bubble": "#d8d8d8"}


def chrome_trace(stages: Mapping[str, Mapping[str, Any]], devices: Mapping[str, str],
                 job: str) -> dict[str, Any]:
    """Trace events of every stage; ``stages`` maps ``"vw0/stage1"`` to its final stats."""
    events: list[dict[str, Any]] = [{"name": "process_name", "ph": "M", "pid": 1,
                                     "args": {"name": f"hetpipe job {job}"}}]
    t0 = min((s[1] for st in stages.values() for s in st.get("spans", [])), default=0.0)
    for tid, (where, st) in enumerate(sorted(stages.items()), start=1):
        events.append({"name": "thread_name", "ph": "M", "pid": 1, "tid": tid,
                       "args": {"name": f"{devices.get(where, '?')} ({where})"}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": 1, "tid": tid,
                       "args": {"sort_index": tid}})
        for kind, start, end, p, wave in st.get("spans", []):
            name = kind if p is None else f"{kind} {p}"
            events.append({"name": name, "cat": kind, "ph": "X", "pid": 1, "tid": tid,
                           "ts": (start - t0) * 1e6, "dur": max(end - start, 0.0) * 1e6,
                           "args": {"minibatch": p, "wave": wave, "stage": where}})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"job": job, "t0_unix_s": t0}}


def gantt_png(trace: Mapping[str, Any], path: str | Path) -> None:
    """Draw the trace as a Gantt chart, one row per device (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise RuntimeError("the PNG needs matplotlib: pip install 'hetpipe[plot]'") from exc
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"]
             if e.get("name") == "thread_name"}
    rows = sorted(names)
    fig, ax = plt.subplots(figsize=(14, 1 + 0.6 * len(rows)))
    for e in trace["traceEvents"]:
        if e.get("ph") != "X":
            continue
        y = rows.index(e["tid"])
        ax.broken_barh([(e["ts"] / 1e6, e["dur"] / 1e6)], (y - 0.4, 0.8),
                       facecolors=COLORS.get(e["cat"], "#999999"))
    ax.set_yticks(range(len(rows)), [names[t] for t in rows])
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLORS.values()]
    ax.legend(handles, list(COLORS), ncol=len(COLORS), loc="upper center",
              bbox_to_anchor=(0.5, -0.25), frameon=False)
    ax.set_title(f"hetpipe job {trace.get('otherData', {}).get('job', '')}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
