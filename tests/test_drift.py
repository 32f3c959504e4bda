"""Drift detection on the head (hetpipe.head.drift): pure, from progress reports."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest
from helpers import KW, profile16, repo_cluster

from hetpipe.core.layout import VWLayout
from hetpipe.head import drift
from hetpipe.head.drift import NO_MIGRATION, DriftDetector, Watch
from hetpipe.job import ReplanSpec
from hetpipe.planner.plans import PlanInputs

PRED = {(0, 0): 0.010, (0, 1): 0.020, (0, 2): 0.010}
DEVICES = {(0, 0): "gpu0", (0, 1): "gpu1", (0, 2): "gpu2"}


class Run:
    """Stages' cumulative reports as a job's telemetry would carry them, one tick at a time
    (``per_tick`` minibatches each)."""

    def __init__(self, scale: float = 1.0, per_tick: int = 3) -> None:
        self.done = 0
        self.spent = dict.fromkeys(PRED, 0.0)
        self.scale = scale
        self.per_tick = per_tick

    def tick(self, factor: dict[tuple[int, int], float] | None = None) -> dict[Any, Any]:
        for _ in range(self.per_tick):
            self.done += 1
            for key, t in PRED.items():
                self.spent[key] += t * self.scale * (factor or {}).get(key, 1.0)
        return {
            k: {"done": self.done, "forward_s": v / 3, "backward_s": 2 * v / 3}
            for k, v in self.spent.items()
        }


def detector(threshold: float = 1.5, window: int = 6) -> DriftDetector:
    return DriftDetector(PRED, DEVICES, [2], threshold, window)


def test_a_slow_warm_up_is_no_drift() -> None:
    det, run = detector(), Run()
    for i in range(12):  # the first minibatches 5x slower: allocations, first calls
        assert det.observe(run.tick({k: 5.0 for k in PRED} if i < 2 else None)) == []
    for _ in range(40):
        assert det.observe(run.tick()) == []


def test_a_constant_prediction_error_is_no_drift() -> None:
    det, run = detector(), Run(scale=2.5)  # the host runs everything 2.5x the profile
    for _ in range(40):
        assert det.observe(run.tick()) == []


def test_noise_below_the_threshold_is_no_drift() -> None:
    det, run = detector(), Run()
    for i in range(60):
        assert det.observe(run.tick({(0, 1): 1.3 if i % 2 else 0.8})) == []


def test_a_slowed_stage_drifts_by_its_factor_within_a_window() -> None:
    det, run = detector(window=6), Run(per_tick=3)
    for _ in range(10):
        assert det.observe(run.tick()) == []
    at = run.done
    found = []
    for _ in range(8):
        found = det.observe(run.tick({(0, 1): 3.0}))
        if found:
            break
    assert len(found) == 1
    d = found[0]
    assert (d.vw, d.stage, d.device) == (0, 1, "gpu1")
    assert d.ratio == pytest.approx(3.0)  # measured on a window wholly slowed
    assert run.done - at <= 2 * 6 + 3  # within two windows and a tick
    assert d.predicted_s == pytest.approx(PRED[(0, 1)])


def test_a_faster_stage_drifts_too() -> None:
    det, run = detector(), Run()
    for _ in range(10):
        det.observe(run.tick())
    found = []
    for _ in range(8):
        found = found or det.observe(run.tick({(0, 2): 0.25}))
    assert found and found[0].stage == 2 and found[0].ratio < 1 / 1.5


def test_a_restarted_stage_counts_anew() -> None:
    det, run = detector(), Run()
    for _ in range(10):
        det.observe(run.tick())
    reset = {k: {"done": 1, "forward_s": 0.001, "backward_s": 0.002} for k in PRED}
    assert det.observe(reset) == []  # fewer minibatches than before: a new attempt


def watch(migrate: Any = None, min_gain: float = 1.1) -> Watch:
    layouts = [VWLayout.from_counts([("gpu0",), ("gpu1",), ("gpu2",)], (6, 5, 5), 2)]
    return Watch(
        ReplanSpec(True, 1.5, 6, min_gain, window_s=0.0),
        layouts,
        PRED,
        repo_cluster(),
        profile16(),
        PlanInputs(**KW, nm=2),
        pick_nm=False,
        schedule="async",
        migrate=migrate,
    )


def slowed(w: Watch, ticks: int = 30) -> list[Any]:
    run, made = Run(), []
    for _ in range(10):
        made += w.tick(run.tick(), now=1.0)
    for _ in range(ticks):
        made += w.tick(run.tick({(0, 1): 3.0}), now=2.0)
    return made


def test_one_slowdown_makes_one_decision_recorded_as_not_carried_out() -> None:
    w = watch()
    made = slowed(w)
    assert len(made) == 1, [d.line() for d in made]
    d = made[0]
    assert (d.vw, d.device, d.stage, d.at) == (0, "gpu1", 1, 2.0)
    assert not d.take and NO_MIGRATION in d.reason
    assert d.moves  # what it would have moved is recorded
    rec = w.records()[0]
    assert rec["taken"] is False and rec["line"] == d.line() and rec["moves"]


def test_a_decision_migration_takes_changes_the_watched_split() -> None:
    taken: list[Any] = []
    w = watch(migrate=lambda d: taken.append(d))  # returns None: taken
    made = slowed(w, ticks=8)
    assert len(made) == 1 and made[0].take and taken == made
    assert w.layouts[0] == made[0].layout
    assert tuple((s.first, s.last) for s in w.layouts[0].stages) == made[0].bounds


def test_migration_refusing_says_why() -> None:
    w = watch(migrate=lambda d: "a worker is lost")
    d = slowed(w, ticks=8)[0]
    assert not d.take and d.reason.endswith("; a worker is lost")


def test_the_head_hooks() -> None:
    log = SimpleNamespace(lines=[])
    log.info = log.warning = lambda *a, **k: log.lines.append(k)
    plan = SimpleNamespace(
        vws=watch().layouts,
        predicted={"vws": [{"stages": [{"time_s": t} for t in PRED.values()]}]},
    )
    replan = ReplanSpec(window=6, window_s=0.0)  # ticks come at once here
    spec = SimpleNamespace(replan=replan, nm=2, vws=(), schedule="async")
    w = drift.watch_for(spec, plan, repo_cluster(), profile16(), PlanInputs(**KW, nm=2))
    assert w is not None and w.detector.stages.keys() == PRED.keys()
    off = dataclasses.replace(spec.replan, enabled=False)
    assert (
        drift.watch_for(SimpleNamespace(**{**vars(spec), "replan": off}), plan, None, None, None)
        is None
    )
    unpriced = SimpleNamespace(vws=plan.vws, predicted={})
    assert drift.watch_for(spec, unpriced, None, None, None) is None

    js = SimpleNamespace(id="j-1", watch=w, progress={}, plan=plan)
    run = Run()
    records = []
    for i in range(40):
        js.progress = run.tick({(0, 1): 3.0} if i >= 10 else None)
        records += drift.tick(js, log)
    assert len(records) == 1 and log.lines[0]["decision"] == records[0]["line"]
    assert drift.stage_record(js, 0)["replans"] == records
    assert drift.stage_record(js, 1) == {}
    result = drift.result_of(js)
    assert result["final_plan"][0]["layers"] == [[0, 6], [6, 11], [11, 16]]  # not carried out
    assert result["replan_decisions"] == records
    assert drift.tick(SimpleNamespace(watch=None), log) == []


def test_a_spike_shorter_than_a_window_is_no_drift() -> None:
    det, run = detector(window=6), Run(per_tick=3)
    for i in range(40):  # one tick 4x slower (a pause of the host), then as before
        assert det.observe(run.tick({(0, 1): 4.0} if i == 15 else None)) == []


def test_the_host_slowing_every_stage_at_once_is_no_drift() -> None:
    det, run = detector(), Run()
    for i in range(60):  # the host's load doubles for a while, for every stage alike
        assert det.observe(run.tick({k: 2.5 for k in PRED} if 15 <= i < 35 else None)) == []


def test_an_error_in_the_watch_stops_it_not_the_telemetry() -> None:
    log = SimpleNamespace(lines=[])
    log.info = log.warning = lambda *a, **k: log.lines.append(k)
    w = watch()

    def broken(progress: Any, now: float | None = None) -> list[Any]:
        raise ValueError("boom")

    w.tick = broken  # type: ignore[method-assign]
    js = SimpleNamespace(id="j-1", watch=w, progress={})
    assert drift.tick(js, log) == [] and w.stopped == "ValueError: boom"
    assert drift.tick(js, log) == [] and len(log.lines) == 1  # said once


def test_a_window_spans_window_s_seconds_at_least() -> None:
    """Ticks 1 s apart, 6 minibatches each: a window of 6 minibatches would be one tick, but
    with window_s = 4 it spans four, so a burst of two ticks is no drift, a lasting
    slowdown is."""
    det, run = DriftDetector(PRED, DEVICES, [2], 1.5, 6, window_s=4.0), Run(per_tick=6)
    t = 0.0
    for i in range(40):
        t += 1.0
        burst = {(0, 1): 3.0} if i in (15, 16) else None
        assert det.observe(run.tick(burst), now=t) == []
    found = []
    for _ in range(12):
        t += 1.0
        found = found or det.observe(run.tick({(0, 1): 3.0}), now=t)
    # the settled mean holds the burst: the change reads a little under 3
    assert found and found[0].stage == 1 and found[0].ratio == pytest.approx(3.0, rel=0.15)


def test_a_forgotten_vw_is_watched_no_more_and_the_others_still_are() -> None:
    """A VW re-formed after a lost worker leaves the watch: its slowdown is no drift, while
    a slowdown of another VW's stage still is."""
    pred = {**PRED, **{(1, s): t for (_, s), t in PRED.items()}}
    devices = {**DEVICES, **{(1, s): f"gpu{3 + s}" for s in range(3)}}
    spent = dict.fromkeys(pred, 0.0)
    done = 0

    def tick(slow: dict[tuple[int, int], float]) -> dict[tuple[int, int], dict[str, Any]]:
        nonlocal done
        done += 2
        for key, t in pred.items():
            spent[key] += 2 * t * slow.get(key, 1.0)
        return {
            k: {"done": done, "forward_s": spent[k] / 3, "backward_s": spent[k] * 2 / 3}
            for k in pred
        }

    det = DriftDetector(pred, devices, [2, 2], 1.5, 6)
    for _ in range(10):
        assert det.observe(tick({})) == []
    det.forget(1)
    assert all(v == 0 for v, _ in det.stages)
    found = []
    for _ in range(10):
        found += det.observe(tick({(1, 1): 4.0}))
    assert found == []
    for _ in range(10):
        found += det.observe(tick({(1, 1): 4.0, (0, 1): 3.0}))
    assert found and (found[0].vw, found[0].stage) == (0, 1)
    assert all(d.vw == 0 for d in found)


def test_unwatch_names_the_vw_in_the_result() -> None:
    w = watch()
    w.unwatch(0, "re-formed or left out after worker gpu1 was lost")
    assert w.detector.stages == {}
    js = SimpleNamespace(watch=w, plan=None)
    assert drift.result_of(js)["replan_unwatched"] == {
        "vw0": "re-formed or left out after worker gpu1 was lost"
    }


def head_side(w: Any) -> Any:
    js = SimpleNamespace(
        id="j-1", watch=w, plan=SimpleNamespace(minibatches_of=lambda _v: 1000), migrations=[]
    )
    return js


def test_a_refused_migration_leaves_the_split_and_says_so() -> None:
    w = watch(migrate=lambda d: None)
    before = w.layouts[0]
    (d,) = slowed(w, ticks=8)
    assert d.take and w.layouts[0] != before
    js = head_side(w)
    drift.migrated(js, 0, None, "vw0/stage0: minibatch 8 is behind this stage")
    assert w.layouts[0] == before  # the final plan is the split the job still runs
    assert drift.final_plan(js)[0]["layers"] == [[0, 6], [6, 11], [11, 16]]
    rec = w.records()[0]
    assert rec["taken"] is False and "the migration was refused: vw0/stage0" in rec["reason"]
    assert w.probes == []


def test_a_carried_out_migration_gets_its_measured_gain() -> None:
    w = watch(migrate=lambda d: None)
    (d,) = slowed(w, ticks=8)
    js = head_side(w)
    js.migrations.append({"event": "migration", "vw": 0, "at": 40})
    drift.migrated(js, 0, 40, None)
    log = SimpleNamespace(info=lambda *a, **k: None)
    drift.noted(js, (0, 0), {"forwards": 0})  # the head's hook takes the report's time
    assert w.pace.of(0)[0][1] == 0
    w.pace.seen.clear()
    # 10 per second until the boundary at 40, 16 per second after it
    for i in range(9):
        w.pace.note(0, 0.5 * i, 5 * i)
    for i in range(1, 4):
        w.pace.note(0, 4.0 + 0.5 * i, 40 + 8 * i)
    assert drift.gains(js, log) == []  # the span after the boundary (2 s) is not over
    for i in range(4, 7):
        w.pace.note(0, 4.0 + 0.5 * i, 40 + 8 * i)
    (got,) = drift.gains(js, log)
    assert got["event"] == "migration_gain" and got["measured_gain"] == 1.6
    assert js.migrations[0]["measured_gain"] == 1.6
    assert w.records()[0]["measured_gain"] == 1.6 and w.records()[0]["gain"] == round(d.gain, 4)
    assert drift.gains(js, log) == []  # measured once


def test_of_two_stages_only_the_slowed_one_drifts() -> None:
    """With two stages each one's reference is the other: one slowing down makes the other
    look as much faster. The one whose own time moved is the drifted one, whichever
    window comes first."""
    pred = {(0, 0): 0.010, (0, 1): 0.010}
    for slow, lag in [(0, 0), (0, 1), (1, 0), (1, 1)]:
        det = DriftDetector(pred, {(0, 0): "a", (0, 1): "b"}, [2], 1.5, 6)
        spent = dict.fromkeys(pred, 0.0)
        done = dict.fromkeys(pred, 0)
        seen = []
        for i in range(60):
            for key, t in pred.items():
                if key[1] == lag and i % 2:
                    continue  # one stage's reports come every other tick
                for _ in range(3):
                    done[key] += 1
                    spent[key] += t * (4.0 if key[1] == slow and i >= 20 else 1.0)
            report = {k: {"done": done[k], "forward_s": spent[k]} for k in pred}
            for d in det.observe(report, now=float(i)):
                seen.append(d)
                det.settle(d.vw)  # as the watch does once it decided
        assert [(d.stage, d.ratio > 1) for d in seen] == [(slow, True)], (slow, lag, seen)


def test_a_re_formed_vw_is_watched_again_on_its_new_devices() -> None:
    w = watch()
    w.unwatch(0, "re-formed or left out after worker gpu1 was lost")
    assert slowed(w) == []  # not watched meanwhile
    layout = VWLayout.from_counts([("gpu0",), ("gpu3",), ("gpu2",)], (6, 5, 5), 2)
    w.rewatch(0, layout, list(PRED.values()))
    assert w.unwatched == {} and w.layouts[0] == layout
    (d,) = slowed(w)
    assert (d.vw, d.stage, d.device) == (0, 1, "gpu3")
    w.rewatch(0, layout, [0.0, 0.0, 0.0])  # no prediction: nothing to compare with
    assert w.layouts[0] == layout
