"""Tests of the WSP clock rules of one shard (hetpipe.core.wsp)."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import pytest

from hetpipe.core.wsp import (
    WaveClock,
    WspError,
    covers,
    first_of_wave,
    is_last_of_wave,
    pull_need,
    unincluded_waves,
    wave_of,
    wave_ranges,
)

# -- helpers ---------------------------------------------------------------------------------


def test_wave_arithmetic() -> None:
    assert [wave_of(p, 4) for p in range(9)] == [0, 0, 0, 0, 1, 1, 1, 1, 2]
    assert first_of_wave(0, 4) == 0
    assert first_of_wave(3, 4) == 12
    assert all(wave_of(first_of_wave(c, 3), 3) == c for c in range(10))


def test_is_last_of_wave_full_and_partial_final_wave() -> None:
    # total = 10, nm = 4: waves {0..3}, {4..7}, {8, 9} (partial, ends at total - 1).
    lasts = [p for p in range(10) if is_last_of_wave(p, 4, 10)]
    assert lasts == [3, 7, 9]
    # total a multiple of nm: no extra last.
    assert [p for p in range(8) if is_last_of_wave(p, 4, 8)] == [3, 7]
    # nm = 1: every minibatch closes its wave.
    assert all(is_last_of_wave(p, 1, 5) for p in range(5))
    # final wave of a single minibatch.
    assert [p for p in range(9) if is_last_of_wave(p, 4, 9)] == [3, 7, 8]
    # one push per wave, always.
    for nm in range(1, 6):
        for total in range(1, 20):
            lasts = [p for p in range(total) if is_last_of_wave(p, nm, total)]
            assert [wave_of(p, nm) for p in lasts] == list(range(math.ceil(total / nm)))


def test_pull_need() -> None:
    assert pull_need(0, 0) == -1
    assert pull_need(1, 0) == 0
    assert pull_need(5, 0) == 4
    assert pull_need(5, 2) == 2
    assert pull_need(1, 3) == -3


def test_unincluded_waves() -> None:
    # the shard reports its applied waves as [first, end) runs
    assert unincluded_waves([3, 4, 5], wave_ranges([0, 1, 2, 3])) == [4, 5]
    assert unincluded_waves([5, 3, 4], [[0, 6]]) == []
    assert unincluded_waves([2], []) == [2]
    assert unincluded_waves([], [[0, 1]]) == []
    # out-of-order applied set: 4 applied, 3 not yet.
    assert unincluded_waves([3, 4, 5], wave_ranges([0, 1, 2, 4])) == [3, 5]


@pytest.mark.parametrize(
    ("call", "text"),
    [
        (lambda: wave_of(1, 0), "nm"),
        (lambda: wave_of(-1, 2), "minibatch"),
        (lambda: first_of_wave(-1, 2), "wave"),
        (lambda: is_last_of_wave(10, 4, 10), "minibatch"),
        (lambda: is_last_of_wave(-1, 4, 10), "minibatch"),
        (lambda: is_last_of_wave(0, 0, 10), "nm"),
        (lambda: pull_need(-1, 0), "wave"),
        (lambda: pull_need(1, -1), "staleness"),
    ],
)
def test_helper_errors(call, text: str) -> None:
    with pytest.raises(WspError, match=text) as info:
        call()
    assert "\n" not in str(info.value)


# -- the clock -------------------------------------------------------------------------------


def test_construction_errors() -> None:
    with pytest.raises(WspError, match="vw 1 has no stages"):
        WaveClock({0: [0], 1: []}, 0)
    with pytest.raises(WspError, match="no virtual workers"):
        WaveClock({}, 0)
    with pytest.raises(WspError, match="staleness"):
        WaveClock({0: [0]}, -1)


def test_push_errors() -> None:
    clock: WaveClock[str] = WaveClock({0: [0, 1]}, 0)
    with pytest.raises(WspError, match="unknown vw 5"):
        clock.record_push(5, 0, 0)
    with pytest.raises(WspError, match="vw 0 has no stage 7"):
        clock.record_push(0, 7, 0)
    with pytest.raises(WspError, match="wave must be >= 0"):
        clock.record_push(0, 0, -1)
    with pytest.raises(WspError, match="unknown vw"):
        clock.vw_clock(3)
    with pytest.raises(WspError, match="unknown vw"):
        clock.applied(3, 0)
    with pytest.raises(WspError, match="unknown vw"):
        clock.finish(3, 1)
    with pytest.raises(WspError, match="waves must be >= 0"):
        clock.finish(0, -1)
    clock.finish(0, 1)
    with pytest.raises(WspError, match="finished after 1 waves; wave 1 refused"):
        clock.record_push(0, 0, 1)


def test_duplicate_push_is_applied_once() -> None:
    clock: WaveClock[str] = WaveClock({0: [0]}, 0)
    assert clock.record_push(0, 0, 0) is True
    assert clock.record_push(0, 0, 0) is False
    assert clock.applied(0, 0) == [0]
    assert clock.vw_clock(0) == 1
    # a duplicate of an out-of-order push, too
    assert clock.record_push(0, 0, 2) is True
    assert clock.record_push(0, 0, 2) is False
    assert clock.applied(0, 0) == [0, 2]
    assert clock.vw_clock(0) == 1


def test_applied_waves_come_as_runs_whose_size_does_not_grow_with_the_job() -> None:
    # what a pull answer carries: the same waves as ``applied``, as [first, end) runs
    rng = random.Random(7)
    for _ in range(200):
        clock: WaveClock[str] = WaveClock({0: [0]}, 0)
        waves = rng.sample(range(40), rng.randrange(41))
        for w in waves:
            clock.record_push(0, 0, w)
            runs = clock.applied_ranges(0, 0)
            assert runs == wave_ranges(clock.applied(0, 0))
            assert all(covers(runs, x) == clock.is_applied(0, 0, x) for x in range(42))
    # a long job pushing in order: one run, where the list of waves holds every one
    clock = WaveClock({0: [0]}, 0)
    for w in range(20000):
        clock.record_push(0, 0, w)
    clock.record_push(0, 0, 20002)
    assert clock.applied_ranges(0, 0) == [[0, 20000], [20002, 20003]]
    assert covers([[0, 3], [5, 6]], 5) and not covers([[0, 3], [5, 6]], 3)
    assert wave_ranges([]) == [] and wave_ranges([0, 1, 2, 5, 6]) == [[0, 3], [5, 7]]


def test_out_of_order_pushes_advance_only_when_contiguous() -> None:
    clock: WaveClock[str] = WaveClock({0: [0]}, 0)
    assert clock.record_push(0, 0, 3)
    assert clock.record_push(0, 0, 1)
    assert clock.contiguous(0, 0) == 0
    assert clock.vw_clock(0) == 0
    assert clock.applied(0, 0) == [1, 3]
    assert clock.is_applied(0, 0, 3) and not clock.is_applied(0, 0, 2)
    assert clock.record_push(0, 0, 0)
    assert clock.contiguous(0, 0) == 2
    assert clock.record_push(0, 0, 2)
    assert clock.contiguous(0, 0) == 4
    assert clock.applied(0, 0) == [0, 1, 2, 3]
    assert clock.record_push(0, 0, 1) is False  # inside the prefix now


def test_vws_with_different_nm_and_k_count_waves() -> None:
    """VW 0: 3 stages here, nm = 2; VW 1: 1 stage here, nm = 5; 10 minibatches each."""
    total = 10
    vws = {0: (2, [0, 1, 2]), 1: (5, [3])}
    clock: WaveClock[str] = WaveClock({vw: stages for vw, (_, stages) in vws.items()}, 0)
    pushed = {0: 0, 1: 0}
    for p in range(total):
        for vw, (nm, stages) in vws.items():
            if is_last_of_wave(p, nm, total):
                c = wave_of(p, nm)
                # stages push in reverse pipeline order; the clock moves only after the last one
                for i, stage in enumerate(reversed(stages)):
                    assert clock.vw_clock(vw) == c
                    assert clock.record_push(vw, stage, c)
                    assert clock.vw_clock(vw) == (c + 1 if i == len(stages) - 1 else c)
                pushed[vw] = c + 1
        assert clock.vw_clock(0) == pushed[0] == (p + 1) // 2
        assert clock.vw_clock(1) == pushed[1] == (p + 1) // 5
        assert clock.global_clock() == min(pushed.values())
    assert clock.snapshot() == {"global": 2, "vws": {"0": 5, "1": 2}, "parked": 0, "done": []}


def test_vw_with_three_stages_needs_all_three() -> None:
    clock: WaveClock[str] = WaveClock({0: [0, 1, 2], 1: [0]}, 0)
    clock.record_push(1, 0, 0)
    clock.record_push(0, 0, 0)
    clock.record_push(0, 2, 0)
    clock.record_push(0, 0, 1)
    clock.record_push(0, 2, 1)
    assert clock.vw_clock(0) == 0
    assert clock.global_clock() == 0
    clock.record_push(0, 1, 0)
    assert clock.vw_clock(0) == 1
    assert clock.global_clock() == 1


def test_pull_answered_exactly_when_need_met() -> None:
    clock: WaveClock[str] = WaveClock({0: [0, 1], 1: [0]}, 0)
    assert clock.park(-3, "neg") is True  # negative need: at once, not parked
    assert clock.park(0, "zero") is True
    assert clock.parked() == 0
    assert clock.park(2, "a") is False
    assert clock.park(1, "b") is False
    assert clock.park(2, "c") is False
    assert clock.parked() == 3
    steps = [
        ((0, 0, 0), []),
        ((0, 1, 0), []),  # vw 0 at 1, vw 1 at 0
        ((1, 0, 0), ["b"]),  # global 1: exactly now
        ((1, 0, 1), []),
        ((0, 1, 1), []),
        ((1, 0, 1), []),  # duplicate: changes nothing
        ((0, 0, 1), ["a", "c"]),  # global 2, arrival order
    ]
    for push, expect in steps:
        clock.record_push(*push)
        assert clock.release() == expect, push
    assert clock.parked() == 0
    assert clock.release() == []


def test_release_keeps_arrival_order_across_needs() -> None:
    clock: WaveClock[int] = WaveClock({0: [0]}, 0)
    for i, need in enumerate([3, 1, 2, 1, 3]):
        assert clock.park(need, i) is False
    for w in (2, 1, 0):  # out of order: nothing until wave 0 arrives
        clock.record_push(0, 0, w)
        if w:
            assert clock.release() == []
    assert clock.release() == [0, 1, 2, 3, 4]


def test_finish_stops_holding_back_only_after_last_wave() -> None:
    clock: WaveClock[str] = WaveClock({0: [0], 1: [0]}, 0)
    for w in range(5):
        clock.record_push(0, 0, w)
    clock.record_push(1, 0, 0)
    assert clock.park(3, "x") is False
    clock.finish(1, 2)  # vw 1 will push waves 0 and 1 only
    assert clock.release() == []  # its wave 1 is still owed
    assert not clock.done(1)
    clock.record_push(1, 0, 1)
    assert clock.done(1)
    assert clock.global_clock() == 5
    assert clock.release() == ["x"]
    assert clock.snapshot() == {"global": 5, "vws": {"0": 5, "1": 2}, "parked": 0, "done": [1]}
    clock.finish(0, 5)
    assert clock.global_clock() == 5  # all done: the largest clock, never lower
    assert clock.park(100, "y") is True


def test_snapshot_shape() -> None:
    clock: WaveClock[str] = WaveClock({3: [0], 7: [1, 2]}, 1)
    clock.park(4, "p")
    snap = clock.snapshot()
    assert snap == {"global": 0, "vws": {"3": 0, "7": 0}, "parked": 1, "done": []}
    assert all(isinstance(k, str) for k in snap["vws"])


# -- simulation: VWs of different speeds, Nm and k driving one shard -------------------------
#
# Model of one VW, following DESIGN.md's rules at wave granularity:
# - it pulls for wave c (need = c - 1 - D) before starting wave c; the first pull is c = 0
#   (need < 0, answered at once);
# - the pull for wave c may be issued once wave c - 1 has started (the pipeline keeps up to Nm
#   minibatches in flight, so wave c - 1 is still running) and every stage has sent its push of
#   wave c - 2 (admission of minibatch c*Nm waits for the backward of (c-1)*Nm at stage 0, after
#   which the backwards of all of wave c - 2 are done at every stage);
# - each stage sends its push of wave c, in wave order, at any time after wave c has started;
# - pushes travel with random delay: delivery order across and within stages is random, and some
#   are delivered twice (retries).
# Each VW runs ceil(total / Nm) waves of the same minibatch total, so VWs with a smaller Nm run
# more waves; a VW declares finish() once it has sent its last push.
#
# Asserted at every wave start of VW v for wave c, with g = the shard's global clock then:
#   (a) g >= c - 1 - D (the pull's need is met when it is answered);
#   (b) g is the minimum of the clocks of the VWs not done and c - g <= D + 1 (no VW starts a
#       wave more than D + 1 waves ahead of the slowest unfinished VW's clock; given (a) this is
#       the same inequality), and every unfinished VW u has itself started >= c - 1 - D waves
#       (checked on the simulated VWs, not on the clock);
#   (c) the shard's weights then include every VW u's pushes of every stage for all waves
#       w < min(c - 1 - D, waves_u) (the DESIGN invariant, at the shard);
# after every step:
#   (d) every pull still parked has need > g (answered no later than its need is met), unless
#       all VWs are done, and every pull answered by release() had need <= g (not earlier);
#   (e) the global clock never decreases;
# and at the end (f) every VW has started all its waves and every push has been applied: no
# deadlock, including D = 0.


@dataclass
class _VW:
    vw: int
    stages: list[int]
    nm: int
    waves: int
    speed: float
    started: int = 0
    pulling: int | None = None  # wave of the parked pull
    sent: dict[int, int] = field(default_factory=dict)  # stage -> waves sent
    finished: bool = False

    def actions(self) -> list[tuple]:
        acts: list[tuple] = []
        c = self.started
        ready = c < 2 or all(n >= c - 1 for n in self.sent.values())
        if self.pulling is None and c < self.waves and ready:
            acts.append(("pull", self.vw, c))
        for stage, n in self.sent.items():
            if n < self.started:
                acts.append(("send", self.vw, stage, n))
        return acts


def _simulate(seed: int, staleness: int, use_finish: bool = True) -> dict:
    rng = random.Random(seed)
    total = rng.randint(4, 24)
    n_vws = rng.randint(2, 3)
    vws: dict[int, _VW] = {}
    for v in range(n_vws):
        nm = rng.randint(1, 5)
        stages = sorted(rng.sample(range(4), rng.randint(1, 3)))
        vws[v] = _VW(
            v, stages, nm, math.ceil(total / nm), rng.choice([0.25, 0.5, 1.0, 3.0]),
            sent={s: 0 for s in stages},
        )  # fmt: skip
    clock: WaveClock[tuple[int, int]] = WaveClock({v.vw: v.stages for v in vws.values()}, staleness)
    applied: set[tuple[int, int, int]] = set()
    inflight: list[tuple[int, int, int]] = []
    needs: dict[tuple[int, int], int] = {}
    last_global = 0
    steps = 0

    def start(v: _VW, c: int) -> None:
        g = clock.global_clock()
        need = pull_need(c, staleness)
        assert c == v.started
        assert g >= need, (seed, "a")
        active = [u for u in vws.values() if not clock.done(u.vw)]
        if active:
            assert g == min(clock.vw_clock(u.vw) for u in active)
            assert c - g <= staleness + 1, (seed, "b")
            # the same seen from the VWs themselves: each has started >= c - 1 - D waves
            assert all(u.started >= c - 1 - staleness for u in active), (seed, "b")
        for u in vws.values():
            for s in u.stages:
                for w in range(min(need, u.waves)):
                    assert (u.vw, s, w) in applied, (seed, "c", u.vw, s, w)
        v.started += 1
        v.pulling = None

    while True:
        acts = [a for v in vws.values() for a in v.actions()]
        weights = [vws[a[1]].speed for a in acts]
        for i, _ in enumerate(inflight):
            acts.append(("deliver", i))
            weights.append(1.0)
        if not acts:
            break
        steps += 1
        act = rng.choices(acts, weights)[0]
        if act[0] == "pull":
            _, vw, c = act
            need = pull_need(c, staleness)
            if clock.park(need, (vw, c)):
                start(vws[vw], c)
            else:
                vws[vw].pulling = c
                needs[(vw, c)] = need
        elif act[0] == "send":
            _, vw, stage, w = act
            v = vws[vw]
            v.sent[stage] += 1
            inflight.append((vw, stage, w))
            if use_finish and not v.finished and all(n == v.waves for n in v.sent.values()):
                v.finished = True
                clock.finish(vw, v.waves)
        else:
            msg = inflight.pop(act[1])
            if rng.random() < 0.15:
                inflight.append(msg)  # a retry: the same push delivered again later
            if clock.record_push(*msg):
                assert msg not in applied
                applied.add(msg)
            else:
                assert msg in applied
            g = clock.global_clock()
            assert g >= last_global, (seed, "e")
            last_global = g
            for vw, c in clock.release():
                assert needs.pop((vw, c)) <= g, (seed, "d")
                start(vws[vw], c)
            if not all(clock.done(u) for u in vws):
                assert all(n > g for n in needs.values()), (seed, "d")
    return {
        "done": all(v.started == v.waves for v in vws.values()),
        "applied": len(applied) == sum(v.waves * len(v.stages) for v in vws.values()),
        "parked": clock.parked(),
        "steps": steps,
        "waves": sorted(v.waves for v in vws.values()),
    }


@pytest.mark.parametrize("staleness", [0, 1, 2, 4])
def test_simulation_never_deadlocks_and_keeps_the_bound(staleness: int) -> None:
    for seed in range(300):
        result = _simulate(seed * 7 + staleness, staleness)
        assert result["done"], (seed, result)
        assert result["applied"], (seed, result)
        assert result["parked"] == 0, (seed, result)


def test_simulation_equal_waves_needs_no_finish() -> None:
    """With the same number of waves in every VW the plain contract (no finish) completes."""
    ran = 0
    for seed in range(300):
        result = _simulate(seed, 0, use_finish=False)
        if len(set(result["waves"])) == 1:
            assert result["done"], (seed, result)
            ran += 1
    assert ran >= 10


def test_without_finish_a_vw_with_more_waves_waits_forever() -> None:
    """Nm = 4 and Nm = 1 over 8 minibatches: 2 waves and 8 waves. At D = 0 the pull of the
    second VW for wave 4 needs global clock 3, which the first VW (done at 2) never reaches."""
    clock: WaveClock[str] = WaveClock({0: [0], 1: [0]}, 0)
    for w in range(2):
        clock.record_push(0, 0, w)
    for w in range(3):
        clock.record_push(1, 0, w)
    assert clock.park(pull_need(3, 0), "wave3") is True
    clock.record_push(1, 0, 3)
    assert clock.park(pull_need(4, 0), "wave4") is False
    assert clock.release() == []  # stuck for good under the plain rule
    clock.finish(0, 2)
    assert clock.release() == ["wave4"]
