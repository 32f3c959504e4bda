"""The planner's speed-ups compute the very floats of the plain computations they replace."""

from __future__ import annotations

import itertools
import random

import numpy as np

from hetpipe.config import DeviceSpec
from hetpipe.planner import CostModel, synthetic_profile
from hetpipe.planner.costs import INF
from hetpipe.planner.partition import _keep, _merge_distinct, _recall


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
