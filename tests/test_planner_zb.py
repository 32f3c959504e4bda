"""The synchronous planner prices and chooses the zero-bubble kinds: their iteration time is
the simulator's, their memory counts the graph a deferred weight gradient keeps, and the
planner picks among gpipe, 1f1b, zb-h1 and zb-h2 by predicted time under each memory cap."""

from __future__ import annotations

import math
import random

import pytest
from helpers import Dev

from hetpipe.core.memory import stage_memory
from hetpipe.core.schedule import (
    INPUT_GRAD_SHARE,
    max_deferred,
    max_in_flight,
    microbatch_order,
)
from hetpipe.planner.profile import LayerProfile, ModelProfile, synthetic_profile
from hetpipe.planner.simulate import iteration_time
from hetpipe.planner.syncmodel import SyncModel, SyncStage, warmup_ladder
from hetpipe.planner.syncsearch import exhaustive, plan_sync

KINDS = ("gpipe", "1f1b", "zb-h1", "zb-h2")
ACT = 1 << 20


def test_unit_stages_zb_fills_what_1f1b_leaves_idle():
    """Forward 1, backward 2 (input and weight gradient 1 each): 1f1b takes 3 (m + k - 1),
    zb-h1 3m + k - 1, the last stage's own work after its first input."""
    assert INPUT_GRAD_SHARE == 0.5
    unit = [SyncStage(1.0, 2.0)] * 4
    free = [(0.0, 0.0)] * 3
    t = {kind: iteration_time(unit, free, [microbatch_order(kind, 4, s, 8) for s in range(4)])
         for kind in KINDS}  # fmt: skip
    assert t["1f1b"] == pytest.approx(3 * (8 + 3))
    assert t["zb-h1"] == pytest.approx(3 * 8 + 3)
    assert t["zb-h2"] == pytest.approx(3 * 8 + 3)


def test_zb_memory_holds_the_graph_until_the_weight_gradient():
    """A stage holds each microbatch's activations until its W (the order's held peak) and,
    between its I and W, its output's gradient and one per other layer with weights (the
    first stage, whose input takes none, its output's alone)."""
    layer = LayerProfile(1e-3, 2e-3, 4096, 0, ACT, 3 * ACT, 0)
    layers = (layer, layer)

    def mem(kind: str, pos: int):
        return stage_memory(layers, pos, 4, 8, 1, ACT, kind)

    for pos in range(4):
        n = max_in_flight("zb-h1", 4, pos, 8)
        deferred = max_deferred("zb-h1", 4, pos, 8)
        assert (n, deferred) == (4, pos + 1)
        grads = ACT if pos == 0 else 2 * ACT  # the first stage keeps its output's gradient
        assert mem("zb-h1", pos).activations == n * (ACT + 2 * 3 * ACT) + deferred * grads
        assert max_deferred("1f1b", 4, pos, 8) == 0
        assert mem("1f1b", pos).activations == (4 - pos) * (ACT + 2 * 3 * ACT)


def _hetero(cap_acts: int) -> SyncModel:
    """Four devices, the second at half speed, four equal layers (1 ms forward, 2 ms
    backward, one activation unit out and saved, a few bytes of weights: a stage without
    any keeps no gradient for its weight pass), M = 8, a cap of ``cap_acts`` units (and room
    for the weights' few bytes)."""
    layer = LayerProfile(1e-3, 2e-3, 4, 0, ACT, ACT, 0)
    prof = ModelProfile("four", 32, ACT, {"a": (layer,) * 4})
    devs = [Dev(f"d{i}", "a", cap_acts * ACT + 1024, s) for i, s in enumerate((1.0, 0.5, 1.0, 0.7))]
    return SyncModel(
        prof, devs, lambda a, b: ACT / 1e-4, 8, 1, kinds=KINDS, warmups=warmup_ladder(8)
    )


@pytest.mark.parametrize(
    ("cap", "want"), [(8, "1f1b"), (12, "zb-h1"), (60, "zb-h2")]
)  # fmt: skip
def test_the_planner_picks_the_fastest_kind_that_fits(cap, want):
    """On unequal devices the zero-bubble kinds fill the slow stage's shadow: zb-h2 where
    its memory fits, zb-h1 where only 1f1b's peak (on the first stage) does, 1f1b where the
    graphs kept for deferred weight gradients fit nowhere."""
    model = _hetero(cap)
    cuts = ((0, 1), (1, 2), (2, 3), (3, 4))
    devs = (0, 1, 2, 3)
    t = {o: model.evaluate(devs, cuts, *o) for o in model.orders}
    fits = {o: x for o, x in t.items() if x < math.inf}
    assert min(fits, key=fits.__getitem__)[0] == want
    if want != "1f1b":
        assert fits[("1f1b", 0)] / min(fits.values()) > 1.15
    best = exhaustive(model)
    assert best is not None and best.kind == want


def test_search_with_zb_kinds_is_within_5_percent_of_the_exhaustive_optimum():
    rng = random.Random(37)
    gaps = []
    while len(gaps) < 15:
        speeds = {"a": 1.0, "b": 0.5, "c": 0.25}
        types = rng.sample(list(speeds), rng.randint(1, 3))
        layers, n, m = rng.randint(2, 6), rng.randint(2, 4), rng.randint(1, 4)
        prof = synthetic_profile(layers, {t: speeds[t] for t in types}, rng)
        need = sum(lp.param_bytes for lp in prof.layers[types[0]]) * 6
        devs = [Dev(f"d{i}", rng.choice(types), rng.randint(need // 4, need * 2)) for i in range(n)]
        bw = {(i, j): rng.choice([1e8, 1e9, 1e10]) for i in range(n) for j in range(n)}
        index = {d.name: i for i, d in enumerate(devs)}
        model = SyncModel(
            prof, devs, lambda a, b, bw=bw, ix=index: bw[ix[a.name], ix[b.name]], m, 1, kinds=KINDS
        )
        opt = exhaustive(model)
        got = plan_sync(model, budget_s=2)
        if opt is None:
            assert got is None
            continue
        assert got is not None
        gaps.append(got.iteration_s / opt.iteration_s - 1)
    assert max(gaps) <= 0.05, sorted(gaps)[-3:]


@pytest.mark.parametrize("kind", KINDS)
def test_vectorised_memory_is_the_scalar_models(kind):
    """The partitioner's memory over every [a, b) is the one model's, zb terms included."""
    rng = random.Random(5)
    prof = synthetic_profile(5, {"a": 1.0}, rng)
    model = SyncModel(prof, [Dev("d0", "a", 1 << 40)], lambda a, b: 1e9, 6, 1, kinds=KINDS)
    for pos in range(3):
        grid = model._memory_matrix(0, pos, 3, kind)
        for a in range(5):
            for b in range(a + 1, 6):
                assert grid[a, b] == model.memory(0, a, b, pos, 3, kind).total
