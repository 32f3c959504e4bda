"""The DP over device classes (:mod:`hetpipe.planner.classdp`) against brute force over
orders: the same best estimated rate, the same feasibility, on generated VWs of 7-10 devices
in 2-3 nodes of mixed types (links follow node membership)."""

from __future__ import annotations

import itertools
import math
import random

from helpers import node_bandwidth, order_dev, random_vw

from hetpipe.config import DeviceSpec
from hetpipe.planner import CostModel, Partition, best_order, synthetic_profile
from hetpipe.planner.classdp import best_class_order, class_space, dp_cells
from hetpipe.planner.order import count_orders, device_classes, score


def signature(d: DeviceSpec) -> tuple:
    """What a node-membership cluster can tell of a device: two of one signature are alike."""
    return (d.type, d.memory, d.speed, d.host_gbps, d.node)


def every_order(devs: list[DeviceSpec]):
    """One order per distinct sequence of signatures: every permutation, each seen once."""
    pools: dict[tuple, list[DeviceSpec]] = {}
    for d in devs:
        pools.setdefault(signature(d), []).append(d)
    left = {s: len(v) for s, v in pools.items()}
    seq: list[tuple] = []

    def rec():
        if len(seq) == len(devs):
            used = dict.fromkeys(pools, 0)
            out = []
            for s in seq:
                out.append(pools[s][used[s]])
                used[s] += 1
            yield tuple(out)
            return
        for s in pools:
            if left[s]:
                left[s] -= 1
                seq.append(s)
                yield from rec()
                seq.pop()
                left[s] += 1

    yield from rec()


def instance(seed: int, max_orders: int = 100):
    """A VW of 7-10 devices in 2-3 nodes of two or three types (each node mostly of one),
    memory caps that make some orders infeasible; redrawn (seeded) until the brute force
    has at most ``max_orders`` distinct orders to try."""
    r = random.Random(seed)
    while True:
        k = r.randint(7, 10)
        L = r.randint(k, k + 3)
        types = {"a": 1.0, "b": 0.6, "c": 0.3}
        prof = synthetic_profile(L, types, r, param_bytes=(2000, 30000), out_bytes=(1000, 40000))
        need = sum(lp.param_bytes * 5 + lp.saved_bytes * 3 for lp in prof.layers["a"])
        nodes = r.randint(2, 3)
        main = [r.choice("abc") for _ in range(nodes)]
        mem = {t: int(need * r.choice((0.12, 0.2, 0.35, 0.7))) for t in "abc"}
        devs = []
        for i in range(k):
            n = r.randrange(nodes)
            t = main[n] if r.random() < 0.8 else r.choice("abc")
            devs.append(order_dev(f"g{i}", t, mem[t], f"n{n}"))
        if (
            len({d.type for d in devs}) > 1
            and count_orders([signature(d) for d in devs]) <= max_orders
        ):
            return prof, devs


def brute(prof, devs, cands=None):
    """The best score over every order of :meth:`CostModel.best_nm` (Nm and split chosen)."""
    model = CostModel(prof, node_bandwidth, 1)
    best = None
    infeasible = 0
    for o in every_order(devs):
        p = model.best_nm(o, cands)
        infeasible += not isinstance(p, Partition)
        if best is None or score(p) > score(best):
            best = p
    return best, infeasible


def rate_of(p) -> float | None:
    return p.minibatches_per_s if isinstance(p, Partition) else None


def same_rate(a: float | None, b: float | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0)


def test_class_dp_equals_brute_force_on_300_instances():
    feasible = mixed = 0
    for seed in range(300):
        prof, devs = instance(seed)
        model = CostModel(prof, node_bandwidth, 1)
        got = best_order(model, devs)
        assert got.by_classes and got.exact, seed
        want, infeasible = brute(prof, devs)
        assert same_rate(rate_of(got.partition), rate_of(want)), seed
        if isinstance(want, Partition):
            feasible += 1
            mixed += infeasible > 0
            # the order found reaches the rate with the split the planner gives any order
            again = CostModel(prof, node_bandwidth, 1).best_nm(got.order)
            assert score(again) == score(got.partition), seed
            assert sorted(d.name for d in got.order) == sorted(d.name for d in devs)
        else:
            assert not isinstance(got.partition, Partition), seed
    assert feasible >= 200
    assert mixed >= 30  # instances where some orders do not fit and the DP still finds one


def test_class_dp_equals_every_permutation():
    # the literal brute force, over itertools.permutations, on a few 7-device instances
    for seed in range(3):
        prof, devs = instance(1000 + seed, max_orders=60)
        devs = devs[:7]
        model = CostModel(prof, node_bandwidth, 1)
        space = class_space(model, devs, device_classes(devs, node_bandwidth))
        got = best_class_order(model, space)
        plain = CostModel(prof, node_bandwidth, 1)
        seen: dict[tuple, float | None] = {}
        for o in itertools.permutations(devs):
            sig = tuple(signature(d) for d in o)
            if sig not in seen:
                seen[sig] = rate_of(plain.best_nm(o))
        rates = [r for r in seen.values() if r is not None]
        assert same_rate(got.rate if got.order else None, max(rates) if rates else None)


def test_small_vws_match_the_exhaustive_search():
    # k <= 6: today's exhaustive path and the class DP agree on the rate
    for seed in range(60):
        r = random.Random(2000 + seed)
        L = r.randint(4, 10)
        k = r.randint(2, min(6, L))
        prof, devs = random_vw(r, L, k)
        cands = r.choice((None, (1, 2), (2, 3)))
        model = CostModel(prof, node_bandwidth, 1)
        old = best_order(model, devs, nm_candidates=cands)
        assert old.exhaustive and not old.by_classes
        space = class_space(model, devs, device_classes(devs, node_bandwidth))
        got = best_class_order(CostModel(prof, node_bandwidth, 1), space, cands)
        assert same_rate(got.rate if got.order else None, rate_of(old.partition)), seed


def test_fixed_nm_and_large_spaces_keep_the_order_search():
    prof = synthetic_profile(20, {"a": 1.0, "b": 0.5}, 3)
    devs = [order_dev(f"g{i}", "ab"[i % 2], 1 << 30, f"n{i // 4}") for i in range(8)]
    model = CostModel(prof, node_bandwidth, 1)
    assert best_order(model, devs).by_classes
    fixed = best_order(model, devs, nm=2)
    assert not fixed.by_classes and not fixed.exhaustive  # the local search, as before
    off = best_order(model, devs, classes_dp=False)
    assert not off.by_classes
    assert score(best_order(model, devs).partition) >= score(off.partition)
    space = class_space(model, devs, device_classes(devs, node_bandwidth))
    assert dp_cells(space, model.L) > 0
