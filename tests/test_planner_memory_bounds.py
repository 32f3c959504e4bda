"""The memory-aware VW bounds (hetpipe.planner.bounds) against every split they bound."""

from __future__ import annotations

import dataclasses
import itertools
import random

from helpers import node_bandwidth, random_vw

from hetpipe.core.profile import TieProfile
from hetpipe.planner import CostModel
from hetpipe.planner.bounds import MemoryBounds
from hetpipe.planner.partition import Partition


def with_saved_inputs(prof, r: random.Random):
    """``prof`` with part of each layer's saved bytes its saved input (a tensor the layer
    before it saves as output too), so that the bounds' correction for shared tensors is
    exercised."""
    layers = {
        t: tuple(
            dataclasses.replace(lp, saved_input_bytes=int(lp.saved_bytes * r.random() * 0.5))
            for lp in lps
        )
        for t, lps in prof.layers.items()
    }
    return dataclasses.replace(prof, layers=layers)


def test_no_split_fits_above_the_nm_ceiling_nor_runs_below_the_trip_floor() -> None:
    """Over every order, Nm and subset of random VWs, under each weights mode and
    activation policy: a split that fits has Nm at most the ceiling of its devices and of
    every group holding them, and a round trip (its stages' forwards and backwards) at least
    the floor; and the bounds bite (a ceiling below the Nm searched, a floor above the
    fastest type's) on some of them."""
    bit = {"ceiling": 0, "floor": 0}
    for seed in range(36):
        r = random.Random(900 + seed)
        prof, devs = random_vw(r, r.randint(4, 24), r.randint(2, 4))
        if seed % 2:
            prof = with_saved_inputs(prof, r)
        weights = ("stash", "predict-consistent", "latest", "predict")[seed % 4]
        activations = ("keep", "recompute", "auto")[seed % 3]
        model = CostModel(prof, node_bandwidth, 1, weights=weights, activations=activations)
        bounds = MemoryBounds(model)
        if seed % 3 != 1:  # devices that hold the model at a shallow Nm only
            need = float(bounds.layer_bytes(1).sum())
            devs = [dataclasses.replace(d, memory=int(need * r.uniform(0.4, 0.8))) for d in devs]
        top = 8
        whole = bounds.nm_ceiling(devs, top)
        floor = bounds.trip_floor(devs)
        bit["ceiling"] += whole < top
        bit["floor"] += floor > model.round_trip_floor(devs)
        for size in range(1, len(devs) + 1):
            for sub in itertools.combinations(devs, size):
                ceiling = bounds.nm_ceiling(sub, top)
                assert ceiling <= whole or size < 2
                sub_floor = bounds.trip_floor(sub)
                assert sub_floor >= floor * (1 - 1e-12)
                for order in itertools.permutations(sub):
                    for nm in range(1, top + 1):
                        p = model.partition(order, nm)
                        if not isinstance(p, Partition):
                            continue
                        assert size < 2 or nm <= ceiling, (seed, order, nm, ceiling)
                        trip = sum(
                            (model.costs(t).F[b] - model.costs(t).F[a])
                            + (model.costs(t).Bk[b] - model.costs(t).Bk[a])
                            for t, (a, b) in zip(p.types, p.cuts, strict=True)
                        )
                        assert trip >= sub_floor, (seed, order, nm, trip, sub_floor)
    assert bit["ceiling"] > 0 and bit["floor"] > 0


def test_tied_tensors_leave_the_plain_bounds() -> None:
    """With a tensor tied across layers (counted once by a stage holding several of them)
    the per-layer bytes over-count, so no memory bound is given: the ceiling is the most Nm
    asked and the floor 0."""
    r = random.Random(7)
    prof, devs = random_vw(r, 8, 3)
    prof = dataclasses.replace(prof, ties=(TieProfile("w", (0, 7), 1000),))
    bounds = MemoryBounds(CostModel(prof, node_bandwidth, 1))
    assert bounds.nm_ceiling(devs, 6) == 6
    assert bounds.trip_floor(devs) == 0.0
