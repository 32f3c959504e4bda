"""The exact split: DP against brute force, memory model, infeasibility reasons, Nm choice."""

from __future__ import annotations

import dataclasses
import itertools
import random

import numpy as np
import pytest
from helpers import with_saved_ends

from hetpipe.config import DeviceSpec
from hetpipe.planner import (
    WEIGHT_MODES,
    CallProfile,
    CostModel,
    Infeasible,
    LayerProfile,
    ModelProfile,
    Partition,
    brute_force,
    in_flight,
    partition,
    partition_best_nm,
    stage_memory,
    stage_memory_of,
    synthetic_profile,
    weights_mode,
)
from hetpipe.planner.runtime import RuntimeCosts


def dev(name: str, dtype: str, memory: int, node: str = "n0", speed: float = 1.0) -> DeviceSpec:
    return DeviceSpec(name, "cpu", dtype, memory, speed, 0, node, "127.0.0.1")


def bandwidth(a: DeviceSpec, b: DeviceSpec) -> float:
    return 1e9 if a.node == b.node else 1e8


def random_instance(seed: int):
    r = random.Random(seed)
    L = r.randint(1, 10)
    k = r.randint(1, 4)
    types = {f"t{j}": r.uniform(0.2, 1.0) for j in range(r.randint(1, 3))}
    prof = synthetic_profile(
        L, types, r, param_bytes=(1000, 40000), out_bytes=(100, 20000), time_s=(1e-3, 5e-3)
    )
    # caps around what an even share needs, so that both outcomes are common
    share = sum(lp.param_bytes * 4 + lp.saved_bytes * 2 for lp in prof.layers["t0"]) // k
    devs = [
        dev(
            f"g{i}",
            r.choice(list(types)),
            int(share * r.uniform(0.3, 2.5)) + 1,
            f"n{r.randint(0, 1)}",
        )
        for i in range(k)
    ]
    return prof, devs, r.randint(1, 4), r.randint(0, 2)


def test_dp_equals_brute_force_on_random_instances():
    feasible = infeasible = 0
    for seed in range(240):
        prof, devs, nm, factor = random_instance(seed)
        p = partition(prof, devs, nm, bandwidth, factor)
        q = brute_force(prof, devs, nm, bandwidth, factor)
        assert bool(p) == bool(q), (seed, p, q)
        if not isinstance(p, Partition):
            infeasible += 1
            assert isinstance(p, Infeasible) and p.reason
            continue
        feasible += 1
        assert isinstance(q, Partition)
        # the same floats on both sides: exact equality, not closeness
        assert p.bottleneck == q.bottleneck, seed
        k, L = len(devs), prof.n_layers()
        assert p.cuts[0][0] == 0 and p.cuts[-1][1] == L
        assert all(a < b for a, b in p.cuts)
        assert all(x[1] == y[0] for x, y in itertools.pairwise(p.cuts))
        for i, (d, (a, b)) in enumerate(zip(devs, p.cuts, strict=True)):
            lps = prof.layers[d.type]
            inb = prof.input_bytes if a == 0 else lps[a - 1].out_bytes
            mem = stage_memory(lps[a:b], i, k, nm, factor, inb)
            assert mem == p.memory[i]
            assert mem.total <= d.memory
        assert p.bottleneck == max(p.stage_times)
    assert feasible >= 60 and infeasible >= 40, (feasible, infeasible)


@pytest.mark.parametrize("weights", WEIGHT_MODES)
def test_vectorised_memory_matches_the_memory_model(weights):
    prof = synthetic_profile(9, {"a": 1.0, "b": 0.5}, 3)
    model = CostModel(prof, bandwidth, 2, weights=weights)
    for dtype in ("a", "b"):
        for k, nm in ((1, 1), (3, 2), (4, 5)):
            for pos in range(k):
                flight = in_flight(pos, k, nm, weights=weights)
                totals = model.memory_total(dtype, flight)
                for a in range(9):
                    for b in range(a + 1, 10):
                        ref = stage_memory_of(prof, dtype, (a, b), pos, k, nm, 2, weights=weights)
                        assert int(totals[a, b]) == ref.total
                        assert model.stage_memory(dtype, a, b, pos, k, nm) == ref


@pytest.mark.parametrize("weights", WEIGHT_MODES)
def test_the_matrices_count_what_two_layers_save_once_as_the_memory_model(weights):
    """On a profile with measured saved ends the planner's matrices and its scalar path
    (recomputing and swapping included) charge every ``[a, b)`` exactly what the memory
    model does: the stage input and a tensor two adjacent layers save once, the output
    where the last layer does not save it."""
    prof = with_saved_ends(synthetic_profile(8, {"a": 1.0, "b": 0.5}, 5), 11)
    assert any(lp.saved_input_bytes for lp in prof.layers["a"])
    model = CostModel(prof, bandwidth, 2, weights=weights)
    plain = CostModel(synthetic_profile(8, {"a": 1.0, "b": 0.5}, 5), bandwidth, 2, weights=weights)
    differs = False
    for dtype in ("a", "b"):
        for k, nm in ((1, 1), (3, 2)):
            for pos in range(k):
                totals = model.memory_total(dtype, in_flight(pos, k, nm, weights=weights))
                for a in range(8):
                    for b in range(a + 1, 9):
                        ref = stage_memory_of(prof, dtype, (a, b), pos, k, nm, 2, weights=weights)
                        assert int(totals[a, b]) == ref.total
                        assert model.stage_memory(dtype, a, b, pos, k, nm) == ref
                        differs |= ref != plain.stage_memory(dtype, a, b, pos, k, nm)
                        rel = list(range(b - a))
                        for rec, swap in ((rel[:2], ()), ((), rel[-2:]), (rel[:1], rel[1:2])):
                            got = model.stage_memory(
                                dtype,
                                a,
                                b,
                                pos,
                                k,
                                nm,
                                recompute=[a + j for j in rec],
                                swap=[a + j for j in swap],
                            )
                            want = stage_memory_of(
                                prof,
                                dtype,
                                (a, b),
                                pos,
                                k,
                                nm,
                                2,
                                weights=weights,
                                recompute=[a + j for j in rec],
                                swap=[a + j for j in swap],
                            )
                            assert got == want
    assert differs  # the ends changed the count


def test_stage_memory_by_hand():
    lps = [LayerProfile(0.1, 0.2, 100, 10, 50, 30, 70), LayerProfile(0.1, 0.2, 200, 0, 40, 20, 90)]
    m = stage_memory(lps, position=0, k=3, nm=4, optimizer_state_factor=2, input_bytes=8)
    assert m.params == 310 and m.optimizer == 600 and m.stash == 3 * 300
    assert m.accumulators == 600 and m.activations == 4 * (50 + 8) and m.working == 90
    assert m.total == 310 + 600 + 900 + 600 + 232 + 90
    last = stage_memory(lps, position=2, k=3, nm=4, optimizer_state_factor=2, input_bytes=8)
    assert last.stash == 0 and last.activations == 58


def test_stage_memory_by_weights_mode():
    """stash: a version per in-flight minibatch; latest: none (the backward reruns the
    forward, so only inputs stay); predict: one predicted copy (paper: each in-flight
    minibatch keeps its forward's graph, whose weights are bound at the backward, and its
    recomputed layers' prediction) or one per in-flight minibatch (consistent)."""
    lps = [LayerProfile(0.1, 0.2, 100, 10, 50, 30, 70), LayerProfile(0.1, 0.2, 200, 0, 40, 20, 90)]

    def mem(weights: str, recompute: tuple[int, ...] = ()):
        return stage_memory(
            lps,
            position=0,
            k=3,
            nm=4,
            optimizer_state_factor=1,
            input_bytes=8,
            weights=weights,
            recompute=recompute,
        )

    assert mem("stash").stash == 3 * 300 and mem("stash").activations == 4 * (50 + 8)
    assert mem("latest").stash == 0 and mem("latest").activations == 4 * 8 + 50
    assert mem("predict").stash == 300 and mem("predict").activations == 4 * (50 + 8)
    # layer 1 recomputed: its 200 parameter bytes stay with each of the 4 in flight
    assert mem("predict", (1,)).stash == 300 + 4 * 200
    # and its output (40, the backward's root) stays whole: the recomputed layer keeps none
    assert mem("predict", (1,)).activations == 4 * (50 + 30 + 40 + 8)
    assert mem("stash", (1,)).stash == mem("stash").stash
    pc = mem("predict-consistent")
    assert pc.stash == 4 * 300 and pc.activations == 4 * (50 + 8)
    assert mem("predict").total < mem("stash").total < pc.total
    assert weights_mode("predict", "consistent") == "predict-consistent"
    assert weights_mode("predict") == "predict" and weights_mode("stash", "consistent") == "stash"


def test_predict_lets_a_whimpy_device_hold_a_longer_pipeline():
    """Prediction keeps one weight copy whatever Nm (stashing Nm - 1): a cap that fits
    Nm = 2 with stashing, plus the activations of the three more minibatches the first
    stage holds at Nm = 6 (prediction keeps each one's graph as stashing does), fits Nm = 6
    with prediction and not with stashing."""
    prof = _uniform_profile(6, param=4000, out=100)
    two = stage_memory_of(prof, "x", (0, 2), 0, 3, 2, 1)
    cap = two.total + 3 * (two.activations // 2)
    devs = [dev(f"g{i}", "x", cap) for i in range(3)]
    assert isinstance(partition(prof, devs, 2, bandwidth, 1), Partition)
    assert isinstance(partition(prof, devs, 6, bandwidth, 1), Infeasible)
    model = CostModel(prof, bandwidth, 1, weights="predict")
    assert isinstance(model.partition(devs, 6), Partition)
    q = brute_force(prof, devs, 6, bandwidth, 1, weights="predict")
    assert isinstance(q, Partition) and q.bottleneck == model.partition(devs, 6).bottleneck


def _uniform_profile(L: int, param: int = 1000, out: int = 100) -> ModelProfile:
    lp = LayerProfile(1e-3, 2e-3, param, 0, out, 2 * out, 2 * out)
    return ModelProfile("u", 8, out, {"x": (lp,) * L})


def test_balanced_split_of_identical_layers():
    prof = _uniform_profile(12)
    devs = [dev(f"g{i}", "x", 1 << 30) for i in range(4)]
    p = partition(prof, devs, 4, lambda a, b: float("inf"), 0)
    assert isinstance(p, Partition)
    assert p.sizes == (3, 3, 3, 3)


def test_memory_forces_an_uneven_split():
    prof = _uniform_profile(8)
    # stage 0 keeps Nm=4 minibatches and 3 stashed versions; allow it only 2 layers
    per_layer0 = stage_memory_of(prof, "x", (0, 2), 0, 2, 4, 1).total
    devs = [dev("small", "x", per_layer0), dev("big", "x", 1 << 30)]
    p = partition(prof, devs, 4, lambda a, b: float("inf"), 1)
    assert isinstance(p, Partition)
    assert p.sizes == (2, 6)
    assert p.memory[0].total <= per_layer0


@pytest.mark.parametrize(
    ("devices", "expect"),
    [
        ([dev("g0", "x", 1 << 30)] * 5, "only 4 layers"),
        ([dev("g0", "x", 10), dev("g1", "x", 10)], "in total"),
        ([dev("g0", "missing", 1 << 30)], "no profile"),
    ],
)
def test_infeasible_reasons(devices, expect):
    prof = _uniform_profile(4)
    p = partition(prof, devices, 2, lambda a, b: 1e9, 1)
    assert isinstance(p, Infeasible) and not p
    assert expect in p.reason


def test_a_layer_too_big_for_every_device_is_named():
    lps = [LayerProfile(1e-3, 2e-3, 1000, 0, 10, 10, 10)] * 4
    big = LayerProfile(1e-3, 2e-3, 1 << 20, 0, 10, 10, 10)
    prof = ModelProfile("m", 8, 10, {"x": (*lps[:2], big, *lps[2:])})
    devs = [dev("g0", "x", 3 << 20), dev("whimpy", "x", 3 << 20)]
    p = partition(prof, devs, 2, lambda a, b: 1e9, 1)
    assert isinstance(p, Infeasible)
    assert "layer 2 alone needs" in p.reason and "cap 3.0MiB" in p.reason


def test_a_device_too_small_for_any_layer_is_named():
    prof = _uniform_profile(6)
    devs = [dev("g0", "x", 1 << 30), dev("tiny", "x", 2000)]
    p = partition(prof, devs, 2, lambda a, b: 1e9, 1)
    assert isinstance(p, Infeasible)
    assert "tiny" in p.reason and "cannot hold even one layer" in p.reason


def test_best_nm_maximises_the_estimate():
    for seed in range(60):
        prof, devs, _, factor = random_instance(1000 + seed)
        k = len(devs)
        best = partition_best_nm(prof, devs, bandwidth, factor)
        per_nm = [partition(prof, devs, n, bandwidth, factor) for n in range(1, k + 1)]
        rates = [p.minibatches_per_s for p in per_nm if isinstance(p, Partition)]
        if not rates:
            assert not best
            continue
        assert isinstance(best, Partition)
        # cuts and Nm are chosen together: at least every Nm's least-bottleneck split
        # (equality with the best over all splits: tests/test_planner_joint.py)
        assert best.minibatches_per_s >= max(rates) * (1 - 1e-12)


def test_a_pipeline_fills_at_nm_equal_k():
    prof = _uniform_profile(12)
    devs = [dev(f"g{i}", "x", 1 << 30) for i in range(4)]
    p = partition_best_nm(prof, devs, lambda a, b: float("inf"), 0)
    assert isinstance(p, Partition)
    assert p.nm == 4 and p.minibatches_per_s == pytest.approx(1 / p.bottleneck)


def test_partitions_of_alike_device_sequences_are_memoised():
    prof = synthetic_profile(20, {"a": 1.0, "b": 0.5}, 1)
    model = CostModel(prof, bandwidth, 1)
    x = [dev("g0", "a", 1 << 30), dev("g1", "b", 1 << 30)]
    y = [dev("h0", "a", 1 << 30), dev("h1", "b", 1 << 30)]
    p, q = model.partition(x, 2), model.partition(y, 2)
    assert model.dp_runs == 1
    assert isinstance(p, Partition) and isinstance(q, Partition)
    assert q.devices == ("h0", "h1") and q.cuts == p.cuts


def test_prefix_bound_never_exceeds_the_optimum():
    for seed in range(80):
        prof, devs, nm, factor = random_instance(2000 + seed)
        model = CostModel(prof, bandwidth, factor)
        p = model.partition(devs, nm)
        if not isinstance(p, Partition):
            continue
        for m in range(1, len(devs) + 1):
            lb = model.prefix_bound(devs[:m], len(devs), nm, devs[m:])
            assert lb <= p.bottleneck


def test_time_matrix_is_the_scalar_expression():
    prof = synthetic_profile(7, {"a": 1.0}, 5)
    model = CostModel(prof, bandwidth, 0)
    t = model.time_matrix("a", 1e8, 3e9)
    for a in range(7):
        for b in range(8):
            want = model.stage_time("a", a, b, 1e8, 3e9) if a < b else np.inf
            assert t[a, b] == want


def test_dp_equals_brute_force_with_the_runtime_costs():
    # the runtime's per-stage costs (hand-offs, messages, padded task work) enter both sides
    costs = RuntimeCosts(task_s=2e-4, hop_s=4e-4, message_s=3e-4, message_byte_s=1e-8)
    feasible = 0
    for seed in range(120):
        prof, devs, nm, factor = random_instance(5000 + seed)
        speeds = {t: 0.25 + 0.25 * i for i, t in enumerate(sorted(prof.layers))}
        p = partition(prof, devs, nm, bandwidth, factor, costs=costs, speeds=speeds)
        q = brute_force(prof, devs, nm, bandwidth, factor, costs=costs, speeds=speeds)
        assert bool(p) == bool(q), seed
        if isinstance(p, Partition):
            feasible += 1
            assert p.bottleneck == q.bottleneck, seed
    assert feasible >= 30


def test_runtime_costs_add_per_stage_time():
    prof = synthetic_profile(6, {"a": 1.0}, 1)
    costs = RuntimeCosts(task_s=1e-3, hop_s=2e-3, message_s=3e-3, message_byte_s=0.0)
    bare = CostModel(prof, bandwidth, 0)
    model = CostModel(prof, bandwidth, 0, costs, {"a": 0.5})
    # a middle stage: two tasks (task_s padded by 1/speed, plus a hand-off each), two sends
    extra = model.stage_time("a", 2, 4, 1e9, 1e9) - bare.stage_time("a", 2, 4, 1e9, 1e9)
    assert extra == pytest.approx(2 * (1e-3 / 0.5 + 2e-3) + 2 * 3e-3)
    # the last stage runs its forward and backward as one task and sends one gradient
    extra = model.stage_time("a", 4, 6, 1e9, None) - bare.stage_time("a", 4, 6, 1e9, None)
    assert extra == pytest.approx(1e-3 / 0.5 + 2e-3 + 3e-3)
    # the update of a layer's state counts like its forward and backward
    lp = LayerProfile(1e-3, 2e-3, 100, 0, 10, 10, 10, update_s=5e-4)
    one = CostModel(ModelProfile("m", 1, 10, {"a": (lp, lp)}), bandwidth, 0)
    assert one.stage_time("a", 0, 2, None, None) == pytest.approx(2 * 3.5e-3)


def test_the_call_term_is_charged_once_per_stage():
    prof = synthetic_profile(6, {"a": 1.0}, 1)
    call = CallProfile(1e-3, 2e-3, 5e-4)
    bare = CostModel(prof, bandwidth, 0)
    model = CostModel(dataclasses.replace(prof, calls={"a": call}), bandwidth, 0)
    links = (None, 1e9)
    for a, b in ((0, 1), (2, 4), (0, 6)):
        for bw_in, bw_out in itertools.product(links, links):
            extra = model.stage_time("a", a, b, bw_in, bw_out) - bare.stage_time(
                "a", a, b, bw_in, bw_out
            )
            assert extra == pytest.approx(call.time_s)  # whatever the stage's layer count
    # the matrix the DP reads is the scalar stage time, float for float
    t = model.time_matrix("a", 1e9, None)
    for a in range(7):
        for b in range(a + 1, 7):
            assert t[a, b] == model.stage_time("a", a, b, 1e9, None)


def test_a_large_call_term_moves_layers_to_the_type_without_one():
    # ten 1 ms layers on two devices: alike they split 5/5; a device whose type pays 4 ms
    # per stage call takes 3 layers (3 + 4 = 7 ms) and leaves 7 to the other (7 ms)
    lp = LayerProfile(1e-3, 0.0, 0, 0, 1, 1, 1)
    types = {"a": (lp,) * 10, "b": (lp,) * 10}
    devs = [dev("g0", "a", 1 << 30), dev("g1", "b", 1 << 30)]
    free = partition(ModelProfile("m", 8, 1, types), devs, 1, lambda a, b: float("inf"), 0)
    assert isinstance(free, Partition) and free.sizes == (5, 5)
    prof = ModelProfile("m", 8, 1, types, {"a": CallProfile(4e-3, 0.0, 0.0)})
    p = partition(prof, devs, 1, lambda a, b: float("inf"), 0)
    assert isinstance(p, Partition) and p.sizes == (3, 7)
    assert p.bottleneck == pytest.approx(7e-3)
    q = partition(prof, devs[::-1], 1, lambda a, b: float("inf"), 0)
    assert isinstance(q, Partition) and q.sizes == (7, 3)


def test_dp_equals_brute_force_with_call_terms():
    costs = RuntimeCosts(task_s=2e-4, hop_s=4e-4, message_s=3e-4, message_byte_s=1e-8)
    feasible = 0
    for seed in range(60):
        prof, devs, nm, factor = random_instance(7000 + seed)
        r = random.Random(seed)
        prof = dataclasses.replace(
            prof,
            calls={
                t: CallProfile(r.uniform(0, 4e-3), r.uniform(0, 8e-3), r.uniform(0, 1e-3))
                for t in prof.layers
            },
        )
        speeds = {t: 0.25 + 0.25 * i for i, t in enumerate(sorted(prof.layers))}
        p = partition(prof, devs, nm, bandwidth, factor, costs=costs, speeds=speeds)
        q = brute_force(prof, devs, nm, bandwidth, factor, costs=costs, speeds=speeds)
        assert bool(p) == bool(q), seed
        if isinstance(p, Partition):
            feasible += 1
            assert p.bottleneck == q.bottleneck, seed
    assert feasible >= 15
