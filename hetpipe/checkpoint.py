"""Checkpoints of a job: the shards' cut and every stage's state, written atomically, proven
whole by a manifest.

Why a manifest: a daemon may die in the middle of a write, and a disk may hand back a
truncated or damaged file. A checkpoint is a folder ``<job dir>/checkpoints/<seq>`` whose
files are written and fsynced in a private temporary folder, then a ``MANIFEST.json`` naming
every file with its size and SHA-256 is written last, and the folder is renamed into place.
:func:`latest` returns the newest checkpoint whose manifest matches its files, so a damaged
one is skipped for the previous complete one. Tensor files are in the wire's encoding
(:mod:`hetpipe.tensorfile`): nothing is unpickled, and each file is read once, hashed and
decoded from the same bytes.

What one holds, all of one *cut* (wave c of each virtual worker, see :mod:`hetpipe.shard`):

- ``weights.tensors``: the global weights with exactly the pushes of waves < c of every stage;
- ``stage-v<vw>-s<stage>.tensors``: each stage's state right after its own push of wave c - 1
  (:meth:`hetpipe.stage.StageCompute.state`): local weights ``param/<name>``, buffers
  ``buffer/<name>`` and ``local/<name>``, optimizer state ``opt/<key>/<name>``, and the
  accumulators it still kept ``acc/<wave>/<name>`` (pushed, all inside the cut);
- ``meta.json``: the job, the plan it ran (each stage's device and layers), each virtual
  worker's data position (minibatches done), the shards' applied sets at the cut, and per
  stage its step counts and whether it had merged the cut's pull.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Collection
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hetpipe import tensorfile

__all__ = ["Checkpoint", "cut_after", "is_cut", "latest", "next_seq", "stage_file", "write"]

MANIFEST = "MANIFEST.json"
WEIGHTS = "weights.tensors"
META = "meta.json"
KEEP = 3  # complete checkpoints kept per job (older ones are removed)


@dataclass
class Checkpoint:
    """One complete checkpoint, read back and verified."""

    path: Path
    seq: int
    state: dict[str, torch.Tensor]
    meta: dict[str, Any]
    stages: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)  # by file name


def cut_after(c: int, every: int, last: int, extra: Collection[int] = ()) -> int | None:
    """The cut point after wave ``c``: the next multiple of ``every`` or, past the last
    multiple, the job's last wave ``last``, or the next of the cuts asked for on demand
    (``extra``, ``hetpipe checkpoint``); None after the last (or without cuts)."""
    asked = min((e for e in extra if c < e <= last), default=None)
    if every <= 0 or c >= last:
        return asked
    periodic = min(c + every - c % every, last)
    return periodic if asked is None else min(periodic, asked)


def is_cut(c: int, every: int, last: int, extra: Collection[int] = (), base: int = 0) -> bool:
    """Whether the end of wave ``c - 1`` is a cut of a virtual worker with ``last`` waves
    (periodic, its end, or asked for on demand in ``extra``).

    ``base`` is the shards' wave of the VW's own wave 0: past 0 for a VW re-formed after a
    lost worker (:mod:`hetpipe.head.reform`), whose waves the shards count from the global
    clock it joined at. The periodic cuts are every ``every`` waves of the shards' count, so
    that a cut means the same point of every VW's run; ``c``, ``last`` and ``extra`` are in
    the VW's own count."""
    if not 0 < c <= last:
        return False
    return (every > 0 and ((base + c) % every == 0 or c == last)) or c in extra


def stage_file(vw: int, stage: int) -> str:
    """The file of one stage's state in a checkpoint."""
    return f"stage-v{vw}-s{stage}.tensors"


def next_seq(job_dir: Path) -> int:
    """A sequence number after every checkpoint folder of the job (complete or not)."""
    seqs = [int(p.name) for p in _complete_dirs(job_dir / "checkpoints") if p.name.isdigit()]
    return max(seqs, default=0) + 1


def _entry(pieces: list[bytes | memoryview]) -> dict[str, Any]:
    """A file's manifest entry, from the pieces it is written from (nothing read back)."""
    h = hashlib.sha256()
    for piece in pieces:
        h.update(piece)
    return {"bytes": sum(memoryview(p).nbytes for p in pieces), "sha256": h.hexdigest()}


def _fsync(path: Path) -> None:
    """Make a file's data, or a folder's entries, durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write(
    job_dir: Path,
    seq: int,
    state: dict[str, torch.Tensor],
    meta: dict[str, Any],
    *,
    stages: dict[str, dict[str, torch.Tensor]] | None = None,
    keep: int = KEEP,
) -> Path:
    """Write checkpoint ``seq`` of a job atomically (the global weights ``state``, each
    stage's tensors by file name, ``meta``); keep the newest ``keep``; return its path."""
    root = job_dir / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{seq:06d}"
    tmp = Path(tempfile.mkdtemp(prefix=f".{seq:06d}-", dir=root))
    contents = {
        WEIGHTS: tensorfile.dumps({k: v.detach().cpu() for k, v in state.items()}),
        META: [json.dumps(meta).encode()],
    }
    contents.update({name: tensorfile.dumps(tensors) for name, tensors in (stages or {}).items()})
    try:
        files = {name: _entry(pieces) for name, pieces in contents.items()}
        contents[MANIFEST] = [json.dumps({"seq": seq, "files": files}).encode()]
        for name, pieces in contents.items():
            with open(tmp / name, "wb") as f:
                for piece in pieces:
                    f.write(piece)
        # The files and their folder are made durable at once, their fsyncs in parallel (the
        # file system commits them together), not one after another. No order among them is
        # needed: the manifest proves its files, so one that reached the disk before a file
        # it names is caught by latest() as incomplete.
        paths = [tmp / name for name in contents] + [tmp]
        with ThreadPoolExecutor(len(paths)) as pool:
            list(pool.map(_fsync, paths))
        if final.exists():  # a checkpoint of this seq from an attempt given up
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync(root)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for old in _complete_dirs(root)[keep:]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _complete_dirs(root: Path) -> list[Path]:
    """Checkpoint folders, newest first (temporary ones, named with a dot, are not)."""
    if not root.is_dir():
        return []
    return sorted(
        (p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")),
        key=lambda p: p.name,
        reverse=True,
    )


def verify(path: Path) -> Checkpoint:
    """Read one checkpoint folder; raise ValueError if any file is missing or damaged."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        files = manifest["files"]
        if WEIGHTS not in files and any(name.endswith(".pt") for name in files):
            raise ValueError(
                f"{path}: written by an older hetpipe (torch.save files); "
                "resume it with that version"
            )
        data = {}
        for name in {WEIGHTS, META, *files}:
            entry = files[name]
            f = path / name
            raw = None if "/" in name else bytearray(f.read_bytes())
            if (
                raw is None
                or len(raw) != entry["bytes"]
                or hashlib.sha256(raw).hexdigest() != entry["sha256"]
            ):
                raise ValueError(f"{f}: does not match the manifest (truncated or damaged)")
            data[name] = raw
        meta = json.loads(data.pop(META))
        tensors = {name: tensorfile.loads(raw, str(path / name)) for name, raw in data.items()}
        state = tensors.pop(WEIGHTS)
        return Checkpoint(path, int(manifest["seq"]), state, meta, tensors)
    except ValueError:
        raise
    except Exception as exc:  # missing file, bad JSON, bad keys: all "not a whole checkpoint"
        raise ValueError(
            f"{path}: not a complete checkpoint: {type(exc).__name__}: {exc}"
        ) from None


def latest(job_dir: Path, skipped: list[str] | None = None) -> Checkpoint | None:
    """The newest complete checkpoint of a job; damaged ones are skipped (and listed)."""
    for path in _complete_dirs(job_dir / "checkpoints"):
        try:
            return verify(path)
        except ValueError as exc:
            if skipped is not None:
                skipped.append(str(exc))
    return None
