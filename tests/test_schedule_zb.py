"""Split backward and the zero-bubble schedules as data: exact action tables, the orders'
memory, and deadlock freedom under random timings (see hetpipe/core/schedule.py)."""

from __future__ import annotations

import random

import pytest
from helpers import ScheduleInputs, random_run

from hetpipe.core.schedule import (
    SYNC_KINDS,
    Backward,
    BackwardInput,
    BackwardWeight,
    Forward,
    Merge,
    OptimizerStep,
    Pull,
    Push,
    ScheduleError,
    StageSchedule,
    Wait,
    check_order,
    clock_cycles,
    held_peak,
    iteration_trips,
    max_in_flight,
    microbatch_order,
    stage_tables,
)

F, I, W, S = Forward, BackwardInput, BackwardWeight, OptimizerStep  # noqa: E741
LETTER = {Forward: "F", Backward: "B", BackwardInput: "I", BackwardWeight: "W"}
ZB = ("zb-h1", "zb-h2")


def stages(kind: str, k: int, m: int, total: int, pulls: bool = False) -> list[StageSchedule]:
    return [StageSchedule(kind, k=k, stage=s, nm=m, total=total, pulls=pulls) for s in range(k)]


def text(order) -> str:
    return " ".join(f"{op}{j}" for op, j in order)


# -- orders and exact tables -------------------------------------------------------------------


def test_zb_kinds_are_synchronous():
    assert "zb-h1" in SYNC_KINDS and "zb-h2" in SYNC_KINDS


def test_zb_h1_table_k2():
    t = stage_tables(stages("zb-h1", 2, 4, 4))
    assert t[0] == [Pull(0), Merge(0),
        F(0), F(1), I(0), W(0), F(2), I(1), W(1), F(3), I(2), W(2), I(3), W(3), S(0), Push(0)
    ]  # fmt: skip
    assert t[1][2:] == [
        F(0), I(0), F(1), I(1), W(0), F(2), I(2), W(1), F(3), I(3), W(2), W(3), S(0), Push(0)
    ]  # fmt: skip


def test_zb_h2_table_k2():
    t = stage_tables(stages("zb-h2", 2, 4, 4))
    assert t[0][2:] == [
        F(0), F(1), F(2), I(0), W(0), F(3), I(1), W(1), I(2), W(2), I(3), W(3), S(0), Push(0)
    ]  # fmt: skip
    assert t[1][2:] == [
        F(0), I(0), F(1), I(1), W(0), F(2), I(2), W(1), F(3), I(3), W(2), W(3), S(0), Push(0)
    ]  # fmt: skip


def test_zb_h1_orders_k4():
    """Stage s warms up like 1f1b (k - s - 1 forwards) and defers s weight gradients, which
    fill the time it would wait for a gradient; every stage holds at most k microbatches."""
    assert [text(microbatch_order("zb-h1", 4, s, 8)) for s in range(4)] == [
        "F0 F1 F2 F3 I0 W0 F4 I1 W1 F5 I2 W2 F6 I3 W3 F7 I4 W4 I5 W5 I6 W6 I7 W7",
        "F0 F1 F2 I0 F3 I1 W0 F4 I2 W1 F5 I3 W2 F6 I4 W3 F7 I5 W4 I6 W5 I7 W6 W7",
        "F0 F1 I0 F2 I1 F3 I2 W0 F4 I3 W1 F5 I4 W2 F6 I5 W3 F7 I6 W4 I7 W5 W6 W7",
        "F0 I0 F1 I1 F2 I2 F3 I3 W0 F4 I4 W1 F5 I5 W2 F6 I6 W3 F7 I7 W4 W5 W6 W7",
    ]
    assert [max_in_flight("zb-h1", 4, s, 8) for s in range(4)] == [4, 4, 4, 4]


def test_zb_h2_orders_k4():
    """Twice 1f1b's warm-up: more microbatches held (2k - 1 on the first stage), so a stage
    runs further ahead of a slower successor."""
    assert [text(microbatch_order("zb-h2", 4, s, 8)) for s in range(4)] == [
        "F0 F1 F2 F3 F4 F5 F6 I0 W0 F7 I1 W1 I2 W2 I3 W3 I4 W4 I5 W5 I6 W6 I7 W7",
        "F0 F1 F2 F3 F4 I0 F5 I1 W0 F6 I2 W1 F7 I3 W2 I4 W3 I5 W4 I6 W5 I7 W6 W7",
        "F0 F1 F2 I0 F3 I1 F4 I2 W0 F5 I3 W1 F6 I4 W2 F7 I5 W3 I6 W4 I7 W5 W6 W7",
        "F0 I0 F1 I1 F2 I2 F3 I3 W0 F4 I4 W1 F5 I5 W2 F6 I6 W3 F7 I7 W4 W5 W6 W7",
    ]
    assert [max_in_flight("zb-h2", 4, s, 8) for s in range(4)] == [7, 6, 5, 4]


def test_zb_h1_table_k4_full_iteration():
    t = stage_tables(stages("zb-h1", 4, 8, 8))
    for s in range(4):
        acts = t[s][2:]
        assert acts[-2:] == [S(0), Push(0)]
        order = tuple((LETTER[type(a)], a.p) for a in acts[:-2])
        assert order == microbatch_order("zb-h1", 4, s, 8)


@pytest.mark.parametrize("k", range(1, 7))
def test_zb_h1_is_torch_zb1p_with_one_stage_per_rank(k):
    """The same per-rank order as torch.distributed.pipelining's ScheduleInterleavedZeroBubble
    (ZB1P) with one local stage per rank."""
    sch = pytest.importorskip("torch.distributed.pipelining.schedules")
    try:
        ops_of, warmup_of, comp = sch._get_1f1b_rank_ops, sch._get_warmup_ops, sch._ComputationType
    except AttributeError:
        pytest.skip("this torch has no ZB1P helpers")
    letter = {comp.FORWARD: "F", comp.BACKWARD_INPUT: "I", comp.BACKWARD_WEIGHT: "W"}
    for m in range(1, 13):
        for r in range(k):
            w = warmup_of(r, 1, m, k, m, multiply_factor=1)
            ops = ops_of(1, k, w, m - w, w, r, lambda _s, r=r: r, lambda _s, r=r: r, r, True)
            theirs = tuple((letter[a.computation_type], a.microbatch_index) for a in ops if a)
            assert theirs == microbatch_order("zb-h1", k, r, m)


@pytest.mark.parametrize("kind", ZB)
@pytest.mark.parametrize(("k", "m"), [(1, 3), (2, 2), (2, 8), (3, 4), (4, 4), (4, 9), (6, 12)])
def test_zb_reaches_the_lower_bound_in_unit_time(kind, k, m):
    """F, I and W one clock cycle each: with m >= k an iteration takes 3m + k - 1 cycles, the
    last stage's own work after the first activation reaches it: no bubble but the fill."""
    ticks = {
        tick
        for tick, _s, a in clock_cycles(stages(kind, k, m, m))
        if isinstance(a, Forward | BackwardInput | BackwardWeight)
    }
    assert max(ticks) + 1 == 3 * m + k - 1


def test_split_and_whole_backwards_may_mix_in_an_order():
    order = (("F", 0), ("F", 1), ("B", 0), ("I", 1), ("W", 1))
    check_order(order, 2)
    sch = StageSchedule("1f1b", k=1, stage=0, nm=2, total=2, order=order)
    t = stage_tables([sch])[0]
    assert t[2:] == [F(0), F(1), Backward(0), I(1), W(1), S(0), Push(0)]


@pytest.mark.parametrize(
    ("order", "problem"),
    [
        ((("F", 0), ("W", 0), ("I", 0)), "weight gradient of 0 before"),
        ((("F", 0), ("I", 0)), "one weight gradient"),
        ((("F", 0), ("I", 0), ("W", 0), ("W", 0)), "one weight gradient"),
        ((("F", 0), ("B", 0), ("W", 0)), "one weight gradient"),
        ((("F", 0), ("I", 0), ("I", 0), ("W", 0)), "in order"),
        ((("F", 0), ("X", 0)), "must be one of F, B, I, W"),
        ((("I", 0), ("F", 0), ("W", 0)), "before its forward"),
    ],
)
def test_bad_split_orders_are_refused(order, problem):
    m = 1
    with pytest.raises(ScheduleError, match=problem):
        check_order(order, m)


def test_zb_takes_no_extra_warmup():
    with pytest.raises(ScheduleError, match="for 1f1b, not zb-h1"):
        StageSchedule("zb-h1", k=2, stage=0, nm=2, total=2, warmup=1)


def test_weight_gradient_never_waits_and_input_gradient_waits_for_its_gradient():
    sch = StageSchedule("zb-h1", k=2, stage=0, nm=1, total=1)
    arrived = ScheduleInputs()
    for _ in range(2):  # the initial pull and merge
        a = sch.next(arrived)
        sch.done(a)
        arrived.answered.add((0, False))
    sch.done(sch.next(arrived))  # F0
    assert sch.next(arrived) == Wait("gradient", p=0)
    arrived.grads.add(0)
    assert sch.next(arrived) == I(0)
    sch.done(I(0))
    arrived.grads.clear()
    assert sch.next(arrived) == W(0)
    sch.done(W(0))
    assert sch.next(arrived) == S(0)


def test_hand_offs_keep_the_input_gradient_apart_from_the_weight_gradient():
    """The gradient an I makes goes out before a W runs (a W never joins its I's hand-off);
    on the last stage the I joins its forward, and the step joins the last W."""
    trips = iteration_trips(2, 1, microbatch_order("zb-h1", 2, 1, 2))
    assert trips == ((F(0), I(0)), (F(1), I(1)), (W(0),), (W(1), S(0), Push(0)))
    # the first stage: its next forward (its input is the data) joins a W
    trips = iteration_trips(2, 0, microbatch_order("zb-h1", 2, 0, 4))
    assert trips == ((F(0),), (F(1),), (I(0),), (W(0), F(2)), (I(1),), (W(1), F(3)),
                     (I(2),), (W(2),), (I(3),), (W(3), S(0), Push(0)))  # fmt: skip


def test_zb_with_several_vws_reduces_after_the_last_weight_gradient():
    t = stage_tables(stages("zb-h1", 2, 2, 2, pulls=True))
    assert t[1] == [
        Pull(0), Merge(0), F(0), I(0), F(1), I(1), W(0), W(1),
        Pull(0, True), Merge(0, True), S(0), Push(0),
    ]  # fmt: skip


# -- properties: memory and deadlock freedom over many (k, m) -------------------------------------


def _random_run(schedules: list[StageSchedule], seed: int) -> list[list[tuple[str, int]]]:
    """Run the stages under a random timing (:func:`helpers.random_run`; a deadlock fails
    it). Returns each stage's passes as ("F"/"I"/"W"/"B", p)."""
    return [
        [(LETTER[type(a)], a.p) for a in row if type(a) in LETTER]
        for row in random_run(schedules, seed, 3)
    ]


def _cases():
    rng = random.Random(37)
    out = [(kind, k, m) for kind in ZB for k in (1, 2, 3, 4) for m in (1, 2, 3, k, 2 * k + 1)]
    out += [(rng.choice(ZB), rng.randint(1, 8), rng.randint(1, 20)) for _ in range(40)]
    return sorted(set(out))


@pytest.mark.parametrize(("kind", "k", "m"), _cases())
def test_zb_never_deadlocks_and_holds_its_count_under_random_timings(kind, k, m):
    """Over many (k, m) and random timings the stages always finish (two iterations, the
    second short), run exactly their orders, and hold what max_in_flight says."""
    total = m + max(1, m // 2)
    for seed in range(3):
        passes = _random_run(stages(kind, k, m, total), seed)
        for s in range(k):
            first = tuple(passes[s][: 3 * m])
            assert first == microbatch_order(kind, k, s, m)
            assert held_peak(first) == max_in_flight(kind, k, s, m)
            second = tuple((op, j - m) for op, j in passes[s][3 * m :])
            assert second == microbatch_order(kind, k, s, total - m)


@pytest.mark.parametrize("kind", ZB)
def test_zb_h1_holds_no_more_than_1f1b_on_its_first_stage(kind):
    """zb-h1 keeps 1f1b's peak (the first stage's k), zb-h2 holds at most 2k - 1."""
    for k in range(1, 8):
        for m in range(1, 3 * k):
            peaks = [max_in_flight(kind, k, s, m) for s in range(k)]
            first = max_in_flight("1f1b", k, 0, m)
            assert max(peaks) <= (first if kind == "zb-h1" else min(m, max(1, 2 * k - 1)))
