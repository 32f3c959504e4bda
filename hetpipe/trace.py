"""A job's timeline as a Chrome trace (Perfetto, chrome://tracing).

Each stage reports its spans (:mod:`hetpipe.timeline`); here they become complete events
(``ph: "X"``) on one track per device, named by device, virtual worker and stage, with the
minibatch and wave in their arguments. The Gantt picture of a trace is :mod:`hetpipe.gantt`.

Every stage, the last one included, times its forward and its backward apart (a last stage
runs them in one hand-off to its compute thread, but records one span each), and the
synchronous schedules' optimizer step at the end of an iteration is a ``step`` span, so
microbatches, flushes and steps show as they ran.

A stage whose stream was compacted (:mod:`hetpipe.jobdir`) has no spans for its older
minibatches: each of its summary windows is one ``summary`` event over the time its spans
covered, named by the minibatches it counts, with the count and seconds per kind in its
arguments, so the trace says which range is summarised.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["chrome_trace", "write_chrome_trace"]

_WHERE = re.compile(r"vw(\d+)/stage(\d+)")


def chrome_trace(
    stages: Mapping[str, Mapping[str, Any]], devices: Mapping[str, str], job: str
) -> dict[str, Any]:
    """Trace events of every stage; ``stages`` maps ``"vw0/stage1"`` to its final stats."""
    spans = {where: (lambda st=st: st.get("spans", [])) for where, st in stages.items()}
    t0 = _start(spans)
    return {
        "traceEvents": list(_events(spans, devices, job, t0)),
        "displayTimeUnit": "ms",
        "otherData": {"job": job, "t0_unix_s": t0},
    }


def write_chrome_trace(
    path: Path,
    spans: Mapping[str, Callable[[], Iterable[list[Any]]]],
    devices: Mapping[str, str],
    job: str,
    marks: Iterable[Mapping[str, Any]] = (),
    summaries: Mapping[str, Sequence[Mapping[str, Any]]] | None = None,
) -> None:
    """Write :func:`chrome_trace`'s document to ``path`` from each stage's spans as
    ``spans[where]()`` yields them (read twice: the start, then the events), one event in
    memory at a time; ``marks``: the job's re-plan decisions (:mod:`hetpipe.head.drift`),
    each an instant event at its time ``at``; ``summaries``: each compacted stage's summary
    windows (:mod:`hetpipe.jobdir`), a ``summary`` event each."""
    summaries = summaries or {}
    starts = [w["t0"] for ws in summaries.values() for w in ws if w.get("t0") is not None]
    t0 = _start(spans)
    if starts:  # the windows are older than any span left (0.0: no span left)
        t0 = min(starts) if t0 == 0.0 else min(*starts, t0)
    tids = {where: tid for tid, where in enumerate(sorted(spans), start=1)}
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w") as f:
        f.write('{"traceEvents":[')
        for i, event in enumerate(_events(spans, devices, job, t0)):
            f.write(("," if i else "") + json.dumps(event))
        for where, windows in sorted(summaries.items()):
            for w in windows:
                if w.get("t0") is None or where not in tids:
                    continue
                f.write("," + json.dumps(_summary_event(w, where, tids[where], t0)))
        for m in marks:  # a global instant event: it concerns a whole virtual worker
            event = {"name": f"replan vw{m['vw']}", "cat": "replan", "ph": "i", "s": "g"}
            event.update(pid=1, tid=0, ts=(m["at"] - t0) * 1e6, args=dict(m))
            f.write("," + json.dumps(event))
        f.write('],"displayTimeUnit":"ms","otherData":')
        f.write(json.dumps({"job": job, "t0_unix_s": t0}) + "}")
    os.replace(tmp, path)


def _summary_event(w: Mapping[str, Any], where: str, tid: int, t0: float) -> dict[str, Any]:
    """A summary window as one event over the time its spans covered."""
    return {
        "name": f"summarised {w['from']}-{w['to']}",
        "cat": "summary",
        "ph": "X",
        "pid": 1,
        "tid": tid,
        "ts": (w["t0"] - t0) * 1e6,
        "dur": max(w["t1"] - w["t0"], 0.0) * 1e6,
        "args": {
            "stage": where,
            "from": w["from"],
            "to": w["to"],
            "count": w["count"],
            "spans": w["spans"],
            "exact": w.get("exact", True),
        },
    }


def _start(spans: Mapping[str, Callable[[], Iterable[list[Any]]]]) -> float:
    """The earliest start of any span (0 where there is none)."""
    return min((s[1] for of in spans.values() for s in of()), default=0.0)


def _events(
    spans: Mapping[str, Callable[[], Iterable[list[Any]]]],
    devices: Mapping[str, str],
    job: str,
    t0: float,
) -> Iterator[dict[str, Any]]:
    yield {"name": "process_name", "ph": "M", "pid": 1, "args": {"name": f"hetpipe job {job}"}}
    for tid, (where, of) in enumerate(sorted(spans.items()), start=1):
        yield {
            "name": "thread_name",
            "ph": "M",
            "pid": 1,
            "tid": tid,
            "args": {"name": f"{devices.get(where, '?')} ({where})"},
        }
        yield {
            "name": "thread_sort_index",
            "ph": "M",
            "pid": 1,
            "tid": tid,
            "args": {"sort_index": tid},
        }
        for kind, start, end, p, wave in of():
            args = {"minibatch": p, "wave": wave, "stage": where}
            yield {
                "name": kind if p is None else f"{kind} {p}",
                "cat": kind,
                "ph": "X",
                "pid": 1,
                "tid": tid,
                "ts": (start - t0) * 1e6,
                "dur": max(end - start, 0.0) * 1e6,
                "args": args,
            }
