"""Two chunks per device for the synchronous planner: the devices of a planned (or given)
virtual worker priced again running ``2 D`` stages under the device-level schedules
(:data:`hetpipe.core.schedule.DEVICE_KINDS`: ``interleaved-1f1b`` on a round-robin placement,
``zbv`` on a V), each with the cuts of its stages searched, so the plan can say when one of
them is predicted faster than the best one-stage-per-device pipeline.

**Timing.** Stages that share a device share its time: a device runs the hand-offs of all its
stages one at a time, in the order of its device-level schedule
(:func:`hetpipe.core.devschedule.device_order`), each as :func:`~.simulate.trip_s` prices it
and each starting once its first action's input is there (:func:`device_iteration_time`,
the rules of :func:`hetpipe.planner.simulate.iteration_time` with a clock per device instead
of per stage; with one stage per device the two agree). Activations between two stages on
one device do not leave the process: that link takes no time.

**Memory.** A device's cap holds all its stages together: the sum of their peaks, each by the
one memory model under the kind's projected order (as :func:`hetpipe.jobplan.device_memory_problem`
checks a job's own several-stage split).

**Cuts** (:func:`best_chunk_cuts`). Where the cuts of the ``2 D`` stages are few
(:data:`ENUMERATE`), every one is timed. Else the synchronous planner's per-split machinery
for a fixed device sequence (:meth:`SyncModel._matrices`: a min-max and capped min-sum
programs) runs over the device sequence with its repeats, each stage under a share of its
device's cap (:data:`SHARES`, since the programs see one stage at a time); its candidates are
timed exactly and the fastest few refined by moving cuts while that helps (a candidate over a
cap is first walked back under it). :func:`exhaustive_chunk_cuts` times every cut, to check
the search on small instances.
"""

from __future__ import annotations

import itertools
import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hetpipe.core import devschedule
from hetpipe.core.devschedule import device_of
from hetpipe.core.schedule import (
    DEVICE_KINDS,
    Backward,
    BackwardInput,
    BackwardWeight,
    Forward,
    ScheduleError,
    iteration_trips,
    microbatch_order,
)
from hetpipe.planner.simulate import Timed, send, trip_s
from hetpipe.planner.syncmodel import CAPS, INF, SyncChoice, SyncModel

__all__ = [
    "ENUMERATE",
    "MARGIN",
    "ChunkChoice",
    "best_chunk_cuts",
    "choose_chunks",
    "chunk_candidates",
    "chunk_placement",
    "chunk_report",
    "chunk_time",
    "device_iteration_time",
    "exhaustive_chunk_cuts",
]

ENUMERATE = 64  # cut sets this few are all timed
STARTS = 3  # the fastest candidates of the programs refined
# the shares of its device's cap a device's first and second chunk may take in the programs,
# which see one stage at a time: shares that add up to at most 1 keep a device's stages within
# its cap together
SHARES = ((1.0, 1.0), (0.75, 0.75), *((f / 10, 1 - f / 10) for f in range(1, 10)))
# besides: up to this many splits of a cap where one chunk takes exactly what one of its
# ranges needs and the other the rest (a grid step misses a split that fits only so)
FITTED_SHARES = 16
# a device-level kind replaces the one-stage-a-device pipeline only where predicted faster by
# more than this share: the two are timed by different rules (a clock per device against one
# per stage), and a device's stages also share its worker's event loop and messages, which
# neither prices; a near tie keeps the simpler pipeline
MARGIN = 0.03
CHUNKS = 2  # chunks per device priced (zbv's only shape, interleaved's usual one)
_OPS = {Forward: "F", Backward: "B", BackwardInput: "I", BackwardWeight: "W"}


@dataclass(frozen=True)
class ChunkChoice:
    """A device-level pipeline: the device (index into the model's) of each of its ``2 D``
    stages, their cuts, the kind, and the predicted iteration time."""

    kind: str
    devices: tuple[int, ...]
    cuts: tuple[tuple[int, int], ...]
    iteration_s: float


def chunk_placement(kind: str, devs: Sequence[int]) -> tuple[int, ...]:
    """The device of each of the ``2 D`` stages when ``devs`` (D devices) run two chunks
    each under ``kind``: round robin (interleaved) or a V (zbv)."""
    D = len(devs)
    k = CHUNKS * D
    return tuple(devs[device_of(kind, k, D, s)] for s in range(k))


def device_iteration_time(
    stages: Sequence[Timed],
    links: Sequence[tuple[float, float]],
    orders: Sequence[Sequence[tuple[str, int]]],
    sequences: Sequence[Sequence[tuple[int, str, int]]],
) -> float:
    """Time of one synchronous iteration whose stages share devices: ``sequences[d]`` is what
    device d runs, ``(stage, op, j)`` in order, and ``orders[s]`` stage s's projection of it.
    Each stage's hand-offs (:func:`iteration_trips`) run on its device in the order of their
    first action in the device's sequence (the step and push last), one at a time on the
    device, each starting when its first action's input is there; links as
    :func:`hetpipe.planner.simulate.iteration_time` has them."""
    k = len(stages)
    m = sum(op == "F" for op, _ in orders[0])
    queues: list[list[tuple[int, tuple]]] = []
    for seq in sequences:
        where = {e: n for n, e in enumerate(seq)}
        owned = sorted({s for s, _, _ in seq})
        keyed = []
        for s in owned:
            for trip in iteration_trips(k, s, tuple(orders[s])):
                head = next((a for a in trip if type(a) in _OPS), None)
                at = (
                    where[(s, _OPS[type(head)], head.p)]  # type: ignore[union-attr]
                    if head is not None
                    else len(seq) + s
                )
                keyed.append((at, s, trip))
        keyed.sort(key=lambda x: x[0])
        queues.append([(s, trip) for _, s, trip in keyed])
    fwd_in: list[list[float | None]] = [[0.0] * m] + [[None] * m for _ in range(k - 1)]
    bwd_in: list[list[float | None]] = [[None] * m for _ in range(k)]
    free = [0.0] * len(queues)
    link_f = [0.0] * max(k - 1, 0)
    link_b = [0.0] * max(k - 1, 0)
    pos = [0] * len(queues)
    total = sum(len(q) for q in queues)
    done = 0
    while done < total:
        moved = False
        for d, queue in enumerate(queues):
            while pos[d] < len(queue):
                s, trip = queue[pos[d]]
                head = trip[0]
                kind = type(head)
                ready = (
                    fwd_in[s][head.p]
                    if kind is Forward
                    else bwd_in[s][head.p]
                    if (kind is Backward or kind is BackwardInput) and s < k - 1
                    else 0.0
                )
                if ready is None:
                    break
                end = max(free[d], ready) + trip_s(stages[s], trip)
                for a in trip:
                    ak = type(a)
                    if ak is Forward and s + 1 < k:
                        fwd_in[s + 1][a.p] = send(link_f, s, end, links[s][0])
                    elif (ak is Backward or ak is BackwardInput) and s > 0:
                        bwd_in[s - 1][a.p] = send(link_b, s - 1, end, links[s - 1][1])
                free[d] = end
                pos[d] += 1
                done += 1
                moved = True
        if not moved:
            raise ValueError("device_iteration_time: the orders deadlock")
    return max(free)


def _excess(
    model: SyncModel, kind: str, place: Sequence[int], cuts: Sequence[tuple[int, int]]
) -> int:
    """Bytes by which the devices' stages together exceed their caps under ``kind`` (0:
    every device holds all its stages)."""
    k = len(place)
    need: dict[int, int] = {}
    for pos, (i, (a, b)) in enumerate(zip(place, cuts, strict=True)):
        need[i] = need.get(i, 0) + model.memory(i, a, b, pos, k, kind).total
    return sum(max(0, n - model.devices[i].memory) for i, n in need.items())


def chunk_time(
    model: SyncModel, kind: str, devs: Sequence[int], cuts: Sequence[tuple[int, int]]
) -> float:
    """Predicted iteration time of ``devs`` running two chunks each under ``kind`` with these
    cuts of the ``2 D`` stages; inf where a device's stages do not fit its cap together."""
    place = chunk_placement(kind, devs)
    if _excess(model, kind, place, cuts):
        return INF
    model.evaluations += 1
    k, D = len(place), len(devs)
    stages = [
        model.stage(i, a, b, pos == 0, pos == k - 1)
        for pos, (i, (a, b)) in enumerate(zip(place, cuts, strict=True))
    ]
    links = [
        (0.0, 0.0)
        if place[s] == place[s + 1]
        else (model.link(place[s], place[s + 1], cuts[s][1]),) * 2
        for s in range(k - 1)
    ]
    orders = [microbatch_order(kind, k, s, model.m, devices=D) for s in range(k)]
    sequences = devschedule.device_orders(kind, k, D, model.m)
    return device_iteration_time(stages, links, orders, sequences) + model.tie_exchange_s(
        place, cuts
    )


def _runnable(model: SyncModel, kind: str, devs: Sequence[int]) -> str | None:
    """Why ``kind`` cannot run two chunks on each of ``devs`` here (None: it can)."""
    D = len(devs)
    if CHUNKS * D > model.L:
        return f"{CHUNKS * D} stages for {model.L} layers"
    try:
        devschedule.check_microbatches(kind, D, model.m)
    except ScheduleError as exc:
        return str(exc)
    return None


def _all_cuts(L: int, k: int):
    for c in itertools.combinations(range(1, L), k - 1):
        yield tuple(zip((0, *c), (*c, L), strict=True))


def exhaustive_chunk_cuts(model: SyncModel, kind: str, devs: Sequence[int]) -> ChunkChoice | None:
    """Every cut of the ``2 D`` stages timed: the optimum of :func:`chunk_time` (None:
    nothing fits). For small instances only."""
    if _runnable(model, kind, devs) is not None:
        return None
    best: ChunkChoice | None = None
    for cuts in _all_cuts(model.L, CHUNKS * len(devs)):
        t = chunk_time(model, kind, devs, cuts)
        if t < INF and (best is None or t < best.iteration_s):
            best = ChunkChoice(kind, chunk_placement(kind, devs), cuts, t)
    return best


def best_chunk_cuts(
    model: SyncModel,
    kind: str,
    devs: Sequence[int],
    enumerate_up_to: int = ENUMERATE,
    budget_s: float = 2.0,
) -> ChunkChoice | None:
    """The best cuts the search finds for ``devs`` running two chunks each under ``kind``
    (None: it cannot run here or nothing fits): every cut where there are at most
    ``enumerate_up_to``, else candidates of the synchronous planner's programs refined (see
    the module docstring), within about ``budget_s``."""
    if _runnable(model, kind, devs) is not None:
        return None
    k, L = CHUNKS * len(devs), model.L
    if math.comb(L - 1, k - 1) <= enumerate_up_to:
        return exhaustive_chunk_cuts(model, kind, devs)
    deadline = time.monotonic() + budget_s
    place = chunk_placement(kind, devs)
    cost, _, link = model._matrices(place, kind)
    mems = [model._memory_matrix(i, pos, k, kind) for pos, i in enumerate(place)]
    cands: set[tuple[tuple[int, int], ...]] = set()
    chunk = [place[:pos].count(i) for pos, i in enumerate(place)]  # which chunk of its device
    for shares in (*SHARES, *_fitted_shares(model, place, chunk, mems)):
        ok = [
            mem <= model.devices[i].memory * shares[c]
            for mem, i, c in zip(mems, place, chunk, strict=True)
        ]
        bstar = model._minmax(cost, ok, link)
        if bstar < INF:
            for f in CAPS:
                cuts = model._minsum(cost, ok, link, bstar * f)
                if cuts is not None:
                    cands.add(cuts)
    # an even split too: the programs see each stage alone, not a device's stages together
    inner = _even(L, k)
    cands.add(tuple(zip((0, *inner), (*inner, L), strict=True)))
    starts = sorted((_score(model, kind, devs, place, c), c) for c in cands)
    found = None
    for score, cuts in starts[:STARTS]:
        score, cuts = _refine(model, kind, devs, score, list(cuts), deadline)
        if score[0] == 0 and (found is None or score[1] < found[0]):
            found = (score[1], cuts)
    if found is None:
        return None
    return ChunkChoice(kind, place, tuple(found[1]), found[0])


def _fitted_shares(
    model: SyncModel, place: Sequence[int], chunk: Sequence[int], mems: Sequence[np.ndarray]
) -> list[tuple[float, float]]:
    """Cap splits fitted to the stages: for each share a chunk's range takes of its device's
    cap, that share for the chunk and the rest for the other; at most
    :data:`FITTED_SHARES`, evenly spread over the shares found."""
    found: set[float] = set()
    for mem, i, c in zip(mems, place, chunk, strict=True):
        fits = mem[np.isfinite(mem)] / model.devices[i].memory
        for f in np.unique(fits[(fits > 0) & (fits < 1)]):
            f = float(f) * (1 + 1e-9)  # the range itself fits; candidates are checked whole
            found.add(f if c == 0 else 1.0 - f)
    shares = sorted(found)
    if len(shares) > FITTED_SHARES:
        step = (len(shares) - 1) / (FITTED_SHARES - 1)
        shares = [shares[round(n * step)] for n in range(FITTED_SHARES)]
    return [(f, 1.0 - f) for f in shares]


def _score(
    model: SyncModel,
    kind: str,
    devs: Sequence[int],
    place: Sequence[int],
    cuts: Sequence[tuple[int, int]],
) -> tuple[int, float]:
    """What the refinement lowers: the bytes over the caps first, then the iteration time."""
    over = _excess(model, kind, place, cuts)
    return (over, INF) if over else (0, chunk_time(model, kind, devs, cuts))


def _refine(
    model: SyncModel,
    kind: str,
    devs: Sequence[int],
    score: tuple[int, float],
    best: list[tuple[int, int]],
    deadline: float,
) -> tuple[tuple[int, float], list[tuple[int, int]]]:
    """Move cuts (:func:`_moves`) while that lowers the bytes over the caps, then while the
    iteration gets faster: a start over a cap is walked back under it."""
    place = chunk_placement(kind, devs)
    improved = True
    while improved and time.monotonic() < deadline:
        improved = False
        for trial in _moves(best):
            sc = _score(model, kind, devs, place, trial)
            if sc[0] < score[0] or (sc[0] == score[0] == 0 and sc[1] < score[1] * (1 - 1e-9)):
                score, best, improved = sc, trial, True
                break
    return score, best


def _moves(cuts: list[tuple[int, int]]):
    """The cuts with a run of consecutive inner cuts shifted together by up to three layers
    (one cut alone among them), or two cuts apart moved by one layer each."""
    inner = [b for _, b in cuts[:-1]]
    L = cuts[-1][1]
    n = len(inner)
    shifts = [
        (tuple(range(s, r + 1)), (d,) * (r + 1 - s))
        for s in range(n)
        for r in range(s, n)
        for d in (-3, -2, -1, 1, 2, 3)
    ]
    shifts += [
        ((s, r), (ds, dr))
        for s, r in itertools.combinations(range(n), 2)
        for ds in (-1, 1)
        for dr in (-1, 1)
        if not (r == s + 1 and ds == dr)
    ]
    for which, by in shifts:
        trial = list(inner)
        for s, d in zip(which, by, strict=True):
            trial[s] += d
        if all(a < b for a, b in itertools.pairwise((0, *trial, L))):
            yield list(zip((0, *trial), (*trial, L), strict=True))


def _even(L: int, k: int) -> tuple[int, ...]:
    """The inner cuts of ``k`` stages of nearly equal layer counts."""
    return tuple(round(L * s / k) for s in range(1, k))


def chunk_candidates(
    model: SyncModel, devs: Sequence[int], budget_s: float = 2.0
) -> list[tuple[str, ChunkChoice | None, str | None]]:
    """Per device-level kind: ``(kind, its best pipeline on devs or None, why not)``."""
    out: list[tuple[str, ChunkChoice | None, str | None]] = []
    for kind in DEVICE_KINDS:
        why = _runnable(model, kind, devs)
        c = None
        if why is None:
            c = best_chunk_cuts(model, kind, devs, budget_s=budget_s / len(DEVICE_KINDS))
            if c is None:
                why = "the stages of some device do not fit its memory together"
        out.append((kind, c, why))
    return out


def _rows(
    model: SyncModel, best: SyncChoice, budget_s: float
) -> tuple[list[dict[str, Any]], dict[str, ChunkChoice]]:
    """The candidate rows of :func:`chunk_report` (the fastest marked ``best``), and each
    device-level kind's pipeline that can run."""

    def names(idx: Sequence[int]) -> list[str]:
        return [model.devices[i].name for i in idx]

    def layers(cuts: Sequence[tuple[int, int]]) -> list[int]:
        return [b - a for a, b in cuts]

    rows: list[dict[str, Any]] = [
        {
            "kind": best.kind,
            "warmup": best.warmup,
            "chunks": 1,
            "devices": names(best.devices),
            "layers": layers(best.cuts),
            "iteration_s": float(best.iteration_s),
            "why": None,
        }
    ]
    found: dict[str, ChunkChoice] = {}
    for kind, c, why in chunk_candidates(model, best.devices, budget_s):
        if c is not None:
            found[kind] = c
        rows.append(
            {
                "kind": kind,
                "warmup": 0,
                "chunks": CHUNKS,
                "devices": names(c.devices if c else chunk_placement(kind, best.devices)),
                "layers": layers(c.cuts) if c else None,
                "iteration_s": float(c.iteration_s) if c else None,
                "why": why,
            }
        )
    fastest = min((r for r in rows if r["iteration_s"] is not None), key=lambda r: r["iteration_s"])
    for r in rows:
        r["best"] = r is fastest
    return rows, found


def chunk_report(
    model: SyncModel, best: SyncChoice, budget_s: float = 2.0
) -> tuple[list[dict[str, Any]], str | None]:
    """The synchronous plan's candidates on its devices, for the plan's details: ``best`` (one
    stage a device) and each device-level kind with two chunks a device, each with its
    devices per stage, layers per stage and predicted iteration time on an idle host (None
    with the reason where it cannot run); the fastest marked ``best``. With it the one-line
    suggestion to write where a device-level kind is the fastest (the runtime runs it only
    from a job's own ``[[vw]]`` split with ``train.several_stages``), else None."""
    rows, _ = _rows(model, best, budget_s)
    fastest = next(r for r in rows if r["best"])
    if fastest is rows[0]:
        return rows, None
    return rows, (
        f"suggestion: {fastest['kind']} with two stages on each of the same devices is "
        f"predicted faster, {fastest['iteration_s']:.4g} s an iteration against "
        f"{rows[0]['iteration_s']:.4g} s ({best.kind}, idle host); to run it, write "
        f"[[vw]] devices = {json.dumps(fastest['devices'])}, "
        f"layers = {json.dumps(fastest['layers'])} with train.schedule = "
        f'"{fastest["kind"]}" and train.several_stages = true'
    )


def choose_chunks(
    model: SyncModel,
    best: SyncChoice,
    budget_s: float = 2.0,
    *,
    margin: float = MARGIN,
    total: int | None = None,
    only: str | None = None,
) -> tuple[list[dict[str, Any]], ChunkChoice | None, str]:
    """The planner's choice between ``best`` (one stage a device) and the same devices with
    two chunks each under a device-level kind: the fastest device-level pipeline where it is
    predicted faster than ``best`` by more than ``margin`` (a share of ``best``'s iteration
    time, :data:`MARGIN`), else None (``best`` stays). ``total``: the job's microbatches,
    where known; a kind whose last, short iteration could not run is not chosen
    (:func:`hetpipe.core.devschedule.last_iteration_problem`). Returns :func:`chunk_report`'s
    rows (the chosen one marked ``chosen``, every row's ``why`` saying why it was or was not
    taken), the choice, and why in one line. ``only``: that kind alone may be chosen, at any
    margin (a job that runs it already, planned again)."""
    rows, found = _rows(model, best, budget_s)
    base = float(best.iteration_s)
    D = len(best.devices)
    ranked = sorted(
        (c for c in found.values() if only in (None, c.kind)), key=lambda c: c.iteration_s
    )
    if only is not None:
        margin = -math.inf
    chosen: ChunkChoice | None = None
    for c in ranked:
        problem = (
            devschedule.last_iteration_problem(c.kind, D, total, model.m)
            if total is not None
            else None
        )
        row = next(r for r in rows if r["kind"] == c.kind)
        gain = 1 - c.iteration_s / base if base > 0 else 0.0
        if problem is not None:
            row["why"] = f"not chosen: {problem}"
        elif gain <= margin:
            row["why"] = (
                f"not chosen: {gain:.1%} faster than {best.kind}, within the {margin:.0%} margin"
                if gain > 0
                else f"not chosen: not faster than {best.kind}"
            )
        elif chosen is None:
            chosen = c
            row["why"] = (
                f"chosen: {gain:.1%} faster than {best.kind} (margin {margin:.0%})"
                if only is None
                else "chosen: the kind the job runs"
            )
        else:
            row["why"] = f"not chosen: slower than {chosen.kind}"
    for r in rows:
        r["chosen"] = r["kind"] == (chosen.kind if chosen else best.kind)
    if chosen is None:
        why = (
            f"{best.kind}, one stage a device: no device-level schedule with two stages a "
            f"device is predicted more than {margin:.0%} faster"
            if only is None
            else f"{only} cannot run with two stages on each of these {D} devices"
        )
        rows[0]["why"] = "chosen"
        return rows, None, why
    gain = 1 - chosen.iteration_s / base
    why = (
        f"{chosen.kind}, two stages on each of {D} devices: predicted "
        f"{chosen.iteration_s:.4g} s an iteration against {base:.4g} s for {best.kind} one "
        f"stage a device (idle host), "
        + (
            f"{gain:.1%} faster, over the {margin:.0%} margin"
            if only is None
            else "the kind the job runs, planned again"
        )
    )
    rows[0]["why"] = f"not chosen: {chosen.kind} is faster" if only is None else "not chosen"
    return rows, chosen, why
