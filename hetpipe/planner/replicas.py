"""Stage replicas in the planner: cut a fixed device order into stages that may each hold
several consecutive devices of the order (PipeDream / Pipe-Torch style), exactly.

Index letters as in :mod:`hetpipe.planner.partition`, plus:

=====  ==============================================================
``n``  devices in the order; a stage takes the run ``[u, v)`` of them
``r``  replicas of a stage, ``v - u`` (at most ``max_replicas``)
=====  ==============================================================

**Stage time** of the group ``[u, v)`` running layers ``[a, b)``: each replica ``j`` runs its
rows' share ``s_j`` of every minibatch, split as the runtime splits it
(:func:`hetpipe.replicas.split_rows`, in proportion to the devices' ``speed``)::

    time = max over j of  stage_time(type_j, a, b, bw_in_j, bw_out_j, share = s_j) + exchange
    exchange = 2 (r - 1) param_bytes(a, b) / min bandwidth between two replicas   (r > 1)

``stage_time`` is the unreplicated stage's (forward, backward and boundary bytes scaled by
the share; the update and per-message costs whole). A replica's boundary link is the one to
the device before the group in the order (``u - 1``) and after it (``v``): the only
neighbours the order fixes, so the DP stays exact for this model. The exchange counts every
replica sending its whole gradient to each other one and receiving as much (both ends
charged, as boundary transfers are), the runtime's direct exchange
(:mod:`hetpipe.replicas`).

**Memory:** every replica holds the whole stage (weights, optimizer state, stashes) and,
conservatively, the activations of whole minibatches; it must fit each device of the group.
**Objective:** the least bottleneck over every way to group the order and cut the layers
(every device used, every stage at least one layer), by ``f(v, b) = min over (u, a) of
max(f(u, a), time(u, v, a, b))``; :func:`brute_force_replicated` checks it.

What this does not do yet: the simulator does not run replicated stages (their figures are
this table's, not a simulation's); the planner proposes a grouping next to its plan
(``train.max_replicas``) rather than running it; every layer's activations are priced as
kept (``train.activations`` is not applied here); device orders are the plan's, not
searched with replicas in mind.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from hetpipe.planner.partition import CostModel, Infeasible
from hetpipe.replicas import split_rows

__all__ = ["Replicated", "brute_force_replicated", "describe_groups", "group_time",
           "partition_replicated"]

INF = math.inf


@dataclass(frozen=True)
class Replicated:
    """A split of the model over groups of consecutive devices of an order."""

    groups: tuple[tuple[str, ...], ...]  # per stage: its devices, leader first
    cuts: tuple[tuple[int, int], ...]
    stage_times: tuple[float, ...]
    exchange_s: tuple[float, ...]  # per stage: the replicas' gradient exchange (0 alone)
    bottleneck: float

    @property
    def devices_entry(self) -> list[Any]:
        """The job file's ``devices = [...]`` for this split."""
        return [g[0] if len(g) == 1 else list(g) for g in self.groups]

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in self.cuts)

    def __bool__(self) -> bool:
        return True


def group_time(
    model: CostModel, devices: Sequence[Any], u: int, v: int, a: int, b: int,
    minibatch: int, nm: int, k: int, position: int,
) -> tuple[float, float]:
    """(time, exchange) of devices ``[u, v)`` of the order running ``[a, b)`` as stage
    ``position`` of ``k`` (inf where a replica's memory does not fit or a replica would get
    no row)."""
    group = devices[u:v]
    try:
        rows = split_rows(minibatch, [float(getattr(d, "speed", 1.0)) for d in group])
    except ValueError:
        return INF, INF
    for d in group:
        if model.stage_memory(d.type, a, b, position, k, nm).total > d.memory:
            return INF, INF
    exchange = 0.0
    if len(group) > 1:
        tc = model.costs(group[0].type)
        pbytes = float(tc.P[b] - tc.P[a])
        slowest = min(model.link(x, y) for x, y in itertools.combinations(group, 2))
        exchange = 2.0 * (len(group) - 1) * pbytes / slowest
    worst = 0.0
    for j, d in enumerate(group):
        share = (rows[j + 1] - rows[j]) / minibatch
        bw_in = model.link(devices[u - 1], d) if u > 0 else None
        bw_out = model.link(d, devices[v]) if v < len(devices) else None
        worst = max(worst, model.stage_time(d.type, a, b, bw_in, bw_out, share))
    return worst + exchange, exchange


def _groupings(n: int, max_r: int) -> Iterator[tuple[int, ...]]:
    """Every way to cut ``n`` devices into runs of at most ``max_r``: run bounds."""
    def rest(u: int) -> Iterator[tuple[int, ...]]:
        if u == n:
            yield (n,)
            return
        for v in range(u + 1, min(n, u + max_r) + 1):
            for tail in rest(v):
                yield (u, *tail)
    yield from rest(0)


def partition_replicated(
    model: CostModel, devices: Sequence[Any], nm: int, minibatch: int, max_replicas: int,
) -> Replicated | Infeasible:
    """The least-bottleneck grouping and cut of ``devices`` (in this order) under the model
    above. The number of stages is not known before the grouping, and memory and in-flight
    counts depend on it, so the DP runs once per stage count ``k``."""
    n, L = len(devices), model.L
    if max_replicas < 1:
        raise ValueError(f"max_replicas must be >= 1, got {max_replicas}")
    best: Replicated | None = None
    for k in range(-(-n // max_replicas), min(n, L) + 1):
        got = _dp(model, devices, nm, minibatch, max_replicas, k)
        if got is not None and (best is None or got.bottleneck < best.bottleneck):
            best = got
    if best is None:
        return Infeasible("no grouping of the devices fits the model (memory or rows)")
    return best


def _dp(model: CostModel, devices: Sequence[Any], nm: int, minibatch: int, max_r: int,
        k: int) -> Replicated | None:
    """Exactly ``k`` stages: f[i][(v, b)] = best bottleneck of stages 0..i-1 on devices
    ``[0, v)`` and layers ``[0, b)``."""
    n, L = len(devices), model.L
    f: list[dict[tuple[int, int], tuple[float, tuple[int, int] | None]]] = [{(0, 0): (0.0, None)}]
    for i in range(k):
        nxt: dict[tuple[int, int], tuple[float, tuple[int, int] | None]] = {}
        for (u, a), (fa, _) in f[i].items():
            for v in range(u + 1, min(n, u + max_r) + 1):
                if (n - v) < (k - i - 1) or (n - v) > (k - i - 1) * max_r:
                    continue
                for b in range(a + 1, L - (k - i - 1) + 1):
                    if i == k - 1 and (v != n or b != L):
                        continue
                    t, _ = group_time(model, devices, u, v, a, b, minibatch, nm, k, i)
                    cand = max(fa, t)
                    if cand < nxt.get((v, b), (INF, None))[0]:
                        nxt[(v, b)] = (cand, (u, a))
        f.append(nxt)
    end = f[k].get((n, L))
    if end is None or end[0] == INF:
        return None
    bounds = [(n, L)]
    for i in range(k, 0, -1):
        prev = f[i][bounds[-1]][1]
        assert prev is not None
        bounds.append(prev)
    bounds.reverse()
    return _describe(model, devices, nm, minibatch, k, bounds)


def _describe(model: CostModel, devices: Sequence[Any], nm: int, minibatch: int, k: int,
              bounds: Sequence[tuple[int, int]]) -> Replicated:
    groups, cuts, times, exch = [], [], [], []
    for i, ((u, a), (v, b)) in enumerate(itertools.pairwise(bounds)):
        t, x = group_time(model, devices, u, v, a, b, minibatch, nm, k, i)
        groups.append(tuple(d.name for d in devices[u:v]))
        cuts.append((a, b))
        times.append(t)
        exch.append(x)
    return Replicated(tuple(groups), tuple(cuts), tuple(times), tuple(exch), max(times))


def describe_groups(model: CostModel, groups: Sequence[Sequence[Any]],
                    cuts: Sequence[tuple[int, int]], nm: int, minibatch: int) -> Replicated:
    """Times of a given grouping (a job's ``devices`` with groups) and cut."""
    devices = [d for g in groups for d in g]
    starts = list(itertools.accumulate((len(g) for g in groups), initial=0))
    bounds = [(u, a) for u, (a, _) in zip(starts, cuts, strict=False)] + [(len(devices),
                                                                          cuts[-1][1])]
    return _describe(model, devices, nm, minibatch, len(groups), bounds)


def brute_force_replicated(
    model: CostModel, devices: Sequence[Any], nm: int, minibatch: int, max_replicas: int,
) -> float:
    """The least bottleneck over every grouping and cut (for tests; exponential)."""
    n, L = len(devices), model.L
    best = INF
    for runs in _groupings(n, max_replicas):
        k = len(runs) - 1
        if k > L:
            continue
        for inner in itertools.combinations(range(1, L), k - 1):
            cuts = (0, *inner, L)
            worst = max(group_time(model, devices, runs[i], runs[i + 1], cuts[i],
                                   cuts[i + 1], minibatch, nm, k, i)[0] for i in range(k))
            best = min(best, worst)
    return best
