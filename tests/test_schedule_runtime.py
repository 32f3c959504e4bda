"""The runtime and the planner's simulator run the same schedule: on random small jobs, each
stage's :class:`StageRunner` (the real one, with a stand-in compute and inputs delivered in
the order the simulator timed them) executes exactly the action sequence the simulator
predicts for that stage."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest
import torch
from helpers import InlineExecutor, StandInCompute, stand_in_stream

from hetpipe.core.schedule import Action, Wait, fill_counts
from hetpipe.pipeline import StageRunner
from hetpipe.planner.simulate import SimLink, SimStage, SimVW, simulate
from hetpipe.wire import Kind, Message


def run_stage(
    kind: str,
    k: int,
    stage: int,
    nm: int,
    total: int,
    timed: list[tuple[float, Action]],
    arrivals: list[tuple[float, Message]],
    warmup: int = 0,
    limit: int = 0,
    fill: int = 0,
) -> list[Action]:
    """Run the real StageRunner of one stage; before each of its decisions, deliver the
    inputs that had arrived in the simulation when the simulator's stage took its next
    action. Returns the actions the runner executed."""
    compute = StandInCompute(kind, k, stage, nm, total, warmup, limit, fill)
    stream = stand_in_stream((torch.zeros(1), torch.zeros(1)))

    async def send(
        kind_: str,
        p: int,
        tensors: dict,
        shared: dict | None = None,
        to: int = 0,
        extra: dict | None = None,
    ) -> None:
        pass

    async def report(stats: dict) -> None:
        pass

    runner = StageRunner(
        compute, InlineExecutor(), send=send, shards={}, report=report, stream=stream
    )  # type: ignore[arg-type]
    sched = runner.schedule
    executed: list[Action] = []
    pending = list(arrivals)
    ask, tell = sched.next, sched.done

    def deliver_until(t: float) -> None:
        while pending and pending[0][0] <= t:
            runner.on_message(pending.pop(0)[1])

    def next_(inputs: Any) -> Action:
        i = len(executed)
        deliver_until(timed[i][0] if i < len(timed) else float("inf"))
        a = ask(inputs)
        if isinstance(a, Wait) and a.what in ("activation", "gradient"):
            # every input the simulated stage needed was delivered: this is a mismatch
            raise AssertionError(
                f"stage {stage} waits ({a}) after {executed}, "
                f"expected {[x for _t, x in timed[i : i + 3]]}"
            )
        return a

    def done(a: Action) -> None:
        executed.append(a)
        tell(a)

    sched.next, sched.done = next_, done  # type: ignore[method-assign]
    asyncio.run(asyncio.wait_for(runner.run(), 30))
    return executed


def simulated(
    kind: str,
    k: int,
    nm: int,
    total: int,
    rng: random.Random,
    warmup: int = 0,
    limits: tuple[int, ...] = (),
):
    stages = tuple(
        SimStage(
            rng.uniform(0.5, 2),
            rng.uniform(0.5, 3),
            push_s=rng.uniform(0, 0.3),
            step_s=rng.uniform(0, 0.2) if kind != "async" else 0.0,
        )
        for _ in range(k)
    )
    links = tuple(SimLink(rng.uniform(0.01, 0.5), rng.uniform(0.01, 0.5)) for _ in range(k - 1))
    return simulate(
        [SimVW(stages, nm, links, schedule=kind, warmup=warmup, limits=limits)],
        0,
        total,
        record=True,
    )


def _jobs(n: int):
    rng = random.Random(7)
    for i in range(n):
        yield (
            i,
            rng.choice(["async", "gpipe", "1f1b"]),
            rng.randint(1, 4),
            rng.randint(1, 4),
            rng.randint(1, 10),
        )


@pytest.fixture(autouse=True)
def no_validation_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """These runners exchange only the schedule's messages: the job-end validation pass
    (its own tests: tests/test_evals.py) is left out."""
    monkeypatch.setattr(StageRunner, "validates", property(lambda self: False))


@pytest.mark.parametrize(("seed", "kind", "k", "nm", "total"), list(_jobs(40)))
def test_runtime_runs_what_the_simulator_predicts(seed, kind, k, nm, total):
    rng = random.Random(seed)
    res = simulated(kind, k, nm, total, rng)
    arrivals = _arrivals_after_compute(res, k)
    for s in range(k):
        timed = list(res.actions[0][s])
        got = run_stage(kind, k, s, nm, total, timed, arrivals[s])
        assert got == [a for _t, a in timed], (kind, k, s, nm, total)


def _warm_jobs(n: int):
    rng = random.Random(11)
    for i in range(n):
        yield i, rng.randint(2, 4), rng.randint(2, 5), rng.randint(1, 10), rng.randint(1, 3)


@pytest.mark.parametrize(("seed", "k", "nm", "total", "warmup"), list(_warm_jobs(16)))
def test_runtime_runs_what_the_simulator_predicts_with_extra_warmup(seed, k, nm, total, warmup):
    """1f1b with extra warm-up forwards: the runner and the simulator take their order from
    the same schedule, so each stage runs the simulated actions, in order."""
    rng = random.Random(seed)
    res = simulated("1f1b", k, nm, total, rng, warmup)
    arrivals = _arrivals_after_compute(res, k)
    for s in range(k):
        timed = list(res.actions[0][s])
        got = run_stage("1f1b", k, s, nm, total, timed, arrivals[s], warmup)
        assert got == [a for _t, a in timed], (k, s, nm, total, warmup)
        # the order itself: k - s - 1 + warmup forwards, then F, B in turn (or all of them)
        first_b = [type(a).__name__ for a in got].index("Backward")
        forwards = sum(type(a).__name__ == "Forward" for a in got[:first_b])
        assert forwards == min(k - s + warmup, nm, total)


def _arrivals_after_compute(res, k: int) -> list[list[tuple[float, Message]]]:
    """Each stage's inputs, timed when the simulated stage used them. That is enough: an
    input changes a decision only by being used in it, so the runner, given every input by
    the time the simulated stage took the action that used it, has what the simulated stage
    had at each of its decisions."""
    log = res.actions[0]
    out: list[list[tuple[float, Message]]] = [[] for _ in range(k)]
    for s in range(k):
        for t, a in log[s]:
            name = type(a).__name__
            if name == "Forward" and s > 0:
                out[s].append(
                    (t, Message(Kind.ACT, {"p": a.p}, {"x": torch.zeros(1), "y": torch.zeros(1)}))
                )
            elif name == "Backward" and s < k - 1:
                out[s].append((t, Message(Kind.GRAD, {"p": a.p}, {"g": torch.zeros(1)})))
    for box in out:
        box.sort(key=lambda x: x[0])
    return out


def _limited_jobs(n: int):
    rng = random.Random(13)
    for i in range(n):
        k, nm = rng.randint(2, 4), rng.randint(1, 5)
        yield i, k, nm, rng.randint(1, 12), tuple(rng.randint(0, nm) for _ in range(k))


@pytest.mark.parametrize(("seed", "k", "nm", "total", "limits"), list(_limited_jobs(24)))
def test_runtime_runs_what_the_simulator_predicts_with_limits(seed, k, nm, total, limits):
    """``train.in_flight = "plan"``: limited and filled stages (fill_counts) run, in the
    runner, the actions the simulator timed for them, in order; the fill's forwards come
    before the first backward."""
    rng = random.Random(seed)
    res = simulated("async", k, nm, total, rng, limits=limits)
    arrivals = _arrivals_after_compute(res, k)
    for s, fill in enumerate(fill_counts(limits, nm)):
        timed = list(res.actions[0][s])
        got = run_stage("async", k, s, nm, total, timed, arrivals[s], limit=limits[s], fill=fill)
        assert got == [a for _t, a in timed], (k, s, nm, total, limits)
        if fill:
            first_b = [type(a).__name__ for a in got].index("Backward")
            assert sum(type(a).__name__ == "Forward" for a in got[:first_b]) >= min(fill, total)
