"""The synchronous planner: its iteration time is the simulator's, its search is within 5% of
the exhaustive optimum on small random instances, and it plans large clusters quickly."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import pytest

from hetpipe.planner.profile import synthetic_profile
from hetpipe.planner.simulate import SimLink, SimStage, SimVW, simulate
from hetpipe.planner.syncplan import SyncModel, SyncStage, exhaustive, iteration_time, plan_sync
from hetpipe.schedule import microbatch_order


@dataclass(frozen=True)
class Dev:
    name: str
    type: str
    memory: int
    speed: float = 1.0


def instance(rng: random.Random, n: int, layers: int, m: int, caps: bool = True):
    """A random small cluster of <= 3 types with a random bandwidth matrix."""
    speeds = {"a": 1.0, "b": 0.5, "c": 0.25}
    types = rng.sample(list(speeds), rng.randint(1, 3))
    prof = synthetic_profile(layers, {t: speeds[t] for t in types}, rng)
    need = sum(lp.param_bytes for lp in prof.layers[types[0]]) * 6
    devs = [Dev(f"d{i}", rng.choice(types),
                rng.randint(need // 4, need * 2) if caps else 1 << 40) for i in range(n)]
    bw = {}
    for i in range(n):
        for j in range(i + 1, n):
            bw[i, j] = bw[j, i] = rng.choice([1e8, 1e9, 1e10]) * rng.uniform(0.5, 2)
    index = {d.name: i for i, d in enumerate(devs)}
    return SyncModel(prof, devs, lambda a, b: bw[index[a.name], index[b.name]], m, 1)


@pytest.mark.parametrize("seed", range(12))
def test_iteration_time_is_the_simulators(seed):
    rng = random.Random(seed)
    k, m = rng.randint(1, 5), rng.randint(1, 6)
    kind = rng.choice(["gpipe", "1f1b"])
    stages = [SyncStage(rng.uniform(.5, 2), rng.uniform(.5, 3), rng.uniform(0, .3),
                        rng.uniform(0, .2)) for _ in range(k)]
    links = [(rng.uniform(0, .5),) * 2 for _ in range(k - 1)]
    want = iteration_time(stages, links, [microbatch_order(kind, k, s, m) for s in range(k)])
    sim = simulate([SimVW(tuple(SimStage(s.fwd_s, s.bwd_s, push_s=s.push_s, step_s=s.step_s)
                                for s in stages), m, tuple(SimLink(*x) for x in links),
                          schedule=kind)], 0, m)
    assert sim.makespan_s == pytest.approx(want)


def test_more_microbatches_and_a_faster_order_on_unit_stages():
    unit = [SyncStage(1.0, 1.0)] * 4
    for kind in ("gpipe", "1f1b"):
        orders = [microbatch_order(kind, 4, s, 8) for s in range(4)]
        assert iteration_time(unit, [(0.0, 0.0)] * 3, orders) == pytest.approx(2 * (8 + 3))


def test_memory_caps_are_respected_and_gpipe_needs_more():
    rng = random.Random(3)
    model = instance(rng, 4, 8, 4)
    choice = plan_sync(model, budget_s=2)
    assert choice is not None
    k = len(choice.devices)
    for pos, (i, (a, b)) in enumerate(zip(choice.devices, choice.cuts, strict=True)):
        assert model.memory(i, a, b, pos, k, choice.kind).total <= model.devices[i].memory
    # third of four stages, M = 4: gpipe holds 4 microbatches, 1f1b k - position = 2
    gpipe, one = model.memory(0, 0, 4, 2, 4, "gpipe"), model.memory(0, 0, 4, 2, 4, "1f1b")
    assert gpipe.activations == 2 * one.activations > 0
    assert gpipe.stash == one.stash == 0


def optimality_gaps(count: int, seed: int = 0, budget_s: float = 2.0) -> list[float]:
    rng = random.Random(seed)
    gaps = []
    while len(gaps) < count:
        model = instance(rng, rng.randint(2, 5), rng.randint(2, 7), rng.randint(1, 4))
        opt = exhaustive(model)
        got = plan_sync(model, budget_s=budget_s)
        if opt is None:
            assert got is None
            continue
        assert got is not None
        assert got.iteration_s == pytest.approx(
            model.evaluate(got.devices, got.cuts, got.kind))
        gaps.append(got.iteration_s / opt.iteration_s - 1)
    return gaps


def test_search_is_within_5_percent_of_the_exhaustive_optimum():
    """A sample here; scripts/bench_sync.py --optimality runs the 300 of the full check."""
    gaps = optimality_gaps(25)
    assert max(gaps) <= 0.05, sorted(gaps)[-3:]


def test_plans_200_layers_on_32_devices_in_under_10_s():
    rng = random.Random(1)
    model = instance(rng, 32, 200, 4, caps=False)
    t0 = time.process_time()  # CPU seconds: what planning costs, whatever else runs here
    choice = plan_sync(model, budget_s=5)
    assert time.process_time() - t0 < 10
    assert choice is not None and sum(b - a for a, b in choice.cuts) == 200
