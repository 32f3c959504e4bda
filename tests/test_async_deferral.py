"""The async schedule with deferred weight gradients (``train.defer_weight_grad``): the
order of its split backwards and steps, that a deferred W never leaves a stage idle, no
deadlock under lock-step or random timings, and what the memory model charges."""

from __future__ import annotations

import pytest
from helpers import ScheduleInputs, random_run

from hetpipe.core.memory import stage_memory
from hetpipe.core.profile import LayerProfile
from hetpipe.core.schedule import (
    Backward,
    BackwardInput,
    BackwardWeight,
    Forward,
    OptimizerStep,
    Pull,
    Push,
    ScheduleError,
    StageSchedule,
    Wait,
    max_deferred,
    max_in_flight,
    stage_tables,
)


def stages(k: int, nm: int, total: int, pulls: bool = False, **kw) -> list[StageSchedule]:
    return [
        StageSchedule("async", k=k, stage=s, nm=nm, total=total, pulls=pulls, defer=True, **kw)
        for s in range(k)
    ]


def check_stage(actions: list, total: int, nm: int) -> None:
    """Each p's I before its W, W's in p order, the step of p right after its W, no whole
    backward, and each wave pushed after its last minibatch's step."""
    inputs = [a.p for a in actions if isinstance(a, BackwardInput)]
    weights = [a.p for a in actions if isinstance(a, BackwardWeight)]
    assert inputs == list(range(total))
    assert weights == list(range(total))
    assert not any(isinstance(a, Backward) for a in actions)
    for j, a in enumerate(actions):
        if isinstance(a, BackwardWeight):
            assert actions.index(BackwardInput(a.p)) < j
            assert actions[j + 1] == OptimizerStep(a.p)
        if isinstance(a, Push):
            last = min(total, (a.c + 1) * nm) - 1
            assert actions.index(OptimizerStep(last)) < j


@pytest.mark.parametrize("k", range(2, 9))
@pytest.mark.parametrize("nm", range(1, 9))
def test_lock_step_order_and_no_deadlock(k, nm):
    """clock_cycles finishes for k 2-8, Nm 1-8 (alone and pulling), with the split order."""
    total = 3 * nm + 1
    for pulls in (False, True):
        tables = stage_tables(stages(k, nm, total, pulls))
        for row in tables:
            check_stage(row, total, nm)


def _random_run(schedules: list[StageSchedule], seed: int) -> list[list]:
    """Random timing (:func:`helpers.random_run`); checks at every step that a stage with a
    deferred W pending never waits, and what each holds (forward to W) stays within
    max_in_flight."""
    k = len(schedules)

    def waits(s: int, sch: StageSchedule, a: Wait) -> None:
        assert sch.nb == sch.ni, (s, a)  # a deferred W runs before the stage idles

    def held(s: int, sch: StageSchedule, _a: object) -> None:
        assert sch.nf - sch.nb <= max_in_flight("async", k, s, sch.nm)

    return random_run(schedules, seed, 4, on_wait=waits, on_step=held)


@pytest.mark.parametrize("k", range(2, 9))
@pytest.mark.parametrize("nm", [1, 2, 3, 5, 8])
def test_random_timings(k, nm):
    total = 2 * nm + 1
    for seed in range(2):
        for row in _random_run(stages(k, nm, total, pulls=seed == 1), seed):
            check_stage(row, total, nm)


def test_nm_one_runs_each_w_right_after_its_i():
    """Nm = 1: nothing else is ready after an I, so its W and step follow at once (the
    computation of plain training)."""
    for row in stage_tables(stages(4, 1, 5)):
        passes = [a for a in row if isinstance(a, Forward | BackwardInput | BackwardWeight)]
        for j, a in enumerate(passes):
            if isinstance(a, BackwardInput):
                assert passes[j + 1] == BackwardWeight(a.p)


def test_w_fills_what_would_be_a_bubble():
    """A stage whose gradient has not come back runs its deferred W instead of waiting, and
    an input gradient that is ready goes before a deferred W."""
    sch = StageSchedule("async", k=4, stage=1, nm=4, total=8, defer=True)
    inputs = ScheduleInputs()
    for a in (Pull(0),):
        sch.done(a)
        inputs.answered.add((0, False))
    sch.done(sch.next(inputs))  # merge
    inputs.acts |= {0, 1}
    for p in (0, 1):
        assert sch.next(inputs) == Forward(p)
        sch.done(Forward(p))
    inputs.grads |= {0, 1}
    assert sch.next(inputs) == BackwardInput(0)
    sch.done(BackwardInput(0))
    assert sch.next(inputs) == BackwardInput(1)  # a ready input gradient first
    sch.done(BackwardInput(1))
    inputs.acts.add(2)
    assert sch.next(inputs) == Forward(2)  # a ready forward first
    sch.done(Forward(2))
    assert sch.next(inputs) == BackwardWeight(0)  # nothing else: the deferred W
    sch.done(BackwardWeight(0))
    assert sch.next(inputs) == OptimizerStep(0)


def test_last_stage_holds_one():
    """The last stage sends its input gradient at once and runs its W before its next
    forward: it holds one minibatch, as without deferral."""
    for row in stage_tables(stages(3, 3, 7))[-1:]:
        passes = [type(a) for a in row if isinstance(a, Forward | BackwardInput | BackwardWeight)]
        assert passes == [Forward, BackwardInput, BackwardWeight] * 7


def test_refusals():
    for kind in ("1f1b", "zb-h1", "gpipe"):
        with pytest.raises(ScheduleError, match="defer"):
            StageSchedule(kind, k=2, stage=0, nm=2, total=4, defer=True)
    with pytest.raises(ScheduleError, match="defer"):
        StageSchedule("async", k=2, stage=0, nm=2, total=4, defer=True, replicated=True)
    with pytest.raises(ScheduleError, match="defer"):
        StageSchedule("async", k=2, stage=0, nm=2, total=4, defer=True, sequence=lambda n: ("F", 0))


def test_memory_model_counts_deferred_gradients():
    """Every minibatch an async stage holds may keep its output gradient until its W."""
    assert max_deferred("async", 4, 0, 3) == 0
    assert [max_deferred("async", 4, s, 3, defer=True) for s in range(4)] == [3, 3, 3, 1]
    assert max_deferred("async", 4, 0, 3, defer=True, limit=2) == 2
    layers = [LayerProfile(0.1, 0.2, 4000, 0, 2000, 3000, 100)]
    plain = stage_memory(layers, 0, 4, 3, 2, 1000)
    deferred = stage_memory(layers, 0, 4, 3, 2, 1000, defer=True)
    assert deferred.total > plain.total


def _spec(**train):
    from hetpipe.job import JobSpec

    return JobSpec.from_dict(
        {
            "name": "d",
            "model": {"name": "mlp"},
            "train": {"minibatch": 4, "minibatches": 9, **train},
        }
    )


def test_job_key_round_trips_and_is_refused_where_it_cannot_run():
    from hetpipe.job import JobError

    spec = _spec(defer_weight_grad=True)
    assert spec.defer_weight_grad
    assert type(spec).from_dict(spec.to_dict()) == spec
    assert not _spec().defer_weight_grad
    for train, why in (
        ({"schedule": "1f1b"}, "needs schedule = async"),
        ({"schedule": "zb-h1"}, "needs schedule = async"),
        ({"weights": "latest"}, "needs weights = stash"),
    ):
        with pytest.raises(JobError, match=why) as err:
            _spec(defer_weight_grad=True, **train)
        assert "\n" not in str(err.value)


def test_deferred_names_the_oldest_held_w_only_under_defer():
    sch = StageSchedule("async", k=2, stage=0, nm=2, total=4, defer=True)
    assert sch.deferred() is None
    for a in (Forward(0), Forward(1), BackwardInput(0), BackwardInput(1)):
        sch.done(a)
    assert sch.deferred() == BackwardWeight(0)
    zb = StageSchedule("zb-h1", k=2, stage=0, nm=2, total=4)
    zb.done(BackwardInput(0))
    assert zb.deferred() is None
