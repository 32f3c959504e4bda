"""The rate bounds that let the exhaustive order search skip orders whose pipeline fill (Nm
over the latency), not their bottleneck, limits the rate: checked against plain
computations on small random VWs."""

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


def test_prefix_latency_is_below_every_completion():
    checked = 0
    for seed in range(60):
        prof, devs = case(seed, kmax=4)
        model = CostModel(prof, node_bandwidth, 1)
        k = len(devs)
        for nm in (1, 2, k):
            for order in itertools.permutations(devs):
                full = model._shortest(order, nm)
                for m in range(k + 1):
                    lb = model.prefix_latency(order[:m], k, nm, order[m:])
                    assert lb <= full * (1 + 1e-12) or math.isinf(full), (seed, nm, m)
                if math.isfinite(full):
                    # a whole order: its exact least latency
                    assert math.isclose(model.prefix_latency(order, k, nm), full, rel_tol=1e-9)
                    checked += 1
    assert checked > 100


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
