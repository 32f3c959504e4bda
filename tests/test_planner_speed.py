"""The planner's speed-ups compute the very floats of the plain computations they replace."""

from __future__ import annotations

import importlib
import itertools
import math
import random
from typing import Any

import numpy as np
from helpers import gpu_cluster, node_bandwidth, random_vw

from hetpipe.config import DeviceSpec
from hetpipe.core.memory import in_flight
from hetpipe.planner import CostModel, make_plan, synthetic_profile
from hetpipe.planner import plan as plan_module
from hetpipe.planner.costs import INF
from hetpipe.planner.partition import Partition, _keep, _merge_distinct, _recall
from hetpipe.planner.staleness import factor
from hetpipe.views import explain_lines

partition_module = importlib.import_module("hetpipe.planner.partition")


def dev(name: str, dtype: str, memory: int, node: str) -> DeviceSpec:
    return DeviceSpec(name, "cpu", dtype, memory, 1.0, 0, node, "127.0.0.1")


def bandwidth(a: DeviceSpec, b: DeviceSpec) -> float:
    return 1e9 if a.node == b.node else 1e8


def test_merge_distinct_is_unique_of_the_concatenation() -> None:
    r = np.random.default_rng(0)
    for _ in range(200):
        runs = [
            np.unique(r.integers(0, 50, r.integers(0, 30)).astype(np.float64) / 7)
            for _ in range(r.integers(1, 6))
        ]
        got = _merge_distinct(runs)
        want = np.unique(np.concatenate(runs))
        assert got.dtype == want.dtype and np.array_equal(got, want)


def test_cached_dp_states_give_the_plain_least_latency_of_every_order() -> None:
    """Over every order of random devices, one model shared by all orders as in an order
    search (its DP states, in a small cache, and its memos reused from order to order):
    the least latency (``_shortest``) is the plain DP's (``_least_latency`` at no limit),
    and the split is the one a fresh model finds."""
    for seed in range(40):
        r = random.Random(seed)
        L = r.randint(3, 40)
        types = {f"t{j}": r.uniform(0.2, 1.0) for j in range(r.randint(1, 3))}
        prof = synthetic_profile(
            L, types, r, param_bytes=(1000, 40000), out_bytes=(100, 20000), time_s=(1e-3, 5e-3)
        )
        k = r.randint(2, min(5, L))
        share = sum(lp.param_bytes * 4 + lp.saved_bytes * 2 for lp in prof.layers["t0"]) // k
        devs = [
            dev(
                f"g{i}",
                r.choice(list(types)),
                int(share * r.uniform(0.4, 2.5)) + 1,
                f"n{r.randint(0, 1)}",
            )
            for i in range(k)
        ]
        factor = r.randint(0, 2)
        model = CostModel(prof, bandwidth, factor)
        model._prefix_limit = 4  # a small cache: the search keeps evicting states
        for order in itertools.permutations(devs):
            for nm in range(1, k + 1):
                bws = model.links(order)
                plain = model._least_latency(model._stage_bands(order, bws, nm), INF, cuts=False)
                want = INF if plain is None else plain[1]
                assert model._shortest(order, nm) == want
                got, alone = model.partition(order, nm), CostModel(prof, bandwidth, factor)
                assert got == alone.partition(order, nm)


def test_dp_state_cache_drops_the_least_recently_used() -> None:
    states: dict[tuple, np.ndarray] = {}
    for i in range(8):
        _keep(states, (i,), np.full(1, float(i)), 8)
    assert _recall(states, (0,)) is not None  # now the most recently used
    _keep(states, (8,), np.zeros(1), 8)  # full: the least recently used eighth goes
    assert (1,) not in states and (0,) in states and (8,) in states and len(states) == 8
    assert _recall(states, (99,)) is None


def test_batched_least_latency_is_the_plain_one_at_each_limit() -> None:
    """``_latencies`` (one DP, a row of states per limit) gives each limit's least latency
    exactly as ``_least_latency`` alone does, inf where no split meets the limit."""
    for seed in range(30):
        r = random.Random(seed)
        prof, devs = random_vw(r, r.randint(4, 40), r.randint(2, 5))
        model = CostModel(prof, node_bandwidth, 1)
        nm = r.randint(1, len(devs))
        bands = model._stage_bands(devs, model.links(devs), nm)
        values = np.unique(np.concatenate([b[b < INF] for b, _ in bands]))
        if not values.size:
            continue
        limits = np.array(sorted(r.sample(list(values), min(12, values.size))))
        got = model._latencies(bands, limits)
        for lim, h in zip(limits.tolist(), got.tolist(), strict=True):
            plain = model._least_latency(bands, lim, cuts=False)
            assert h == (INF if plain is None else plain[1])


def test_probing_many_limits_finds_the_binary_search_split(monkeypatch) -> None:
    """The joint split's rounds of probed limits end where the plain binary search (one
    limit per round) ends: the same best split at every Nm of every order."""
    calls, probed = [0], 0
    plain = CostModel._latencies

    def counted(self: CostModel, bands: Any, limits: np.ndarray) -> np.ndarray:
        calls[0] += partition_module.PROBES_MAX > 1
        return plain(self, bands, limits)

    monkeypatch.setattr(CostModel, "_latencies", counted)
    for seed in range(25):
        calls[0] = 0
        r = random.Random(100 + seed)
        prof, devs = random_vw(r, r.randint(6, 60), r.randint(2, 5))
        orders = list(itertools.islice(itertools.permutations(devs), 6))
        got = []
        for probes in (partition_module.PROBES_MAX, 1):
            monkeypatch.setattr(partition_module, "PROBES_MAX", probes)
            model = CostModel(prof, node_bandwidth, 1)
            got.append([model.best_rate(o, nm) for o in orders for nm in range(1, len(o) + 1)])
        assert got[0] == got[1]
        probed += calls[0]
    assert probed > 10  # the rounds of probes did run (and the plain search did not)


def test_round_trip_floor_is_below_every_split_latency() -> None:
    """No split of any order, at any Nm, has a round trip (latency) below the floor the
    formation bound divides Nm by."""
    for seed in range(30):
        r = random.Random(300 + seed)
        prof, devs = random_vw(r, r.randint(3, 30), r.randint(1, 4))
        model = CostModel(prof, node_bandwidth, 1)
        floor = model.round_trip_floor(devs)
        assert floor > 0
        for order in itertools.permutations(devs):
            for nm in range(1, len(order) + 1):
                p = model.partition(order, nm)
                if isinstance(p, Partition):
                    assert p.latency >= floor


def test_formation_bound_holds_over_every_simulated_formation(monkeypatch) -> None:
    """``upper_bound`` (the VWs' bounds, each the lower of one minibatch per least
    bottleneck and Nm per least round trip at the best Nm) is never below what a
    formation's evaluation simulates or estimates, nor a VW's bound below that VW's
    simulated staleness-weighted rate; and the round-trip limit is the lower of the two for some VW
    (so it is what these checks test)."""
    seen = {"formations": 0, "tighter": 0}
    evaluate = plan_module._Search.evaluate

    def checked(self: Any, f: Any) -> Any:
        score, res = evaluate(self, f)
        seen["formations"] += 1
        assert score <= self.upper_bound(f)
        kept, pred = res[0], res[1]
        # the bound that skips a formation before its estimate is made, without the
        # simulator's slack, is above that estimate
        bound = self.upper_bound(f) / plan_module.SIM_SLACK
        assert self.estimated(kept) <= bound * (1 + 1e-12)
        for v, (devs, p) in enumerate(kept if pred is not None else ()):  # None: unsimulated
            rate = pred.sim.vw_samples_per_s[v] * factor(p.nm, self.inputs.weights)
            assert rate <= self.vw_bound(devs)
        for g in f.groups:
            if len(g) <= self.model.L:
                lb = float(self.model.rest_bound(g)[0])
                if self.vw_bound(g) < 1.02 * self.inputs.minibatch / lb * (1 - 1e-9):
                    seen["tighter"] += 1
        return score, res

    monkeypatch.setattr(plan_module._Search, "evaluate", checked)
    for layers, nodes, seed in ((24, 2, 0), (40, 3, 1), (60, 2, 2)):
        cluster, prof = bench_like(layers, nodes, seed)
        make_plan(cluster, prof, minibatch=32, staleness=0, optimizer_state_factor=1)
    assert seen["formations"] > 5 and seen["tighter"] > 0


def bench_like(layers: int, nodes: int, seed: int) -> tuple[Any, Any]:
    """A cluster of ``nodes`` nodes of four device types (speeds 1 to 0.25) and a synthetic
    model of ``layers`` layers, shaped like the planner benchmark's."""
    types = [("t1", 1.0), ("t2", 0.7), ("t3", 0.5), ("t4", 0.25)]
    prof = synthetic_profile(
        layers,
        dict(types),
        seed,
        minibatch=32,
        param_bytes=(1 << 20, 16 << 20),
        out_bytes=(1 << 20, 8 << 20),
    )
    return gpu_cluster([types] * nodes, memory=8 << 30), prof


def test_formations_far_below_the_best_estimate_are_not_simulated(monkeypatch) -> None:
    """A formation is simulated exactly where its estimate is at least ``1 - SIM_MARGIN``
    of the best estimate simulated before it, the trace says why one was not, and the
    plans are those of a search that simulates every formation (margin 1). One whose bound
    (``upper_bound``) is already below is skipped before its estimate is made, and the
    trace says so with that bound."""
    estimated = plan_module._Search.estimated
    log: list[tuple[float, bool]] = []  # (estimate, simulated) per formation, in order
    variants = plan_module._Search.variants

    def est(self: Any, kept: Any) -> float:
        e = estimated(self, kept)
        log.append((e, False))
        return e

    def var(self: Any, kept: Any) -> Any:
        log[-1] = (log[-1][0], True)
        return variants(self, kept)

    skips = bounded = 0
    for layers, nodes, seed in ((24, 3, 0), (60, 3, 2)):
        cluster, prof = bench_like(layers, nodes, seed)
        kw = {"minibatch": 32, "staleness": 0, "optimizer_state_factor": 1}
        monkeypatch.setattr(plan_module, "SIM_MARGIN", 1.0)  # never skips
        every = make_plan(cluster, prof, **kw)
        monkeypatch.undo()
        monkeypatch.setattr(plan_module._Search, "estimated", est)
        monkeypatch.setattr(plan_module._Search, "variants", var)
        log.clear()
        plan = make_plan(cluster, prof, **kw)
        monkeypatch.undo()
        assert plan.samples_per_s == every.samples_per_s
        assert [vw.nm for vw in plan.vws] == [vw.nm for vw in every.vws]
        best = -math.inf
        for e, simulated in log:
            assert simulated == (e >= best * (1 - plan_module.SIM_MARGIN)), (e, best)
            if simulated:
                best = max(best, e)
            skips += not simulated
        notes = [c["skipped"] or "" for c in plan.details["candidates"]]
        by_bound = [
            c for c in plan.details["candidates"] if "on its estimate" in (c["skipped"] or "")
        ]
        for c in by_bound:  # each below the margin of the best estimate before it
            bound = c["bound"] / plan_module.SIM_SLACK
            assert bound < best * (1 - plan_module.SIM_MARGIN) and c.get("not_simulated")
        bounded += len(by_bound)
        assert sum("not simulated" in n for n in notes) == sum(not s for _, s in log) + len(
            by_bound
        )
        unsimulated = sum(bool(c.get("not_simulated")) for c in plan.details["candidates"])
        assert unsimulated == sum(not s for _, s in log) + len(by_bound)
        if unsimulated:
            summary = [line for line in explain_lines(plan.details) if line.startswith("chosen")]
            assert f"; {unsimulated} not simulated" in summary[0]
    assert skips > 0 and bounded > 0


def test_reach_bounds_keep_every_dp_answer_of_a_brute_force() -> None:
    """The reach test (``_unreachable``, no DP where the stages cannot cover the model), the
    least-latency DPs' lower bounds on the states that can still end at ``L`` (``_lows``)
    and the bottleneck DP's last step on ``b = L`` alone: over every order and Nm of random
    VWs, the least bottleneck, the least latency (at no limit and under stage-time limits),
    the split's existence and its bottleneck are a brute force's over every split of the
    stage times; the reach test proves some orders infeasible, and only infeasible ones."""
    proved = limited = 0
    for seed in range(30):
        r = random.Random(300 + seed)
        prof, devs = random_vw(r, r.randint(3, 12), r.randint(2, 4))
        model = CostModel(prof, node_bandwidth, 1)
        k, n_layers = len(devs), model.L
        for order in itertools.permutations(devs):
            for nm in range(1, k + 1):
                bws = model.links(order)
                mats = [
                    model.masked_times(
                        d.type,
                        bws[i - 1] if i > 0 else None,
                        bws[i] if i < k - 1 else None,
                        in_flight(i, k, nm, weights=model.weights),
                        d.memory,
                        d.host_gbps,
                        nm,
                    )
                    for i, d in enumerate(order)
                ]
                splits = []  # every split's stage times, where every stage fits
                for inner in itertools.combinations(range(1, n_layers), k - 1):
                    cuts = itertools.pairwise((0, *inner, n_layers))
                    times = [float(m[a, b]) for m, (a, b) in zip(mats, cuts, strict=False)]
                    if max(times) < INF:
                        splits.append(times)
                least = min((max(t) for t in splits), default=INF)
                bands = model._stage_bands(order, bws, nm)
                if model._unreachable(bands):
                    assert not splits
                    proved += 1
                assert model._least_bottleneck(order, nm) == least
                assert model._shortest(order, nm) == min((sum(t) for t in splits), default=INF)
                p = model.partition(order, nm)
                assert isinstance(p, Partition) == bool(splits)
                if isinstance(p, Partition):
                    assert p.bottleneck == least
                    limit = r.choice(sorted({x for t in splits for x in t}))
                    want = min((sum(t) for t in splits if max(t) <= limit), default=INF)
                    plain = model._least_latency(bands, limit, cuts=False)
                    assert (INF if plain is None else plain[1]) == want
                    assert model._latencies(bands, np.array([limit]))[0] == want
                    limited += 1
    assert proved > 0 and limited > 0
