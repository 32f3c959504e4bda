"""Drift detection on the head: a virtual worker whose stage runs slower (or faster) than its
plan said, and the re-plan decided for it (``[replan]``, :mod:`hetpipe.planner.online`).

**What is compared.** Each stage reports, with its progress, the minibatches it has done and
the time its forwards and backwards took (``done``, ``forward_s``, ``backward_s``); the plan
predicted that time per minibatch (``time_s`` of each stage in the plan's ``predicted``).
Over a window of ``window`` minibatches (spanning ``window_s`` seconds at least) the stage's
measured / predicted ratio is taken.

**Warm-up and the settled ratio.** A stage's first minibatches pay for allocations and
first calls, and a plan's prediction is off by a constant of its own (the host shares its
cores, the profile was measured under another load). So no ratio counts before the stage
has done its VW's Nm plus one window of minibatches; the next window's ratio is the stage's
*settled* ratio, and drift is the ratio over the latest window departing from the settled
one by more than ``threshold`` (either way). The drift's ``ratio`` (current / settled) is
what the drifted device's profile is scaled by for the re-plan.

**After a decision.** A refused decision acknowledges the drift: the stages of that VW
settle again at what they measure now, so one slowdown makes one decision, not one per
telemetry tick. A decision handed to live migration (the ``migrate`` hook, which the head sets to
:meth:`hetpipe.head.migration.MigrationPart.order_migration`; without one, a decision is
recorded as not carried out) changes the VW's split: its stages are
watched anew against the new split's predicted times, after a new warm-up.

:class:`DriftDetector` is pure (it reads progress dicts); :class:`Watch` adds the re-plan and
the records; :func:`watch_for` and :func:`tick` are the head's hooks (its plan step and its
telemetry loop).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hetpipe.core.layout import VWLayout
from hetpipe.head.gain import GainProbe, Pace
from hetpipe.planner.online import Decision, replan

if TYPE_CHECKING:
    from hetpipe.core.profile import ModelProfile
    from hetpipe.job import ReplanSpec
    from hetpipe.planner.plans import PlanInputs

__all__ = [
    "Drift",
    "DriftDetector",
    "Watch",
    "decisions_of",
    "final_plan",
    "gains",
    "migrated",
    "noted",
    "result_of",
    "stage_record",
    "tick",
    "watch_for",
]

NO_MIGRATION = "not carried out: this head cannot migrate layers between live stages"
# the samples kept per stage: enough to span a window at any report rate
_HISTORY = 256


@dataclass(frozen=True)
class Drift:
    """Stage ``stage`` of virtual worker ``vw`` (on ``device``) runs ``ratio`` times the
    time it settled at, relative to its plan: ``measured_s`` per minibatch over the last
    window against ``predicted_s``; ``minibatch``: the stage's minibatches done then."""

    vw: int
    stage: int
    device: str
    ratio: float
    measured_s: float
    predicted_s: float
    minibatch: int


@dataclass
class _Stage:
    """One stage's samples ``(done, compute seconds)``, where its settled span begins
    (``anchor``) and, while a change awaits confirmation, where it was first seen."""

    predicted_s: float
    warmup: int  # minibatches done before anything counts (from ``start``)
    start: int = 0  # minibatches done when this watch (re)began
    # (minibatches done, compute seconds, when it was taken: time.monotonic())
    samples: deque[tuple[int, float, float]] = field(default_factory=lambda: deque(maxlen=_HISTORY))
    anchor: tuple[int, float] | None = None  # the first sample past the warm-up
    # while a change awaits confirmation: the minibatches done when the ratio first crossed
    # the threshold, and where that window began (the settled span ends there)
    suspect: tuple[int, int] | None = None

    def spent_at(self, done: int) -> float | None:
        """The compute seconds reported at ``done`` minibatches (None: not kept)."""
        for d, s, _ in reversed(self.samples):
            if d == done:
                return s
            if d < done:
                return None
        return None


def _median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


class DriftDetector:
    """Per stage, the measured / predicted ratio over the latest window against its settled
    ratio (the mean since the warm-up), and that relative to the job's other stages.

    The host's load moves every stage at once (emulated devices share its cores; a real
    host's data loading and network are shared too), so each stage's change is divided by
    the median change of the job's other stages: a common slowdown is no drift of a device
    and a device's own change stands out. ``predicted[(vw, stage)]``: the plan's compute
    seconds per minibatch; ``devices``: each stage's device; ``nms[vw]``: each VW's Nm (its
    warm-up)."""

    def __init__(
        self,
        predicted: Mapping[tuple[int, int], float],
        devices: Mapping[tuple[int, int], str],
        nms: Sequence[int],
        threshold: float,
        window: int,
        window_s: float = 0.0,
    ) -> None:
        self.threshold = threshold
        self.window = window
        self.window_s = window_s
        self.devices = dict(devices)
        self.stages = {
            key: _Stage(t, nms[key[0]] + window) for key, t in predicted.items() if t > 0
        }

    def restart(self, vw: int, predicted: Sequence[float], nm: int, done: int = 0) -> None:
        """Watch ``vw``'s stages anew against ``predicted`` (a new split), after a warm-up
        counted from ``done`` minibatches."""
        for s, t in enumerate(predicted):
            if t > 0:
                self.stages[(vw, s)] = _Stage(t, nm + self.window, start=done)

    def forget(self, vw: int) -> None:
        """Watch ``vw``'s stages no more (its VW left the job or was re-formed); the others'
        detection goes on, their changes no longer measured against its stages'."""
        for key in [k for k in self.stages if k[0] == vw]:
            del self.stages[key]

    def settle(self, vw: int) -> None:
        """Settle each stage of ``vw`` again from now on (a drift seen and decided on: what
        it measures from now on is the new normal)."""
        for (v, _), st in self.stages.items():
            if v == vw:
                st.anchor, st.suspect, st.warmup = None, None, 0
                st.start = st.samples[-1][0] if st.samples else st.start

    def _window(self, st: _Stage, floor: int) -> tuple[int, float] | None:
        """``(first minibatch, measured / predicted)`` of the latest window that starts at
        ``floor`` minibatches or later; None before one is complete."""
        if not st.samples:
            return None
        done, spent, now = st.samples[-1]
        for d, s, t in reversed(st.samples):
            if done - d >= self.window and now - t >= self.window_s:
                if d < floor:
                    return None  # the window reaches back before the floor
                return d, (spent - s) / (done - d) / st.predicted_s
        return None

    def _settled(self, st: _Stage, until: int) -> float | None:
        """Measured / predicted from the anchor to ``until`` minibatches (at least a
        window of them), None before that."""
        if st.anchor is None or until - st.anchor[0] < self.window:
            return None
        spent = st.spent_at(until)
        if spent is None:
            return None
        return (spent - st.anchor[1]) / (until - st.anchor[0]) / st.predicted_s

    def _take(self, progress: Mapping[tuple[int, int], Mapping[str, Any]], now: float) -> None:
        """Append each stage's new report to its samples."""
        for key, st in self.stages.items():
            report = progress.get(key)
            if not report or not report.get("done"):
                continue
            done = int(report["done"])
            spent = float(report.get("forward_s", 0.0)) + float(report.get("backward_s", 0.0))
            if st.samples and st.samples[-1][0] == done:
                continue
            if st.samples and done < st.samples[-1][0]:  # a restarted stage counts anew
                st.samples.clear()
                st.anchor, st.suspect, st.start = None, None, 0
            st.samples.append((done, spent, now))

    def _changes(self) -> dict[tuple[int, int], tuple[int, float, float]]:
        """Per stage: ``(first minibatch of its window, change, settled ratio)``, the change
        being the window's ratio / the settled one (the settled span ends where a change
        awaiting confirmation began)."""
        out = {}
        for key, st in self.stages.items():
            w = self._window(st, st.start + st.warmup)
            if w is None:
                continue
            if st.anchor is None:
                spent = st.spent_at(w[0])
                st.anchor = (w[0], spent) if spent is not None else None
                continue
            settled = self._settled(st, w[0] if st.suspect is None else st.suspect[1])
            if settled:
                out[key] = (w[0], w[1] / settled, settled)
        return out

    def _drifts(self, rel: float) -> bool:
        return rel > self.threshold or rel < 1.0 / self.threshold

    def _own(self, change: float, rel: float) -> bool:
        """Whether a stage's drift relative to the others (``rel``) is its own: its time
        itself moved the same way, by the threshold's square root at least (half of it in
        log terms). With few stages the others' median is one stage, so one device slowing
        down makes the other look as much faster; that one's own time did not move (or
        moved the other way, where the host slowed everything), so it is not the drifted
        one."""
        half = math.sqrt(self.threshold)
        return change >= half if rel > 1.0 else change <= 1.0 / half

    def observe(
        self, progress: Mapping[tuple[int, int], Mapping[str, Any]], now: float | None = None
    ) -> list[Drift]:
        """Take each stage's latest report (``now``: when, on a monotonic clock); the drifts
        seen now, at most one per virtual worker (its stage furthest from its settled
        ratio)."""
        self._take(progress, time.monotonic() if now is None else now)
        changes = self._changes()
        worst: dict[int, Drift] = {}
        for key, (first, change, settled) in changes.items():
            st = self.stages[key]
            others = [c for k, (_, c, _) in changes.items() if k != key]
            common = _median(others) if others else 1.0
            done = st.samples[-1][0]
            if st.suspect is None:
                # a window partly before the change: confirmed (and measured) on the next
                # window wholly after it, so a spike is no drift and the ratio is the new one
                st.suspect = (done, first) if self._drifts(change / common) else None
                continue
            w = self._window(st, st.suspect[0])
            if w is None:
                continue
            st.suspect = None
            rel = w[1] / settled / common
            if not self._drifts(rel) or not self._own(w[1] / settled, rel):
                continue
            vw, stage = key
            d = Drift(
                vw,
                stage,
                self.devices.get(key, "?"),
                rel,
                w[1] * st.predicted_s,
                st.predicted_s,
                done,
            )
            old = worst.get(vw)
            if old is None or abs(math.log(rel)) > abs(math.log(old.ratio)):
                worst[vw] = d
        return [worst[v] for v in sorted(worst)]


class Watch:
    """One job's drift watch: detection, the re-plan and the decisions' records.

    ``migrate(decision)``: hands a decision to live migration and returns None once it has
    taken it, or why it cannot (the decision is then recorded as not carried out); None:
    no migration on this head."""

    def __init__(
        self,
        spec: ReplanSpec,
        layouts: Sequence[VWLayout],
        predicted: Mapping[tuple[int, int], float],
        cluster: Any,
        profile: ModelProfile,
        inputs: PlanInputs,
        *,
        pick_nm: bool,
        schedule: str,
        migrate: Callable[[Decision], str | None] | None = None,
    ) -> None:
        self.spec = spec
        self.layouts = list(layouts)
        self.cluster = cluster
        self.profile = profile
        self.inputs = inputs
        self.pick_nm = pick_nm
        self.schedule = schedule
        self.migrate = migrate
        devices = {
            (v, s): st.device for v, lay in enumerate(layouts) for s, st in enumerate(lay.stages)
        }
        self.detector = DriftDetector(
            predicted,
            devices,
            [lay.nm for lay in layouts],
            spec.threshold,
            spec.window,
            spec.window_s,
        )
        self.decisions: list[Decision] = []
        self.drifts: list[Drift] = []
        self.stopped: str | None = None  # why the watch gave up (an unexpected error)
        self.unwatched: dict[int, str] = {}  # VWs no longer watched, and why
        # a decision handed to migration, until its outcome comes (:meth:`migrated`): the
        # VW -> its index in ``decisions``, the split before and its predicted stage times
        self.handed: dict[int, tuple[int, VWLayout, list[float]]] = {}
        self.pace = Pace()  # each VW's first stage's admissions over time (hetpipe.head.gain)
        self.probes: list[tuple[int, GainProbe]] = []  # migrations carried out, unmeasured

    def unwatch(self, vw: int, why: str) -> None:
        """Stop watching ``vw`` alone: the other VWs stay watched and re-planned (its
        migration under way, if any, and its gain's measurement go with it)."""
        self.detector.forget(vw)
        self.unwatched[vw] = why
        self.handed.pop(vw, None)
        self.probes = [(i, p) for i, p in self.probes if p.vw != vw]

    def tick(
        self, progress: Mapping[tuple[int, int], Mapping[str, Any]], now: float | None = None
    ) -> list[Decision]:
        """Take the stages' latest reports; the decisions made now (each logged by the
        caller, recorded here)."""
        made = []
        for drift in self.detector.observe(progress):
            self.drifts.append(drift)
            d = self.decide(drift, time.time() if now is None else now)
            made.append(d)
        return made

    def decide(self, drift: Drift, now: float) -> Decision:
        """The re-plan for ``drift``, carried out where migration takes it."""
        d = replan(
            self.cluster,
            self.profile,
            self.layouts,
            self.inputs,
            drift.vw,
            drift.device,
            drift.ratio,
            min_gain=self.spec.min_gain,
            pick_nm=self.pick_nm,
            schedule=self.schedule,
        )
        d = dataclasses.replace(d, at=now, minibatch=drift.minibatch)
        before = self.layouts[drift.vw]
        was = [
            st.predicted_s if (st := self.detector.stages.get((drift.vw, s))) else 0.0
            for s in range(len(before.stages))
        ]
        if d.take:
            why = NO_MIGRATION if self.migrate is None else self.migrate(d)
            if why is not None:
                d = dataclasses.replace(d, take=False, reason=f"{d.reason}; {why}")
        if d.take and d.layout is not None:
            self.handed[drift.vw] = (len(self.decisions), before, was)
            self.layouts[drift.vw] = d.layout
            predicted = d.details.get("stage_times") or ()
            self.detector.restart(drift.vw, predicted, d.layout.nm, drift.minibatch)
        else:
            self.detector.settle(drift.vw)
        self.decisions.append(d)
        return d

    def rewatch(self, vw: int, layout: VWLayout, predicted: Sequence[float]) -> None:
        """Watch ``vw`` again, re-formed on ``layout`` after a lost worker, against its new
        stages' ``predicted`` compute per minibatch (from a new warm-up); without a
        prediction it stays unwatched."""
        self.layouts[vw] = layout
        if not any(t > 0 for t in predicted):
            return
        self.unwatched.pop(vw, None)
        self.detector.forget(vw)
        self.detector.devices.update({(vw, s): st.device for s, st in enumerate(layout.stages)})
        self.detector.restart(vw, predicted, layout.nm)

    def note(self, vw: int, stage: int, stats: Mapping[str, Any], now: float) -> None:
        """A stage's progress report: the first stage's admissions time the gain."""
        if stage == 0:
            self.pace.note(vw, now, int(stats.get("forwards") or 0))

    def migrated(self, vw: int, at: int | None, refusal: str | None, total: int) -> None:
        """The outcome of the migration the decision handed to it for ``vw``: refused, the
        VW keeps its split (watched against it again, its decision marked not carried
        out); carried out at boundary ``at`` of ``total`` minibatches, its gain is measured
        (:mod:`hetpipe.head.gain`)."""
        handed = self.handed.pop(vw, None)
        if handed is None:
            return
        i, before, was = handed
        d = self.decisions[i]
        if refusal is not None or at is None:
            self.layouts[vw] = before
            self.detector.restart(vw, was, before.nm, d.minibatch)
            why = f"the migration was refused: {refusal}"
            self.decisions[i] = dataclasses.replace(d, take=False, reason=f"{d.reason}; {why}")
            return
        # two windows: the drift was seen over one and confirmed over the next, so the span
        # before the boundary is slowed throughout
        span = max(2.0 * self.spec.window_s, 2.0)
        self.probes.append((i, GainProbe(vw, at, before.nm, total, d.gain, span)))

    def measured(self) -> list[dict[str, Any]]:
        """The gains measured since the last call (each also on its decision)."""
        out = []
        for i, probe in list(self.probes):
            got = probe.measure(self.pace.of(probe.vw))
            if got is None:
                continue
            self.probes.remove((i, probe))
            self.decisions[i] = dataclasses.replace(
                self.decisions[i], measured_gain=got["measured_gain"]
            )
            out.append(got)
        return out

    def records(self) -> list[dict[str, Any]]:
        """Every decision as plain data, with its one-line summary."""
        return [{**d.to_dict(), "line": d.line()} for d in self.decisions]


# -- the head's hooks ----------------------------------------------------------------------


def watch_for(
    spec: Any,
    plan: Any,
    cluster: Any,
    profile: ModelProfile,
    inputs: PlanInputs,
    migrate: Callable[[Decision], str | None] | None = None,
) -> Watch | None:
    """The watch of a job about to run (its :class:`~hetpipe.jobplan.JobPlan` ``plan``,
    planned on ``cluster`` from ``profile`` with ``inputs``), or None where ``[replan]``
    is off or the plan has no predicted stage times to compare with. ``migrate``: what
    carries a decision out (:class:`Watch`); a live migration keeps Nm, so with one the
    re-plan never changes it."""
    if not spec.replan.enabled:
        return None
    vws = (plan.predicted or {}).get("vws") or []
    if len(vws) != len(plan.vws):
        return None
    predicted = {
        (v, s): float(st.get("time_s") or 0.0)
        for v, vw in enumerate(vws)
        for s, st in enumerate(vw.get("stages", []))
    }
    if not any(predicted.values()):
        return None
    return Watch(
        spec.replan,
        plan.vws,
        predicted,
        cluster,
        profile,
        inputs,
        migrate=migrate,
        pick_nm=migrate is None and spec.nm is None and not any(v.nm for v in spec.vws),
        schedule=spec.schedule,
    )


def tick(js: Any, log: Any) -> list[dict[str, Any]]:
    """The telemetry loop's hook: a running job's new decisions, each logged in one line,
    as the records the metrics file takes (empty where the job has no watch)."""
    watch = getattr(js, "watch", None)
    if watch is None or watch.stopped is not None:
        return []
    out = []
    try:
        made = watch.tick(js.progress)
    except Exception as exc:  # a bug here must never stop the job's telemetry
        watch.stopped = f"{type(exc).__name__}: {exc}"
        log.warning("replan watch stopped", job=js.id, error=watch.stopped)
        return []
    for d in made:
        (log.info if d.take else log.warning)("replan", job=js.id, decision=d.line())
        out.append({**d.to_dict(), "line": d.line()})
    return out


def noted(js: Any, key: tuple[int, int], stats: Mapping[str, Any]) -> None:
    """The head's hook for each stage report of a running job (the gain's pace)."""
    watch = getattr(js, "watch", None)
    if watch is not None:
        watch.note(key[0], key[1], stats, time.time())


def migrated(js: Any, vw: int, at: int | None, refusal: str | None) -> None:
    """The head's hook for a migration's outcome (:meth:`Watch.migrated`)."""
    watch = getattr(js, "watch", None)
    if watch is not None and js.plan is not None:
        watch.migrated(vw, at, refusal, js.plan.minibatches_of(vw))


def gains(js: Any, log: Any) -> list[dict[str, Any]]:
    """The telemetry loop's hook: the migrations' gains measured now, each logged in one
    line and put on the job's migration entry, as the records the metrics file takes."""
    watch = getattr(js, "watch", None)
    if watch is None or watch.stopped is not None:
        return []
    out = []
    for got in watch.measured():
        log.info("migration gain", job=js.id, **got)
        for entry in js.migrations:
            if entry.get("vw") == got["vw"] and entry.get("at") == got["at"]:
                entry["measured_gain"] = got["measured_gain"]
        out.append({"event": "migration_gain", "time": time.time(), **got})
    return out


def decisions_of(js: Any, vw: int | None = None) -> list[dict[str, Any]]:
    """A job's decisions (those of virtual worker ``vw`` only, where given)."""
    watch = getattr(js, "watch", None)
    if watch is None:
        return []
    return [r for r in watch.records() if vw is None or r["vw"] == vw]


def stage_record(js: Any, vw: int) -> dict[str, Any]:
    """What a stage's entry in ``stages.json`` says of its virtual worker's re-plans."""
    found = decisions_of(js, vw)
    return {"replans": found} if found else {}


def final_plan(js: Any) -> list[dict[str, Any]]:
    """The split each virtual worker ends with: its stages' devices and layers, its Nm."""
    watch = getattr(js, "watch", None)
    layouts = watch.layouts if watch is not None else (js.plan.vws if js.plan else ())
    return [
        {
            "vw": v,
            "devices": [list(st.devices) for st in lay.stages],
            "layers": [[st.first, st.last] for st in lay.stages],
            "nm": lay.nm,
        }
        for v, lay in enumerate(layouts)
    ]


def result_of(js: Any) -> dict[str, Any]:
    """The job result's part of this module: the final plan, and each decision."""
    found = decisions_of(js)
    watch = getattr(js, "watch", None)
    unwatched = {f"vw{v}": why for v, why in sorted(watch.unwatched.items())} if watch else {}
    return {
        "final_plan": final_plan(js),
        **({"replan_decisions": found} if found else {}),
        **({"replan_unwatched": unwatched} if unwatched else {}),
    }
