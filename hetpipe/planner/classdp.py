"""Device order and split of one virtual worker at once: a DP over device classes.

Devices of one class are interchangeable (:func:`hetpipe.planner.order.device_classes`:
same type, memory, speed and host link, and the same bandwidth to every other device), so an
order is, as far as any stage time or memory cap can tell, its sequence of classes. Instead
of enumerating the sequences, this module runs the split's dynamic programs over states

    (layers placed so far ``b``, multiset ``U`` of classes used, class ``p`` of the last
    stage placed, class ``c`` of the stage placed next)

Index letters: ``U`` counts per class (a tuple), ``c`` and ``q`` the current and next class,
``p`` the previous one, ``b`` a layer boundary, ``w`` a band's width (:meth:`band`).

A stage's time and memory depend on its device's class, its position (``sum(U) - 1``: the
in-flight count) and the links in and out, ``link(p, c)`` and ``link(c, q)``; with links that
follow node membership a class is a type on a node, so both links are functions of the two
classes. The state must hold ``p`` only through ``link(p, c)``: states that differ only in a
``p`` of the same link are merged (an elementwise minimum) before the stage's step, which is
exact since a step distributes over the minimum. The work is about ``prod(count + 1) x
classes x links in x links out`` band steps of ``L x w`` each, against one DP per order.

**What is exact.** With Nm chosen (``best_nm``'s objective), the estimated rate
``min(1 / bottleneck, Nm / latency)`` maximised over every order, contiguous split and Nm
candidate: for each Nm, the least bottleneck ``B*`` over all orders (the min-max DP) and the
least latency ``H(T)`` over all orders whose every stage takes at most ``T`` (the min-sum DP,
stages over ``T`` masked) give the best rate ``max_T min(1 / T, Nm / H(T))``, found by the
binary search over the bands' stage times that :meth:`CostModel._joint_split` runs for one
order (``H`` falls and ``1 / T`` falls with ``T``). So the best rate equals the best over
every order of :meth:`CostModel.best_nm`, which tests check against brute force. The order
returned is one that reaches it (traced back from the DP); its split and Nm are then
:meth:`CostModel.best_nm`'s for that order, so they carry the same tie-breaks as any order's.
**What is not:** among orders of *equal* best rate, the one kept is the DP's (lower Nm, then
the lower stage-time limit), not necessarily the order enumeration would keep (the
lower bottleneck, Nm and latency of each order's own split); the rate itself is the same.
With Nm fixed, the planner ranks each order by its least-bottleneck split's rate, which is
not a DP objective over classes, so :func:`hetpipe.planner.order.best_order` keeps its own
search there.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hetpipe.core.memory import in_flight
from hetpipe.planner.costs import INF
from hetpipe.planner.partition import CostModel, _merge_distinct, _windows, rate_bound

__all__ = ["ClassSpace", "best_class_order", "class_space", "dp_cells"]

State = tuple[tuple[int, ...], int, int]  # (U, p, c); p = -1 before the first stage


@dataclass(frozen=True)
class ClassSpace:
    """The devices of one VW grouped into interchangeable classes."""

    members: tuple[tuple[Any, ...], ...]  # per class, its devices
    link: tuple[tuple[float, ...], ...]  # link[c][q]: bandwidth from a c device to a q one

    @property
    def counts(self) -> tuple[int, ...]:
        return tuple(len(m) for m in self.members)

    @property
    def k(self) -> int:
        return sum(self.counts)


def class_space(model: CostModel, devices: Sequence[Any], classes: Sequence[int]) -> ClassSpace:
    """:class:`ClassSpace` of ``devices`` from :func:`~hetpipe.planner.order.device_classes`,
    split further by each device's host link (a band's key, which the classes ignore)."""
    groups: dict[tuple[int, Any], list[Any]] = {}
    for d, c in zip(devices, classes, strict=True):
        groups.setdefault((c, getattr(d, "host_gbps", None)), []).append(d)
    members = tuple(tuple(g) for g in groups.values())
    link = []
    for mc in members:
        row = []
        for mq in members:
            if mc is mq:
                row.append(model.link(mc[0], mc[1]) if len(mc) > 1 else INF)
            else:
                row.append(model.link(mc[0], mq[0]))
        link.append(tuple(row))
    return ClassSpace(members, tuple(link))


def dp_cells(space: ClassSpace, layers: int) -> int:
    """A measure of one DP sweep's work: states (``prod(count + 1) x classes``) times the
    distinct links in and out of a class, times the layers (each step costs ``L x w``)."""
    states = math.prod(n + 1 for n in space.counts) * len(space.counts)
    links = len({x for row in space.link for x in row if x < INF}) or 1
    return states * links * links * (layers + 1)


def _step(f: np.ndarray, band: np.ndarray, w: int, limit: float | None) -> np.ndarray:
    """One stage: the min-max step (``limit`` None) or the min-sum step over stages of at
    most ``limit``, written as :meth:`CostModel._run` and :meth:`CostModel._least_latency`
    write them (the same floats)."""
    n = len(f)
    out = np.full(n, INF)
    live = np.flatnonzero(f < INF)
    if live.size:
        lo, hi = int(live[0]) + 1, min(n, int(live[-1]) + w + 1)
        if lo < hi:
            win = _windows(f, w)[lo:hi]
            rows = band[lo:hi]
            if limit is None:
                out[lo:hi] = np.maximum(win, rows).min(axis=1)
            else:
                cand = win + rows
                if limit != INF:
                    np.putmask(cand, ~(rows <= limit), INF)
                out[lo:hi] = cand.min(axis=1)
    return out


def _step_many(F: np.ndarray, band: np.ndarray, w: int, limit: float | None) -> np.ndarray:
    """:func:`_step` of every row of ``F`` with one band (the same floats), in chunks of
    rows that keep the ``rows x L x w`` candidates to a few MiB."""
    m, n = F.shape
    out = np.full((m, n), INF)
    live = np.flatnonzero(np.isfinite(F).any(axis=0))
    if not live.size:
        return out
    lo, hi = int(live[0]) + 1, min(n, int(live[-1]) + w + 1)
    if lo >= hi:
        return out
    padded = np.full((m, n + w), INF)
    padded[:, w:] = F
    s0, s1 = padded.strides
    win_all = np.lib.stride_tricks.as_strided(padded, shape=(m, n, w), strides=(s0, s1, s1))
    rows = band[lo:hi]
    mask = None if limit is None or limit == INF else ~(rows <= limit)
    chunk = max(1, (1 << 19) // max(1, (hi - lo) * w))
    for r0 in range(0, m, chunk):
        win = win_all[r0 : r0 + chunk, lo:hi]
        if limit is None:
            out[r0 : r0 + chunk, lo:hi] = np.maximum(win, rows).min(axis=2)
        else:
            cand = win + rows
            if mask is not None:
                np.putmask(cand, np.broadcast_to(mask, cand.shape), INF)
            out[r0 : r0 + chunk, lo:hi] = cand.min(axis=2)
    return out


class _Sweep:
    """The DP over class states at one Nm; ``limit`` None: the bottleneck, else the least
    latency with every stage at most ``limit``."""

    def __init__(self, model: CostModel, space: ClassSpace, nm: int) -> None:
        self.model, self.space, self.nm = model, space, nm
        self.bands: dict[int, np.ndarray] = {}  # id -> band, every band a sweep used
        self.runs = 0  # sweeps run

    def band(
        self, c: int, bw_in: float | None, bw_out: float | None, i: int
    ) -> tuple[np.ndarray, int]:
        """The band of a ``c`` stage at position ``i`` with these links (recorded for the
        joint search's stage times)."""
        d = self.space.members[c][0]
        flight = in_flight(i, self.space.k, self.nm, weights=self.model.weights)
        got = self.model.band(d.type, bw_in, bw_out, flight, d.memory, d.host_gbps, self.nm)
        self.bands[id(got[0])] = got[0]
        return got

    def link(self, p: int, c: int, U: tuple[int, ...]) -> float | None:
        """The link into a ``c`` stage from a ``p`` one (None for the first stage)."""
        return None if p < 0 else self.space.link[p][c]

    def run(
        self, limit: float | None, keep: bool = False
    ) -> tuple[float, State | None, list[dict[State, np.ndarray]]]:
        """The best value at ``L`` over all orders, the final state reaching it and, with
        ``keep``, every level's states (for :meth:`trace`).

        Each level's states are the rows of one array; merging the states of one link in
        and stepping every state of one band are a few array operations each
        (:func:`_levels` lays out which rows go where)."""
        levels = _levels(self.space)
        self.runs += 1
        n, L, k = self.model.L + 1, self.model.L, self.space.k
        F = np.full((len(levels[0].states), n), INF)
        F[:, 0] = 0.0
        kept: list[dict[State, np.ndarray]] = []
        for m, lv in enumerate(levels):
            if keep:
                kept.append(dict(zip(lv.states, F, strict=True)))
            M = np.full((len(lv.groups), n), INF)
            np.minimum.at(M, lv.group_of, F)
            nxt = np.full((lv.next_size, n), INF) if m < k - 1 else None
            best, where = INF, -1
            for c, bw_in, bw_out, rows, src, dst in lv.batches:
                band, w = self.band(c, bw_in, bw_out, m)
                G = _step_many(M[rows], band, w, limit)
                if nxt is not None:
                    np.minimum.at(nxt, dst, G[src])
                else:
                    col = G[:, L]
                    r = int(np.argmin(col))
                    if col[r] < best:
                        best, where = float(col[r]), int(rows[r])
            if nxt is None:
                if where < 0:
                    return INF, None, kept
                # a state of the last level whose merged group reaches the optimum
                end = next(
                    s
                    for s, gi in zip(lv.states, lv.group_of, strict=True)
                    if gi == where
                    and np.isfinite(F[lv.index[s]]).any()
                    and self._ends(s, F[lv.index[s]], limit, best)
                )
                return best, end, kept
            F = nxt
        raise AssertionError("unreachable")

    def _ends(self, s: State, f: np.ndarray, limit: float | None, best: float) -> bool:
        """Whether the last stage from state ``s`` with states ``f`` reaches ``best``."""
        U, p, c = s
        band, w = self.band(c, self.link(p, c, U), None, self.space.k - 1)
        return float(_step(f, band, w, limit)[self.model.L]) == best

    def trace(self, limit: float | None, end: State, kept: list[dict[State, np.ndarray]]):
        """The class of each stage of a split reaching the sweep's optimum at ``end``,
        recomputing each step's candidates and matching the stored floats exactly."""
        k, L = self.space.k, self.model.L

        def cands(f: np.ndarray, band: np.ndarray, w: int, b: int) -> np.ndarray:
            a = b - w + np.arange(w)
            prev = np.where(a >= 0, f[np.maximum(a, 0)], INF)
            row = band[b]
            if limit is None:
                return np.maximum(prev, row)
            out = prev + row
            out[~(row <= limit)] = INF
            return out

        U, p, c = end
        band, w = self.band(c, self.link(p, c, U), None, k - 1)
        target = float(_step(kept[k - 1][end], band, w, limit)[L])
        seq = [c]
        b = L
        a_of = cands(kept[k - 1][end], band, w, b)
        j = int(np.flatnonzero(a_of == target)[0])
        b = b - w + j
        state = end
        for m in range(k - 1, 0, -1):
            U, p, c = state
            want = float(kept[m][state][b])
            prevU = tuple(u - (i == c) for i, u in enumerate(U))
            found = None
            for (U2, p2, c2), f in kept[m - 1].items():
                if prevU != U2 or c2 != p:
                    continue
                band, w = self.band(p, self.link(p2, p, U2), self.space.link[p][c], m - 1)
                hit = np.flatnonzero(cands(f, band, w, b) == want)
                if hit.size:
                    found = ((U2, p2, c2), b - w + int(hit[0]))
                    break
            assert found is not None, "a stored state comes from some predecessor"
            state, b = found
            seq.append(p)
        assert b == 0
        seq.reverse()
        return seq


@dataclass
class _Level:
    """One level of the class DP (``m + 1`` devices chosen), laid out once per class space:
    its states (rows), the merged group (``U``, ``c``, link in) of each, and per band
    (``c``, link in, link out) the groups it steps (``rows``) and where each result goes
    (``G[src]`` into the next level's rows ``dst``)."""

    states: list[State]
    index: dict[State, int]
    groups: list[tuple[tuple[int, ...], int, float | None]]
    group_of: np.ndarray
    batches: list[tuple[int, float | None, float | None, np.ndarray, np.ndarray, np.ndarray]]
    next_size: int


_LEVELS: dict[int, tuple[ClassSpace, list[_Level]]] = {}


def _levels(space: ClassSpace) -> list[_Level]:
    """:class:`_Level` of each level of ``space`` (cached while the space lives)."""
    hit = _LEVELS.get(id(space))
    if hit is not None and hit[0] is space:
        return hit[1]
    counts, k, link = space.counts, space.k, space.link
    C = len(counts)
    states: list[State] = [
        (tuple(int(j == c) for j in range(C)), -1, c) for c in range(C) if counts[c]
    ]
    out: list[_Level] = []
    for m in range(k):
        index = {s: i for i, s in enumerate(states)}
        gidx: dict[tuple[tuple[int, ...], int, float | None], int] = {}
        group_of = []
        for U, p, c in states:
            key = (U, c, None if p < 0 else link[p][c])
            group_of.append(gidx.setdefault(key, len(gidx)))
        groups = list(gidx)
        nstates: dict[State, int] = {}
        plan: dict[tuple[int, float | None, float | None], tuple[list, list, list]] = {}
        for gi, (U, c, bw_in) in enumerate(groups):
            if m == k - 1:
                plan.setdefault((c, bw_in, None), ([], [], []))[0].append(gi)
                continue
            for q in range(C):
                if U[q] >= counts[q]:
                    continue
                rows, src, dst = plan.setdefault((c, bw_in, link[c][q]), ([], [], []))
                if not rows or rows[-1] != gi:
                    rows.append(gi)
                V = tuple(u + (j == q) for j, u in enumerate(U))
                src.append(len(rows) - 1)
                dst.append(nstates.setdefault((V, c, q), len(nstates)))
        batches = [
            (
                c,
                bi,
                bo,
                np.array(r, dtype=np.intp),
                np.array(sr, dtype=np.intp),
                np.array(d, dtype=np.intp),
            )
            for (c, bi, bo), (r, sr, d) in plan.items()
        ]
        out.append(
            _Level(states, index, groups, np.array(group_of, dtype=np.intp), batches, len(nstates))
        )
        states = list(nstates)
    if len(_LEVELS) > 64:
        _LEVELS.clear()
    _LEVELS[id(space)] = (space, out)
    return out


@dataclass(frozen=True)
class ClassResult:
    """The best rate over every order (with its Nm and stage-time limit) and an order
    reaching it; ``order`` None where no order fits at any candidate Nm."""

    order: tuple[Any, ...] | None
    rate: float
    nm: int
    sweeps: int


def best_class_order(
    model: CostModel, space: ClassSpace, nm_candidates: Iterable[int] | None = None
) -> ClassResult:
    """The order (and Nm) of the best estimated rate over all orders, splits and Nm
    candidates (module docs); ties: the smaller Nm, then the lower stage-time limit.

    The largest Nm goes first (its pipeline fills most often, so its rate is usually the
    one to beat); every other Nm is first asked, in one sweep, whether it can reach the
    best rate ``R`` so far at all: a split of rate ``R`` or more has every stage at most
    ``1 / R`` and a latency at most ``Nm / R``, so where the least latency under the limit
    ``1 / R`` is above ``Nm / R`` (with a margin for rounding) that Nm is skipped."""
    k = space.k
    cands = sorted(set(nm_candidates) if nm_candidates is not None else range(1, k + 1))
    best: tuple[float, int, float] | None = None  # (rate, nm, limit)
    sweeps = 0
    for nm in reversed(cands):
        sw = _Sweep(model, space, nm)
        if best is not None and best[0] > 0 and math.isfinite(best[0]):
            reach, _, _ = sw.run((1.0 / best[0]) * (1.0 + 1e-9))
            if not reach * (1.0 - 1e-9) <= nm / best[0]:
                sweeps += sw.runs
                continue
        b_star, _, _ = sw.run(None)
        if not math.isfinite(b_star):
            sweeps += sw.runs
            continue
        shortest, _, _ = sw.run(INF)  # H(inf): no split at this Nm beats Nm / it
        got = _joint(sw, b_star, shortest, -INF if best is None else best[0])
        sweeps += sw.runs
        if got is None:
            continue  # bounded below the best so far
        rate, limit = got
        # ties: the smaller Nm (they come later), then the lower limit
        if best is None or rate > best[0] or (rate == best[0] and nm < best[1]):
            best = (rate, nm, limit)
    if best is None:
        return ClassResult(None, -INF, cands[0], sweeps)
    rate, nm, limit = best
    sw = _Sweep(model, space, nm)
    _, end, kept = sw.run(limit, keep=True)
    sweeps += 1
    assert end is not None
    return ClassResult(order_of(space, sw.trace(limit, end, kept)), rate, nm, sweeps)


def _rate(count: float, time: float) -> float:
    return count / time if time > 0 else INF


def _joint(
    sw: _Sweep, b_star: float, shortest: float, beat: float = -INF
) -> tuple[float, float] | None:
    """The best rate at the sweep's Nm over all orders, the stage-time limit whose
    least-latency split reaches it (None where bounds prove it below ``beat``): the
    smallest stage time ``T`` (of the bands, from ``B*``) whose least latency ``H(T)``
    fills (``Nm T >= H(T)``) gives ``1 / T``, the one below it ``Nm / H``; the better of
    the two is the best."""
    nm = sw.nm
    values = [sw.model._band_values(b) for b in sw.bands.values()]
    merged = _merge_distinct(values)
    merged = merged[merged >= b_star]
    cache: dict[float, float] = {}
    if merged.size:
        cache[float(merged[-1])] = shortest  # every stage time is at most the largest

    def h(t: float) -> float:
        if t not in cache:
            cache[t] = sw.run(t)[0]
        return cache[t]

    below, fills = -1, len(merged)
    if merged.size and nm * float(merged[0]) >= h(float(merged[0])):
        fills = 0  # the least bottleneck's least-latency split fills: 1 / B* is the best
    elif merged.size:
        # no T below H(inf) / Nm fills (H(T) >= H(inf)); every T from H(B*) / Nm does
        # (H(T) <= H(B*)): the search runs between the two
        below = max(0, int(np.searchsorted(merged, shortest / nm, "left")) - 1)
        fills = min(fills, int(np.searchsorted(merged, h(float(merged[0])) / nm, "left")))
    while fills - below > 1:
        mid = (below + fills) // 2
        t = float(merged[mid])
        if nm * t >= h(t):
            fills = mid
        else:
            below = mid
        if beat > -INF:
            # as CostModel._joint_split bounds it: H falls with T, so the best rate is at
            # most Nm / H(below) up to ``below``, 1 / T(fills) from ``fills``, and the
            # smaller of 1 / T(below) and Nm / H(fills) between
            # (H never goes below H(inf): where H is not known yet, that bounds it)
            t_below = float(merged[below]) if below >= 0 else b_star
            h_below = cache.get(t_below, shortest)
            t_fills = float(merged[fills]) if fills < len(merged) else INF
            h_fills = cache.get(t_fills, shortest)
            most = rate_bound(nm, t_below, h_below, t_fills, h_fills)
            if most * (1.0 + 1e-9) < beat:
                return None
    options: list[tuple[float, float]] = []
    if fills < len(merged):
        options.append((_rate(1.0, float(merged[fills])), float(merged[fills])))
    if below >= 0:
        t = float(merged[below])
        options.append((_rate(nm, h(t)), t))
    # the higher rate; among equal rates the lower limit (the lower bottleneck)
    rate, limit = max(options, key=lambda o: (o[0], -o[1]))
    return rate, limit


def order_of(space: ClassSpace, seq: Sequence[int]) -> tuple[Any, ...]:
    """Devices for a sequence of classes, each class's members in their order."""
    used = [0] * len(space.members)
    out = []
    for c in seq:
        out.append(space.members[c][used[c]])
        used[c] += 1
    return tuple(out)
