"""Portable schedules: per-stage synchronous orders in ``torch.distributed.pipelining``'s CSV.

torch writes a schedule (``_dump_csv``) as one CSV row per pipeline rank, each cell one action
``<stage><type>[<microbatch>]``: ``0F3`` (stage 0, forward of microbatch 3), ``1B0`` (full
backward), ``1I0`` / ``1W0`` (input- and weight-gradient halves of a backward), ``0REDUCE_GRAD``,
``0SEND_F1`` / ``1RECV_F1`` / ``SEND_B`` / ``RECV_B`` (communication), ``UNSHARD`` /
``RESHARD`` (FSDP), ``(0F1;0B0)OVERLAP_F_B`` (actions run overlapped), and an empty cell for
a deliberate idle step. This module reads and writes that format for hetpipe's per-stage
orders (:func:`hetpipe.core.schedule.microbatch_order`: tuples of ``("F", p)``, ``("B", p)``,
and the split backward's ``("I", p)`` / ``("W", p)``), so a schedule made by torch runs here
and one of ours runs there.

Read, a row's compute actions become that stage's order; idle cells, communication and
gradient reduction are dropped (hetpipe's runtime sends, receives and reduces where its own
rules say: each is implied by the compute actions around it), as are FSDP's shard actions
(hetpipe does not shard a stage's parameters). What hetpipe cannot run is refused in one line
naming the row and column: an action of another stage than its row's (several chunks per
rank, as in interleaved and V-shaped schedules: a hetpipe worker serves one stage), a compute
action without a microbatch, an unknown action.

:func:`check_schedule` is a dry run: it runs the stages' orders against one another under the
pipeline's data dependencies (no timing) and names the first action that can never run, with
the chain of waits that blocks it, and each microbatch a stage misses or runs twice. Every
stage's order is checked before a job runs it.

Device-level schedules (:mod:`hetpipe.core.devschedule`: a device runs several stages, its
chunks) are written one row per device, torch's rank: the device's order, each action naming
its stage as torch numbers them (the pipeline's stage index, interleaved's round robin and
zbv's V alike), what torch's ``_dump_csv`` writes for its ``ScheduleInterleaved1F1B`` and
``ScheduleZBVZeroBubble`` less its idle cells (:func:`dumps_devices`). Reading them is
refused as above (a hetpipe job runs a device-level kind from its ``[[vw]]`` split, not from
an order file).

Pure: no torch, asyncio or sockets (the ``csv`` module of the standard library only).
"""

from __future__ import annotations

import csv
import io
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hetpipe.core.schedule import ScheduleError, check_order, max_in_flight

__all__ = [
    "DryRun",
    "Order",
    "ScheduleCsvError",
    "check_schedule",
    "device_rows",
    "dumps",
    "dumps_devices",
    "held",
    "job_order_problem",
    "load",
    "loads",
    "microbatches",
    "order_value",
    "parse_rows",
    "rows",
]

Order = tuple[tuple[str, int], ...]  # one stage's actions of one iteration, in order

# torch's action letters for compute (a full backward is "B") and the actions read and
# dropped: communication and reduction are implied by the compute around them, FSDP's shard
# actions mean nothing to an unsharded stage
COMPUTE = ("F", "B", "I", "W")
DROPPED = ("REDUCE_GRAD", "SEND_F", "RECV_F", "SEND_B", "RECV_B", "UNSHARD", "RESHARD")
_ACTION = re.compile(r"(\d+)(F|B|I|W|REDUCE_GRAD|SEND_F|RECV_F|SEND_B|RECV_B|UNSHARD|RESHARD)(\d*)")
_OVERLAP = re.compile(r"\((.*)\)OVERLAP_F_B")
_NAMES = {"F": "forward", "B": "backward", "I": "input-gradient backward", "W": "weight gradient"}


class ScheduleCsvError(ValueError):
    """A schedule file hetpipe cannot read or run; ``str(e)`` is one line naming the file,
    row and column (both from 1) where it can."""


# -- reading and writing -------------------------------------------------------------------------


def parse_rows(rows: Sequence[Sequence[str]], source: str = "<csv>") -> tuple[Order, ...]:
    """Each row (one rank's cells, torch's action strings) as that stage's order."""
    rows = list(rows)
    while rows and not any(c.strip() for c in rows[-1]):  # a trailing blank line is no rank
        rows.pop()
    if not rows:
        raise ScheduleCsvError(f"{source}: no rows (one row per pipeline stage expected)")
    orders = []
    for r, row in enumerate(rows):
        if isinstance(row, str) or not all(isinstance(c, str) for c in row):
            raise ScheduleCsvError(f"{source}: row {r + 1}: expected a list of action strings")
        order: list[tuple[str, int]] = []
        for c, cell in enumerate(row):
            order += _cell(cell.strip(), r, f"{source}: row {r + 1}, column {c + 1}")
        orders.append(tuple(order))
    return tuple(orders)


def _cell(text: str, stage: int, where: str) -> list[tuple[str, int]]:
    """The compute actions of one cell (none for an idle step or a dropped action)."""
    if not text:
        return []
    if overlap := _OVERLAP.fullmatch(text):  # run together; in sequence they keep their order
        return [a for part in overlap[1].split(";") for a in _cell(part.strip(), stage, where)]
    m = _ACTION.fullmatch(text)
    if m is None:
        raise ScheduleCsvError(
            f"{where}: {text!r} is not an action (<stage><type><microbatch>, e.g. 0F3; "
            f"types {', '.join(COMPUTE + DROPPED)})"
        )
    s, kind, p = int(m[1]), m[2], m[3]
    if s != stage:
        raise ScheduleCsvError(
            f"{where}: {text!r} runs stage {s} on the rank of stage {stage}: hetpipe runs one "
            "stage per rank (no interleaved or V-shaped chunks), stage index = row - 1"
        )
    if kind in DROPPED:
        return []
    if not p:
        raise ScheduleCsvError(f"{where}: {text!r}: a {_NAMES[kind]} needs its microbatch")
    return [(kind, int(p))]


def loads(text: str, source: str = "<csv>") -> tuple[Order, ...]:
    """The stages' orders of a CSV text in torch's format (one row per stage)."""
    try:
        table = list(csv.reader(io.StringIO(text), strict=True))
    except csv.Error as exc:
        raise ScheduleCsvError(f"{source}: not CSV ({exc})") from None
    return parse_rows(table, source)


def load(path: str | os.PathLike[str]) -> tuple[Order, ...]:
    """The stages' orders of a CSV file in torch's format."""
    source = os.fspath(path)
    try:
        text = Path(source).read_text(encoding="utf-8")
    except OSError as exc:
        raise ScheduleCsvError(f"{source}: cannot read ({exc.strerror or exc})") from None
    except UnicodeDecodeError as exc:
        raise ScheduleCsvError(f"{source}: not UTF-8 text (byte {exc.start})") from None
    return loads(text, source)


def rows(orders: Sequence[Sequence[tuple[str, int]]]) -> list[list[str]]:
    """Each stage's order as torch's action strings (``0F0``, ``1B2``, ...)."""
    out = []
    for s, order in enumerate(orders):
        for op, _ in order:
            if op not in COMPUTE:
                raise ScheduleError(f"stage {s}: {op!r} is not an action ({', '.join(COMPUTE)})")
        out.append([f"{s}{op}{p}" for op, p in order])
    return out


def dumps(orders: Sequence[Sequence[tuple[str, int]]]) -> str:
    """The orders as CSV in torch's compute-only format (what ``_dump_csv`` writes and
    ``_load_csv`` reads; torch adds its own communication and reduction on loading)."""
    buf = io.StringIO()
    csv.writer(buf).writerows(rows(orders))
    return buf.getvalue()


def device_rows(orders: Sequence[Sequence[tuple[int, str, int]]]) -> list[list[str]]:
    """Each device's order (``(stage, op, microbatch)`` entries,
    :func:`hetpipe.core.devschedule.device_order`) as torch's action strings, one row per
    device (torch's rank), each naming its entry's stage."""
    out = []
    for d, order in enumerate(orders):
        for s, op, _ in order:
            if op not in COMPUTE:
                raise ScheduleError(
                    f"device {d}, stage {s}: {op!r} is not an action ({', '.join(COMPUTE)})"
                )
        out.append([f"{s}{op}{p}" for s, op, p in order])
    return out


def dumps_devices(orders: Sequence[Sequence[tuple[int, str, int]]]) -> str:
    """Device orders as CSV in torch's compute-only format, one row per device
    (:func:`device_rows`)."""
    buf = io.StringIO()
    csv.writer(buf).writerows(device_rows(orders))
    return buf.getvalue()


# -- the dry run ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class DryRun:
    """What :func:`check_schedule` found. ``deadlock``: the first action that can never run
    and the chain of waits that blocks it, one line (None: every action runs). ``problems``:
    each microbatch a stage misses or runs twice, one line each."""

    deadlock: str | None
    problems: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return self.deadlock is None and not self.problems

    @property
    def reason(self) -> str | None:
        """One line: the deadlock, else the first problem (and how many more); None: fine."""
        if self.deadlock is not None:
            return self.deadlock
        if not self.problems:
            return None
        more = len(self.problems) - 1
        return self.problems[0] + (f" (and {more} more)" if more else "")


def _name(op: str, p: int) -> str:
    return f"{op}{p}"


def microbatches(orders: Sequence[Sequence[tuple[str, int]]]) -> int:
    """The microbatches of the iteration the orders run: one more than the largest named."""
    return 1 + max((p for order in orders for _, p in order), default=-1)


def _needs(k: int, s: int, op: str, p: int) -> list[tuple[int, str, int]]:
    """What ``op`` of ``p`` at stage ``s`` waits for: ``(stage, letter, p)``, where a
    backward at a later stage is met by its full backward or its input-gradient half
    (letter ``"B|I"``)."""
    if op == "F":
        return [(s - 1, "F", p)] if s > 0 else []
    if op == "W":
        return [(s, "I", p)]
    return [(s, "F", p)] + ([(s + 1, "B|I", p)] if s + 1 < k else [])


def check_schedule(orders: Sequence[Sequence[tuple[str, int]]], m: int | None = None) -> DryRun:
    """Run the stages' orders against one another and report what can never run.

    The dependencies are the pipeline's data: the forward of p at stage s needs the forward
    of p at s - 1; a backward of p (``B``, or its input-gradient half ``I``) at s needs the
    forward of p at s and the backward of p at s + 1 (the last stage: its own forward only,
    the loss is there); the weight gradient ``W`` of p needs the ``I`` of p at the same stage.
    Every stage runs its order in sequence, each action as soon as what it needs has run
    (no timing: an action that can run at some time runs here).

    ``m``: the microbatches of the iteration (default: as many as the orders name). Each
    stage must run the forward of every microbatch once and its backward once: ``B``, or
    ``I`` and ``W``.
    """
    k = len(orders)
    m = microbatches(orders) if m is None else m
    problems = [line for s, order in enumerate(orders) for line in _coverage(s, order, m)]
    done: list[dict[tuple[str, int], int]] = [{} for _ in range(k)]
    pos = [0] * k

    def ran(stage: int, letters: str, p: int) -> bool:
        return any(done[stage].get((op, p), 0) for op in letters.split("|"))

    def unmet(s: int) -> tuple[int, str, int] | None:
        op, p = orders[s][pos[s]]
        return next((n for n in _needs(k, s, op, p) if not ran(*n)), None)

    moved = True
    while moved:
        moved = False
        for s in range(k):
            while pos[s] < len(orders[s]) and unmet(s) is None:
                done[s][orders[s][pos[s]]] = done[s].get(orders[s][pos[s]], 0) + 1
                pos[s] += 1
                moved = True
    stuck = [s for s in range(k) if pos[s] < len(orders[s])]
    deadlock = None
    if stuck:
        deadlock = _chain(orders, pos, stuck[0], unmet)
    return DryRun(deadlock, tuple(problems))


def _chain(
    orders: Sequence[Sequence[tuple[str, int]]],
    pos: list[int],
    s: int,
    unmet: Callable[[int], tuple[int, str, int] | None],
) -> str:
    """The waits from stage ``s``'s blocked action: each names what it waits for, and where
    that stage is blocked in turn, until a stage that never runs it or a cycle."""
    seen: set[int] = set()
    op, p = orders[s][pos[s]]
    text = f"stage {s}, action {pos[s] + 1} ({_name(op, p)}) can never run: "
    while True:
        seen.add(s)
        need = unmet(s)
        assert need is not None
        t, letters, q = need
        has = [x for x in letters.split("|") if (x, q) in orders[t]]
        text += f"waits for stage {t}'s {_name((has or letters.split('|'))[0], q)}"
        if not has:
            return text + f", which stage {t} never runs"
        op, p = orders[t][pos[t]]
        if (op, p) != (has[0], q):  # behind another blocked action of that stage
            text += f", which comes after stage {t}'s action {pos[t] + 1} ({_name(op, p)})"
        if t in seen:
            return text + ": a cycle"
        text += ", which "
        s = t


def _coverage(s: int, order: Sequence[tuple[str, int]], m: int) -> list[str]:
    """Stage ``s``'s microbatches outside 0..m-1, missing or run twice, one line each."""
    count: dict[tuple[str, int], int] = {}
    out = []
    for op, p in order:
        count[(op, p)] = count.get((op, p), 0) + 1
        if not 0 <= p < m:
            out.append(f"stage {s}: {_name(op, p)} names microbatch {p}, not one of 0..{m - 1}")
    for p in range(m):
        n = {op: count.get((op, p), 0) for op in COMPUTE}
        for op in COMPUTE:
            if n[op] > 1:
                out.append(f"stage {s}: microbatch {p}'s {_NAMES[op]} runs {n[op]} times")
        if not n["F"]:
            out.append(f"stage {s}: microbatch {p} has no forward")
        if n["B"] and (n["I"] or n["W"]):
            out.append(f"stage {s}: microbatch {p} has a full backward and a split one")
        elif not n["B"] and not n["I"]:
            out.append(f"stage {s}: microbatch {p} has no backward")
        elif n["I"] and not n["W"]:
            out.append(f"stage {s}: microbatch {p} has no weight gradient (W) after its I")
        elif n["W"] and not n["I"]:
            out.append(f"stage {s}: microbatch {p} has a W without its I")
    return out


def held(order: Sequence[tuple[str, int]]) -> int:
    """The most microbatches the order holds at once between a forward and its backward
    (the input-gradient half ends the hold of activations, as a full backward does)."""
    most = now = 0
    for op, _ in order:
        now += 1 if op == "F" else -1 if op in ("B", "I") else 0
        most = max(most, now)
    return most


# -- in a job ------------------------------------------------------------------------------------


def order_value(value: Any, base: str | os.PathLike[str] | None = None) -> tuple[Order, ...]:
    """The job key ``train.order``: a path to a CSV file in torch's format (relative to
    ``base``, the job file's folder) or its rows inline (an array of arrays of action
    strings, what a loaded job carries to the head and the workers)."""
    if isinstance(value, str):
        path = Path(value)
        if base is not None and not path.is_absolute():
            path = Path(base) / path
        return load(path)
    if isinstance(value, list | tuple) and all(isinstance(r, list | tuple) for r in value):
        return parse_rows(value, "rows")
    raise ScheduleCsvError(
        "expected a CSV file's path (string) or its rows (an array of arrays of action "
        f"strings), got {type(value).__name__}"
    )


def job_order_problem(
    orders: Sequence[Sequence[tuple[str, int]]],
    *,
    kind: str,
    warmup: int,
    stages: Sequence[int],
    ms: Sequence[int | None],
) -> str | None:
    """Why a synchronous job cannot run ``orders`` (one line), or None.

    ``stages``: each virtual worker's stage count; ``ms``: each one's microbatches per
    iteration (None: not fixed before planning). Every virtual worker must have as many
    stages as the orders have rows and run the orders' microbatches per iteration; the
    orders must pass the dry run and the runtime's own check of an order; and no stage may
    hold more microbatches at once than the memory model charges ``kind`` with (gpipe's
    charge holds any order)."""
    k, m = len(orders), microbatches(orders)
    if not stages:
        return f"needs [[vw]] tables of {k} devices each (one per row of the order)"
    for v, (n, vm) in enumerate(zip(stages, ms, strict=True)):
        if n != k:
            return f"has {k} rows (stages) but virtual worker {v} has {n} stages"
        if vm != m:
            got = "none" if vm is None else vm
            return (
                f"runs {m} microbatches per iteration: give train.nm = {m} (virtual worker "
                f"{v} has {got})"
            )
    run = check_schedule(orders, m)
    if not run.ok:
        return f"dry run: {run.reason}"
    for s, order in enumerate(orders):
        try:
            check_order(order, m)
        except ScheduleError as exc:
            return f"stage {s}: {exc}"
        most = max_in_flight(kind, k, s, m, warmup=warmup)
        if held(order) > most:
            need = max(held(o) - (k - t) for t, o in enumerate(orders))
            return (
                f"stage {s} holds {held(order)} microbatches at once, more than schedule "
                f"{kind!r} charges it ({most}): give train.warmup_forwards = {need} (1f1b) "
                "or schedule gpipe"
            )
    return None
