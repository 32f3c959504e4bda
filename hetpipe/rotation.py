"""Files that must not grow without bound on a job that runs for weeks.

Two rules, one per kind of file:

- *Rotation* (daemon logs, a job's ``metrics.jsonl``): past a size the file becomes
  ``name.1`` (``.1`` becomes ``.2`` …, up to ``keep``) and a fresh one starts; what a person
  reads last is always whole, the oldest lines go first.
- *Thinning* (a stage's per-minibatch record stream, ``records/vw<V>-stage<S>.jsonl``): the
  stream feeds ``stages.json`` and the trace, whose value is the whole run's shape, so
  neither end may go. Past its budget the stream is halved (every second chunk dropped,
  :func:`halve_lines`) and from then on keeps every second chunk it is sent; past the budget
  again, halved again and every fourth, and so on. A run of any length stays under the
  budget with every part of it represented about evenly, and each chunk carries the stride it
  was sent at (``"every"``), so a reader knows what the newest stand for.

A third rule bounds a job's directory as a whole (``[runtime] job_dir_max_bytes``): the
streams are *compacted*, older chunks folded into summary windows, and ``metrics.jsonl``
rotates earlier (:mod:`hetpipe.jobdir`). Thinning, where ``records_max_bytes`` is the lower
bound, keeps the summary windows whole.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["RotatingJsonl", "Thinning", "append_line", "halve_lines", "shift"]

_SUMMARY_LINE = b'{"summary"'  # a compacted stream's summary window (hetpipe.jobdir)


def shift(path: Path, keep: int) -> None:
    """Move ``path`` to ``path.1`` (``.1`` to ``.2`` …, dropping what passes ``keep``); with
    ``keep = 0`` the file is removed instead."""
    if keep == 0:
        path.unlink(missing_ok=True)
        return
    for i in range(keep - 1, 0, -1):
        older = path.with_name(f"{path.name}.{i}")
        if older.exists():
            older.replace(path.with_name(f"{path.name}.{i + 1}"))
    if path.exists():
        path.replace(path.with_name(f"{path.name}.1"))


def append_line(path: Path, line: str, max_bytes: int, keep: int) -> None:
    """Append ``line`` (a newline is added) to ``path``, rotating it first when the line would
    take it past ``max_bytes`` (:func:`shift`)."""
    data = (line + "\n").encode()
    try:
        size = os.stat(path).st_size
    except FileNotFoundError:
        size = 0
    if size and size + len(data) > max_bytes:
        shift(path, keep)
    with open(path, "ab") as f:
        f.write(data)


def halve_lines(path: Path) -> None:
    """Rewrite ``path`` keeping its 1st, 3rd, 5th … complete line (a last line still being
    written, without its newline, is dropped); a compacted stream's summary windows
    (:mod:`hetpipe.jobdir`) are all kept and not counted. Line by line, nothing parsed: a
    stream of hundreds of MiB halves in about a second."""
    tmp = path.with_name(f".{path.name}.halving")
    with path.open("rb") as src, tmp.open("wb") as dst:
        i = 0
        for line in src:
            if line.startswith(_SUMMARY_LINE):
                dst.write(line)
                continue
            if i % 2 == 0 and line.endswith(b"\n"):
                dst.write(line)
            i += 1
    tmp.replace(path)


@dataclass(slots=True)
class Thinning:
    """One thinned stream's state: chunks offered so far and the stride it keeps them at."""

    budget: int
    offered: int = 0
    every: int = 1

    def keep(self) -> bool:
        """Whether the chunk offered now goes into the stream (counts it either way)."""
        n, self.offered = self.offered, self.offered + 1
        return n % self.every == 0

    def written(self, path: Path) -> None:
        """After a chunk went in: past the budget, halve the stream and double the stride."""
        if path.stat().st_size > self.budget:
            halve_lines(path)
            self.every *= 2


@dataclass(frozen=True, slots=True)
class RotatingJsonl:
    """A JSON-lines file that rotates past ``max_bytes``, keeping ``keep`` older ones."""

    path: Path
    max_bytes: int
    keep: int

    def append(self, obj: Any) -> None:
        """Append ``obj`` as one JSON line (the folder is made where missing)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        append_line(self.path, json.dumps(obj), self.max_bytes, self.keep)
