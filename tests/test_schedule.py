"""The schedules as data: exact action tables, no processes (see hetpipe/schedule.py)."""

from __future__ import annotations

import random

import pytest
from helpers import ScheduleInputs

from hetpipe.core.schedule import (
    Action,
    Backward,
    Done,
    Forward,
    Merge,
    OptimizerStep,
    Pull,
    Push,
    ScheduleError,
    StageSchedule,
    Wait,
    clock_cycles,
    fill_counts,
    max_in_flight,
    microbatch_order,
    stage_tables,
)
from hetpipe.core.staleness import StageTable, lockstep_orders, version_gaps

F, B, S = Forward, Backward, OptimizerStep


def stages(
    kind: str, k: int, nm: int, total: int, pulls: bool = False, warmup: int = 0
) -> list[StageSchedule]:
    return [
        StageSchedule(kind, k=k, stage=s, nm=nm, total=total, pulls=pulls, warmup=warmup)
        for s in range(k)
    ]


def cells(kind: str, k: int, nm: int, total: int) -> list[list[tuple[int, str]]]:
    """Per tick, the (stage, 'F3'/'B3') compute cells: the torchgpipe-style clock table."""
    out: list[list[tuple[int, str]]] = []
    for tick, s, a in clock_cycles(stages(kind, k, nm, total)):
        while len(out) <= tick:
            out.append([])
        if isinstance(a, Forward | Backward):
            out[tick].append((s, f"{type(a).__name__[0]}{a.p}"))
    return out


# -- microbatch orders ---------------------------------------------------------------------


def test_gpipe_order_is_all_forwards_then_all_backwards():
    assert microbatch_order("gpipe", 3, 1, 3) == (
        ("F", 0),
        ("F", 1),
        ("F", 2),
        ("B", 0),
        ("B", 1),
        ("B", 2),
    )


def test_1f1b_order_warms_up_then_alternates_then_drains():
    orders = [microbatch_order("1f1b", 4, s, 4) for s in range(4)]
    as_text = [" ".join(f"{op}{j}" for op, j in o) for o in orders]
    assert as_text == [
        "F0 F1 F2 F3 B0 B1 B2 B3",
        "F0 F1 F2 B0 F3 B1 B2 B3",
        "F0 F1 B0 F2 B1 F3 B2 B3",
        "F0 B0 F1 B1 F2 B2 F3 B3",
    ]
    # fewer microbatches than the warm-up: all forwards first
    assert microbatch_order("1f1b", 4, 0, 2) == (("F", 0), ("F", 1), ("B", 0), ("B", 1))


def test_extra_warmup_spans_the_orders_from_1f1b_to_gpipe():
    """Each extra warm-up forward moves every stage's first backward one microbatch later;
    from m - 1 on, every stage runs gpipe's order."""

    def text(w: int) -> list[str]:
        return [
            " ".join(f"{op}{j}" for op, j in microbatch_order("1f1b", 3, s, 5, w)) for s in range(3)
        ]

    assert text(1) == [
        "F0 F1 F2 F3 B0 F4 B1 B2 B3 B4",
        "F0 F1 F2 B0 F3 B1 F4 B2 B3 B4",
        "F0 F1 B0 F2 B1 F3 B2 F4 B3 B4",
    ]
    assert text(2) == [
        "F0 F1 F2 F3 F4 B0 B1 B2 B3 B4",
        "F0 F1 F2 F3 B0 F4 B1 B2 B3 B4",
        "F0 F1 F2 B0 F3 B1 F4 B2 B3 B4",
    ]
    gpipe = [microbatch_order("gpipe", 3, s, 5) for s in range(3)]
    for w in (4, 5, 9):
        assert [microbatch_order("1f1b", 3, s, 5, w) for s in range(3)] == gpipe
    assert [microbatch_order("1f1b", 3, s, 5, 3) for s in range(3)] != gpipe
    with pytest.raises(ScheduleError, match="warmup: must be >= 0"):
        microbatch_order("1f1b", 3, 0, 5, -1)


def test_1f1b_table_with_extra_warmup_k3_m4():
    t = stage_tables(stages("1f1b", 3, 4, 4, warmup=1))
    assert t[0][2:] == [F(0), F(1), F(2), F(3), B(0), B(1), B(2), B(3), S(0), Push(0)]
    assert t[1][2:] == [F(0), F(1), F(2), B(0), F(3), B(1), B(2), B(3), S(0), Push(0)]
    assert t[2][2:] == [F(0), F(1), B(0), F(2), B(1), F(3), B(2), B(3), S(0), Push(0)]


@pytest.mark.parametrize(
    ("k", "m", "warmup"), [(2, 4, 1), (3, 4, 1), (3, 6, 2), (4, 8, 3), (4, 3, 5)]
)
def test_extra_warmup_holds_its_count_under_any_timing_and_never_deadlocks(k, m, warmup):
    """The memory model's count for 1f1b with extra warm-up, min(M, k - stage + warmup), is
    what a stage holds whatever the speeds and message delays, and the orders always finish
    (each stage warms up one more than its successor)."""
    want = [min(m, k - s + warmup) for s in range(k)]
    assert [max_in_flight("1f1b", k, s, m, warmup=warmup) for s in range(k)] == want
    for seed in range(5):
        orders = _random_timing_orders(stages("1f1b", k, m, 3 * m, warmup=warmup), seed)
        assert held_peaks(orders) == want
        assert all(sum(op == "B" for op, _ in o) == 3 * m for o in orders)


@pytest.mark.parametrize(
    ("kind", "args", "problem"),
    [
        ("zigzag", {"nm": 1, "total": 1}, "unknown kind"),
        ("async", {"stage": 2, "nm": 1, "total": 1}, "stage"),
        ("gpipe", {"nm": 0, "total": 1}, "nm"),
        ("1f1b", {"order": [("B", 0), ("F", 0), ("F", 1), ("B", 1)]}, "before its forward"),
        ("1f1b", {"order": [("F", 0), ("F", 1), ("B", 1), ("B", 0)]}, "in order"),
        # extra warm-up forwards are for 1f1b only
        ("gpipe", {"warmup": 1}, "for 1f1b, not gpipe"),
        ("async", {"warmup": 1}, "for 1f1b, not async"),
        ("1f1b", {"warmup": -1}, "warmup: must be >= 0"),
        # an in-flight limit is for the async kind's greedy order only
        ("async", {"total": 4, "limit": 0}, "in-flight limit: must be >= 1"),
        ("1f1b", {"total": 4, "limit": 1}, "for the async kind's greedy order only"),
        (
            "async",
            {"total": 4, "limit": 1, "sequence": StageTable(2, 0, 2, 4).op},
            "a fixed order holds its own count",
        ),
        # a fill needs a limit, and at most it
        ("async", {"fill": 2}, "fill: forwards before the first backward need a limit"),
        ("async", {"limit": 1, "fill": 2}, r"fill: .* 1\.\.limit \(1\), got 2"),
        ("async", {"limit": 2, "fill": -1}, r"fill: .* 1\.\.limit \(2\), got -1"),
    ],
)
def test_bad_schedules_are_refused_with_one_line(kind, args, problem):
    with pytest.raises(ScheduleError, match=problem) as info:
        StageSchedule(kind, **{"k": 2, "stage": 0, "nm": 2, "total": 2, **args})
    assert "\n" not in str(info.value)


# -- exact tables ----------------------------------------------------------------------------


def test_async_table_k2_nm2():
    """Admission holds F2 at stage 0 until B0 is done; a push closes each wave."""
    t = stage_tables(stages("async", 2, 2, 4))
    assert t[0] == [
        Pull(0),
        Merge(0),
        F(0),
        F(1),
        B(0),
        S(0),
        F(2),
        B(1),
        S(1),
        Push(0),
        F(3),
        B(2),
        S(2),
        B(3),
        S(3),
        Push(1),
    ]
    assert t[1] == [
        Pull(0),
        Merge(0),
        F(0),
        B(0),
        S(0),
        F(1),
        B(1),
        S(1),
        Push(0),
        F(2),
        B(2),
        S(2),
        F(3),
        B(3),
        S(3),
        Push(1),
    ]
    assert cells("async", 2, 2, 4) == [
        [(0, "F0")],
        [(0, "F1"), (1, "F0")],
        [(1, "B0")],
        [(0, "B0"), (1, "F1")],
        [(0, "F2"), (1, "B1")],
        [(0, "B1"), (1, "F2")],
        [(0, "F3"), (1, "B2")],
        [(0, "B2"), (1, "F3")],
        [(1, "B3")],
        [(0, "B3")],
    ]


def test_async_table_with_pulls_k3_nm2():
    """Several VWs: the pull of wave c is sent as soon as its first forward is admitted
    (overlapping backwards), merged before that forward."""
    t = stage_tables(stages("async", 3, 2, 4, pulls=True))
    assert t[0] == [
        Pull(0),
        Merge(0),
        F(0),
        F(1),
        B(0),
        S(0),
        Pull(1),
        Merge(1),
        F(2),
        B(1),
        S(1),
        Push(0),
        F(3),
        B(2),
        S(2),
        B(3),
        S(3),
        Push(1),
    ]
    assert t[1] == [
        Pull(0),
        Merge(0),
        F(0),
        F(1),
        Pull(1),
        Merge(1),
        B(0),
        S(0),
        B(1),
        S(1),
        Push(0),
        F(2),
        F(3),
        B(2),
        S(2),
        B(3),
        S(3),
        Push(1),
    ]
    assert t[2] == [
        Pull(0),
        Merge(0),
        F(0),
        B(0),
        S(0),
        F(1),
        B(1),
        S(1),
        Push(0),
        Pull(1),
        Merge(1),
        F(2),
        B(2),
        S(2),
        F(3),
        B(3),
        S(3),
        Push(1),
    ]


def test_gpipe_table_k2_m2_two_iterations():
    t = stage_tables(stages("gpipe", 2, 2, 4))
    assert t[0] == [
        Pull(0),
        Merge(0),
        F(0),
        F(1),
        B(0),
        B(1),
        S(0),
        Push(0),
        F(2),
        F(3),
        B(2),
        B(3),
        S(1),
        Push(1),
    ]
    assert t[1] == [
        Pull(0),
        Merge(0),
        F(0),
        F(1),
        B(0),
        B(1),
        S(0),
        Push(0),
        F(2),
        F(3),
        B(2),
        B(3),
        S(1),
        Push(1),
    ]
    # a flush: no forward of iteration 1 anywhere before iteration 0's last backward
    assert cells("gpipe", 2, 2, 4)[:6] == [
        [(0, "F0")],
        [(0, "F1"), (1, "F0")],
        [(1, "F1")],
        [(1, "B0")],
        [(0, "B0"), (1, "B1")],
        [(0, "B1")],
    ]


def test_1f1b_table_k3_m4():
    t = stage_tables(stages("1f1b", 3, 4, 4))
    assert t[0][2:] == [F(0), F(1), F(2), B(0), F(3), B(1), B(2), B(3), S(0), Push(0)]
    assert t[1][2:] == [F(0), F(1), B(0), F(2), B(1), F(3), B(2), B(3), S(0), Push(0)]
    assert t[2][2:] == [F(0), B(0), F(1), B(1), F(2), B(2), F(3), B(3), S(0), Push(0)]


def test_sync_with_several_vws_exchanges_gradients_before_the_step():
    t = stage_tables(stages("1f1b", 2, 2, 4, pulls=True))
    assert t[0] == [
        Pull(0),
        Merge(0),
        F(0),
        F(1),
        B(0),
        B(1),
        Pull(0, True),
        Merge(0, True),
        S(0),
        Push(0),
        F(2),
        F(3),
        B(2),
        B(3),
        Pull(1, True),
        Merge(1, True),
        S(1),
        Push(1),
    ]


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("k", "m"), [(2, 2), (3, 4), (4, 8), (5, 3)])
def test_sync_iteration_takes_2_m_plus_k_minus_1_cycles(kind, k, m):
    """Unit-time forwards and backwards: one iteration is 2 (M + k - 1) clock cycles."""
    ticks = {
        tick
        for tick, _s, a in clock_cycles(stages(kind, k, m, m))
        if isinstance(a, Forward | Backward)
    }
    assert max(ticks) + 1 == 2 * (m + k - 1)


def test_waits_say_what_for():
    sch = StageSchedule("async", k=3, stage=1, nm=2, total=4, pulls=True, staleness=1)
    nothing = ScheduleInputs()
    assert sch.next(nothing) == Pull(0)
    sch.done(Pull(0))
    assert sch.next(nothing) == Wait("pull", p=0, c=0, need=-2)
    nothing.answered.add((0, False))
    sch.done(sch.next(nothing))
    assert sch.next(nothing) == Wait("activation", p=0)
    nothing.acts.add(0)
    sch.done(sch.next(nothing))
    assert sch.next(nothing) == Wait("gradient", p=0)
    with pytest.raises(ScheduleError):
        sch.done(Wait("gradient", p=0))


# -- properties on random jobs ---------------------------------------------------------------


def _random_jobs(n: int, seed: int = 0):
    rng = random.Random(seed)
    for _ in range(n):
        kind = rng.choice(["async", "gpipe", "1f1b"])
        yield kind, rng.randint(1, 6), rng.randint(1, 5), rng.randint(1, 13), rng.random() < 0.5


@pytest.mark.parametrize(("kind", "k", "nm", "total", "pulls"), list(_random_jobs(60)))
def test_rules_hold_on_random_jobs(kind, k, nm, total, pulls):
    tables = stage_tables(stages(kind, k, nm, total, pulls))
    waves = -(-total // nm)
    for s, table in enumerate(tables):
        fwd = [a.p for a in table if isinstance(a, Forward)]
        bwd = [a.p for a in table if isinstance(a, Backward)]
        assert fwd == list(range(total)) and bwd == list(range(total))
        pos = {a: i for i, a in enumerate(table)}
        assert all(pos[F(p)] < pos[B(p)] for p in range(total))
        assert [a.c for a in table if isinstance(a, Push)] == list(range(waves))
        assert table[:2] == [Pull(0), Merge(0)]
        if kind == "async":
            steps = [a.i for a in table if isinstance(a, OptimizerStep)]
            assert steps == list(range(total))  # a local update after every backward
            assert all(table[pos[B(p)] + 1] == S(p) for p in range(total))
            for c in range(waves):  # the push follows the wave's last update
                last = min((c + 1) * nm, total) - 1
                assert pos[Push(c)] > pos[S(last)]
            if s == 0:  # admission: at most nm in flight
                assert all(pos[F(p)] > pos[B(p - nm)] for p in range(nm, total))
            for c in range(1, waves):
                if pulls:
                    assert pos[F(c * nm - 1)] < pos[Pull(c)] < pos[Merge(c)] < pos[F(c * nm)]
                else:
                    assert Pull(c) not in pos
        else:
            assert [a.i for a in table if isinstance(a, OptimizerStep)] == list(range(waves))
            for c in range(waves):  # a flush: the step closes the iteration
                lo, hi = c * nm, min((c + 1) * nm, total)
                order = [
                    (type(a).__name__[0], a.p - lo)
                    for a in table
                    if isinstance(a, Forward | Backward) and lo <= a.p < hi
                ]
                assert tuple(order) == microbatch_order(kind, k, s, hi - lo)
                assert pos[S(c)] > max(pos[B(p)] for p in range(lo, hi))
                if hi < total:
                    assert pos[S(c)] < pos[F(hi)]
                if pulls:
                    assert pos[B(hi - 1)] < pos[Pull(c, True)] < pos[Merge(c, True)] < pos[S(c)]


def test_finished_schedules_say_done():
    schedules = stages("1f1b", 2, 2, 2)
    list(clock_cycles(schedules))
    assert all(isinstance(sch.next(ScheduleInputs()), Done) for sch in schedules)


# -- version gaps for weight prediction (hetpipe.core.staleness) ---------------------------------


@pytest.mark.parametrize("k", range(2, 9))
def test_version_gaps_match_the_paper_on_uniform_pipelines(k):
    """Counted from the action tables, with the stage's own step (the paper's convention):
    backward floor(k_i/2) exactly; forward the paper's floor(k_i/2) + N - k_i - 1 plus the
    one update the paper's figure leaves out (see hetpipe.core.staleness)."""
    total = 10 * k
    gaps = version_gaps(k, k, total, own=True)
    p = total // 2  # steady state
    for i in range(k):
        ki = i + 1
        s_fwd, s_bwd = gaps[i][p]
        assert s_bwd == ki // 2
        assert s_fwd == ki // 2 + k - ki - 1 + 1
        # what a run observes at this stage: updates between its forward and backward of p
        assert s_fwd - s_bwd == k - ki


@pytest.mark.parametrize(("k", "nm"), [(1, 1), (3, 1), (4, 1)])
def test_version_gaps_vanish_without_pipelining(k, nm):
    for stage in version_gaps(k, nm, 6):
        assert set(stage.values()) == {(0, 0)}


@pytest.mark.parametrize(
    ("k", "nm", "total"), [(4, 4, 200), (3, 5, 157), (5, 2, 91), (2, 7, 164), (8, 8, 301)]
)
def test_stage_tables_of_long_runs_equal_the_full_tables(k, nm, total):
    """The periodic extension of a short window gives every minibatch's s and every compute
    action of a long run exactly."""
    full = version_gaps(k, nm, total)
    orders = lockstep_orders(k, nm, total)
    for stage in range(k):
        table = StageTable(k, stage, nm, total)
        assert table.window < total
        assert [table.s(p) for p in range(total)] == [full[stage][p] for p in range(total)]
        ops = [(op, p) for op, p, _t in orders[stage] if op in ("F", "B")]
        assert [table.op(n) for n in range(2 * total)] == ops


class _Boxes:
    """Inputs of one stage under a random-timing driver."""

    def __init__(self) -> None:
        self.acts: set[int] = set()
        self.grads: set[int] = set()

    def has_activation(self, p: int) -> bool:
        return p in self.acts

    def has_gradient(self, p: int) -> bool:
        return p in self.grads

    def pulled(self, c: int, grads: bool) -> bool:
        return True


def _random_timing_orders(schedules: list[StageSchedule], seed: int) -> list[list[tuple]]:
    """Run one virtual worker's stages with random speeds and random message delays; return
    each stage's forwards and backwards in the order it ran them."""
    rng = random.Random(seed)
    k = len(schedules)
    boxes = [_Boxes() for _ in range(k)]
    in_transit: list[tuple[set[int], int]] = []
    orders: list[list[tuple]] = [[] for _ in range(k)]
    while not all(s.finished for s in schedules):
        if in_transit and rng.random() < 0.3:  # a message arrives, not necessarily the oldest
            box, p = in_transit.pop(rng.randrange(len(in_transit)))
            box.add(p)
            continue
        s = rng.randrange(k)
        a = schedules[s].next(boxes[s])
        if isinstance(a, Wait | Done):
            assert in_transit or any(
                not isinstance(sch.next(boxes[i]), Wait | Done) for i, sch in enumerate(schedules)
            ), "deadlock"
            continue
        schedules[s].done(a)
        if isinstance(a, Forward):
            orders[s].append(("F", a.p))
            if s + 1 < k:
                in_transit.append((boxes[s + 1].acts, a.p))
        elif isinstance(a, Backward):
            orders[s].append(("B", a.p))
            if s > 0:
                in_transit.append((boxes[s - 1].grads, a.p))
    return orders


@pytest.mark.parametrize(
    ("k", "nm", "total", "seed"),
    [(4, 4, 40, 0), (4, 4, 40, 1), (3, 5, 33, 2), (5, 2, 30, 3), (8, 8, 70, 4), (2, 3, 20, 5)],
)
def test_a_fixed_sequence_runs_the_counted_order_under_any_timing(k, nm, total, seed):
    """With ``sequence`` every stage runs the lock-step order its s was counted on, whatever
    the speeds and message delays (greedy 1F1B would reorder); it never deadlocks."""
    tables = [StageTable(k, s, nm, total) for s in range(k)]
    schedules = [
        StageSchedule("async", k=k, stage=s, nm=nm, total=total, sequence=tables[s].op)
        for s in range(k)
    ]
    orders = _random_timing_orders(schedules, seed)
    for s in range(k):
        assert orders[s] == [tables[s].op(n) for n in range(2 * total)]


# -- minibatches in flight: the count the memory model charges -------------------------------


def held_peaks(orders: list[list[tuple]]) -> list[int]:
    """Per stage, the most minibatches forwarded and not yet differentiated at once."""
    peaks = []
    for order in orders:
        held = peak = 0
        for op, _p in order:
            held += 1 if op == "F" else -1
            peak = max(peak, held)
        peaks.append(peak)
    return peaks


def _lagging_successors(
    schedules: list[StageSchedule], keeping_pace: bool = False
) -> list[list[tuple]]:
    """Run one virtual worker where a stage acts whenever it can before any later stage does
    (messages arrive at once): every stage's successors lag as far as the schedule lets them.
    ``keeping_pace``: the other way round, a later stage acts first, so gradients return as
    early as they can. Return each stage's forwards and backwards in the order it ran them."""
    k = len(schedules)
    boxes = [_Boxes() for _ in range(k)]
    orders: list[list[tuple]] = [[] for _ in range(k)]
    turns = list(enumerate(schedules))
    if keeping_pace:
        turns.reverse()
    while not all(s.finished for s in schedules):
        for s, sch in turns:
            a = sch.next(boxes[s])
            if not isinstance(a, Wait | Done):
                break
        else:
            raise AssertionError("deadlock")
        sch.done(a)
        if isinstance(a, Forward):
            orders[s].append(("F", a.p))
            if s + 1 < k:
                boxes[s + 1].acts.add(a.p)
        elif isinstance(a, Backward):
            orders[s].append(("B", a.p))
            if s > 0:
                boxes[s - 1].grads.add(a.p)
    return orders


@pytest.mark.parametrize("kind", ["async", "gpipe", "1f1b"])
@pytest.mark.parametrize(
    ("k", "nm"), [(1, 1), (1, 4), (2, 1), (2, 4), (3, 4), (4, 2), (4, 8), (5, 3)]
)
def test_max_in_flight_is_what_a_stage_holds_when_its_successors_lag(kind, k, nm):
    """The count the memory model charges is reached: with each stage's successors lagging,
    an async stage before the last holds Nm, the last one; gpipe holds M everywhere, 1f1b
    min(M, k - stage)."""
    schedules = stages(kind, k, nm, 3 * nm)
    want = {
        "async": [nm] * (k - 1) + [1],
        "gpipe": [nm] * k,
        "1f1b": [min(nm, k - s) for s in range(k)],
    }[kind]
    assert [max_in_flight(kind, k, s, nm) for s in range(k)] == want
    assert held_peaks(_lagging_successors(schedules)) == want


@pytest.mark.parametrize(
    ("k", "nm", "want"),
    [(2, 4, [3, 1]), (3, 4, [4, 3, 1]), (4, 2, [2, 2, 2, 1]), (4, 8, [7, 5, 3, 1])],
)
def test_successors_that_keep_pace_hold_fewer(k, nm, want):
    """In lock step (every compute one tick) an async stage holds min(Nm, 2 (k - stage) - 1):
    a timing the schedule permits, but not its maximum, so no memory figure may rest on it."""
    orders = [
        [(type(a).__name__[0], a.p) for a in table if isinstance(a, Forward | Backward)]
        for table in stage_tables(stages("async", k, nm, 3 * nm))
    ]
    assert held_peaks(orders) == want
    assert all(w <= max_in_flight("async", k, s, nm) for s, w in enumerate(want))


@pytest.mark.parametrize("seed", range(40))
def test_no_timing_holds_more_than_max_in_flight(seed):
    """Random speeds and message delays: no stage ever holds more than the count the memory
    model charges; the synchronous kinds hold exactly that count under any timing."""
    rng = random.Random(seed)
    kind = rng.choice(["async", "async", "gpipe", "1f1b"])
    k, nm = rng.randint(1, 6), rng.randint(1, 6)
    peaks = held_peaks(_random_timing_orders(stages(kind, k, nm, rng.randint(nm, 4 * nm)), seed))
    bound = [max_in_flight(kind, k, s, nm) for s in range(k)]
    assert all(p <= b for p, b in zip(peaks, bound, strict=True)), (kind, k, nm, peaks)
    if kind != "async":
        assert peaks == bound
    else:
        assert peaks[-1] == 1


@pytest.mark.parametrize(
    ("k", "nm", "seed"),
    [(1, 3, 0), (2, 4, 1), (3, 4, 2), (4, 2, 3), (4, 8, 4), (5, 3, 5), (8, 8, 6), (3, 9, 7)],
)
def test_a_fixed_order_holds_its_own_count_under_any_timing(k, nm, seed):
    """A stage that runs the lock-step order as its sequence (weights not stashed) holds
    exactly ``min(Nm, 2 (k - stage) - 1)``, the count max_in_flight gives it, whatever the
    speeds and message delays."""
    total = 4 * (nm + k)
    tables = [StageTable(k, s, nm, total) for s in range(k)]
    want = [max_in_flight("async", k, s, nm, fixed=True) for s in range(k)]
    assert want == [min(nm, 2 * (k - s) - 1) for s in range(k)]
    assert held_peaks([[t.op(n) for n in range(2 * total)] for t in tables]) == want
    schedules = [
        StageSchedule("async", k=k, stage=s, nm=nm, total=total, sequence=tables[s].op)
        for s in range(k)
    ]
    assert held_peaks(_random_timing_orders(schedules, seed)) == want


@pytest.mark.parametrize("seed", range(30))
def test_a_limited_stage_never_holds_more_and_never_deadlocks(seed):
    """Random per-stage limits (``train.in_flight = "plan"``), random speeds and message
    delays, with and without lagging successors: no stage holds more than its limit (the
    count max_in_flight gives it then), and every job finishes."""
    rng = random.Random(seed)
    k, nm = rng.randint(1, 6), rng.randint(1, 6)
    total = rng.randint(nm, 4 * nm)
    limits = [rng.randint(1, nm + 1) for _ in range(k)]

    def limited() -> list[StageSchedule]:
        return [
            StageSchedule("async", k=k, stage=s, nm=nm, total=total, limit=limits[s])
            for s in range(k)
        ]

    bound = [max_in_flight("async", k, s, nm, limit=limits[s]) for s in range(k)]
    assert bound == [min(limits[s], nm, 1 if s == k - 1 else nm) for s in range(k)]
    for orders in (_random_timing_orders(limited(), seed), _lagging_successors(limited())):
        assert all(len(o) == 2 * total for o in orders)
        peaks = held_peaks(orders)
        assert all(p <= b for p, b in zip(peaks, bound, strict=True)), (k, nm, limits, peaks)
    # lagging successors reach the limit where stage 0 admits that many
    peaks = held_peaks(_lagging_successors(limited()))
    assert peaks[0] == min(limits[0], nm, 1 if k == 1 else nm)


@pytest.mark.parametrize("seed", range(30))
def test_a_filled_stage_reaches_its_fill_under_any_timing(seed):
    """With the fills of :func:`fill_counts`, a limited stage runs that many forwards before
    its first backward: whatever the timing (random speeds and delays, successors lagging or
    keeping pace) its peak is at least its fill and at most its limit, and nothing
    deadlocks. With the limits non-increasing, the peak is exactly the limit."""
    rng = random.Random(seed)
    k, nm = rng.randint(1, 6), rng.randint(1, 6)
    total = rng.randint(1, 4 * nm)
    limits = [rng.choice((0, rng.randint(1, nm))) for _ in range(k)]
    if seed % 2:  # the planner's usual case: later stages hold no more than earlier ones
        limits = sorted((x or nm for x in limits), reverse=True)
    fills = fill_counts(limits, nm)
    assert fills[-1] == 0
    assert all(
        f == (min(x or nm for x in limits[: s + 1]) if limits[s] else 0)
        for s, f in enumerate(fills[:-1])
    )

    def filled() -> list[StageSchedule]:
        return [
            StageSchedule(
                "async", k=k, stage=s, nm=nm, total=total, limit=limits[s] or None, fill=fills[s]
            )
            for s in range(k)
        ]

    bound = [max_in_flight("async", k, s, nm, limit=limits[s] or None) for s in range(k)]
    for orders in (
        _random_timing_orders(filled(), seed),
        _lagging_successors(filled()),
        _lagging_successors(filled(), keeping_pace=True),
    ):
        assert all(len(o) == 2 * total for o in orders)
        peaks = held_peaks(orders)
        for s in range(k):
            assert min(fills[s], total) <= peaks[s] <= bound[s], (k, nm, limits, peaks)
            if seed % 2 and s < k - 1:
                assert peaks[s] == min(bound[s], total)


def test_a_limit_at_the_lock_step_count_keeps_the_lock_step_tables():
    """A limit that the timing never reaches changes nothing: in lock step an async stage
    holds min(Nm, 2 (k - stage) - 1), and limiting each stage to that gives the same tables;
    one less makes the stage wait for a gradient instead of forwarding."""
    k, nm, total = 4, 8, 24
    free = stage_tables(stages("async", k, nm, total))
    held = [min(nm, 2 * (k - s) - 1) for s in range(k)]
    same = stage_tables(
        [StageSchedule("async", k=k, stage=s, nm=nm, total=total, limit=held[s]) for s in range(k)]
    )
    assert same == free
    tighter = [
        StageSchedule("async", k=k, stage=s, nm=nm, total=total, limit=max(1, held[s] - 1))
        for s in range(k)
    ]
    orders = [
        [(type(a).__name__[0], a.p) for a in t if isinstance(a, Forward | Backward)]
        for t in stage_tables(tighter)
    ]
    assert held_peaks(orders) == [max(1, h - 1) for h in held]


def test_max_in_flight_refuses_what_cannot_exist():
    with pytest.raises(ScheduleError, match="stage"):
        max_in_flight("async", 2, 2, 4)
    with pytest.raises(ScheduleError, match="nm"):
        max_in_flight("async", 2, 0, 0)
    with pytest.raises(ScheduleError, match="unknown kind"):
        max_in_flight("zigzag", 2, 0, 1)


def handoffs(kind: str, k: int, nm: int, total: int, pulls: bool = False) -> list[list[str]]:
    """Per stage, its compute hand-offs under :meth:`StageSchedule.joins`, as 'F0+B0' ..."""
    out = []
    for table in stage_tables(stages(kind, k, nm, total, pulls)):
        sched = StageSchedule(kind, k=k, stage=len(out), nm=nm, total=total, pulls=pulls)
        runs: list[list[Action]] = []
        for a in table:
            if isinstance(a, F | B | S | Push):
                if runs and runs[-1] and sched.joins(runs[-1], a):
                    runs[-1].append(a)
                else:
                    runs.append([a])
            else:
                runs.append([])  # a pull or merge ends a hand-off
            sched.done(a)
        out.append(
            ["+".join(f"{type(a).__name__[0]}{getattr(a, 'p', '')}" for a in r) for r in runs if r]
        )
    return out


def test_handoffs_group_what_the_runtime_sends_to_the_compute_thread_at_once():
    """The first stage takes its next forward with a backward (and with the iteration's
    step and push), the last a microbatch's forward and backward together, every stage the
    step and push with the iteration's last backward: one trip to the compute thread each."""
    h = handoffs("1f1b", 3, 4, 8)
    assert h[0] == [
        "F0",
        "F1",
        "F2",
        "B0+F3",
        "B1",
        "B2",
        "B3+O+P+F4",
        "F5",
        "F6",
        "B4+F7",
        "B5",
        "B6",
        "B7+O+P",
    ]
    assert h[1] == [
        "F0",
        "F1",
        "B0",
        "F2",
        "B1",
        "F3",
        "B2",
        "B3+O+P",
        "F4",
        "F5",
        "B4",
        "F6",
        "B5",
        "F7",
        "B6",
        "B7+O+P",
    ]
    assert h[2] == ["F0+B0", "F1+B1", "F2+B2", "F3+B3+O+P", "F4+B4", "F5+B5", "F6+B6", "F7+B7+O+P"]
    # async: the local update goes with each backward; alone, the first stage's next
    # forward too; with other virtual workers a wave's first forward waits for its pull,
    # and a push that they wait for goes without a forward
    assert handoffs("async", 2, 2, 4) == [
        ["F0", "F1", "B0+O+F2", "B1+O+P+F3", "B2+O", "B3+O+P"],
        ["F0+B0+O", "F1+B1+O+P", "F2+B2+O", "F3+B3+O+P"],
    ]
    assert handoffs("async", 2, 2, 4, pulls=True)[0] == [
        "F0",
        "F1",
        "B0+O",
        "F2",
        "B1+O+P",
        "F3",
        "B2+O",
        "B3+O+P",
    ]
