"""The grid model (cuts restricted to a grid of layer boundaries) that ranks device orders on
large models, and the vectorised infeasibility diagnosis: checked against plain
computations on small random instances."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from hetpipe.config import DeviceSpec, format_size
from hetpipe.core.memory import in_flight
from hetpipe.planner import CostModel, synthetic_profile
from hetpipe.planner import order as order_mod
from hetpipe.planner.partition import GridModel, Infeasible, Partition, _grid


def dev(name: str, dtype: str, memory: int, node: str) -> DeviceSpec:
    return DeviceSpec(name, "cpu", dtype, memory, 1.0, 0, node, "127.0.0.1")


def bandwidth(a: DeviceSpec, b: DeviceSpec) -> float:
    return 1e9 if a.node == b.node else 1e8


def instance(
    seed: int, layers: tuple[int, int] = (12, 40), kmax: int = 5, loose: float = 2.5, kmin: int = 2
):
    """A random profile, devices (2-3 types, 2 nodes) and optimizer factor."""
    r = random.Random(seed)
    L = r.randint(*layers)
    types = {f"t{j}": r.uniform(0.2, 1.0) for j in range(r.randint(1, 3))}
    prof = synthetic_profile(
        L, types, r, param_bytes=(1000, 40000), out_bytes=(100, 20000), time_s=(1e-3, 5e-3)
    )
    k = r.randint(kmin, min(kmax, L))
    share = sum(lp.param_bytes * 4 + lp.saved_bytes * 2 for lp in prof.layers["t0"]) // k
    devs = [
        dev(f"g{i}", r.choice(list(types)), int(share * r.uniform(0.4, loose)) + 1, f"n{i % 2}")
        for i in range(k)
    ]
    return prof, devs, r.randint(0, 2)


def test_grid_is_evenly_spaced_and_holds_both_ends() -> None:
    for L in (1, 7, 100, 1000):
        for points in (4, 128):
            g = _grid(L, points)
            assert g[0] == 0 and g[-1] == L and np.all(np.diff(g) > 0)
            assert len(g) <= points + 1


def test_grid_times_are_the_full_matrix_at_the_grid() -> None:
    """The grid's masked stage times are the full model's entries at its rows and columns,
    the same floats (so its DPs compare what the full model's would)."""
    for seed in range(20):
        prof, devs, factor = instance(seed)
        model = CostModel(prof, bandwidth, factor)
        grid = GridModel(model, _grid(model.L, 6))
        g = grid.grid
        for d in devs:
            for bw_in, bw_out, flight in ((None, 1e9, 2), (1e8, None, 1), (1e9, 1e8, 3)):
                full = model.masked_times(d.type, bw_in, bw_out, flight, d.memory)
                got = grid.masked_times(d.type, bw_in, bw_out, flight, d.memory)
                assert np.array_equal(got, full[np.ix_(g, g)])


def test_grid_split_is_the_best_split_with_cuts_on_the_grid() -> None:
    """The grid model's split of an order is the least-bottleneck split (then least
    latency) among those cutting only at the grid, found by trying every such split; it is
    a split of the full model, never better than the full model's."""
    checked = 0
    for seed in range(60):
        prof, devs, factor = instance(100 + seed)
        model = CostModel(prof, bandwidth, factor)
        grid = GridModel(model, _grid(model.L, 8))
        inner = [int(x) for x in grid.grid[1:-1]]
        k = len(devs)
        for nm in (1, k):
            got = grid.partition(devs, nm)
            best = None
            for cut in itertools.combinations(inner, k - 1):
                bounds = (0, *cut, model.L)
                p = model.describe(devs, list(itertools.pairwise(bounds)), nm)
                if any(m.total > c for m, c in zip(p.memory, p.caps, strict=True)):
                    continue
                if best is None or (p.bottleneck, p.latency) < (best.bottleneck, best.latency):
                    best = p
            if best is None:
                assert isinstance(got, Infeasible)
                continue
            checked += 1
            assert isinstance(got, Partition)
            assert got.bottleneck == best.bottleneck
            assert got.latency == pytest.approx(best.latency, rel=1e-12)
            full = model.partition(devs, nm)
            assert isinstance(full, Partition) and full.bottleneck <= got.bottleneck
    assert checked > 20


def test_coarse_order_search_returns_the_full_models_split_of_its_order(monkeypatch) -> None:
    """Above the size threshold a large VW's orders are ranked on the grid, but the split
    and Nm returned are the full model's best for the order chosen, and its rate is at
    least the grid's best order's; a VW of at most EXHAUSTIVE_MAX devices is still searched
    exhaustively (exact) on the full model."""
    monkeypatch.setattr(order_mod, "COARSE_POINTS", 14)
    monkeypatch.setattr(order_mod, "COARSE_MIN_LAYERS", 28)
    coarse = 0
    for seed in range(25):
        prof, devs, factor = instance(300 + seed, layers=(30, 45), kmin=7, kmax=9)
        model = CostModel(prof, bandwidth, factor)
        r = order_mod.best_order(model, devs, classes_dp=False)
        if not isinstance(r.partition, Partition):
            continue
        assert not r.exact
        again = CostModel(prof, bandwidth, factor).best_nm(r.order)
        assert isinstance(again, Partition)
        assert (again.cuts, again.nm) == (r.partition.cuts, r.partition.nm)
        classes = order_mod.device_classes(devs, model.link)
        ranked = order_mod._grid_ranked(model, tuple(devs), None, classes)
        if ranked:
            coarse += 1
            assert r.partition.minibatches_per_s >= ranked[0][0][0]
    assert coarse >= 5
    for seed in range(10):
        prof, devs, factor = instance(400 + seed, layers=(16, 30), kmax=5)
        model = CostModel(prof, bandwidth, factor)
        r = order_mod.best_order(model, devs)
        assert r.exhaustive
        plain = order_mod.best_order(CostModel(prof, bandwidth, factor), devs, prune=False)
        assert order_mod.score(r.partition) == order_mod.score(plain.partition)


def _diagnose_plain(model: CostModel, devices, nm: int) -> str:
    """The scalar diagnosis the vectorised one replaced (reference)."""
    k, L = len(devices), model.L

    def need(d, i: int, a: int, b: int) -> int:
        return int(model.memory_total(d.type, in_flight(i, k, nm, weights=model.weights))[a, b])

    def desc(d) -> str:
        return f"{d.name} ({d.type}, cap {format_size(d.memory)})"

    lower = model.min_total_memory()
    total_cap = sum(d.memory for d in devices)
    if lower > total_cap:
        return (
            f"the model needs at least {format_size(lower)} in total, "
            f"the devices hold {format_size(total_cap)}"
        )
    for j in range(L):
        needs = [(need(d, i, j, j + 1), d) for i, d in enumerate(devices)]
        if all(n > d.memory for n, d in needs):
            n, d = min(needs, key=lambda x: x[0] - x[1].memory)
            return f"layer {j} alone needs {format_size(n)} on {desc(d)} (Nm={nm})"
    for i, d in enumerate(devices):
        lo, hi = i, L - k + i
        smallest = min(need(d, i, j, j + 1) for j in range(lo, hi + 1))
        if smallest > d.memory:
            return (
                f"{desc(d)} cannot hold even one layer at stage {i} "
                f"(the smallest needs {format_size(smallest)}, Nm={nm})"
            )
    names = ", ".join(d.name for d in devices)
    return (
        f"no contiguous split of {L} layers over {names} fits in memory at Nm={nm} "
        f"(the model needs at least {format_size(lower)}, the devices hold "
        f"{format_size(total_cap)})"
    )


def test_vectorised_diagnosis_says_what_the_scalar_one_said() -> None:
    kinds = set()
    for seed in range(150):
        prof, devs, factor = instance(500 + seed, kmax=6, loose=1.2)
        r = random.Random(seed)
        for d in r.sample(devs, r.randint(0, len(devs))):  # some very small devices
            object.__setattr__(d, "memory", max(1, d.memory // r.choice((3, 30, 300))))
        model = CostModel(prof, bandwidth, factor)
        for nm in (1, len(devs)):
            got, want = model.diagnose(devs, nm), _diagnose_plain(model, devs, nm)
            assert got == want
            kinds.add(want.split(" ")[0] + (" cannot" if "cannot" in want else ""))
    assert len(kinds) >= 3  # total, a layer alone, a device, the general reason
