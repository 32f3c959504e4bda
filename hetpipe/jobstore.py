"""A finished job's record on disk: ``<run_dir>/jobs/<job>/``.

The head keeps only the last few finished jobs in memory (``[runtime] jobs_kept``); the rest,
and every job of an earlier head process, live here: ``result.json`` (the job's final status),
``trace.json``, ``stages.json``, ``metrics.jsonl`` and ``model.pt``; while the job runs,
``records/vw<V>-stage<S>.jsonl`` gathers each stage's per-minibatch records and timeline
spans as they stream in (one JSON line a chunk; thinned to stay under a size,
:mod:`hetpipe.rotation`, and compacted into summary windows to keep the whole directory under
the job's size, :mod:`hetpipe.jobdir`), and ``stages.json`` and ``trace.json`` are written
from them at its end, one chunk at a time. A job that ends otherwise (failed,
cancelled, interrupted) keeps ``records/`` beside the ``stages.json`` and ``trace.json``
written from what had streamed. The head and the CLI both
read this directory, so ``status``/``trace`` of a finished job work with the head forgotten,
restarted or down. Job ids are checked before they become paths: an id is a name plus
``-<n>``, never a path.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, TextIO

from hetpipe.jobdir import covered, named, summaries_of

__all__ = [
    "METRICS",
    "RECORDS",
    "RESULT",
    "STAGES",
    "TRACE",
    "append_records",
    "job_dir",
    "links",
    "list_jobs",
    "next_number",
    "read_chunks",
    "read_result",
    "read_summaries",
    "records_path",
    "recovered_line",
    "safe_name",
    "update_result",
    "waiting_text",
    "write_result",
    "write_stages",
]

RESULT = "result.json"
TRACE = "trace.json"
STAGES = "stages.json"
METRICS = "metrics.jsonl"  # rotated: hetpipe.rotation
RECORDS = "records"  # the folder of the per-stage streams

_JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,199}")
_NUMBER = re.compile(r"-(\d+)$")


def safe_name(name: object) -> bool:
    """Whether ``name`` may become a path component: letters, digits, ``_ . -``, no ``..``.

    The one rule for job names (checked at submit, :mod:`hetpipe.security`) and job ids
    (checked before any path is made of one, here).
    """
    return isinstance(name, str) and _JOB_ID.fullmatch(name) is not None and ".." not in name


def job_dir(run_dir: Path, job: str) -> Path | None:
    """The directory of job ``job``, or None when ``job`` cannot be a job id."""
    if not safe_name(job):
        return None
    return run_dir / "jobs" / job


def next_number(run_dir: Path) -> int:
    """The first job number after every job already on disk.

    A restarted head must not hand out ``demo-1`` again: its directory (and the outputs of
    the first run) would be overwritten by the second.
    """
    highest = 0
    jobs = run_dir / "jobs"
    if jobs.is_dir():
        for entry in jobs.iterdir():
            m = _NUMBER.search(entry.name)
            if m is not None:
                highest = max(highest, int(m[1]))
    return highest + 1


def write_result(run_dir: Path, job: str, info: dict[str, Any]) -> None:
    """Write a finished job's final status atomically (a reader never sees half a file)."""
    d = job_dir(run_dir, job)
    if d is None:
        return
    d.mkdir(parents=True, exist_ok=True)
    tmp = d / f".{RESULT}.tmp"
    tmp.write_text(json.dumps(info, default=str))
    os.replace(tmp, d / RESULT)


def update_result(run_dir: Path, job: str, base: Mapping[str, Any], **fields: Any) -> None:
    """Set ``fields`` in a job's final status on disk (atomically); where it has none yet,
    write ``base`` with them (a job whose head died before it wrote one)."""
    info = read_result(run_dir, job)
    write_result(run_dir, job, {**(info if info is not None else base), **fields})


def read_result(run_dir: Path, job: str) -> dict[str, Any] | None:
    """A finished job's final status from disk, or None when there is none (or it is bad)."""
    d = job_dir(run_dir, job)
    if d is None:
        return None
    try:
        info = json.loads((d / RESULT).read_text())
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def list_jobs(run_dir: Path) -> list[dict[str, Any]]:
    """The final status of every finished job on disk, oldest first (by job number)."""
    jobs = run_dir / "jobs"
    if not jobs.is_dir():
        return []
    out = []
    for entry in jobs.iterdir():
        info = read_result(run_dir, entry.name)
        if info is not None and isinstance(info.get("id"), str):
            out.append(info)

    def number(info: dict[str, Any]) -> int:
        m = _NUMBER.search(info["id"])
        return int(m[1]) if m else 0

    return sorted(out, key=number)


# the fields of a job that a listing shows (a finished job's whole view is kilobytes): the
# head's job list and ``hetpipe jobs`` on a result read from disk show the same ones
SUMMARY_FIELDS = (
    "id",
    "name",
    "owner",
    "state",
    "error",
    "seconds",
    "total",
    "minibatches",
    "loss",
    "samples_per_s",
    "test_accuracy",
    "resumed_from",  # the job this one continues (hetpipe.head.recovery)
    "resumed_as",  # the job that continues this one
    "waiting",  # what a paused job waits for (hetpipe.head.shardwait)
)


def summary(info: dict[str, Any]) -> dict[str, Any]:
    """The fields of a job's status or result that a listing shows (those that are set)."""
    return {k: info[k] for k in SUMMARY_FIELDS if info.get(k) is not None}


def waiting_text(waiting: Mapping[str, Any], now: float | None = None) -> str:
    """One line for a person: what a paused job waits for (its status's ``waiting``), since
    when, and how long it still waits before it fails."""
    now = time.time() if now is None else now
    shards = ", ".join(
        f"shard {i} ({a})" if a else f"shard {i}" for i, a in waiting.get("shards", {}).items()
    )
    since = time.strftime("%H:%M:%S", time.localtime(waiting["since"]))
    left = max(0.0, waiting["until"] - now)
    return (
        f"waiting for {shards} to register again since {since} "
        f"({now - waiting['since']:.0f} s; fails in {left:.0f} s)"
    )


def links(info: Mapping[str, Any], now: float | None = None) -> list[str]:
    """What a job's status says of its lineage and pauses, for a person: the job it resumed
    (and from which wave), the job that resumed it, what it waits for, and which minibatches'
    records are summary windows (:mod:`hetpipe.jobdir`)."""
    out = []
    came = info.get("resumed_from")
    if isinstance(came, Mapping) and came.get("job"):
        wave = came.get("wave")
        out.append(
            f"resumed from {came['job']}"
            + (f" at wave {wave}" if wave is not None else " (its last checkpoint)")
        )
    if info.get("resumed_as"):
        out.append(f"resumed as {info['resumed_as']}")
    if isinstance(info.get("waiting"), Mapping):
        out.append(waiting_text(info["waiting"], now))
    summarised = info.get("records_summarised")
    if isinstance(summarised, Mapping) and summarised:  # hetpipe.jobdir
        ranges = ", ".join(f"{w} {s.get('from')}-{s.get('to')}" for w, s in summarised.items())
        out.append(f"records summarised (job_dir_max_bytes): {ranges}")
    return out


def recovered_line(entry: Mapping[str, Any]) -> str:
    """What a restarted head did with a job its predecessor was running or had queued (one
    line): ``resumed job OLD as NEW from wave N``, ``queued job J again``, or why it could
    not."""
    if entry.get("queued"):
        return f"queued job {entry['job']} again (it had not started)"
    if entry.get("as"):
        wave = entry.get("wave")
        return f"resumed job {entry['job']} as {entry['as']} from " + (
            f"wave {wave}" if wave is not None else "its last checkpoint"
        )
    return f"job {entry['job']} not resumed: {entry.get('error')}"


# -- a stage's streamed records --------------------------------------------------------------


def records_path(d: Path, vw: int, stage: int) -> Path:
    """The stream of stage ``stage`` of virtual worker ``vw`` in job directory ``d``."""
    return d / RECORDS / f"vw{vw}-stage{stage}.jsonl"


def append_records(
    d: Path,
    vw: int,
    stage: int,
    records: list[list[Any]],
    spans: list[list[Any]],
    every: int = 1,
) -> None:
    """Append one chunk (records as rows, spans) to the stage's stream in ``d``; ``every``:
    the chunk stands for that many (a thinned stream, :mod:`hetpipe.rotation`)."""
    path = records_path(d, vw, stage)
    path.parent.mkdir(parents=True, exist_ok=True)
    chunk: dict[str, Any] = {"records": records, "spans": spans}
    if every > 1:
        chunk["every"] = every
    with path.open("a") as f:
        f.write(json.dumps(chunk) + "\n")


def read_chunks(path: Path) -> Iterator[dict[str, Any]]:
    """The chunks of one stage's stream in the order they arrived (none if it is absent).

    A last line without its newline is a chunk still being appended (or cut off by a head
    that died mid-write): it is left out, so a stream can be read while it grows. A compacted
    stream's summary windows are not chunks (:func:`read_summaries`).
    """
    if not path.exists():
        return
    with path.open() as f:
        for line in f:
            if line.strip() and line.endswith("\n") and not line.startswith('{"summary"'):
                yield json.loads(line)


def read_summaries(path: Path) -> list[dict[str, Any]]:
    """The summary windows of a compacted stream, oldest first (:mod:`hetpipe.jobdir`); none
    where it was never compacted or is absent."""
    if not path.exists():
        return []
    with path.open() as f:
        return list(summaries_of(f))


def _items(f: TextIO, rows: Iterable[Any]) -> None:
    """Write ``rows`` as the items of a JSON list (the brackets are the caller's)."""
    for i, row in enumerate(rows):
        f.write(("," if i else "") + json.dumps(row))


def write_stages(
    d: Path, stages: Mapping[str, tuple[dict[str, Any], Path]]
) -> dict[str, dict[str, Any]]:
    """Write ``stages.json`` in ``d``: each stage (``"vw0/stage1"`` -> its report without
    records and spans, its stream) as ``{**report, "records": [...]}`` with its spans in
    ``report["stats"]["spans"]``, one chunk in memory at a time; a stream thinned to stay under
    its budget adds ``"records_every"``, the widest stride its chunks were kept at; a
    compacted one (:mod:`hetpipe.jobdir`) adds ``"records_summary"`` (its summary windows, the
    columns named by ``record_fields``) and ``"records_summarised"`` (the range they cover).
    Returns each compacted stage's ``records_summarised``."""
    summarised: dict[str, dict[str, Any]] = {}
    tmp = d / f".{STAGES}.tmp"
    with tmp.open("w") as f:
        f.write("{")
        for n, (where, (report, stream)) in enumerate(stages.items()):
            stats = {k: v for k, v in report["stats"].items() if k != "spans"}
            rest = {k: v for k, v in report.items() if k not in ("stats", "records")}
            f.write(("," if n else "") + json.dumps(where) + ':{"stats":')
            f.write(json.dumps(stats)[:-1] + ("," if stats else "") + '"spans":[')
            _items(f, (s for c in read_chunks(stream) for s in c["spans"]))
            f.write(']},"records":[')
            every = [1]  # the widest stride the stream was thinned to (1: every chunk)

            def rows(stream: Path = stream, every: list[int] = every) -> Iterator[list[Any]]:
                for c in read_chunks(stream):
                    every[0] = max(every[0], int(c.get("every", 1)))
                    yield from c["records"]

            _items(f, rows())
            f.write("]")
            if every[0] > 1:
                f.write(',"records_every":' + json.dumps(every[0]))
            windows = read_summaries(stream)
            if windows:
                fields = report["stats"].get("record_fields")
                f.write(',"records_summary":[')
                _items(f, (named(w, fields) for w in windows))
                summarised[where] = covered(windows) or {}
                f.write('],"records_summarised":' + json.dumps(summarised[where]))
            for k, v in rest.items():
                f.write("," + json.dumps(k) + ":" + json.dumps(v))
            f.write("}")
        f.write("}")
    os.replace(tmp, d / STAGES)
    return summarised
