"""A job directory of bounded size, however long the job runs (``[runtime] job_dir_max_bytes``).

What grows with a job's length in ``<run_dir>/jobs/<job>/`` is its per-minibatch part: each
stage's record stream (``records/vw<V>-stage<S>.jsonl``: one record and a few timeline spans a
minibatch), the ``stages.json`` and ``trace.json`` written from the streams at the end, and
``metrics.jsonl`` with its rotations. Checkpoints (the newest three), ``model.pt`` and the best
model do not grow with the job's length and are never compacted: they are what a resume and
the result need. The budget ``B`` is shared out so that the per-minibatch part stays under it:

- ``metrics.jsonl`` and its ``log_keep`` rotations: at most ``B / 8`` together
  (:func:`metrics_bytes`);
- the record streams: at most ``B / 8`` together, ``B / 8 / n`` each for ``n`` streams
  (:func:`stream_budget`), plus one chunk each (the newest is always kept whole). The
  ``stages.json`` and ``trace.json`` written from them at the end hold the same records and
  spans in a wordier form (the trace's events take about twice the spans' bytes), and the
  streams stay on disk while those are written: the three together at about four times the
  streams' share, half of ``B``;
- the rest is slack for the job's status files and the last chunks.

**Compaction.** A stream past its budget folds its oldest full chunks into *summary windows*
(:func:`summarise`), one per :data:`WINDOW` minibatches: the first and last minibatch and the
count, per record column the count of numbers, their sum, min, max and 50th/90th/99th
percentiles, per span kind the count and the seconds spent, and the time the window's spans
cover. The windows stay at the head of the stream (``{"summary": {...}}`` lines, written with
the remaining chunks in one atomic replace, so a head that dies mid-way leaves either the old
stream or the new one), followed by the newest full chunks, half the budget's worth or more
(one compaction folds at most :data:`FOLD_MAX` bytes: the head's event loop waits for it).
Past an eighth of the budget the windows themselves merge in pairs (:func:`merge`): counts,
sums, min and max stay exact, the percentiles become count-weighted means of the pair's (the
window says ``"exact": false``). So the newest minibatches keep their full records and spans,
every earlier one is counted in a window, and the readers (``stages.json``: ``records_summary``
and ``records_summarised``; the trace: a ``summary`` event per window; the job's result:
``records_summarised``) say which range is summarised.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "FOLD_MAX",
    "SUMMARY",
    "WINDOW",
    "bounded_bytes",
    "compact",
    "covered",
    "merge",
    "metrics_bytes",
    "named",
    "stream_budget",
    "summarise",
]

SUMMARY = "summary"  # the key of a summary window's line in a stream
_SUMMARY_LINE = b'{"summary"'
WINDOW = 1024  # minibatches a summary window covers when it is made (merges double it)
FOLD_MAX = 2 << 20  # the most bytes of chunks one compaction parses (the head's loop waits)
QUANTILES = (50, 90, 99)


def stream_budget(job_max_bytes: int, streams: int) -> int:
    """The size one of ``streams`` record streams is compacted to stay under."""
    return max(1, job_max_bytes // 8 // max(1, streams))


def metrics_bytes(job_max_bytes: int, metrics_max_bytes: int, keep: int) -> int:
    """The size ``metrics.jsonl`` rotates at: ``[runtime] metrics_max_bytes``, lowered so that
    it and its ``keep`` rotations take at most an eighth of the job's budget."""
    return max(1, min(metrics_max_bytes, job_max_bytes // 8 // (keep + 1)))


def bounded_bytes(d: Path) -> int:
    """The bytes of job directory ``d`` that ``job_dir_max_bytes`` bounds: every file but the
    checkpoints (``checkpoints/``) and the models (``*.pt``)."""
    total = 0
    for root, dirs, files in os.walk(d):
        if Path(root) == d and "checkpoints" in dirs:
            dirs.remove("checkpoints")
        for name in files:
            if not name.endswith(".pt"):
                try:
                    total += os.stat(os.path.join(root, name)).st_size
                except FileNotFoundError:  # replaced meanwhile
                    continue
    return total


# -- summary windows (pure) ------------------------------------------------------------------


def _number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def _quantile(ordered: Sequence[float], q: int) -> float:
    """The ``q``-th percentile of ``ordered`` (nearest rank)."""
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def summarise(
    rows: Sequence[Sequence[Any]], spans: Iterable[Sequence[Any]], every: int = 1
) -> dict[str, Any]:
    """One summary window of ``rows`` (records, the minibatch first) and ``spans`` (``[kind,
    t0, t1, p, wave]``); ``every``: the widest stride the chunks were thinned to
    (:mod:`hetpipe.rotation`), 1 where none was. Columns are by position (a record's
    ``record_fields`` name them: :func:`named`)."""
    width = max((len(r) for r in rows), default=0)
    columns: list[dict[str, Any] | None] = []
    for i in range(width):
        values = sorted(r[i] for r in rows if i < len(r) and _number(r[i]))
        if not values:
            columns.append(None)
            continue
        col = {"n": len(values), "sum": math.fsum(values), "min": values[0], "max": values[-1]}
        col.update({f"p{q}": _quantile(values, q) for q in QUANTILES})
        columns.append(col)
    kinds: dict[str, list[float]] = {}
    t0, t1 = math.inf, -math.inf
    for kind, start, end, *_ in spans:
        k = kinds.setdefault(kind, [0, 0.0])
        k[0] += 1
        k[1] += max(end - start, 0.0)
        t0, t1 = min(t0, start), max(t1, end)
    ps = [r[0] for r in rows if r and _number(r[0])]
    out: dict[str, Any] = {
        "from": min(ps, default=None),
        "to": max(ps, default=None),
        "count": len(rows),
        "columns": columns,
        "spans": {k: {"count": int(c), "seconds": s} for k, (c, s) in sorted(kinds.items())},
        "t0": t0 if kinds else None,
        "t1": t1 if kinds else None,
        "exact": True,
    }
    if every > 1:
        out["every"] = every
    return out


def _lo(a: Any, b: Any) -> Any:
    return b if a is None else a if b is None else min(a, b)


def _hi(a: Any, b: Any) -> Any:
    return b if a is None else a if b is None else max(a, b)


def _merge_column(a: dict[str, Any] | None, b: dict[str, Any] | None) -> dict[str, Any] | None:
    if a is None or b is None:
        return a if b is None else b
    n = a["n"] + b["n"]
    out = {"n": n, "sum": a["sum"] + b["sum"], "min": min(a["min"], b["min"])}
    out["max"] = max(a["max"], b["max"])
    for q in QUANTILES:  # not exact: the windows' values are gone
        out[f"p{q}"] = (a[f"p{q}"] * a["n"] + b[f"p{q}"] * b["n"]) / n
    return out


def merge(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, Any]:
    """One window for two consecutive ones: counts, sums, min and max exact, the percentiles
    count-weighted means of theirs (``"exact": false``)."""
    ca, cb = list(a["columns"]), list(b["columns"])
    width = max(len(ca), len(cb))
    ca += [None] * (width - len(ca))
    cb += [None] * (width - len(cb))
    spans: dict[str, dict[str, Any]] = {k: dict(v) for k, v in a["spans"].items()}
    for k, v in b["spans"].items():
        s = spans.setdefault(k, {"count": 0, "seconds": 0.0})
        s["count"] += v["count"]
        s["seconds"] += v["seconds"]
    out = {
        "from": _lo(a["from"], b["from"]),
        "to": _hi(a["to"], b["to"]),
        "count": a["count"] + b["count"],
        "columns": [_merge_column(x, y) for x, y in zip(ca, cb, strict=True)],
        "spans": dict(sorted(spans.items())),
        "t0": _lo(a["t0"], b["t0"]),
        "t1": _hi(a["t1"], b["t1"]),
        "exact": False,
    }
    every = max(a.get("every", 1), b.get("every", 1))
    if every > 1:
        out["every"] = every
    return out


def named(window: Mapping[str, Any], fields: Sequence[str] | None) -> dict[str, Any]:
    """``window`` with its columns as ``{field: figures}`` (the stage's ``record_fields``);
    unnamed (``"column<i>"``) where the fields do not match, columns without a number left
    out."""
    cols = window["columns"]
    names = list(fields) if fields is not None and len(fields) == len(cols) else None
    out = {k: v for k, v in window.items() if k != "columns"}
    out["columns"] = {
        (names[i] if names else f"column{i}"): c for i, c in enumerate(cols) if c is not None
    }
    return out


def covered(windows: Iterable[Mapping[str, Any]]) -> dict[str, Any] | None:
    """The range the summary windows cover: first and last minibatch, count, windows (None
    where there are none)."""
    out: dict[str, Any] | None = None
    for w in windows:
        if out is None:
            out = {"from": w["from"], "to": w["to"], "count": 0, "windows": 0}
        out["from"], out["to"] = _lo(out["from"], w["from"]), _hi(out["to"], w["to"])
        out["count"] += w["count"]
        out["windows"] += 1
    return out


# -- a stream's compaction -----------------------------------------------------------------


class _Windows:
    """Rows and spans of folded chunks, cut into windows of :data:`WINDOW` minibatches."""

    def __init__(self) -> None:
        self.rows: list[list[Any]] = []
        self.spans: list[list[Any]] = []
        self.every = 1
        self.out: list[dict[str, Any]] = []

    def add(self, chunk: Mapping[str, Any]) -> None:
        self.rows.extend(chunk.get("records", ()))
        self.spans.extend(chunk.get("spans", ()))
        self.every = max(self.every, int(chunk.get("every", 1)))
        if len(self.rows) >= WINDOW:
            self.cut()

    def cut(self) -> None:
        if self.rows or self.spans:
            self.out.append(summarise(self.rows, self.spans, self.every))
        self.rows, self.spans, self.every = [], [], 1


def _line(window: Mapping[str, Any]) -> bytes:
    return (json.dumps({SUMMARY: window}) + "\n").encode()


def _merged(windows: list[dict[str, Any]], most: int) -> list[dict[str, Any]]:
    """``windows`` merged in pairs, again and again, until their lines take at most ``most``
    bytes (or one is left)."""
    while len(windows) > 1 and sum(len(_line(w)) for w in windows) > most:
        windows = [
            merge(windows[i], windows[i + 1]) if i + 1 < len(windows) else windows[i]
            for i in range(0, len(windows), 2)
        ]
    return windows


def compact(path: Path, budget: int) -> bool:
    """Keep the stream ``path`` under ``budget`` bytes (plus its newest chunk): past it, fold
    its oldest chunks into summary windows until its chunks take about half the budget (at
    most :data:`FOLD_MAX` bytes of them at a time), the windows kept at its head and merged in
    pairs past an eighth of the budget. Returns whether it compacted."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return False
    if size <= budget:
        return False
    heads: list[dict[str, Any]] = []  # the windows already there
    sizes: list[int] = []  # each complete chunk line's bytes
    with path.open("rb") as src:
        for line in src:
            if not line.endswith(b"\n"):
                break  # a chunk still being written (never, from the head): dropped
            if line.startswith(_SUMMARY_LINE):
                heads.append(json.loads(line)[SUMMARY])
            else:
                sizes.append(len(line))
    chunk_bytes = sum(sizes)
    fold = 0  # chunk lines folded, oldest first; the newest is always kept
    folded_bytes = 0
    while (
        fold < len(sizes) - 1
        and chunk_bytes - folded_bytes > budget // 2
        and folded_bytes < FOLD_MAX
    ):
        folded_bytes += sizes[fold]
        fold += 1
    windows = _Windows()
    tmp = path.with_name(f".{path.name}.compacting")
    with path.open("rb") as src, tmp.open("wb") as dst:
        chunks = (line for line in src if not line.startswith(_SUMMARY_LINE))
        for _, line in zip(range(fold), chunks, strict=False):
            windows.add(json.loads(line))
        windows.cut()
        for w in _merged(heads + windows.out, budget // 8):
            dst.write(_line(w))
        for line in chunks:
            if line.endswith(b"\n"):
                dst.write(line)
    os.replace(tmp, path)
    return True


def summaries_of(lines: Iterable[bytes | str]) -> Iterator[dict[str, Any]]:
    """The summary windows among a stream's lines (they come first)."""
    for line in lines:
        text = line.decode() if isinstance(line, bytes) else line
        if not text.startswith('{"summary"'):
            return
        if text.endswith("\n"):
            yield json.loads(text)[SUMMARY]
