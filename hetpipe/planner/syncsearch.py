"""The synchronous planner's search: mappings of devices for one virtual worker
(:func:`search_sync`; :func:`exhaustive` to check it on small instances), and formations of
several that share an iteration's microbatches (:func:`search_formations`). Every candidate
is priced by :class:`hetpipe.planner.syncmodel.SyncModel`.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hetpipe.planner.syncmodel import INF, SyncChoice, SyncModel

__all__ = [
    "SyncFormation",
    "exhaustive",
    "plan_sync",
    "search_formations",
    "search_sync",
    "split_microbatches",
]

SMALL = 7  # clusters this small get every mapping tried when no heuristic start fits


# -- the search over mappings ------------------------------------------------------------------


def _chain(model: SyncModel, subset: Sequence[int], start: int) -> list[int]:
    """``subset`` ordered as a path from ``start`` along the fastest links, then 2-opt."""
    rest = [i for i in subset if i != start]
    path = [start]
    while rest:
        nxt = max(rest, key=lambda j: model.bw[path[-1], j])
        path.append(nxt)
        rest.remove(nxt)

    def length(p: Sequence[int]) -> float:
        return sum(1.0 / model.bw[a, b] for a, b in itertools.pairwise(p))

    improved = True
    while improved and len(path) > 3:
        improved = False
        for i in range(1, len(path) - 1):
            for j in range(i + 1, len(path)):
                trial = path[:i] + path[i : j + 1][::-1] + path[j + 1 :]
                if length(trial) < length(path) * (1 - 1e-12):
                    path, improved = trial, True
    return path


def plan_sync(model: SyncModel, budget_s: float = 5.0) -> SyncChoice | None:
    """The fastest synchronous pipeline the search finds (None: the model fits nowhere)."""
    found = search_sync(model, budget_s)
    return found[0] if found else None


def search_sync(model: SyncModel, budget_s: float = 5.0) -> list[SyncChoice]:
    """Every pipeline the search timed, fastest first (empty: the model fits nowhere)."""
    deadline = model.deadline = time.monotonic() + budget_s
    n, L = len(model.devices), model.L

    def whole_s(t: dict[str, np.ndarray]) -> float:  # the model as one stage on a type
        return float(t["F"][-1] + t["B"][-1] + t["cf"] + t["cb"])

    power = [1.0 / max(whole_s(model._t(d.type)), 1e-12) for d in model.devices]
    ranked = sorted(range(n), key=lambda i: (-power[i], -model.devices[i].memory, i))
    lengths = list(range(1, min(n, L) + 1))
    if len(lengths) > 12:  # long clusters: a geometric ladder of pipeline lengths
        lengths = sorted({1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, min(n, L)} & set(lengths))
    seen: dict[tuple[int, ...], SyncChoice | None] = {}

    def try_(devs: Sequence[int]) -> SyncChoice | None:
        key = tuple(devs)
        if key not in seen:
            seen[key] = model.best_kind(key)
        return seen[key]

    starts: list[SyncChoice] = []
    for k in lengths:
        for subset in (ranked[:k], sorted(ranked, key=lambda i: -model.devices[i].memory)[:k]):
            orders = [
                _chain(model, subset, start)
                for start in dict.fromkeys((subset[0], max(subset, key=lambda i: power[i])))
            ]
            orders.append(sorted(subset, key=lambda i: -model.devices[i].memory))
            for order in orders:  # either direction: memory and links differ by position
                for devs in (order, order[::-1]):
                    c = try_(devs)
                    if c is not None:
                        starts.append(c)
        if time.monotonic() > deadline:
            break
    if not starts and n <= SMALL:
        # nothing the heuristics tried fits: on a small cluster, try every mapping in turn
        for k in range(1, min(n, L) + 1):
            for devs in itertools.permutations(range(n), k):
                c = try_(devs)
                if c is not None:
                    starts.append(c)
                    break
            if starts or time.monotonic() > deadline:
                break
    if not starts:
        return []
    starts.sort(key=lambda c: c.iteration_s)
    best = starts[0]
    for start in starts[:3]:
        cur = start
        while time.monotonic() < deadline:
            nxt = _improve(model, cur, try_, deadline)
            if nxt is None:
                break
            cur = nxt
        if cur.iteration_s < best.iteration_s:
            best = cur
    return sorted((c for c in seen.values() if c is not None), key=lambda c: c.iteration_s)


def _improve(model: SyncModel, cur: SyncChoice, try_, deadline: float) -> SyncChoice | None:
    """The first neighbouring mapping that is faster, or None."""
    devs = list(cur.devices)
    unused = [i for i in range(len(model.devices)) if i not in devs]
    k = len(devs)
    moves: list[list[int]] = []
    moves += [devs[:i] + devs[i + 1 :] for i in range(k) if k > 1]
    moves += [[*devs[:i], u, *devs[i + 1 :]] for i in range(k) for u in unused]
    moves += [
        [*devs[:i], devs[j], *devs[i + 1 : j], devs[i], *devs[j + 1 :]]
        for i in range(k)
        for j in range(i + 1, k)
    ]
    if k < model.L:
        moves += [[*devs[:i], u, *devs[i:]] for i in range(k + 1) for u in unused]
    for mv in moves:
        if time.monotonic() > deadline:
            return None
        c = try_(mv)
        if c is not None and c.iteration_s < cur.iteration_s * (1 - 1e-9):
            return c
    return None


def exhaustive(model: SyncModel) -> SyncChoice | None:
    """Every mapping (ordered subset of devices), every partition and every kind: the optimum
    of :meth:`SyncModel.evaluate`. For small instances only."""
    n, L = len(model.devices), model.L
    best: SyncChoice | None = None
    for k in range(1, min(n, L) + 1):
        partitions = [
            tuple(zip((0, *c), (*c, L), strict=True))
            for c in itertools.combinations(range(1, L), k - 1)
        ]
        for devs in itertools.permutations(range(n), k):
            for kind, warmup in model.orders:
                for cuts in partitions:
                    t = model.evaluate(devs, cuts, kind, warmup)
                    if best is None or t < best.iteration_s:
                        best = SyncChoice(devs, cuts, kind, t, warmup)
    return best if best is not None and best.iteration_s < INF else None


# -- several virtual workers -------------------------------------------------------------------


@dataclass(frozen=True)
class SyncFormation:
    """Synchronous virtual workers planned together: each one's pipeline (device indices of
    the whole model) and its microbatches per iteration, summing to the job's M."""

    vws: tuple[SyncChoice, ...]
    ms: tuple[int, ...]
    exchange_s: float
    iteration_s: float  # the slowest virtual worker's iteration plus the exchange
    policy: str


def split_microbatches(times: Sequence[Sequence[float]], m: int) -> tuple[int, ...] | None:
    """Microbatches per virtual worker, ``m`` in all and at least one each, that minimise the
    slowest one's iteration time. ``times[g][j]``: virtual worker g's time with j + 1
    microbatches (non-decreasing in j; inf where nothing fits). Greedy: every further
    microbatch goes to whoever it slows least; for non-decreasing times that minimises the
    maximum (no worker is ever given a microbatch past the optimum's bound while another
    could take it under that bound). None: fewer microbatches than workers, or one fits
    nowhere."""
    n = len(times)
    if n == 0 or n > m or any(not row or row[0] == INF for row in times):
        return None
    ms = [1] * n
    for _ in range(m - n):
        g = min(range(n), key=lambda g: (times[g][ms[g]] if ms[g] < len(times[g]) else INF, g))
        if ms[g] >= len(times[g]) or times[g][ms[g]] == INF:
            return None
        ms[g] += 1
    return tuple(ms)


def search_formations(
    model: SyncModel,
    formations: Sequence[tuple[str, Sequence[Sequence[int]]]],
    budget_s: float = 5.0,
) -> list[SyncFormation]:
    """Every formation of two or more virtual workers (``(policy, groups of device
    indices)``), each group's pipeline searched at each M it may get, M split by
    :func:`split_microbatches`, the exchange added; fastest first. One order for all (the
    runtime runs one schedule and warm-up per job)."""
    deadline = time.monotonic() + budget_s
    found: dict[tuple[tuple[int, ...], int, str, int], SyncChoice | None] = {}

    def best(group: tuple[int, ...], m: int, kind: str, warmup: int) -> SyncChoice | None:
        key = (group, m, kind, warmup)
        if key not in found:
            left = deadline - time.monotonic()
            sub = model.sub(group, m, (kind,), (warmup,))
            c = plan_sync(sub, max(0.05, left / 4)) if left > 0 else None
            found[key] = (
                None
                if c is None
                else SyncChoice(
                    tuple(group[i] for i in c.devices), c.cuts, c.kind, c.iteration_s, c.warmup
                )
            )
        return found[key]

    out = []
    for policy, groups in formations:
        n = len(groups)
        if not 2 <= n <= model.m:
            continue
        for kind, warmup in model.orders:
            if time.monotonic() > deadline:
                break
            rows = []
            for g in groups:
                row = []
                for j in range(1, model.m - n + 2):
                    c = best(tuple(g), j, kind, warmup)
                    row.append(INF if c is None else c.iteration_s)
                rows.append(row)
            ms = split_microbatches(rows, model.m)
            if ms is None:
                continue
            vws = tuple(best(tuple(g), mg, kind, warmup) for g, mg in zip(groups, ms, strict=True))
            assert all(c is not None for c in vws)
            x = max(
                model.exchange_s(c.devices, c.cuts, len(vws))  # type: ignore[union-attr]
                for c in vws
            )
            slowest = max(c.iteration_s for c in vws)  # type: ignore[union-attr]
            out.append(SyncFormation(vws, ms, x, slowest + x, policy))  # type: ignore[arg-type]
    return sorted(out, key=lambda f: f.iteration_s)
