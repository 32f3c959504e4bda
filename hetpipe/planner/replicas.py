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
    exchange = 2 (r - 1) (param_bytes(a, b) / min bandwidth between two replicas
                          + message_s + param_bytes(a, b) message_byte_s) + latency_s (r > 1)

``stage_time`` is the unreplicated stage's (forward, backward and boundary bytes scaled by
the share; the update and per-message costs whole). A replica's boundary link is the one to
the device before the group in the order (``u - 1``) and after it (``v``): the only
neighbours the order fixes, so the DP stays exact for this model. The exchange counts every
replica sending its whole gradient to each other one and receiving as much (both ends
charged, as boundary transfers are), the runtime's direct exchange
(:mod:`hetpipe.replicas`), and the others' messages' flight (``latency_s``, once: they travel
at once); :func:`exchange_time` is its one formula, which the predictor
(:mod:`hetpipe.planner.predict`) charges too, with the wake-up of the waiting replica.

**Memory:** every replica holds the whole stage (weights, optimizer state, stashes) and the
activations and working memory of its rows only (:func:`replica_memory`); it must fit each
device of the group. **What may be grouped** (the runtime's refusals, so the planner never
proposes what the head would refuse): no replicated stage holding buffers (batch-norm
statistics: each replica would keep its own), at least one row per replica, and whatever
``may_group`` refuses (the planner passes the cluster's rule: replicas on different nodes
only where a ``[[network.link]]`` joins them).
**Objective:** the least bottleneck over every way to group the order and cut the layers
(every device used, every stage at least one layer), by ``f(v, b) = min over (u, a) of
max(f(u, a), time(u, v, a, b))``; :func:`brute_force_replicated` checks it.

**Deciding** (:func:`replicate`): for each virtual worker of the plan the search chose, the
DP's best grouping of its order (or of that order with alike devices made consecutive,
:func:`candidate_orders`) is turned into a split (:func:`as_partition`) and the whole
job is predicted again with it (:func:`hetpipe.planner.predict.predict`, the predictor every
plan is compared by: the replicated stage's compute at its slowest replica's rows, its
exchange, each replica a process sharing its host); it replaces the unreplicated split where
the job's predicted rate is higher by at least 1% (:data:`GAIN`).

What this does not do: every layer's activations are priced as kept (so replicas are only
considered under ``train.activations`` "keep" or "auto", and a replicated stage keeps
everything); formations are searched without replicas in mind, and orders only as
:func:`candidate_orders` says, a group being consecutive devices of one of them.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from hetpipe.core.memory import StageMemory
from hetpipe.core.replicas import pieces_for, split_rows
from hetpipe.planner.partition import CostModel, Infeasible, Partition

__all__ = [
    "Replicated",
    "as_partition",
    "brute_force_replicated",
    "candidate_orders",
    "describe_groups",
    "exchange_time",
    "flight_time",
    "group_time",
    "partition_replicated",
    "replica_memory",
    "replicate",
]

INF = math.inf
# a replicated split replaces the plain one only where the job predicts at least this much
# faster: replicas cost processes, exchanges and a non-identical dropout; a tie is no reason
GAIN = 1.01
MayGroup = Callable[[Sequence[Any]], bool]  # may these devices replicate one stage?
Chosen = list[tuple[tuple[Any, ...], Partition]]  # per VW: its stages' devices, its split


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

    @property
    def replicated(self) -> bool:
        """Whether some stage runs on more than one device."""
        return any(len(g) > 1 for g in self.groups)

    def __bool__(self) -> bool:
        return True


def _rows(group: Sequence[Any], minibatch: int) -> list[int]:
    """A minibatch's row bounds over ``group`` as the runtime splits them (by speed)."""
    return split_rows(minibatch, [float(getattr(d, "speed", 1.0)) for d in group])


def exchange_time(model: CostModel, group: Sequence[Any], param_bytes: float) -> float:
    """The replicas' gradient exchange per minibatch (see the module docs; 0 alone)."""
    r = len(group)
    if r < 2:
        return 0.0
    rt = model.runtime
    slowest = min(model.link(x, y) for x, y in itertools.combinations(group, 2))
    return (
        2.0 * (r - 1) * (param_bytes / slowest + rt.message_s + param_bytes * rt.message_byte_s)
        + rt.latency_s
    )


def flight_time(
    model: CostModel,
    senders: Sequence[Any],
    send_rows: Sequence[int],
    receivers: Sequence[Any],
    recv_rows: Sequence[int],
    nbytes: float,
) -> float:
    """Time on the links for a minibatch's ``nbytes`` of boundary tensor to go from a stage
    split ``send_rows`` over ``senders`` to one split ``recv_rows`` over ``receivers``: each
    sender sends its rows' pieces one after the other, the senders at once (the slowest
    sender's sum)."""
    n = send_rows[-1]
    worst = 0.0
    for j, src in enumerate(senders):
        t = 0.0
        for r, lo, hi in pieces_for((send_rows[j], send_rows[j + 1]), recv_rows):
            t += nbytes * ((hi - lo) / n) / model.link(src, receivers[r])
        worst = max(worst, t)
    return worst


def replica_memory(
    model: CostModel,
    dtype: str,
    a: int,
    b: int,
    position: int,
    k: int,
    nm: int,
    share: float,
    flight: int | None = None,
) -> StageMemory:
    """A replica's memory: the whole stage's state, its rows' activations and working
    memory (``share`` of the minibatch's rows); ``flight`` as for
    :meth:`CostModel.stage_memory`."""
    mem = model.stage_memory(dtype, a, b, position, k, nm, flight=flight)
    if share >= 1.0:
        return mem
    return dataclasses.replace(
        mem, activations=math.ceil(mem.activations * share), working=math.ceil(mem.working * share)
    )


def group_time(
    model: CostModel,
    devices: Sequence[Any],
    u: int,
    v: int,
    a: int,
    b: int,
    minibatch: int,
    nm: int,
    k: int,
    position: int,
    may_group: MayGroup | None = None,
) -> tuple[float, float]:
    """(time, exchange) of devices ``[u, v)`` of the order running ``[a, b)`` as stage
    ``position`` of ``k`` (inf where the group may not replicate the stage, a replica's
    memory does not fit or a replica would get no row)."""
    group = devices[u:v]
    try:
        rows = _rows(group, minibatch)
    except ValueError:
        return INF, INF
    tc = model.costs(group[0].type)
    if len(group) > 1 and (tc.B[b] - tc.B[a] > 0 or (may_group and not may_group(group))):
        return INF, INF
    shares = [(rows[j + 1] - rows[j]) / minibatch for j in range(len(group))]
    for d, share in zip(group, shares, strict=True):
        if replica_memory(model, d.type, a, b, position, k, nm, share).total > d.memory:
            return INF, INF
    exchange = exchange_time(model, group, float(tc.P[b] - tc.P[a]))
    worst = 0.0
    for d, share in zip(group, shares, strict=True):
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
    model: CostModel,
    devices: Sequence[Any],
    nm: int,
    minibatch: int,
    max_replicas: int,
    may_group: MayGroup | None = None,
) -> Replicated | Infeasible:
    """The least-bottleneck grouping and cut of ``devices`` (in this order) under the model
    above. The number of stages is not known before the grouping, and memory and in-flight
    counts depend on it, so the DP runs once per stage count ``k``, the most stages first:
    among equal bottlenecks the grouping with the fewest replicas wins (a replica that does
    not lower the bottleneck only adds an exchange)."""
    n, L = len(devices), model.L
    if max_replicas < 1:
        raise ValueError(f"max_replicas must be >= 1, got {max_replicas}")
    best: Replicated | None = None
    for k in range(min(n, L), -(-n // max_replicas) - 1, -1):
        got = _dp(model, devices, nm, minibatch, max_replicas, k, may_group)
        if got is not None and (best is None or got.bottleneck < best.bottleneck):
            best = got
    if best is None:
        return Infeasible("no grouping of the devices fits the model (memory or rows)")
    return best


def _dp(
    model: CostModel,
    devices: Sequence[Any],
    nm: int,
    minibatch: int,
    max_r: int,
    k: int,
    may_group: MayGroup | None,
) -> Replicated | None:
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
                    t, _ = group_time(model, devices, u, v, a, b, minibatch, nm, k, i, may_group)
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
    return _describe(model, devices, nm, minibatch, k, bounds, may_group)


def _describe(
    model: CostModel,
    devices: Sequence[Any],
    nm: int,
    minibatch: int,
    k: int,
    bounds: Sequence[tuple[int, int]],
    may_group: MayGroup | None = None,
) -> Replicated:
    groups, cuts, times, exch = [], [], [], []
    for i, ((u, a), (v, b)) in enumerate(itertools.pairwise(bounds)):
        t, x = group_time(model, devices, u, v, a, b, minibatch, nm, k, i, may_group)
        groups.append(tuple(d.name for d in devices[u:v]))
        cuts.append((a, b))
        times.append(t)
        exch.append(x)
    return Replicated(tuple(groups), tuple(cuts), tuple(times), tuple(exch), max(times))


def describe_groups(
    model: CostModel,
    groups: Sequence[Sequence[Any]],
    cuts: Sequence[tuple[int, int]],
    nm: int,
    minibatch: int,
) -> Replicated:
    """Times of a given grouping (a job's ``devices`` with groups) and cut."""
    devices = [d for g in groups for d in g]
    starts = list(itertools.accumulate((len(g) for g in groups), initial=0))
    bounds = [(u, a) for u, (a, _) in zip(starts, cuts, strict=False)] + [
        (len(devices), cuts[-1][1])
    ]
    return _describe(model, devices, nm, minibatch, len(groups), bounds)


def brute_force_replicated(
    model: CostModel,
    devices: Sequence[Any],
    nm: int,
    minibatch: int,
    max_replicas: int,
    may_group: MayGroup | None = None,
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
            worst = max(
                group_time(
                    model,
                    devices,
                    runs[i],
                    runs[i + 1],
                    cuts[i],
                    cuts[i + 1],
                    minibatch,
                    nm,
                    k,
                    i,
                    may_group,
                )[0]
                for i in range(k)
            )
            best = min(best, worst)
    return best


def as_partition(
    model: CostModel, devices: Sequence[Any], r: Replicated, nm: int, minibatch: int
) -> tuple[tuple[Any, ...], Partition]:
    """A replicated split as the planner's :class:`Partition` of its stages' leaders (with
    ``groups``, ``rows`` and ``exchange_s``), and the leaders: what
    :func:`hetpipe.planner.predict.predict` and the plan take. A stage's memory is its
    leader's (every replica's was checked by the DP)."""
    by_name = {d.name: d for d in devices}
    groups = tuple(tuple(by_name[n] for n in g) for g in r.groups)
    leaders = tuple(g[0] for g in groups)
    k = len(groups)
    rows = tuple(tuple(_rows(g, minibatch)) for g in groups)
    memory = tuple(
        replica_memory(model, g[0].type, a, b, i, k, nm, (rw[1] - rw[0]) / minibatch)
        for i, (g, (a, b), rw) in enumerate(zip(groups, r.cuts, rows, strict=True))
    )
    p = Partition(
        tuple(d.name for d in leaders),
        tuple(d.type for d in leaders),
        r.cuts,
        r.stage_times,
        memory,
        tuple(d.memory for d in leaders),
        nm,
        r.bottleneck,
        ((),) * k,
        memory,
        (),
        groups,
        rows,
        r.exchange_s,
    )
    return leaders, p


def replicate(
    model: CostModel,
    kept: Sequence[tuple[Sequence[Any], Partition]],
    predict: Callable[[Sequence[tuple[Sequence[Any], Partition]]], Any],
    *,
    minibatch: int,
    max_replicas: int,
    may_group: MayGroup | None = None,
) -> tuple[Chosen, Any, list[dict[str, Any]]]:
    """Per virtual worker of ``kept`` (its order and unreplicated split), the DP's best
    grouping of that order against the split without replicas, compared by ``predict`` on
    the whole job (``predict(chosen).sim``, the planner's predictor), one VW after the other,
    taken where the job predicts at least :data:`GAIN` faster. Returns the chosen splits,
    their prediction, and per VW a note of what was weighed (``Plan.details``)."""
    chosen: Chosen = [(tuple(o), p) for o, p in kept]
    pred = predict(chosen)
    notes: list[dict[str, Any]] = []
    for v, (order, p) in enumerate(kept):
        note: dict[str, Any] = {"vw": v, "chosen": False}
        found = [
            (x, partition_replicated(model, x, p.nm, minibatch, max_replicas, may_group))
            for x in candidate_orders(order)
        ]
        ok = [(x, r) for x, r in found if isinstance(r, Replicated)]
        if not ok:
            note["why"] = found[0][1].reason  # type: ignore[union-attr]
            notes.append(note)
            continue
        order, r = min(ok, key=lambda xr: xr[1].bottleneck)  # type: ignore[union-attr]
        if not r.replicated:
            note["why"] = "no grouping with a replicated stage lowers the bottleneck"
            notes.append(note)
            continue
        leaders, q = as_partition(model, order, r, p.nm, minibatch)
        trial = list(chosen)
        trial[v] = (leaders, q)
        got = predict(trial)
        before, after = pred.sim, got.sim
        note.update(
            groups=[list(g) for g in r.groups],
            layers=list(r.layers),
            exchange_s=list(r.exchange_s),
            minibatch_s=_per_minibatch(after, v, minibatch),
            unreplicated_minibatch_s=_per_minibatch(before, v, minibatch),
            samples_per_s=after.job_samples_per_s,
            unreplicated_samples_per_s=before.job_samples_per_s,
        )
        if after.job_samples_per_s > GAIN * before.job_samples_per_s:
            note["chosen"] = True
            chosen, pred = trial, got
        notes.append(note)
    return chosen, pred, notes


def candidate_orders(order: Sequence[Any]) -> list[tuple[Any, ...]]:
    """The orders whose groupings are weighed for one VW: its plan's order (searched without
    replicas), and the same devices with alike ones (same node and type) next to each other,
    in the order each kind first appears and reversed, so that devices that could replicate
    one stage are consecutive. Duplicates dropped; the plan's order first (it wins ties)."""
    kinds: dict[tuple[str, str], list[Any]] = {}
    for d in order:
        kinds.setdefault((str(getattr(d, "node", "")), d.type), []).append(d)
    alike = tuple(d for devs in kinds.values() for d in devs)
    out: list[tuple[Any, ...]] = []
    for x in (tuple(order), alike, alike[::-1]):
        if x not in out:
            out.append(x)
    return out


def _per_minibatch(sim: Any, v: int, minibatch: int) -> float:
    """VW ``v``'s predicted time per minibatch in its steady state."""
    rate = sim.vw_samples_per_s[v]
    return minibatch / rate if rate > 0 else INF
