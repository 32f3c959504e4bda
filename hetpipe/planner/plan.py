"""The plan: which devices form each virtual worker, in which order, with which layers and Nm.

:func:`make_plan` searches (formation -> device order -> exact split and Nm -> simulated
throughput under WSP) and returns a :class:`Plan` that the runtime executes and a person can
read (:meth:`Plan.table`). Alike VWs (equal up to renaming devices and nodes) share one order
search; formations whose throughput bound cannot beat the best so far are skipped, and so
is the simulation of one whose estimate is far below the best estimate simulated
(:data:`SIM_MARGIN`, a heuristic). Because
WSP couples VWs by *waves* of Nm minibatches, the search also tries raising the Nm of faster
VWs so that every VW's wave takes about as long (:meth:`_Search.balance`). With
``max_replicas`` > 1 it then weighs, per VW, running a stage on several of its devices
(:func:`hetpipe.planner.replicas.replicate`) by the same prediction.

:func:`hetpipe.planner.explicit.explicit_plan` prices a split the user wrote in the job
file with the same helpers; the plan's types and table are :mod:`hetpipe.planner.plans`.

Parameter placement is :func:`hetpipe.planner.placement.place_stages` (its rule and what it
costs on the links live there). Each stage reports the shard holding most of its bytes;
``Plan.layer_shards`` has the full per-layer map.

Memory, two figures per stage, one model (:mod:`hetpipe.core.memory`): ``memory`` at the
most minibatches the schedule lets the stage hold under ANY timing, the bound every cap is
checked against; ``expected_memory`` at the most its predicted timeline held
(:func:`hetpipe.core.memory.expected_in_flight`), the peak a run of that timing reaches.
Under ``train.in_flight = "plan"`` (:func:`_limited`) the second is the first: each stage is
limited to the count its predicted timeline held, and reaches it under any timing.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from hetpipe.core.layout import StageLayout
from hetpipe.core.memory import StageMemory, expected_in_flight, fixed_order, in_flight
from hetpipe.core.profile import ModelProfile
from hetpipe.core.replicas import check_group
from hetpipe.core.schedule import fill_counts
from hetpipe.planner.bounds import MemoryBounds
from hetpipe.planner.costs import check_devices
from hetpipe.planner.formation import Formation, best_formation, candidate_formations
from hetpipe.planner.order import OrderResult, best_order
from hetpipe.planner.partition import CostModel, Infeasible, Partition
from hetpipe.planner.placement import compare_placements, place_plan, place_stages
from hetpipe.planner.plans import Plan, PlanError, PlanInputs, StagePlan, VWPlan
from hetpipe.planner.predict import Prediction, predict
from hetpipe.planner.replicas import (
    replica_memory,
    replicate,
)
from hetpipe.planner.runtime import RuntimeCosts
from hetpipe.planner.simulate import SimLink, SimStage, SimVW
from hetpipe.planner.staleness import (
    best_effective_nm,
    deep_warnings,
    effective_rate,
    factor,
    summary,
)

__all__ = ["make_plan", "place_stages", "sim_vw"]


NM_MAX = 32  # the most minibatches per wave the planner gives a VW when balancing waves
TRIM_MAX = 16  # the largest VW from which the search tries leaving a device out
TRIM_GAIN = 0.01  # the least relative gain of a VW's rate that leaves a device out
# a formation whose estimate (its VWs' estimated rates at their Nm's staleness factor) is
# more than SIM_MARGIN below the best estimate of a formation simulated before it is not
# simulated: a heuristic (the simulator, not the estimate, ranks formations), measured to
# keep every benchmark plan (the chosen formation's estimate was at least 0.94 of the best
# estimate before it)
SIM_MARGIN = 0.15
# a VW's rate bound (_Search.vw_bound) over its estimate's: the simulator's finite window
SIM_SLACK = 1.02


# --------------------------------------------------------------------------- search


def sim_vw(model: CostModel, devices: Sequence[Any], p: Partition, minibatch: int) -> SimVW:
    """The simulator's view of a split on an ideal runtime: compute per stage (layers only)
    and transfer time per link. :func:`.predict.predict` adds the runtime's costs."""
    prof = model.profile
    stages = []
    for d, (a, b) in zip(devices, p.cuts, strict=True):
        t = model.stage_times_at(d.type, a, b)
        stages.append(SimStage(t.fwd_s, t.bwd_s + t.update_s))
    links = []
    for i in range(len(devices) - 1):
        out = prof.layers[devices[i].type][p.cuts[i][1] - 1].out_bytes
        t = out / model.link(devices[i], devices[i + 1])
        links.append(SimLink(t, t))
    return SimVW(tuple(stages), p.nm, tuple(links), minibatch, ",".join(p.devices))


@dataclass
class _Search:
    """Shared state of one planning run: caches across formations."""

    model: CostModel
    inputs: PlanInputs
    shard_hosts: tuple[str, ...] = ()
    vw_memo: dict[tuple, OrderResult] = field(default_factory=dict)
    formations: int = 0
    orders: int = 0
    trim_memo: dict[tuple, tuple[OrderResult, list[Any]]] = field(default_factory=dict)
    raw: dict[str, float] = field(default_factory=dict)  # formation -> its samples/s
    incumbent: float = -math.inf  # the best score of a formation evaluated so far
    estimate: float = -math.inf  # the best estimate (:meth:`estimated`) of one simulated
    # formation -> (its estimate, or its bound on it; the best estimate; whether a bound)
    unsimulated: dict[str, tuple[float, float, bool]] = field(default_factory=dict)
    memory: MemoryBounds = field(init=False)  # the memory-aware parts of :meth:`vw_bound`
    bounds: dict[tuple, float] = field(default_factory=dict)  # vw_bound by types and memory

    def __post_init__(self) -> None:
        self.memory = MemoryBounds(self.model)

    def canon(self, group: Sequence[Any]) -> tuple[tuple, list[Any]]:
        """A key equal for groups alike up to renaming devices and nodes, and an order of
        the group's devices that aligns alike groups device by device."""
        if not self.model.uniform_nodes:
            names = tuple(sorted(d.name for d in group))
            return ("exact", names), sorted(group, key=lambda d: d.name)
        nodes: dict[str, list[Any]] = {}
        for d in group:
            nodes.setdefault(d.node, []).append(d)
        blocks = []
        for devs in nodes.values():
            devs = sorted(devs, key=lambda d: (d.type, d.memory, d.speed, d.name))
            blocks.append((tuple((d.type, d.memory, d.speed) for d in devs), devs))
        blocks.sort(key=lambda x: x[0])
        return ("iso", tuple(k for k, _ in blocks)), [d for _, devs in blocks for d in devs]

    def nm_cap(self, k: int) -> int | None:
        """The most Nm a VW of ``k`` devices may get: the job's ``max_nm`` where it is
        below the order search's own limit (k), else None (no extra cap)."""
        cap = self.inputs.max_nm
        return cap if cap is not None and cap < k else None

    def vw(self, group: Sequence[Any]) -> OrderResult:
        """The best order of ``group`` and its split, Nm chosen for the best effective rate
        (:func:`hetpipe.planner.staleness.best_effective_nm`) under the job's ``max_nm``."""
        key, canon = self.canon(group)
        hit = self.vw_memo.get(key)
        if hit is None:
            cap = self.nm_cap(len(canon))
            cands = range(1, cap + 1) if cap is not None and self.inputs.nm is None else None
            hit = best_order(self.model, canon, nm=self.inputs.nm, nm_candidates=cands)
            if isinstance(hit.partition, Partition) and self.inputs.nm is None:
                p = best_effective_nm(self.model, hit.order, hit.partition, self.inputs.weights)
                hit = dataclasses.replace(hit, partition=p)
            self.orders += hit.evaluated
            self.vw_memo[key] = hit
            return hit
        _, canon_hit = self.canon(hit.order)
        mapping = {id(x): y for x, y in zip(canon_hit, canon, strict=True)}
        order = tuple(mapping[id(d)] for d in hit.order)
        p = hit.partition
        # same device sequence key as the cached split: a memo hit, renamed to these devices
        nm = p.nm if isinstance(p, Partition) else (self.inputs.nm or 1)
        split = self.model.partition if self.inputs.nm is not None else self.model.best_rate
        p = split(order, nm)
        return dataclasses.replace(hit, order=order, partition=p, evaluated=0)

    def evaluate(self, f: Formation) -> tuple[float, Any]:
        """Effective rate of a formation (:meth:`score`): each VW's best order, split and Nm,
        less any device whose VW predicts faster without it (:meth:`trimmed`, each such
        choice confirmed by the simulator); then, unless Nm is fixed, the same with Nm
        re-balanced across VWs (see :meth:`balance`), keeping whichever scores higher.
        Last, the slowest VW is left out whole where the job then simulates faster (its
        waves held the others at the WSP gate), tried only where the others' rates without
        their gate waits (:func:`_unwaited`) could beat both this formation and the best
        one so far; repeated while it pays. A formation whose VWs' estimate
        (:meth:`estimated`) is more than :data:`SIM_MARGIN` below the best estimate of a
        formation simulated before it scores -inf unsimulated (``unsimulated``); so does one
        whose :meth:`upper_bound`, never below its estimate, already is, before any of its
        VWs' orders is searched."""
        self.formations += 1
        floor = self.estimate * (1.0 - SIM_MARGIN)
        if floor > 0:
            # the estimate has no simulated window: the bound without its slack holds it
            bound = self.upper_bound(f) / SIM_SLACK
            if bound < floor:  # its estimate is below too: the same skip, without the VWs
                self.unsimulated[f.describe()] = (bound, self.estimate, True)
                return -math.inf, ([], None, [], [])
        kept: list[tuple[tuple[Any, ...], Partition]] = []
        dropped: list[tuple[tuple[Any, ...], str]] = []
        trims: list[tuple[int, tuple[Any, ...], list[Any]]] = []  # (kept index, group, out)
        for g in f.groups:
            r, out = self.trimmed(g)
            if isinstance(r.partition, Partition):
                if out:
                    trims.append((len(kept), tuple(g), out))
                kept.append((r.order, r.partition))
            else:
                dropped.append((tuple(g), r.partition.reason))
        if not kept:
            return -math.inf, (kept, None, dropped, [])
        estimate = self.estimated(kept)
        if estimate < floor:
            self.unsimulated[f.describe()] = (estimate, self.estimate, False)
            return -math.inf, (kept, None, dropped, [])
        self.estimate = max(self.estimate, estimate)
        best = self.variants(kept)
        left: list[dict[str, Any]] = []
        for v, g, out in trims:
            for d in out:
                # the VW as it is, with d put back: the simulator's figure with it
                names = {x.name for x in kept[v][0]} | {d.name}
                back = [x for x in g if x.name in names]
                r = self.vw(back)
                if not isinstance(r.partition, Partition):
                    continue
                alt = list(kept)
                alt[v] = (r.order, r.partition)
                with_d = self.variants(alt)
                if with_d[0] > best[0]:  # the simulator disagrees: keep the device
                    kept, best = alt, with_d
                    continue
                left.append(
                    {
                        "device": d.name,
                        "type": d.type,
                        "node": d.node,
                        "vw_devices": [x.name for x in g],
                        "with_samples_per_s": with_d[1][1].sim.job_samples_per_s,
                        "without_samples_per_s": best[1][1].sim.job_samples_per_s,
                    }
                )
        while len(kept) > 1:  # a whole VW whose waves hold the others back
            v = min(range(len(kept)), key=lambda u: kept[u][1].minibatches_per_s)
            rest = kept[:v] + kept[v + 1 :]
            bar = max(best[0], self.incumbent) * (1 + TRIM_GAIN)
            if _unwaited(best[1][1].sim, v) <= bar:
                break  # the others, never held at the gate, cannot beat it or the best so far
            without = self.variants(rest)
            if without[0] <= best[0] * (1 + TRIM_GAIN):
                break
            for d in kept[v][0]:
                left.append(
                    {
                        "device": d.name,
                        "type": d.type,
                        "node": d.node,
                        "vw_devices": [x.name for x in kept[v][0]],
                        "with_samples_per_s": best[1][1].sim.job_samples_per_s,
                        "without_samples_per_s": without[1][1].sim.job_samples_per_s,
                        "whole_vw": True,
                    }
                )
            kept, best = rest, without
        score, (chosen, res) = best
        self.raw[f.describe()] = res.sim.job_samples_per_s
        self.incumbent = max(self.incumbent, score)
        return score, (chosen, res, dropped, left)

    def variants(
        self, kept: list[tuple[tuple[Any, ...], Partition]]
    ) -> tuple[float, tuple[list[tuple[tuple[Any, ...], Partition]], Prediction]]:
        """The better-scoring (:meth:`score`) of ``kept`` and, unless Nm is fixed, ``kept``
        with Nm balanced across its VWs: ``(score, (chosen, prediction))``."""
        options = [kept]
        if self.inputs.nm is None and len(kept) > 1:
            balanced = self.balance(kept)
            if balanced != kept:
                options.append(balanced)
        best: tuple[float, Any] | None = None
        for chosen in options:
            res = self.predict(chosen)
            s = self.score(chosen, res)
            if best is None or s > best[0]:
                best = (s, (chosen, res))
        assert best is not None
        return best

    def score(self, chosen: Sequence[tuple[Sequence[Any], Partition]], res: Prediction) -> float:
        """The job's predicted samples/s weighted by the staleness rule
        (:func:`hetpipe.planner.staleness.effective_rate`): each VW's share of the job's
        rate counted at its Nm's factor."""
        rates = res.sim.vw_samples_per_s
        total = sum(rates)
        if not total > 0 or not math.isfinite(total):
            return res.sim.job_samples_per_s
        eff = effective_rate(rates, [p.nm for _, p in chosen], self.inputs.weights)
        return res.sim.job_samples_per_s * eff / total

    def estimated(self, kept: Sequence[tuple[Sequence[Any], Partition]]) -> float:
        """The samples/s the VWs' splits estimate (:attr:`Partition.minibatches_per_s`) at
        their Nm's staleness factor: what decides whether a formation is simulated
        (:data:`SIM_MARGIN`)."""
        weights = self.inputs.weights
        rate = sum(p.minibatches_per_s * factor(p.nm, weights) for _, p in kept)
        return rate * self.inputs.minibatch

    def vw_score(self, r: OrderResult) -> float:
        """A VW's estimated minibatches/s at its Nm's staleness factor; -inf where no split
        fits."""
        p = r.partition
        if not isinstance(p, Partition):
            return -math.inf
        return p.minibatches_per_s * factor(p.nm, self.inputs.weights)

    def gains_without(self, r: OrderResult, d: Any, here: float) -> bool:
        """Whether ``r``'s order with ``d`` taken out, at the same Nm, has a least-bottleneck
        split (one DP, no order or Nm search) that scores above ``here``: the cheap test a
        device passes before its VW's order is searched without it."""
        assert isinstance(r.partition, Partition)
        order = [x for x in r.order if x is not d]
        nm = min(r.partition.nm, len(order))
        p = self.model.partition(order, nm)
        if not isinstance(p, Partition):
            return False
        return p.minibatches_per_s * factor(p.nm, self.inputs.weights) > here * (1 + TRIM_GAIN)

    def trimmed(self, group: Sequence[Any]) -> tuple[OrderResult, list[Any]]:
        """The group's best VW (:meth:`vw`) after leaving out, one at a time, each device
        whose VW estimates a higher rate without it (:meth:`vw_score`), and the devices left
        out in that order.

        The slowest stage bounds a pipeline, and every device is a stage: a device too slow
        (or too small) for even the least layer it could take can cost its VW more than it
        adds. Each round tries one device of every class (type, memory, speed, node: the
        others of a class are interchangeable with it) and skips one whose VW without it is
        bounded (:meth:`vw_bound`) below the rate already reached, or whose VW in the same
        order without it estimates no gain (:meth:`gains_without`: a heuristic filter, so
        a device that pays only after the order changes is kept); the best improvement
        wins, until none improves. VWs of more than :data:`TRIM_MAX` devices keep every
        device (the order search of each trial is the heuristic one there), and so does
        every VW of a job that fixes Nm (``train.nm``): it chose how deep its pipelines are,
        and the plan warns where one cannot fill instead."""
        key = tuple(sorted(d.name for d in group))
        hit = self.trim_memo.get(key)
        if hit is not None:
            return hit
        cur = list(group)
        r = self.vw(cur)
        out: list[Any] = []
        while (
            self.inputs.nm is None
            and 1 < len(cur) <= TRIM_MAX
            and isinstance(r.partition, Partition)
        ):
            here = self.vw_score(r)
            found: tuple[float, Any, OrderResult, list[Any]] | None = None
            seen: set[tuple] = set()
            for d in cur:
                cls = (d.type, d.memory, float(getattr(d, "speed", 1.0)), d.node)
                if cls in seen:
                    continue
                seen.add(cls)
                rest = [x for x in cur if x is not d]
                if self.vw_bound(rest) <= here * self.inputs.minibatch * (1 + 1e-9):
                    continue  # cannot beat the rate with d
                if not self.gains_without(r, d, here):
                    continue
                q = self.vw(rest)
                s = self.vw_score(q)
                if s > here * (1 + TRIM_GAIN) and (found is None or s > found[0]):
                    found = (s, d, q, rest)
            if found is None:
                break
            _, d, r, cur = found
            out.append(d)
        self.trim_memo[key] = (r, out)
        return r, out

    def predict(self, chosen: Sequence[tuple[Sequence[Any], Partition]]) -> Prediction:
        """Simulated rates of the chosen VWs with the runtime's costs and host sharing."""
        return _predict(self.model, chosen, self.inputs, self.shard_hosts)

    def balance(
        self, kept: Sequence[tuple[tuple[Any, ...], Partition]]
    ) -> list[tuple[tuple[Any, ...], Partition]]:
        """Raise the Nm of faster VWs so that every VW's wave takes about as long.

        WSP couples VWs by *waves* (Nm minibatches each), so a VW whose waves are shorter
        than the slowest VW's waits at the gate. A wave of VW v takes about ``Nm_v / r_v``
        (``r_v`` its minibatch rate); giving v ``Nm_v = floor(W * r_v)`` with ``W`` the
        slowest wave time lets every VW run at its own rate. More Nm costs memory on every
        stage but the last (nothing on a one-device VW), so a larger Nm is kept only where
        it still fits and does not lower the VW's own rate. Capped at :data:`NM_MAX`.
        """
        rates = [p.minibatches_per_s for _, p in kept]
        wave = max(p.nm / r for (_, p), r in zip(kept, rates, strict=True))
        out = []
        for (order, p), r in zip(kept, rates, strict=True):
            want = min(self.inputs.max_nm or NM_MAX, NM_MAX, int(wave * r * (1 + 1e-9)))
            choice = p
            for n in dict.fromkeys((want, (want + p.nm) // 2)):
                if n <= p.nm:
                    continue
                q = self.model.partition(order, n)
                if isinstance(q, Partition) and q.minibatches_per_s >= r * (1 - 1e-9):
                    choice = q
                    break
            out.append((order, choice))
        return out

    def upper_bound(self, f: Formation) -> float:
        """Never below :meth:`evaluate`, nor below :data:`SIM_SLACK` times :meth:`estimated`
        of the VWs it keeps: the sum of the VWs' bounds (:meth:`vw_bound`)."""
        return sum(self.vw_bound(g) for g in f.groups)

    def vw_bound(self, group: Sequence[Any]) -> float:
        """The most samples/s, at its Nm's staleness factor, any VW of the group's devices
        (or of some of them) reaches, and nothing if the group's memory is below the least
        the model needs. Two limits, whichever is lower at each Nm the VW may get (its
        candidates, the balanced Nm up to :data:`NM_MAX`, the job's ``nm`` or ``max_nm``):
        one minibatch per least possible bottleneck (:meth:`CostModel.rest_bound` over all
        layers), and Nm minibatches per least possible round trip (a VW keeps at most Nm in
        flight, each for its whole round trip): the larger of
        :meth:`CostModel.round_trip_floor` and the floor with every device holding no more
        than its memory (:meth:`MemoryBounds.trip_floor`), the better Nm's figure taken, up
        to the most Nm any split of the group fits (:meth:`MemoryBounds.nm_ceiling`); both
        times :data:`SIM_SLACK` for the simulator's finite window. Every part depends on
        the devices' types and memory alone, so the bound is kept by them: the formation
        search asks it of each candidate's groups, then again of the one it evaluates, and
        of many alike groups."""
        key = tuple(sorted((d.type, d.memory) for d in group))
        hit = self.bounds.get(key)
        if hit is None:
            hit = self.bounds[key] = self._vw_bound(group)
        return hit

    def _vw_bound(self, group: Sequence[Any]) -> float:
        """:meth:`vw_bound`, computed."""
        if (
            len(group) > self.model.L
            or sum(d.memory for d in group) < self.model.min_total_memory()
        ):
            return 0.0
        lb = float(self.model.rest_bound(group)[0])
        if lb <= 0:
            return math.inf
        per_bottleneck = SIM_SLACK * self.inputs.minibatch / lb
        trip = max(self.model.round_trip_floor(group), self.memory.trip_floor(group))
        if not trip > 0:
            return per_bottleneck
        if self.inputs.nm is not None:
            nms: Sequence[int] = (self.inputs.nm,)
        else:
            top = max(len(group), NM_MAX)
            top = min(top, self.inputs.max_nm or top)
            nms = range(1, self.memory.nm_ceiling(group, top) + 1)
        per_trip = SIM_SLACK * self.inputs.minibatch / trip
        return max(min(per_bottleneck, per_trip * n) * factor(n, self.inputs.weights) for n in nms)


def _unwaited(sim: Any, v: int) -> float:
    """The samples/s of every VW but ``v`` as simulated, each with the time it waited at the
    WSP gate taken off: about the most they reach once ``v`` no longer holds them back
    (without v only the gate's waits can shrink; a filter, the simulator decides)."""
    total = 0.0
    for u, rate in enumerate(sim.vw_samples_per_s):
        if u == v:
            continue
        finish = sim.vw_finish_s[u]
        busy = finish - sim.gate_wait_s[u]
        total += rate * (finish / busy if busy > 0 else math.inf)
    return total


def _limited(
    model: CostModel,
    kept: Sequence[tuple[Sequence[Any], Partition]],
    pred: Prediction,
    predict_chosen: Callable[[Sequence[tuple[Sequence[Any], Partition]]], Prediction],
) -> tuple[list[tuple[Sequence[Any], Partition]], Prediction]:
    """``kept`` with every async stage whose held count depends on timing limited to the
    count ``pred``'s timeline held (``train.in_flight = "plan"``), and the prediction of
    that: what :func:`make_plan` returns under it.

    Such a stage (greedy order, weights stashed, not the last) holds anywhere from a few
    minibatches up to Nm, depending on how its successors keep pace on the day: where a
    minibatch's round trip sits near a multiple of the time between its forwards, one run
    holds one more than the next. Limited and filled
    (:class:`hetpipe.core.schedule.StageSchedule`'s ``limit`` and ``fill``,
    :func:`hetpipe.core.schedule.fill_counts`), it runs that many forwards before its first
    backward and never holds more, so the count is reached under any timing and is its
    bound: the stage's ``in_flight`` and ``memory`` are those figures. The timeline is
    simulated again as the runtime runs it, limits and fills included (the fill may hold a
    backward back at the start); a stage after one limited lower is filled only to that
    lower count, and its expected count is what the new timeline held. A stage on a fixed
    order (weights not stashed) already holds its own count and is left as it is."""
    if fixed_order("async", model.weights):
        return list(kept), pred
    out: list[tuple[Sequence[Any], Partition]] = []
    for v, (devs, p) in enumerate(kept):
        limits = tuple(
            expected_in_flight(pred.sim.peak_in_flight[v][i], i, p.k, p.nm, weights=model.weights)
            if i < p.k - 1
            else 0
            for i in range(p.k)
        )
        out.append((devs, dataclasses.replace(p, limits=limits) if any(limits) else p))
    return out, predict_chosen(out)


def make_plan(
    cluster: Any,
    profile: ModelProfile,
    inputs: PlanInputs | None = None,
    **options: Any,
) -> Plan:
    """Search formations, orders, splits and Nm for the highest predicted throughput.

    ``cluster`` is a :class:`hetpipe.config.ClusterConfig` (or anything with ``devices``,
    ``network.bytes_per_s(a, b)`` and ``ps``). ``inputs`` are the job's
    (:class:`PlanInputs`, where each field is said); ``options`` (its field names as
    keywords) replace them, or are all of them where ``inputs`` is None. Under
    ``activations`` "auto" a stage short of memory recomputes the cheapest run of layers or
    swaps the layers that make it fit, whichever adds less time, chosen with the cuts
    (:mod:`hetpipe.planner.partition`). With ``max_replicas`` > 1 each VW may run a stage on
    up to that many consecutive devices of its order, where the predictor says the job is
    faster so (:func:`hetpipe.planner.replicas.replicate`; ``details["replica_choice"]``
    says what was weighed), a replica's compute priced at its rows from ``row_profiles``
    (:meth:`CostModel.compute_at`; else proportional to its rows). Under ``in_flight``
    "plan" each stage is limited to the count its predicted timeline held
    (:func:`_limited`); under "nm" it may hold what the schedule permits. Raises
    :class:`PlanError` when the model fits on no group of devices.
    """
    inputs = PlanInputs.of(inputs, options)
    minibatch, policy, num_vws = inputs.minibatch, inputs.policy, inputs.num_vws
    if minibatch < 1:
        raise PlanError(f"minibatch must be >= 1, got {minibatch}")
    if inputs.staleness < 0:
        raise PlanError(f"staleness must be >= 0, got {inputs.staleness}")
    if inputs.nm is not None and inputs.nm < 1:
        raise PlanError(f"nm must be >= 1, got {inputs.nm}")
    if inputs.max_nm is not None and inputs.max_nm < 1:
        raise PlanError(f"max_nm must be >= 1, got {inputs.max_nm}")
    if inputs.nm is not None and inputs.max_nm is not None and inputs.nm > inputs.max_nm:
        raise PlanError(f"nm {inputs.nm} is above max_nm {inputs.max_nm}")
    warnings: list[str] = []
    profile = _at_minibatch(profile, minibatch, warnings)
    devices = tuple(cluster.devices)
    check_devices(devices, cluster.network.bytes_per_s)
    usable = tuple(d for d in devices if d.type in profile.layers)
    unused: list[tuple[str, str]] = [
        (d.name, f"no profile for its type {d.type!r}") for d in devices if d not in usable
    ]
    if not usable:
        raise PlanError(
            f"no device has a profile: profiled types {', '.join(profile.layers) or '(none)'}, "
            f"cluster types {', '.join(dict.fromkeys(d.type for d in devices))}"
        )
    model = _cost_model(cluster, profile, inputs)
    search = _Search(model, inputs, _shard_hosts(cluster))
    try:
        cands = candidate_formations(usable, policy, num_vws, power=_power(profile))
    except ValueError as e:
        raise PlanError(str(e)) from e
    trace: list[dict[str, Any]] = []  # every candidate's figure, for `hetpipe plan --explain`
    found = best_formation(cands, search.evaluate, search.upper_bound, trace)
    if found is None:
        raise PlanError(
            f"policy {policy!r}"
            + (f" with {num_vws} VWs" if num_vws is not None else "")
            + f" forms no virtual worker from the {len(usable)} usable devices"
        )
    formation, _, (kept, pred, dropped, left) = found
    for e in trace:  # the candidates' plain samples/s beside their staleness-weighted score
        if e["formation"] in search.unsimulated:
            mine, top, bounded = search.unsimulated[e["formation"]]
            its = f"its bound {mine:.4g} on its estimate" if bounded else f"its estimate {mine:.4g}"
            e["skipped"] = (
                f"{its} is more than {SIM_MARGIN:.0%} below the best "
                f"estimate {top:.4g} of a formation simulated before it (not simulated)"
            )
            e["not_simulated"] = True
        e["samples_per_s"] = search.raw.get(e["formation"]) if e.get("score") is not None else None
    if not kept:
        group, why = max(dropped, key=lambda x: sum(d.memory for d in x[0]))
        if len(usable) <= model.L:
            everything = search.vw(usable).partition
            if isinstance(everything, Infeasible):
                raise PlanError(
                    f"the model fits on no virtual worker, not even all {len(usable)} usable "
                    f"devices together: {everything.reason}"
                )
            raise PlanError(
                f"policy {policy!r} forms no virtual worker that can hold the model "
                f"({','.join(d.name for d in group)}: {why}); all devices together could "
                "(try policy 'auto' or fewer VWs)"
            )
        raise PlanError(
            f"the model fits on no virtual worker; on {','.join(d.name for d in group)}: {why}"
        )
    unused += list(formation.unused)
    for e in left:
        e["why"] = (
            (
                f"left out with its whole VW ({','.join(e['vw_devices'])}): predicted "
                if e.get("whole_vw")
                else f"left out of its VW ({','.join(e['vw_devices'])}): predicted "
            )
            + f"{e['with_samples_per_s']:.1f} samples/s with it, "
            + f"{e['without_samples_per_s']:.1f} without "
            + (
                "(its waves hold the other VWs back at the WSP gate)"
                if e.get("whole_vw")
                else "(the slowest stage bounds a pipeline)"
            )
        )
        unused.append((e["device"], e["why"]))
    for g, why in dropped:
        unused += [
            (d.name, f"its VW ({','.join(x.name for x in g)}) cannot hold the model: {why}")
            for d in g
        ]
    details: dict[str, Any] = {
        "formations_evaluated": search.formations,
        "formations_considered": len(cands),
        "orders_evaluated": search.orders,
        "dp_runs": model.dp_runs,
        "dp_steps": model.dp_steps,
        "formation": formation.describe(),
        "candidates": trace,
        "left_out": left,
    }
    if inputs.max_replicas > 1:
        if inputs.activations in ("keep", "auto"):
            kept, pred, notes = replicate(
                model,
                kept,
                search.predict,
                minibatch=minibatch,
                max_replicas=inputs.max_replicas,
                may_group=may_replicate(cluster, minibatch),
            )
        else:  # the replica DP prices every activation as kept
            notes = [
                {
                    "vw": v,
                    "chosen": False,
                    "why": f"train.activations = {inputs.activations!r} "
                    "(replicas are planned keeping every activation)",
                }
                for v in range(len(kept))
            ]
        details["replica_choice"] = notes
    if inputs.in_flight == "plan":
        kept, pred = _limited(model, kept, pred, search.predict)

    nms = [p.nm for _, p in kept]
    details["staleness"] = summary(pred.sim.vw_samples_per_s, nms, inputs.weights)
    details["staleness"]["effective_samples_per_s"] = search.score(kept, pred)
    if inputs.max_nm is not None:
        details["staleness"]["max_nm"] = inputs.max_nm
    warnings.extend(deep_warnings(nms, inputs.weights))

    def placed(pl: str) -> float:  # the plan's samples/s with its parameters placed by pl
        same = pl == inputs.placement
        at = pred if same else _predict(model, kept, inputs, search.shard_hosts, pl)
        return at.sim.job_samples_per_s

    details["placements"] = compare_placements(placed, inputs.placement)
    return _assemble(
        cluster,
        model,
        kept,
        pred,
        formation.policy,
        unused,
        warnings,
        inputs,
        details,
    )


# --------------------------------------------------------------------------- helpers


def _at_minibatch(profile: ModelProfile, minibatch: int, warnings: list[str]) -> ModelProfile:
    if profile.minibatch != minibatch:
        warnings.append(
            f"profile measured at minibatch {profile.minibatch}, scaled linearly to {minibatch} "
            "(profile at the job's minibatch for better predictions)"
        )
        return profile.scaled(minibatch)
    return profile


def _cost_model(cluster: Any, profile: ModelProfile, inputs: PlanInputs) -> CostModel:
    """The cost model of ``profile`` on ``cluster`` as ``inputs`` price it; raises
    :class:`PlanError` naming a device, link or layer it cannot price."""
    net = cluster.network
    check_devices(tuple(cluster.devices), net.bytes_per_s)
    speeds: dict[str, float] = {}
    for d in cluster.devices:
        speeds[d.type] = min(speeds.get(d.type, math.inf), float(getattr(d, "speed", 1.0)))
    model = CostModel(
        profile,
        net.bytes_per_s,
        inputs.optimizer_state_factor,
        (inputs.costs or RuntimeCosts()).with_runtime(cluster),
        speeds,
        inputs.weights,
        inputs.activations,
        inputs.row_profiles,
    )
    # bandwidth depends only on "same node or not": alike groups can share a search
    model.uniform_nodes = not getattr(net, "links", ()) and hasattr(net, "inter_node_gbps")
    return model


def may_replicate(cluster: Any, minibatch: int) -> Callable[[Sequence[Any]], bool]:
    """Whether the runtime would run a stage on these devices
    (:func:`hetpipe.replicas.check_group`: a row each, and on one node or joined by a
    ``[[network.link]]``)."""

    def ok(group: Sequence[Any]) -> bool:
        try:
            check_group(cluster, group, minibatch)
        except ValueError:
            return False
        return True

    return ok


def _shard_hosts(cluster: Any) -> tuple[str, ...]:
    return tuple(str(s.host) for s in getattr(cluster, "ps", ()) or ())


def _predict(
    model: CostModel,
    chosen: Sequence[tuple[Sequence[Any], Partition]],
    inputs: PlanInputs,
    shard_hosts: Sequence[str],
    placement: str | None = None,
) -> Prediction:
    """Simulated rates of the chosen VWs with the runtime's costs and host sharing, for the
    job ``inputs`` describe, its parameters placed by ``placement`` (None: the job's)."""
    return predict(
        model,
        chosen,
        minibatch=inputs.minibatch,
        staleness=inputs.staleness,
        cores=inputs.cores,
        shard_hosts=tuple(shard_hosts),
        minibatches=inputs.minibatches,
        placement=placement or inputs.placement,
    )


def _power(profile: ModelProfile) -> Callable[[Any], float]:
    """Compute power of a device: 1 / the model's total time on its type (as one stage)."""
    n = profile.n_layers()
    totals = {t: profile.stage_times(t, 0, n).time_s for t in profile.layers}
    return lambda d: 1.0 / totals[d.type] if totals.get(d.type, 0) > 0 else 0.0


def _memory_at(model: CostModel, p: Partition, i: int, flight: int) -> StageMemory:
    """Stage ``i``'s memory as ``p.memory[i]`` was priced (the same policy, rows and
    route: a replicated stage's leader by :func:`replica_memory`), but with ``flight``
    minibatches in flight: at the bound count it is ``p.memory[i]``."""
    a, b = p.cuts[i]
    if p.groups and len(p.groups[i]) > 1:
        rows = p.rows[i]
        return replica_memory(
            model, p.types[i], a, b, i, p.k, p.nm, (rows[1] - rows[0]) / rows[-1], flight
        )
    return model.stage_memory(
        p.types[i],
        a,
        b,
        i,
        p.k,
        p.nm,
        recompute=p.recompute[i] if p.recompute else (),
        swap=p.swap[i] if p.swap else (),
        flight=flight,
    )


def _assemble(
    cluster: Any,
    model: CostModel,
    chosen: Sequence[tuple[Sequence[Any], Partition]],
    pred: Prediction,
    policy: str,
    unused: Sequence[tuple[str, str]],
    warnings: list[str],
    inputs: PlanInputs,
    details: dict[str, Any],
) -> Plan:
    prof = model.profile
    minibatch, staleness, shard_of_stage = inputs.minibatch, inputs.staleness, inputs.shard_of_stage
    layer_shards, stage_shards = place_plan(
        cluster,
        prof,
        [list(zip(devs, p.cuts, strict=True)) for devs, p in chosen],
        inputs.placement,
    )
    if shard_of_stage is not None:
        stage_shards = tuple(
            tuple(shard_of_stage(v, i, d) for i, d in enumerate(devs))
            for v, (devs, _) in enumerate(chosen)
        )
        ls: list[int | None] = [None] * len(layer_shards)
        for v, (_, p) in enumerate(chosen):
            for i, (a, b) in enumerate(p.cuts):
                for j in range(a, b):
                    if ls[j] is None:
                        ls[j] = stage_shards[v][i]
                    elif ls[j] != stage_shards[v][i]:
                        warnings.append(
                            f"shard_of_stage puts layer {j} on shard {ls[j]} for one VW and "
                            f"{stage_shards[v][i]} for another; the first wins"
                        )
        layer_shards = tuple(x or 0 for x in ls)
    sim = pred.sim
    vw_plans = []
    for v, (devs, p) in enumerate(chosen):
        limits = p.limits or (0,) * p.k
        bound = [
            limit or in_flight(i, p.k, p.nm, weights=model.weights)
            for i, limit in enumerate(limits)
        ]
        held = [
            expected_in_flight(sim.peak_in_flight[v][i], i, p.k, p.nm, weights=model.weights)
            for i in range(p.k)
        ]
        fills = fill_counts(limits, p.nm)
        stages = tuple(
            StagePlan(
                StageLayout(
                    devices=(d.name, *(x.name for x in p.group_of(i, d)[1:])),
                    first=p.cuts[i][0],
                    last=p.cuts[i][1],
                    recompute=tuple(p.recompute[i]) if p.recompute else (),
                    swap=tuple(p.swap[i]) if p.swap else (),
                    rows=tuple(p.rows[i]) if p.groups and len(p.groups[i]) > 1 else (),
                    in_flight_limit=limits[i],
                    in_flight_fill=fills[i],
                ),
                d.type,
                pred.compute_s(v, i),
                _memory_at(model, p, i, limits[i]) if limits[i] else p.memory[i],
                d.memory,
                stage_shards[v][i],
                pred.busy_s(v, i, p.nm),
                pred.slowdown[v][i],
                p.keep_memory[i] if p.keep_memory else None,
                p.exchange_s[i] if p.exchange_s else 0.0,
                _memory_at(model, p, i, held[i]),
                held[i],
                bound[i],
            )
            for i, d in enumerate(devs)
        )
        finish = sim.vw_finish_s[v]
        rate = sim.minibatches * minibatch / finish if finish > 0 else math.inf
        vw_plans.append(VWPlan(stages, p.nm, rate))
        if p.nm < len(devs):
            warnings.append(
                f"vw {v}: Nm={p.nm} < {len(devs)} stages: the pipeline cannot fill "
                "(memory or the job's nm limits it)"
            )
    for v, wait in enumerate(sim.gate_wait_s):
        share = wait / sim.vw_finish_s[v] if sim.vw_finish_s[v] > 0 else 0.0
        if share > 0.1:
            warnings.append(
                f"vw {v} waits {share:.0%} of its time at the WSP gate for slower VWs "
                f"(D={staleness}; a larger D or another formation would help)"
            )
    for name, why in unused:
        warnings.append(f"{name} unused: {why}")
    total = sim.job_samples_per_s
    rate_sum = sum(v.samples_per_s for v in vw_plans)
    details = {
        **details,
        # per VW its predicted rate and share of the job's samples: under WSP each VW runs
        # at its own pace, so a faster VW trains on a larger share of the data
        "vw_shares": [
            {
                "vw": v,
                "devices": list(vw.devices),
                "nm": vw.nm,
                "samples_per_s": vw.samples_per_s,
                "share": vw.samples_per_s / rate_sum if rate_sum > 0 else 0.0,
            }
            for v, vw in enumerate(vw_plans)
        ],
        "slowdown": [list(x) for x in pred.slowdown],
        "fixed_point_rounds": pred.rounds,
        "runtime_costs": model.runtime.to_dict(),
    }
    return Plan(
        tuple(vw_plans),
        total,
        policy,
        tuple(name for name, _ in unused),
        tuple(dict.fromkeys(warnings)),
        tuple(layer_shards),
        minibatch,
        staleness,
        prof.model,
        details,
    )
