"""Device-level schedules as data (hetpipe/core/devschedule.py): exact device orders, each
stage's order as their projection, deadlock-free lock-step runs, placements and the gate a
device's stages take turns through (hetpipe/devturn.py). No processes."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from hetpipe.core import devschedule
from hetpipe.core.devschedule import (
    check_placement,
    device_cycles,
    device_order,
    device_orders,
    last_iteration_problem,
    placement,
    stage_order,
)
from hetpipe.core.schedule import (
    DEVICE_KINDS,
    KINDS,
    SYNC_KINDS,
    SYNCHRONOUS,
    Backward,
    BackwardInput,
    BackwardWeight,
    Forward,
    OptimizerStep,
    ScheduleError,
    StageSchedule,
    clock_cycles,
    deferred_peak,
    held_peak,
    max_deferred,
    max_in_flight,
    microbatch_order,
)
from hetpipe.devturn import DeviceTurn, device_turn


def table(kind: str, k: int, D: int, m: int) -> list[str]:
    """Each device's order as ``F2.1`` (op, stage, microbatch) words."""
    return [
        " ".join(f"{op}{s}.{j}" for s, op, j in order) for order in device_orders(kind, k, D, m)
    ]


# -- exact tables, written out by hand from the published definitions ---------------------------


def test_interleaved_k4_on_2_devices_m4():
    """Megatron's interleaved 1F1B: device d warms up 2 (D - d - 1) + (v - 1) D forwards
    (4 and 2), forwards in groups of D microbatches per chunk, backwards chunk-reversed."""
    assert table("interleaved-1f1b", 4, 2, 4) == [
        "F0.0 F0.1 F2.0 F2.1 F0.2 B2.0 F0.3 B2.1 F2.2 B0.0 F2.3 B0.1 B2.2 B2.3 B0.2 B0.3",
        "F1.0 F1.1 F3.0 B3.0 F3.1 B3.1 F1.2 B1.0 F1.3 B1.1 F3.2 B3.2 F3.3 B3.3 B1.2 B1.3",
    ]


def test_interleaved_k6_on_2_devices_m2():
    """Three chunks a device, m = D: device 0's warm-up is all its forwards."""
    assert table("interleaved-1f1b", 6, 2, 2) == [
        "F0.0 F0.1 F2.0 F2.1 F4.0 F4.1 B4.0 B4.1 B2.0 B2.1 B0.0 B0.1",
        "F1.0 F1.1 F3.0 F3.1 F5.0 B5.0 F5.1 B5.1 B3.0 B3.1 B1.0 B1.1",
    ]


def test_zbv_k4_on_2_devices_m4():
    """ZB-V: device 0 holds stages 0 and 3 (the V's ends), device 1 stages 1 and 2;
    backwards split into I and W."""
    assert table("zbv", 4, 2, 4) == [
        "F0.0 F0.1 F0.2 F3.0 I3.0 W3.0 F3.1 I3.1 W3.1 F0.3 I0.0 W0.0 F3.2 I3.2 W3.2 "
        "I0.1 W0.1 F3.3 I3.3 W3.3 I0.2 W0.2 I0.3 W0.3",
        "F1.0 F2.0 F1.1 F2.1 I2.0 W2.0 F1.2 I1.0 W1.0 F2.2 I2.1 W2.1 F1.3 I1.1 W1.1 "
        "F2.3 I2.2 W2.2 I1.2 I2.3 I1.3 W1.2 W2.3 W1.3",
    ]


def test_zbv_k6_on_3_devices_m3():
    """m < 2 D - 1: counted as a full pipeline, the entries of microbatches >= m left out."""
    assert table("zbv", 6, 3, 3) == [
        "F0.0 F0.1 F0.2 F5.0 I5.0 W5.0 F5.1 I5.1 W5.1 F5.2 I5.2 W5.2 I0.0 W0.0 I0.1 W0.1 I0.2 W0.2",
        "F1.0 F1.1 F1.2 F4.0 F4.1 I4.0 W4.0 F4.2 I4.1 W4.1 I1.0 W1.0 I4.2 W4.2 I1.1 W1.1 I1.2 W1.2",
        "F2.0 F3.0 F2.1 F3.1 F2.2 F3.2 I3.0 W3.0 I2.0 W2.0 I3.1 W3.1 I2.1 W2.1 I3.2 W3.2 I2.2 W2.2",
    ]


def test_lock_step_tables_k4_on_2_devices_m4():
    """The ticks each device runs its entries at, one a tick: the iteration's length."""
    assert max(t for d in device_cycles("interleaved-1f1b", 4, 2, 4) for t, _ in d) + 1 == 18
    zbv = device_cycles("zbv", 4, 2, 4)
    assert [t for t, _ in zbv[0]][:6] == [0, 1, 2, 3, 4, 5]
    assert max(t for d in zbv for t, _ in d) + 1 == 25


# -- the same orders as torch.distributed.pipelining builds them --------------------------------


def torch_order(kind: str, k: int, D: int, m: int, d: int) -> list[tuple[int, str, int]]:
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    letter = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}
    if kind == "zbv":
        fake = SimpleNamespace(pp_group_size=D, _n_microbatches=m, num_stages=k)
        ops = schedules.ScheduleZBVZeroBubble._calculate_single_rank_operations
    else:
        fake = SimpleNamespace(
            pp_group_size=D, _n_microbatches=m, n_local_stages=k // D, microbatches_per_round=D
        )
        ops = schedules.ScheduleInterleaved1F1B._calculate_single_rank_operations
    try:
        got = ops(fake, d)
    except (AttributeError, TypeError):  # torch's private layout moved: nothing to compare
        pytest.skip("torch's schedule internals differ from the ones this test reads")
    return [
        (a.stage_index, letter[a.computation_type.name], a.microbatch_index)
        for a in got
        if a is not None
    ]


@pytest.mark.parametrize(
    "kind, v, D, m",
    [
        (kind, v, D, m)
        for kind, v in (("interleaved-1f1b", 2), ("interleaved-1f1b", 3), ("zbv", 2))
        for D in (1, 2, 3, 4)
        for m in (1, 2, 3, 4, 6, 8, 9)
        if kind == "zbv" or m % D == 0  # interleaved needs m a multiple of D
    ],
)
def test_orders_equal_torchs(kind: str, v: int, D: int, m: int):
    for d in range(D):
        assert list(device_order(kind, v * D, D, d, m)) == torch_order(kind, v * D, D, m, d)


# -- projections, lock step, memory ------------------------------------------------------------

GRID = [
    (kind, v * D, D, m)
    for kind, vs in (("interleaved-1f1b", (2, 3, 4)), ("zbv", (2,)))
    for v in vs
    for D in (1, 2, 3, 4)
    for m in range(1, 11)
    if kind != "interleaved-1f1b" or m % D == 0
]


@pytest.mark.parametrize("kind, k, D, m", GRID)
def test_stage_orders_are_the_projections_and_never_deadlock(kind: str, k: int, D: int, m: int):
    orders = device_orders(kind, k, D, m)
    where = placement(kind, k, D)
    for s in range(k):
        want = tuple((op, j) for t, op, j in orders[where[s]] if t == s)
        assert stage_order(kind, k, D, s, m) == want
        assert microbatch_order(kind, k, s, m, devices=D) == want
    # every entry once, on the device that holds its stage
    assert sorted(e for o in orders for e in o) == sorted(
        (s, op, j)
        for s in range(k)
        for j in range(m)
        for op in (("F", "I", "W") if kind == "zbv" else ("F", "B"))
    )
    ran = device_cycles(kind, k, D, m)  # raises on a deadlock
    assert [[e for _, e in d] for d in ran] == [list(o) for o in orders]
    # the stages alone (each its own order, no device between them) finish too
    scheds = [StageSchedule(kind, k=k, stage=s, nm=m, total=2 * m, devices=D) for s in range(k)]
    list(clock_cycles(scheds))
    assert all(s.finished for s in scheds)


@pytest.mark.parametrize("kind, k, D, m", GRID[::7])
def test_memory_counts_follow_the_projected_order(kind: str, k: int, D: int, m: int):
    for s in range(k):
        order = stage_order(kind, k, D, s, m)
        assert max_in_flight(kind, k, s, m, devices=D) == held_peak(order)
        assert max_deferred(kind, k, s, m, devices=D) == (
            deferred_peak(order) if kind == "zbv" else 0
        )


def test_zbv_holds_at_most_what_1f1b_holds_on_the_first_stage():
    """ZB-V's point: each stage holds at most about k microbatches (1F1B's first stage)."""
    for D in (2, 3, 4):
        k, m = 2 * D, 4 * D
        assert max(max_in_flight("zbv", k, s, m, devices=D) for s in range(k)) <= k


def test_the_stages_alone_run_the_projected_actions():
    """The runtime's stage schedule (StageSchedule) runs exactly its projection; no pass joins
    another in one hand-off (the device's next may be another stage's), the step still
    follows the last backward."""
    scheds = [StageSchedule("zbv", k=4, stage=s, nm=4, total=4, devices=2) for s in range(4)]
    letter = {Forward: "F", BackwardInput: "I", BackwardWeight: "W"}
    ran: list[list[tuple[str, int]]] = [[] for _ in range(4)]
    for _t, s, a in clock_cycles(scheds):
        if type(a) in letter:
            ran[s].append((letter[type(a)], a.p))  # type: ignore[union-attr]
    assert ran == [list(stage_order("zbv", 4, 2, s, 4)) for s in range(4)]
    last = StageSchedule("zbv", k=4, stage=3, nm=4, total=4, devices=2)
    assert not last.joins([Forward(0)], BackwardInput(0))
    assert last.joins([BackwardWeight(3)], OptimizerStep(0))


# -- kinds, placements, refusals -----------------------------------------------------------------


def test_kinds():
    assert DEVICE_KINDS == ("interleaved-1f1b", "zbv")
    assert all(k in SYNCHRONOUS and k in KINDS and k not in SYNC_KINDS for k in DEVICE_KINDS)


def test_placements():
    assert placement("interleaved-1f1b", 6, 3) == (0, 1, 2, 0, 1, 2)
    assert placement("zbv", 6, 3) == (0, 1, 2, 2, 1, 0)
    assert check_placement("interleaved-1f1b", ["a", "b", "a", "b"]) == 2
    assert check_placement("zbv", ["a", "b", "b", "a"]) == 2


@pytest.mark.parametrize(
    "call, problem",
    [
        (lambda: check_placement("interleaved-1f1b", ["a", "b", "b", "a"]), "round robin"),
        (lambda: check_placement("zbv", ["a", "b", "a", "b"]), "a V"),
        (lambda: check_placement("zbv", ["a", "b", "c", "a"]), "k = 2 D"),
        (lambda: check_placement("interleaved-1f1b", ["a", "b", "c", "d"]), "2 chunks"),
        (lambda: device_order("interleaved-1f1b", 4, 2, 0, 3), "multiple of the devices"),
        (lambda: device_order("zbv", 4, 2, 2, 4), "device: must be in 0..1"),
        (lambda: microbatch_order("zbv", 3, 0, 4), "even number of stages"),
        (lambda: microbatch_order("zbv", 4, 0, 4, warmup=1), "warmup"),
        (lambda: StageSchedule("1f1b", k=2, stage=0, nm=2, total=2, devices=1), "device count"),
    ],
)
def test_what_cannot_run_is_refused_in_one_line(call, problem: str):
    with pytest.raises(ScheduleError) as exc:
        call()
    assert problem in str(exc.value) and "\n" not in str(exc.value)


def test_a_short_last_iteration():
    assert last_iteration_problem("interleaved-1f1b", 2, 10, 4) is None  # 2 left: fine
    problem = last_iteration_problem("interleaved-1f1b", 2, 9, 4)
    assert problem is not None and "last iteration of 1 microbatches" in problem
    assert last_iteration_problem("zbv", 2, 9, 4) is None


def test_default_devices_are_two_chunks_a_device():
    assert devschedule.default_devices("zbv", 6) == 3
    assert microbatch_order("interleaved-1f1b", 4, 1, 4) == stage_order(
        "interleaved-1f1b", 4, 2, 1, 4
    )


# -- the turn gate -------------------------------------------------------------------------------

LETTER = {"F": Forward, "B": Backward, "I": BackwardInput, "W": BackwardWeight}


def test_the_gate_lets_the_stages_run_in_the_device_order():
    """Two stages of device 0 under zbv, each running its own order as fast as it can, the
    gate between them: what ran equals the device's order, over two iterations (the second
    one short)."""
    kind, k, D, nm, total = "zbv", 4, 2, 4, 6
    turn = DeviceTurn(kind, k, D, 0, nm, total)
    ran: list[tuple[int, str, int]] = []

    async def stage(s: int) -> None:
        for c in range(2):
            m = min(nm, total - c * nm)
            for op, j in stage_order(kind, k, D, s, m):
                action = LETTER[op](c * nm + j)
                await turn.wait(s, action)
                await asyncio.sleep(0)
                ran.append((s, op, c * nm + j))
                turn.passed(s, action)

    async def both() -> None:
        await asyncio.wait_for(asyncio.gather(stage(3), stage(0)), 10)

    asyncio.run(both())
    want = [(s, op, j) for s, op, j in device_order(kind, k, D, 0, 4)]
    want += [(s, op, 4 + j) for s, op, j in device_order(kind, k, D, 0, 2)]
    assert ran == want
    assert turn.next is None


def test_the_gate_refuses_a_pass_out_of_turn():
    turn = DeviceTurn("interleaved-1f1b", 4, 2, 1, 2, 2)
    assert turn.is_turn(1, Forward(0)) and not turn.is_turn(3, Forward(0))
    with pytest.raises(RuntimeError, match="out of turn"):
        turn.passed(3, Forward(0))
    assert not DeviceTurn.gated(OptimizerStep(0))


def test_a_gate_only_where_a_device_runs_several_stages_of_a_device_kind():
    spec = SimpleNamespace(schedule="zbv", vws=(SimpleNamespace(devices=("a", "b", "b", "a")),))
    turn = device_turn(spec, 0, [1, 2], 4, 4, 8)
    assert turn is not None and turn.device == 1 and turn.devices == 2
    assert device_turn(spec, 0, [1], 4, 4, 8) is None
    assert device_turn(SimpleNamespace(schedule="1f1b", vws=spec.vws), 0, [1, 2], 4, 4, 8) is None


# -- the job file refuses what a device-level schedule cannot run -------------------------------


def job_spec(kind: str, devices: list[str] | None, nm: int = 4, **train: object) -> object:
    from hetpipe.job import JobSpec

    d: dict[str, object] = {
        "name": "j",
        "model": {"name": "mlp"},
        "train": {
            "minibatch": 4,
            "minibatches": 8,
            "nm": nm,
            "schedule": kind,
            "several_stages": True,
            **train,
        },
    }
    if devices is not None:
        d["vw"] = [{"devices": devices, "layers": [1] * len(devices)}]
    return JobSpec.from_dict(d)


def test_a_job_runs_a_device_schedule_on_its_placement():
    spec = job_spec("zbv", ["a", "b", "b", "a"])
    assert spec.sync and spec.schedule == "zbv"  # type: ignore[attr-defined]
    assert job_spec("interleaved-1f1b", ["a", "b", "a", "b"]).sync  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "kind, devices, more, problem",
    [
        ("zbv", None, {}, "train.schedule: zbv runs the job's own [[vw]] split"),
        ("zbv", ["a", "b", "a", "b"], {}, "train.schedule: vw[0]: zbv: needs a V"),
        ("interleaved-1f1b", ["a", "b", "b", "a"], {}, "needs stage s on device s mod D"),
        ("interleaved-1f1b", ["a", "b", "a", "b"], {"nm": 3}, "a multiple of the devices (2)"),
        (
            "interleaved-1f1b",
            ["a", "b", "a", "b"],
            {"minibatches": 9},
            "train.minibatches: 9 leaves a last iteration of 1 microbatches",
        ),
    ],
)
def test_a_job_a_device_schedule_cannot_run_is_refused_in_one_line(
    kind: str, devices: list[str] | None, more: dict, problem: str
):
    from hetpipe.job import JobError

    with pytest.raises(JobError) as exc:
        job_spec(kind, devices, **more)
    assert problem in str(exc.value) and "\n" not in str(exc.value)


@pytest.mark.parametrize("kind", DEVICE_KINDS)
def test_the_planner_prices_a_device_kind_it_is_given_by_its_projected_order(kind: str):
    """The head checks a several-stage split's memory with the planner (one stage a device,
    priced as given): each stage is charged what its projected order holds."""
    from helpers import profile16, repo_cluster

    from hetpipe.planner.syncplan import sync_plan

    cluster = repo_cluster()
    names = [d.name for d in cluster.devices][:4]
    plan = sync_plan(
        cluster,
        profile16(),
        minibatch=32,
        m=4,
        optimizer_state_factor=1,
        kind=kind,
        vws=[(names, [4, 4, 4, 4])],
        budget_s=3,
    )
    assert [s.expected_in_flight for s in plan.vws[0].stages] == [
        held_peak(stage_order(kind, 4, 2, s, 4)) for s in range(4)
    ]
