"""The rate bound that lets the order searches skip orders whose pipeline fill (Nm over the
least latency), not only their bottleneck, keeps them below the best order so far
(:meth:`CostModel.rate_below`): checked against plain computations on small random VWs."""

from __future__ import annotations

import itertools
import math
import random

from helpers import node_bandwidth, random_vw

from hetpipe.planner import CostModel, best_order
from hetpipe.planner.order import count_orders, device_classes, score


def case(seed: int, layers: tuple[int, int] = (8, 24), kmax: int = 5):
    r = random.Random(seed)
    L = r.randint(*layers)
    k = r.randint(2, min(kmax, L))
    prof, devs = random_vw(r, L, k)
    return prof, devs


def test_rate_below_only_for_orders_below():
    hits = 0
    for seed in range(60):
        prof, devs = case(1000 + seed)
        model = CostModel(prof, node_bandwidth, 1)
        plain = CostModel(prof, node_bandwidth, 1)
        rates = {o: score(plain.best_nm(o))[0] for o in itertools.permutations(devs)}
        best = max(rates.values())
        if not best > 0 or math.isinf(best):
            continue
        for order, rate in rates.items():
            if model.rate_below(order, None, best):
                assert rate < best, seed
                hits += 1
    assert hits > 0


def test_exhaustive_search_with_fill_bounds_equals_every_order():
    pruned = 0
    for seed in range(40):
        prof, devs = case(2000 + seed, layers=(10, 30), kmax=5)
        got = best_order(CostModel(prof, node_bandwidth, 1), devs)
        plain = CostModel(prof, node_bandwidth, 1)
        want = max(score(plain.best_nm(o)) for o in itertools.permutations(devs))
        assert score(got.partition) == want, seed
        assert got.exhaustive
        n = count_orders(device_classes(devs, node_bandwidth))
        assert got.evaluated + got.pruned == n
        pruned += got.pruned
    assert pruned > 0


def test_best_nm_told_a_rate_answers_as_without_it():
    for seed in range(15):
        prof, devs = case(3000 + seed)
        plain = CostModel(prof, node_bandwidth, 1)
        orders = list(itertools.permutations(devs))[:24]
        found = {o: plain.best_nm(o) for o in orders}
        rates = sorted({score(p)[0] for p in found.values()} - {-math.inf})
        for beat in rates:
            model = CostModel(prof, node_bandwidth, 1)
            for o, want in found.items():
                got = model.best_nm(o, None, beat)
                if score(want)[0] < beat:
                    assert got is None or score(got)[0] < beat, seed
                else:
                    assert got is not None and score(got) == score(want), seed


def test_the_latency_floor_answers_as_the_least_latency_with_fewer_dps():
    """Before a least-latency DP, the round trip's floor (every layer's forward and backward
    on the fastest type present, :meth:`CostModel.round_trip_floor`) is tried: where ``Nm``
    over it is already below the rate to beat, so is ``Nm`` over the least latency. The
    answers of ``rate_below`` and ``best_nm`` told a rate are those without the floor (a
    model whose floor is 0 proves nothing), and some least-latency DPs are never run."""
    saved = 0
    for seed in range(15):
        prof, devs = case(3000 + seed)
        model = CostModel(prof, node_bandwidth, 1)
        blind = CostModel(prof, node_bandwidth, 1)
        blind.round_trip_floor = lambda _devices: 0.0  # type: ignore[method-assign]
        rates = {o: score(blind.best_nm(o))[0] for o in itertools.permutations(devs)}
        best = max(rates.values())
        if not best > 0 or math.isinf(best):
            continue
        for order in rates:
            for beat in (best, best * 0.9):
                assert model.rate_below(order, None, beat) == blind.rate_below(order, None, beat)
                assert model.best_nm(order, None, beat) == blind.best_nm(order, None, beat)
        saved += len(blind._short) - len(model._short)
    assert saved > 0
