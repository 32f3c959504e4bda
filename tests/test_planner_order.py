"""Device order inside a VW: exhaustive search against all permutations, and its pruning."""

from __future__ import annotations

import itertools
import random

from helpers import node_bandwidth, order_dev, random_vw

from hetpipe.planner import CostModel, Partition, best_order, synthetic_profile
from hetpipe.planner.order import count_orders, device_classes, distinct_orders, score


def random_case(seed: int):
    r = random.Random(seed)
    L = r.randint(3, 9)
    k = r.randint(2, min(4, L))
    prof, devs = random_vw(r, L, k)
    return prof, devs, r.choice((None, 1, 2, 3))


def test_exhaustive_equals_every_permutation():
    checked = 0
    for seed in range(120):
        prof, devs, nm = random_case(seed)
        model = CostModel(prof, node_bandwidth, 1)
        got = best_order(model, devs, nm=nm)
        plain = CostModel(prof, node_bandwidth, 1)
        scores = [
            score(plain.partition(o, nm) if nm else plain.best_nm(o))
            for o in itertools.permutations(devs)
        ]
        assert score(got.partition) == max(scores), seed
        assert got.exhaustive
        checked += isinstance(got.partition, Partition)
    assert checked >= 40


def test_pruning_keeps_the_optimum_and_counts_add_up():
    for seed in range(40):
        prof, devs, nm = random_case(500 + seed)
        a = best_order(CostModel(prof, node_bandwidth, 1), devs, nm=nm, prune=True)
        b = best_order(CostModel(prof, node_bandwidth, 1), devs, nm=nm, prune=False)
        assert score(a.partition) == score(b.partition)
        n = count_orders(device_classes(devs, node_bandwidth))
        assert b.evaluated == n and b.pruned == 0
        assert a.evaluated + a.pruned == n


def test_identical_devices_are_enumerated_once():
    prof = synthetic_profile(8, {"a": 1.0, "b": 0.5}, 0)
    devs = [order_dev("a0", "a", 1 << 30), order_dev("a1", "a", 1 << 30)]
    devs += [order_dev("b0", "b", 1 << 30), order_dev("b1", "b", 1 << 30)]
    classes = device_classes(devs, node_bandwidth)
    assert classes == [0, 0, 1, 1]
    orders = list(distinct_orders(devs, classes))
    assert len(orders) == 6 == count_orders(classes)  # 4! / (2! 2!)
    assert len({tuple(d.type for d in o) for o in orders}) == 6
    r = best_order(CostModel(prof, node_bandwidth, 1), devs, prune=False)
    assert r.evaluated == 6


def test_devices_on_other_nodes_are_alike_when_every_link_is_alike():
    # one device per node: every link is inter-node, so same-type devices are interchangeable
    devs = [
        order_dev("a0", "a", 100, "n0"),
        order_dev("a1", "a", 100, "n1"),
        order_dev("b0", "b", 100, "n2"),
    ]
    assert device_classes(devs, node_bandwidth) == [0, 0, 1]
    # but not when one of them shares a node with a third device
    devs = [
        order_dev("a0", "a", 100, "n0"),
        order_dev("a1", "a", 100, "n1"),
        order_dev("b0", "b", 100, "n0"),
    ]
    assert device_classes(devs, node_bandwidth) == [0, 1, 2]
    # different memory: different class
    devs = [order_dev("a0", "a", 100), order_dev("a1", "a", 200)]
    assert device_classes(devs, node_bandwidth) == [0, 1]


def test_order_puts_the_small_device_last():
    # the last stage keeps one minibatch and no stashed versions: a small device fits there only
    prof = synthetic_profile(6, {"a": 1.0}, 2, param_bytes=(40000, 40000), out_bytes=(4000, 4000))
    model = CostModel(prof, lambda a, b: 1e12, 1)
    last = model.stage_memory("a", 5, 6, 2, 3, 3).total
    first = model.stage_memory("a", 0, 1, 0, 3, 3).total
    assert last < first
    devs = [
        order_dev("small", "a", last),
        order_dev("big0", "a", 1 << 30),
        order_dev("big1", "a", 1 << 30),
    ]
    r = best_order(model, devs, nm=3)
    assert isinstance(r.partition, Partition)
    assert r.order[-1].name == "small"


def test_heuristic_for_large_vws():
    prof = synthetic_profile(40, {"a": 1.0, "b": 0.5, "c": 0.25}, 7)
    devs = [order_dev(f"g{i}", "abc"[i % 3], 1 << 30, f"n{i // 4}") for i in range(9)]
    model = CostModel(prof, node_bandwidth, 1)
    r = best_order(model, devs)
    assert not r.exhaustive and isinstance(r.partition, Partition)
    assert r.evaluated < 200  # 9! = 362880 orders were not tried
    start = model.best_nm(tuple(devs))
    assert score(r.partition) >= score(start)


def test_skipping_orders_below_the_best_changes_no_answer():
    # Nm chosen: the split-and-Nm search of an order bounded below the best so far is
    # skipped (prune=True); the local search (k > 6) and the exhaustive one end the same
    checked = 0
    for seed in range(24):
        r = random.Random(900 + seed)
        L, k = r.randint(12, 24), r.choice((4, 5, 7, 8))
        prof = synthetic_profile(
            L, {"a": 1.0, "b": 0.6, "c": 0.3}, r, param_bytes=(2000, 30000), out_bytes=(1000, 40000)
        )
        need = sum(lp.param_bytes * 5 + lp.saved_bytes * 3 for lp in prof.layers["a"]) // k
        devs = [
            order_dev(f"g{i}", r.choice("abc"), int(need * r.choice((0.6, 1.0, 3.0))), f"n{i % 3}")
            for i in range(k)
        ]
        a = best_order(CostModel(prof, node_bandwidth, 1), devs, prune=True)
        b = best_order(CostModel(prof, node_bandwidth, 1), devs, prune=False)
        assert [d.name for d in a.order] == [d.name for d in b.order], seed
        assert a.partition == b.partition, seed
        checked += isinstance(a.partition, Partition) and not a.exhaustive
    assert checked >= 5
