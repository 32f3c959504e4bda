"""Two chunks per device for the synchronous planner (hetpipe/planner/chunksearch.py): the
device-shared timing agrees with the one-stage-per-device one, a device's cap holds all its
stages, the cut search equals brute force on small instances, and the plan lists the
candidates and suggests the split to write where a device-level kind is faster. No
processes."""

from __future__ import annotations

import random

import pytest
from helpers import Dev, profile16, repo_cluster

from hetpipe.core.devschedule import device_orders
from hetpipe.core.schedule import DEVICE_KINDS, SYNC_KINDS, microbatch_order
from hetpipe.planner.chunksearch import (
    ChunkChoice,
    best_chunk_cuts,
    chunk_candidates,
    chunk_placement,
    chunk_report,
    chunk_time,
    device_iteration_time,
    exhaustive_chunk_cuts,
)
from hetpipe.planner.profile import synthetic_profile
from hetpipe.planner.runtime import RuntimeCosts
from hetpipe.planner.simulate import iteration_time
from hetpipe.planner.syncmodel import INF, SyncModel, SyncStage
from hetpipe.planner.syncplan import sync_plan
from hetpipe.views import explain_lines


def small(rng: random.Random, caps: bool = True) -> SyncModel:
    """Two devices of unequal speed, 4-8 layers, a random link, caps that often bind."""
    speeds = {"a": 1.0, "b": 0.5, "c": 0.25}
    types = rng.sample(list(speeds), 2)
    prof = synthetic_profile(rng.randint(4, 8), {t: speeds[t] for t in types}, rng)
    need = sum(lp.param_bytes for lp in prof.layers[types[0]]) * 6
    devs = [
        Dev(f"d{i}", t, rng.randint(need // 4, need * 2) if caps else 1 << 40, speeds[t])
        for i, t in enumerate(types)
    ]
    bw = rng.choice([1e8, 1e9, 1e10]) * rng.uniform(0.5, 2)
    return SyncModel(prof, devs, lambda a, b: bw, rng.choice([2, 4]), 1, kinds=("1f1b",))


def repo_model(m: int = 4) -> SyncModel:
    cluster = repo_cluster()
    return SyncModel(
        profile16(),
        list(cluster.devices),
        cluster.network.bytes_per_s,
        m,
        1,
        RuntimeCosts().with_runtime(cluster),
        ("1f1b",),
    )


@pytest.mark.parametrize("seed", range(12))
def test_one_stage_a_device_is_timed_as_the_synchronous_planner_does(seed):
    rng = random.Random(seed)
    k, m = rng.randint(1, 5), rng.randint(1, 6)
    kind = rng.choice(SYNC_KINDS)
    stages = [
        SyncStage(
            rng.uniform(0.5, 2), rng.uniform(0.5, 3), rng.uniform(0, 0.3), rng.uniform(0, 0.2)
        )
        for _ in range(k)
    ]
    links = [(rng.uniform(0, 0.5),) * 2 for _ in range(k - 1)]
    orders = [microbatch_order(kind, k, s, m) for s in range(k)]
    sequences = [[(s, op, j) for op, j in orders[s]] for s in range(k)]
    assert device_iteration_time(stages, links, orders, sequences) == pytest.approx(
        iteration_time(stages, links, orders)
    )


def test_stages_on_one_device_share_its_time():
    """Four equal stages: on four devices the pipeline overlaps them; on two (two chunks
    each) a device runs its two stages' work one after the other, so the iteration is at
    least each device's whole work."""
    stage = SyncStage(1.0, 2.0)
    m = 4
    for kind in DEVICE_KINDS:
        orders = [microbatch_order(kind, 4, s, m, devices=2) for s in range(4)]
        shared = device_iteration_time(
            [stage] * 4, [(0.0, 0.0)] * 3, orders, device_orders(kind, 4, 2, m)
        )
        apart = device_iteration_time(
            [stage] * 4,
            [(0.0, 0.0)] * 3,
            orders,
            [[(s, op, j) for op, j in orders[s]] for s in range(4)],
        )
        assert shared >= 2 * m * (1.0 + 2.0) - 1e-9
        assert apart < shared


def test_placements_are_round_robin_and_a_v():
    assert chunk_placement("interleaved-1f1b", (5, 7)) == (5, 7, 5, 7)
    assert chunk_placement("zbv", (5, 7, 9)) == (5, 7, 9, 9, 7, 5)


@pytest.mark.parametrize("kind", DEVICE_KINDS)
def test_a_devices_cap_holds_all_its_stages_together(kind: str):
    """Cuts whose stages each fit their device but whose two stages on one device do not
    together are refused (inf), as the head refuses a several-stage split."""
    model = repo_model()
    devs = (0, 1)
    cuts = ((0, 4), (4, 8), (8, 12), (12, 16))
    place = chunk_placement(kind, devs)
    need = {i: 0 for i in devs}
    for pos, (i, (a, b)) in enumerate(zip(place, cuts, strict=True)):
        need[i] += model.memory(i, a, b, pos, 4, kind).total
    assert chunk_time(model, kind, devs, cuts) < INF
    # a cap between the largest stage of device 1 and its stages' sum
    most = max(
        model.memory(i, a, b, pos, 4, kind).total
        for pos, (i, (a, b)) in enumerate(zip(place, cuts, strict=True))
        if i == 1
    )
    tight = [*model.devices]
    tight[1] = Dev(tight[1].name, tight[1].type, (most + need[1]) // 2, tight[1].speed)
    model.devices = tuple(tight)
    assert chunk_time(model, kind, devs, cuts) == INF


@pytest.mark.parametrize("enumerate_up_to", [0, 64])
def test_the_cut_search_equals_brute_force_on_small_instances(enumerate_up_to: int):
    """Two devices of unequal speed, 4-8 layers, caps that often bind: every cut of the four
    stages timed against the search's choice. ``enumerate_up_to = 0`` forces the programs and
    the refinement (the path of larger instances); at the default these cuts are all timed."""
    rng = random.Random(7)
    checked = 0
    gaps = []
    while checked < 30:
        model = small(rng)
        for kind in DEVICE_KINDS:
            opt = exhaustive_chunk_cuts(model, kind, (0, 1))
            got = best_chunk_cuts(model, kind, (0, 1), enumerate_up_to=enumerate_up_to)
            if opt is None:
                assert got is None or got.iteration_s == INF
                continue
            assert got is not None, (kind, opt)
            assert got.iteration_s == pytest.approx(chunk_time(model, kind, (0, 1), got.cuts))
            gaps.append(got.iteration_s / opt.iteration_s - 1)
            checked += 1
    assert max(gaps) <= 1e-9, sorted(gaps)[-3:]


def test_the_choice_equals_brute_force_over_schedules_orders_chunks_and_cuts():
    """On two devices of unequal speed: the fastest of the report (the synchronous planner's
    best kind and order on them, and each device-level kind with two chunks) against every
    order with every cut of one stage a device, and every cut of two chunks a device."""
    rng = random.Random(3)
    gaps = []
    while len(gaps) < 30:
        m0 = small(rng)
        bw = float(m0.bw[0, 1])
        model = SyncModel(m0.profile, m0.devices, lambda a, b, bw=bw: bw, m0.m, 1, kinds=SYNC_KINDS)
        best = model.best_kind((0, 1))
        if best is None:
            continue
        rows, _ = chunk_report(model, best)
        got = min(r["iteration_s"] for r in rows if r["iteration_s"] is not None)
        L = model.L
        brute = min(
            model.evaluate((0, 1), ((0, c), (c, L)), kind, warmup)
            for kind, warmup in model.orders
            for c in range(1, L)
        )
        for kind in DEVICE_KINDS:
            e = exhaustive_chunk_cuts(model, kind, (0, 1))
            brute = min(brute, e.iteration_s if e else INF)
        gaps.append(got / brute - 1)
    assert max(gaps) <= 1e-9, sorted(gaps)[-3:]


def test_interleaved_needs_microbatches_a_multiple_of_the_devices():
    model = repo_model(m=3)
    rows = {kind: (c, why) for kind, c, why in chunk_candidates(model, (0, 1))}
    assert rows["interleaved-1f1b"][0] is None
    assert "multiple of the devices" in rows["interleaved-1f1b"][1]
    assert isinstance(rows["zbv"][0], ChunkChoice)


def test_the_report_suggests_the_split_to_write_where_two_chunks_are_faster():
    """The plan's devices with two chunks each are priced beside its one-stage-a-device
    pipeline; where one is faster, the suggestion is a job the runtime accepts as written."""
    from hetpipe.job import JobSpec

    model = repo_model()
    best = model.choice((0, 1), "1f1b")
    assert best is not None
    rows, suggestion = chunk_report(model, best)
    assert [r["kind"] for r in rows] == ["1f1b", *DEVICE_KINDS]
    assert sum(r["best"] for r in rows) == 1
    fastest = next(r for r in rows if r["best"])
    assert fastest["iteration_s"] == min(r["iteration_s"] for r in rows if r["iteration_s"])
    assert fastest["chunks"] == 2 and suggestion is not None, rows
    assert suggestion.startswith(f"suggestion: {fastest['kind']} ") and "\n" not in suggestion
    spec = JobSpec.from_dict(
        {
            "name": "j",
            "model": {"name": "mlp"},
            "train": {
                "minibatch": 4,
                "minibatches": 8,
                "nm": 4,
                "schedule": fastest["kind"],
                "several_stages": True,
            },
            "vw": [{"devices": fastest["devices"], "layers": fastest["layers"]}],
        }
    )
    assert spec.schedule == fastest["kind"]
    assert sum(fastest["layers"]) == 16


def test_the_plan_lists_the_candidates_and_explains_them():
    """A plan of one synchronous VW prices its devices under every device-level kind beside
    its own schedule (with several VWs it prices none: the runtime runs one VW's chunks)."""
    cluster = repo_cluster()
    plan = sync_plan(
        cluster, profile16(), minibatch=32, m=4, optimizer_state_factor=1, budget_s=2, num_vws=1
    )
    rows = plan.details["chunk_candidates"]
    assert [r["kind"] for r in rows][1:] == list(DEVICE_KINDS)
    assert rows[0]["kind"] == plan.details["kind"] and rows[0]["chunks"] == 1
    assert sum(r["best"] for r in rows) == 1
    suggested = [w for w in plan.warnings if w.startswith("suggestion: ")]
    assert bool(suggested) == (not rows[0]["best"])
    lines = explain_lines(plan.details)
    assert lines[0].startswith("schedules on the plan's devices")
    assert any(line.startswith(" * ") for line in lines[1:4])


def test_given_devices_and_a_given_kind_are_priced_with_two_chunks_a_given_split_is_not():
    cluster = repo_cluster()
    args = dict(minibatch=32, m=4, optimizer_state_factor=1, budget_s=2)
    given = sync_plan(cluster, profile16(), vws=[(["gpu0", "gpu1"], None)], **args)
    rows = given.details["chunk_candidates"]
    assert rows[0]["devices"] == ["gpu0", "gpu1"]
    assert rows[2]["devices"] == ["gpu0", "gpu1", "gpu1", "gpu0"]
    fixed = sync_plan(cluster, profile16(), kind="gpipe", num_vws=1, **args)
    assert fixed.details["chunk_candidates"][0]["kind"] == "gpipe"
    split = sync_plan(cluster, profile16(), vws=[(["gpu0", "gpu1"], [8, 8])], **args)
    assert "chunk_candidates" not in split.details
