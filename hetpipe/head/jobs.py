"""A job on the head, from queue to result: its record (:class:`JobState`) and its life cycle.

Jobs run one after another: planned on the live devices, launched (the initial weights to the
shards, an assignment to each stage's worker, then ``start``), followed until every stage is
done (a lost worker, a stage's error or a cancel ends it first), then finished: the global
weights gathered, evaluated and exported. Every change of state goes through
:func:`hetpipe.head.states.transition`.

:class:`JobsPart` is the part of :class:`hetpipe.head.server.Head` that runs them; it uses the
head's ``registry``, ``channel``, ``profiler``, ``cluster``, ``run_dir`` and ``log``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import shutil
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import zmq

from hetpipe import checkpoint
from hetpipe.core.schedule import ScheduleError
from hetpipe.head import drift
from hetpipe.head.evals import WorkerEvals, workers_evaluate
from hetpipe.head.reform import pushed_before_reforms
from hetpipe.head.registry import SHARD_TIMEOUT_S
from hetpipe.head.states import FINISHED, JobFailed, JobStatus, transition
from hetpipe.head.views import job_summary, job_view, metrics_line, telemetry
from hetpipe.job import JobError, JobSpec
from hetpipe.jobcheck import check_job
from hetpipe.jobdir import metrics_bytes
from hetpipe.jobplan import (
    JobPlan,
    JobPlanError,
    chunk_devices,
    device_memory_problem,
    one_stage_per_device,
    plan_job,
    requested_layouts,
    runs_several_stages,
    several_stage_summary,
)
from hetpipe.jobstore import (
    METRICS,
    RECORDS,
    STAGES,
    TRACE,
    job_dir,
    read_chunks,
    read_summaries,
    records_path,
    write_result,
    write_stages,
)
from hetpipe.metrics import Best, MetricError, best_rule, parse_every
from hetpipe.planner import PlanError
from hetpipe.profiling import live_cluster, plan_for, plan_inputs, predicted_summary
from hetpipe.ratelog import excerpt
from hetpipe.rotation import RotatingJsonl, Thinning
from hetpipe.security import worker_user
from hetpipe.trace import write_chrome_trace
from hetpipe.transport import RemoteError
from hetpipe.wire import Kind

__all__ = ["ASSIGN_TIMEOUT_S", "BEST_MODEL", "JobState", "JobsPart"]

ASSIGN_TIMEOUT_S = 120.0
BEST_MODEL = "model_best.pt"  # train.keep_best: the best evaluation's weights, beside model.pt

# a stage's checkpointed state: (meta, tensors)
StageState = tuple[dict[str, Any], dict[str, torch.Tensor]]


@dataclass
class JobState:
    """One submitted job, from queue to result."""

    id: str
    spec: JobSpec
    submitted: float
    # the user who submitted it (hetpipe.security.owner_of; ``local`` without Curve); None:
    # not recorded (a job recovered from a record older than owners), the admin's alone
    owner: str | None = None
    state: JobStatus = JobStatus.QUEUED
    error: str | None = None
    started: float | None = None
    finished: float | None = None
    plan: JobPlan | None = None
    progress: dict[tuple[int, int], dict[str, Any]] = field(default_factory=dict)
    stage_results: dict[tuple[int, int], dict[str, Any]] = field(default_factory=dict)
    result: dict[str, Any] = field(default_factory=dict)
    evals: list[list[float]] = field(default_factory=list)  # [seconds, minibatches, accuracy]
    # each evaluation (train.eval_every and the end): seconds, minibatches, wave, val_loss
    # and train.metrics' figures (hetpipe.metrics)
    validation: list[dict[str, Any]] = field(default_factory=list)
    best: Best | None = None  # train.keep_best / stop_after_no_gain: the best evaluation
    stopped: str | None = None  # why the job ended before its last minibatch (no gain)
    best_entry: dict[str, Any] = field(default_factory=dict)  # the evaluation ``best`` took
    worker_evals: WorkerEvals | None = None  # the passes on the workers (hetpipe.head.evals)
    diagnosis: list[str] = field(default_factory=list)  # what each stage waits for, if hung
    failure: asyncio.Future[str] | None = None
    all_done: asyncio.Event = field(default_factory=asyncio.Event)
    cancelled: bool = False  # the user asked; the job ends "cancelled", not "failed"
    lost_device: str | None = None  # set when the failure is a lost worker (may re-plan)
    replans: list[dict[str, Any]] = field(default_factory=list)  # what each re-plan did
    lost_shard: int | None = None  # set when the failure is a lost shard (may wait for it)
    waiting: dict[str, Any] | None = None  # what a paused job waits for (shardwait)
    shard_waits: list[dict[str, Any]] = field(default_factory=list)  # each pause, as it went
    watch: drift.Watch | None = None  # [replan]: drift detection and online re-plans
    migrations: list[dict[str, Any]] = field(default_factory=list)  # live (hetpipe.migrate)
    # on_worker_loss = "reform" (hetpipe.head.reform): each VW re-formed or left out, the VWs
    # being re-formed now (vw -> lost devices, reason, when) and the tasks doing it
    reforms: list[dict[str, Any]] = field(default_factory=list)
    reforming: dict[int, dict[str, Any]] = field(default_factory=dict)
    reform_tasks: list[asyncio.Task[None]] = field(default_factory=list)
    resume: checkpoint.Checkpoint | None = None  # submitted with --resume: start from it
    resumed_of: str | None = None  # the job this one continues (hetpipe.head.recovery)
    totals: tuple[int, ...] = ()  # minibatches each VW runs in the whole job
    lost: list[int] | None = None  # per VW, minibatches trained after the checkpoint resumed
    chunks: dict[tuple[int, int], Thinning] = field(default_factory=dict)  # record streams
    checkpoints: int = 0
    checkpoints_superseded: int = 0  # cuts not written: a newer one was ready first
    checkpoint_s: float = 0.0  # head time spent fetching cuts and writing checkpoints
    checkpoint_stage_s: float = 0.0  # stages' time taking their state (slowest, per cut)
    last_checkpoint: dict[str, Any] | None = None
    recovered: bool = False  # queued by a restarted head: wait for the cluster first
    # checkpointed state each stage of the next launch starts from
    restores: dict[tuple[int, int], StageState] = field(default_factory=dict)
    # stage states received for cuts not written yet: (vw, stage) -> wave -> state
    states: dict[tuple[int, int], dict[int, StageState]] = field(default_factory=dict)
    cut_next: int | None = None  # the next cut to write
    cut_asked: set[int] = field(default_factory=set)  # cuts asked for on demand (checkpoint)
    cut_queued: int = -1  # the newest cut handed to a writer
    cut_writes: list[asyncio.Task[None]] = field(default_factory=list)
    cut_lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one write at a time

    @property
    def wire_id(self) -> str:
        """The job's name on the wire: one per attempt, so that a stale activation, push or
        report of an attempt given up is never taken for the current one's."""
        return self.plan.job if self.plan is not None else self.id

    def move(self, to: JobStatus, error: str | None = None) -> None:
        """Go to state ``to`` (:func:`~hetpipe.head.states.transition` refuses a move the
        life cycle does not have), with the error the user reads, if any."""
        self.state = transition(self.state, to)
        if error is not None:
            self.error = error

    def start_attempt(self, plan: JobPlan) -> None:
        """Make ``plan`` the job's next attempt (after a re-plan or a lost shard's return):
        a fresh failure to race, and nothing of the last attempt's progress or results."""
        self.plan = plan
        self.failure = asyncio.get_running_loop().create_future()
        self.progress.clear()
        self.stage_results.clear()
        self.all_done = asyncio.Event()

    def fail(self, reason: str) -> None:
        """End the running attempt (its ``_race`` raises): a lost worker, an error, a cancel."""
        if self.failure is not None and not self.failure.done():
            self.failure.set_result(reason)

    def info(self) -> dict[str, Any]:
        """Plain data for ``job_status`` and the CLI (:func:`hetpipe.head.views.job_view`)."""
        return job_view(self)

    def summary(self) -> dict[str, Any]:
        """A few fields for listings (:func:`hetpipe.head.views.job_summary`)."""
        return job_summary(self)


class JobsPart:
    """The queue and the life cycle of jobs (a part of :class:`hetpipe.head.server.Head`)."""

    # -- queue ------------------------------------------------------------------------------

    def _new_id(self, name: str) -> str:
        """A job id not used by this head nor by any job in its run directory (a restarted
        head must not write over an earlier job's outputs and checkpoints)."""
        return f"{name}-{next(self._ids)}"  # the count starts after the jobs on disk

    def cancel(self, js: JobState) -> str | None:
        """Cancel ``js``: why it cannot be, or None (a queued job ends now, a running one
        as soon as its attempt stops)."""
        if js.state in FINISHED:
            return f"job {js.id} has already ended ({js.state})"
        js.cancelled = True
        if js.state == JobStatus.QUEUED:
            js.move(JobStatus.CANCELLED, "cancelled by the user")
            js.finished = time.time()
            self._retire(js)
        js.fail("cancelled by the user")
        self.log.info("job cancel requested", job=js.id)
        return None

    def job_dir(self, js: JobState) -> Path:
        """Where a job's outputs go: always under ``<run_dir>/jobs`` (names are validated at
        submit; :func:`hetpipe.jobstore.job_dir` refuses any id that is a path)."""
        d = job_dir(self.run_dir, js.id)  # None for anything that is not a job id
        if d is None:
            raise JobFailed(
                f"job id {excerpt(js.id, 80)!r} is not a job id: it would "
                f"write outside {self.run_dir / 'jobs'}"
            )
        return d.resolve()

    def metrics_file(self, js: JobState) -> RotatingJsonl:
        """The job's ``metrics.jsonl``, rotated by ``[runtime] metrics_max_bytes`` (lower
        where ``job_dir_max_bytes`` asks: :func:`hetpipe.jobdir.metrics_bytes`)."""
        rt = self.cluster.runtime
        size = metrics_bytes(rt.job_dir_max_bytes, rt.metrics_max_bytes, rt.log_keep)
        return RotatingJsonl(self.job_dir(js) / METRICS, size, rt.log_keep)

    def _record(self, js: JobState, **extra: Any) -> None:
        """``<job dir>/job.json``: the job's state as the head last knew it (atomic)."""
        path = self.job_dir(js) / "job.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        record = {"id": js.id, "owner": js.owner, "state": js.state.value, "error": js.error}
        record.update(extra)
        tmp.write_text(json.dumps(record))
        tmp.replace(path)

    def _retire(self, js: JobState) -> None:
        """A job has ended: its final status to disk, and old finished jobs out of memory.

        Only the last ``jobs_kept`` finished jobs stay in memory (with their per-stage
        progress, a job's status is kilobytes and a long-running head runs many); the
        others are answered from ``result.json``.
        """
        try:
            write_result(self.run_dir, js.id, js.info())
        except OSError as exc:
            self.log.warning("cannot write the job's result", job=js.id, error=str(exc))
        js.stage_results.clear()  # on disk in stages.json; the largest part of a job
        finished = [j for j in self.jobs.values() if j.state in FINISHED]
        for old in finished[: max(0, len(finished) - self.cluster.runtime.jobs_kept)]:
            if old is not self.current:
                del self.jobs[old.id]

    async def _run_jobs(self) -> None:
        while True:
            js = await self.queue.get()
            if js.state != JobStatus.QUEUED:
                continue
            self.current = js
            try:
                await self._run_job(js)
            except Exception as exc:  # a bug in one job must not stop the queue
                self.log.exception("job crashed", job=js.id)
                if js.state not in FINISHED:
                    js.move(JobStatus.FAILED, f"internal error: {exc}")
            finally:
                js.finished = js.finished or time.time()
                self.current = None
                self._retire(js)

    # -- one job ----------------------------------------------------------------------------

    async def _run_job(self, js: JobState) -> None:
        loop = asyncio.get_running_loop()
        js.failure = loop.create_future()
        if js.recovered:
            await self.registry.wait_complete(self.cluster.runtime.lost_after_s * 6)
            if js.state != JobStatus.QUEUED:  # cancelled while it waited
                return
        js.move(JobStatus.PLANNING)
        log = self.log.bind(job=js.id)
        try:
            await self._plan(js, log)
        except JobPlanError as exc:
            js.move(JobStatus.FAILED, str(exc))
            log.warning("job refused", error=str(exc))
            return
        if js.cancelled:  # cancelled while it was being planned
            js.move(JobStatus.CANCELLED, "cancelled by the user")
            return
        kept = False  # whether the ended job's records were folded (once, never twice)
        try:
            js.move(JobStatus.RUNNING)
            js.started = time.time()
            self._record(js)
            while True:
                try:
                    await self._run_attempt(js)
                    break
                except JobFailed as exc:
                    if self._may_wait_shard(js):  # a lost shard: wait for it, then resume
                        await self._wait_shard(js, str(exc))
                    elif self._may_replan(js):
                        await self._replan(js, str(exc))
                    else:
                        raise
            js.result = await self._race(js, self._finish(js))
            js.finished = time.time()
            js.move(JobStatus.DONE)
            log.info(
                "job done",
                accuracy=js.result.get("test_accuracy"),
                seconds=round(js.finished - js.started, 2),
            )
        except JobFailed as exc:
            await self._abort(js, str(exc))
            if not self._stopping:  # a stopping head has no time to spare: records/ stay
                # before the job is seen to end: what its stages streamed, kept and folded
                kept = True
                await self._keep_records(js)
            js.move(JobStatus.CANCELLED if js.cancelled else JobStatus.FAILED, str(exc))
            js.finished = time.time()
            log.warning("job failed", error=str(exc))
        finally:
            if not (kept or self._stopping or js.state == JobStatus.DONE):
                kept = True
                await self._keep_records(js)  # an unexpected error
            with contextlib.suppress(OSError, JobFailed):
                extra = {}
                if self._stopping and js.state == JobStatus.FAILED and not js.cancelled:
                    # the head stops under it: a later head resumes it (:meth:`_recover`)
                    extra["state"] = transition(js.state, JobStatus.INTERRUPTED).value
                self._record(js, **extra)
            self._drop_cuts(js)
            self._end_reforms(js)  # type: ignore[attr-defined]  # hetpipe.head.reform
            await self._drop_shards(js)
            self.registry.release(js.id)

    async def _plan(self, js: JobState, log: Any) -> None:
        """Plan ``js`` on the live devices (or check the user's split), and start it from
        its checkpoint where it resumes one; :class:`JobPlanError` where it cannot run."""
        loop = asyncio.get_running_loop()
        vws, predicted = None, None
        spec = js.spec
        try:  # the CLI checked this already; other clients may not have. Where the job's
            # code is loaded on the head: its model and data, built once for the whole job
            facts = await loop.run_in_executor(
                None, lambda: check_job(spec, self.cluster, "job", host="head")
            )
        except JobError as exc:
            raise JobPlanError(str(exc)) from None
        n_train = facts.n_train
        needs_plan = not spec.vws or any(v.layers is None for v in spec.vws)
        try:
            if runs_several_stages(spec):
                # its memory per stage is kept (peak_bytes is compared with it); its times
                # would be each stage's alone, so no drift is watched against them
                predicted = await self._check_several(spec, n_train)
                raise PlanError("a device runs several stages (the planner prices one a device)")
            profile, rows = await self.profiler.profiles(spec)
            cluster = live_cluster(self.cluster, self.registry.idle())
            plan = await loop.run_in_executor(
                None, lambda: plan_for(spec, cluster, profile, rows, n_train=n_train)
            )
            if spec.schedule == "auto":  # the planner chose: the job runs its choice
                spec = js.spec = dataclasses.replace(
                    spec, schedule=plan.schedule, nm=plan.vws[0].nm, warmup_forwards=plan.warmup
                )
                log.info("schedule chosen", why=plan.details.get("schedule_choice"))
            elif (
                spec.warmup_forwards is None
            ):  # train.warmup_forwards = "auto": the planner's order
                spec = js.spec = dataclasses.replace(spec, warmup_forwards=plan.warmup)
                log.info("warm-up chosen", warmup=plan.warmup)
            predicted = predicted_summary(plan)
            if needs_plan:
                vws = plan.run_layouts(spec.activations)
                log.info("planned", policy=plan.policy, vws=[v.devices for v in plan.vws])
            elif spec.activations == "auto":  # the user's split, the planner's policy
                vws = requested_layouts(spec, policies=plan.run_layouts(spec.activations))
        except (PlanError, JobFailed) as exc:
            if needs_plan:
                raise JobPlanError(f"cannot plan: {exc}") from None
            log.warning(
                "no prediction for this split" if predicted is None else "memory predicted only",
                error=str(exc),
            )
            if spec.warmup_forwards is None:  # nothing chose the order: 1F1B as published
                spec = js.spec = dataclasses.replace(spec, warmup_forwards=0)
        shards = self.registry.live_shards()
        alive = self.registry.alive()
        js.plan = await loop.run_in_executor(
            None,
            lambda: plan_job(
                spec,
                js.id,
                self.cluster,
                alive,
                shards,
                vws=vws,
                predicted=predicted,
                facts=facts,
            ),
        )
        if predicted is not None and not runs_several_stages(js.plan.spec):
            # [replan]: watched against the plan's predictions (not where a device runs
            # several stages, the planner's split included: those take no live migration)
            js.watch = drift.watch_for(  # decisions carried out by live migration
                spec,
                js.plan,
                cluster,
                profile,
                plan_inputs(spec, rows),
                migrate=lambda d, js=js: self.order_migration(js, d),  # type: ignore[attr-defined]
            )
        if js.resume is not None:
            self._restore(js, js.plan, js.resume)
            js.lost = self._lost_since(js.resume)
        else:
            js.totals = tuple(js.plan.minibatches_of(v) for v in range(len(js.plan.vws)))

    async def _check_several(self, spec: JobSpec, n_train: int | None) -> dict[str, Any] | None:
        """A job whose devices run several stages: each device's cap against its stages'
        predicted peaks together (:class:`JobPlanError`, one line, where they do not fit).
        The planner prices one stage per device, so it prices this split with clones of the
        repeated devices (:func:`hetpipe.jobplan.one_stage_per_device`), each stage's order
        projected from the job's real device count (:func:`hetpipe.jobplan.chunk_devices`).
        Returns that plan's figures with each stage on its own device
        (:func:`hetpipe.jobplan.several_stage_summary`): its memory per stage stands; its
        times would be each stage's alone. None where a device has no idle worker."""
        loop = asyncio.get_running_loop()
        live = live_cluster(self.cluster, self.registry.idle())
        if not {d for v in spec.vws for d in v.devices} <= {d.name for d in live.devices}:
            return None  # a device without an idle worker: plan_job says which, in one line
        profile, rows = await self.profiler.profiles(spec)
        one, cluster, home = one_stage_per_device(spec, live)
        devices = chunk_devices(spec)
        try:
            plan = await loop.run_in_executor(
                None,
                lambda: plan_for(
                    one, cluster, profile, rows, n_train=n_train, chunk_devices=devices
                ),
            )
        except ScheduleError as exc:  # an order the planner's simulator cannot time here
            raise PlanError(f"cannot price this split: {exc}") from None
        stages = [
            (f"vw{v}/stage{s}", st.device, int(st.memory.total))
            for v, vw in enumerate(plan.vws)
            for s, st in enumerate(vw.stages)
        ]
        problem = device_memory_problem(stages, home, self.cluster)
        if problem is not None:
            raise JobPlanError(problem)
        return several_stage_summary(predicted_summary(plan), home)

    async def _run_attempt(self, js: JobState) -> None:
        """Launch the job's current plan and follow it until every stage is done."""
        await self._race(js, self._launch(js))
        if js.replans and "resumed_s" not in js.replans[-1]:
            js.replans[-1]["resumed_s"] = round(time.monotonic() - js.replans[-1]["_t"], 2)
        watchers = [asyncio.ensure_future(telemetry(js, self.metrics_file(js), self.log))]
        waves, seconds = parse_every(js.spec.eval_every)
        seconds = seconds or js.spec.eval_every_s
        if waves or seconds:
            watchers.append(asyncio.ensure_future(self._evaluate_every(js, waves, seconds)))
        done = asyncio.ensure_future(js.all_done.wait())
        try:
            await self._race(js, done)
        finally:
            for w in watchers:
                w.cancel()
            js.diagnosis = []  # a diagnosis describes a running job only
        if js.stopped is not None:  # no gain: the workers drop the job; its weights stay
            await self._abort(js, js.stopped)

    async def _race(self, js: JobState, aw: Any) -> Any:
        """Await ``aw`` unless the job fails first (lost worker, stage error, cancel)."""
        assert js.failure is not None
        task = asyncio.ensure_future(aw)
        await asyncio.wait({task, js.failure}, return_when=asyncio.FIRST_COMPLETED)
        if js.failure.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            raise JobFailed(js.failure.result())
        try:
            return task.result()
        except (RemoteError, TimeoutError, ConnectionError, OSError) as exc:
            raise JobFailed(str(exc)) from None

    async def _launch(self, js: JobState) -> None:
        """Initial weights to the shards, assignments to the workers, then start."""
        plan = js.plan
        assert plan is not None and self.channel is not None
        # "vw/stage" -> the worker whose pushes count; "vw/stage/r" -> replica r, which may
        # pull the stage's weights but never push them (hetpipe.replicas)
        owners = {
            f"{v}/{s}" + (f"/{r}" if r else ""): worker_user(d)
            for v, vwp in enumerate(plan.vws)
            for s, st in enumerate(vwp.stages)
            for r, d in enumerate(st.devices)
        }
        for index, (members, weights) in plan.shard_contents().items():
            ch = await self.registry.shard(index)
            await ch.request(
                Kind.SHARD_INIT,
                {
                    "job": plan.job,
                    "members": members,
                    "staleness": js.spec.staleness,
                    "owners": owners,
                    "cut_every": js.spec.checkpoint_every,
                },
                weights,
                timeout=SHARD_TIMEOUT_S,
                what=f"shard {index}",
            )
        plan.release_initial_weights()
        # this attempt's stages stream their records afresh (as stage_results start empty)
        shutil.rmtree(self.job_dir(js) / RECORDS, ignore_errors=True)
        js.states.clear()
        js.cut_queued = -1
        js.cut_next = checkpoint.cut_after(
            0, js.spec.checkpoint_every, max(plan.waves(v) for v in range(len(plan.vws)))
        )
        workers = self.registry.workers
        waits = []
        named: set[str] = set()  # a worker of several stages is named by its first
        for task in plan.tasks(self.registry.shards, workers):
            w = workers[task.group[task.replica]]
            if w.device not in named:
                named.add(w.device)
                w.job, w.vw, w.stage = js.id, task.vw, task.stage
            tensors = plan.local_state(task.vw, task.stage)
            restore = js.restores.get((task.vw, task.stage))
            if restore is not None:  # a resumed attempt: the stage's checkpointed state
                task = dataclasses.replace(task, restore=restore[0])
                tensors = {**tensors, **restore[1]}
            waits.append(
                self.channel.request(
                    Kind.ASSIGN,
                    {"job": plan.job, "task": task.to_dict()},
                    tensors,
                    to=w.ident,
                    timeout=ASSIGN_TIMEOUT_S,
                    what=f"worker {w.device}",
                )
            )
        await asyncio.gather(*waits)
        js.restores = {}
        for w in workers.values():
            if w.job == js.id:
                await self.channel.send(Kind.START, {"job": plan.job}, to=w.ident)
        self.log.info("job started", job=js.id, stages=plan.n_stages)

    async def _finish(self, js: JobState) -> dict[str, Any]:
        """Gather global weights, evaluate and export them; return the job's result."""
        plan = js.plan
        assert plan is not None and js.started is not None
        # training time: the validation pass after it is not (timed at the first stage, which
        # ends its training last; the other stages pass its minibatches on meanwhile)
        first = js.stage_results.get((0, 0), {}).get("stats", {})
        train_s = time.time() - js.started - first.get("validation_s", 0.0)
        await self._cuts_written(js)  # the last checkpoint: the job's end
        state, clocks = await self._fetch_state(js)
        out_dir = self.job_dir(js)
        loop = asyncio.get_running_loop()
        done = (
            plan.total_minibatches + pushed_before_reforms(js.reforms, plan.job)
            if js.stopped is None
            else js.info().get("minibatches", 0)
        )
        try:
            figures, trained_bn = await loop.run_in_executor(
                None, plan.export_figures, state, out_dir
            )
        except MetricError as exc:
            raise JobFailed(str(exc)) from None
        accuracy = figures.get("accuracy")  # of model.pt: the result's test_accuracy
        # the validation pass the workers ran (virtual worker 0's last stage, on its weights
        # at its last wave: model.pt's); the head's figures of model.pt where none came (a
        # job stopped early, several async VWs) or where batch norm was re-estimated for it
        last = js.stage_results.get((0, len(plan.vws[0].stages) - 1), {})
        on_workers = last.get("stats", {}).get("validation")
        if js.stopped is not None or trained_bn is not None:  # model.pt's are not the VW's
            on_workers = None
        if on_workers:
            figures = dict(on_workers)
        wave = min(c.get("global", 0) for c in clocks.values()) if clocks else None
        on = "workers" if on_workers else "head"
        await self._took_figures(js, figures, train_s, done, wave, state, on)
        # each stage's records and spans streamed into the job's directory while it ran:
        # stages.json and the trace are written from there, a chunk at a time
        stages = {
            f"vw{v}/stage{s}": {
                **r,
                "replicas": list(plan.vws[v].stages[s].replicas),
                **drift.stage_record(js, v),
            }
            for (v, s), r in sorted(js.stage_results.items())
        }
        streams = {f"vw{v}/stage{s}": records_path(out_dir, v, s) for v, s in js.stage_results}
        devices = {f"vw{v}/stage{s}": plan.device_of(v, s) for v, s in js.stage_results}
        marks = drift.decisions_of(js)  # the trace's re-plan events
        summarised = await loop.run_in_executor(
            None, _write_outputs, out_dir, stages, streams, devices, js.id, False, marks
        )
        samples = done * js.spec.minibatch
        quality = {
            k: r["stats"].get("prediction_quality")
            for k, r in stages.items()
            if r["stats"].get("prediction_quality") is not None
        }
        return {
            **({"prediction_quality": quality} if quality else {}),
            # train.bn_recalibrate: the accuracy with the running statistics as trained
            **({"test_accuracy_trained_bn": trained_bn} if trained_bn is not None else {}),
            "status": JobStatus.DONE.value,
            "test_accuracy": accuracy,  # the final accuracy under its earlier name
            **figures,
            **self._best_result(js, out_dir),
            **({"stopped": js.stopped} if js.stopped is not None else {}),
            "samples_per_s": samples / train_s,
            "minibatches": done,
            "seconds": train_s,
            "model_path": str((out_dir / "model.pt").resolve()),
            "stages_path": str((out_dir / STAGES).resolve()),
            "trace_path": str((out_dir / TRACE).resolve()),
            "metrics_path": str((out_dir / METRICS).resolve()),
            "shard_clocks": clocks,
            "checkpoints": js.checkpoints,
            "checkpoints_superseded": js.checkpoints_superseded,
            "checkpoint_s": js.checkpoint_s,
            "checkpoint_stage_s": js.checkpoint_stage_s,
            **drift.result_of(js),  # the final plan and each re-plan decision
            # stages whose older records are summary windows (hetpipe.jobdir)
            **({"records_summarised": summarised} if summarised else {}),
        }

    async def _keep_records(self, js: JobState) -> None:
        """A job that ended without finishing (failed, cancelled, interrupted by a stopping
        head): its ``stages.json`` and trace written from what its stages streamed, and the
        streams kept in ``records/`` (what a resume or a post-mortem reads). Never raises: a
        failure here must not hide the job's own error."""
        plan = js.plan
        if plan is None:
            return
        try:
            out_dir = self.job_dir(js)
            keys = [(v, s) for v, vwp in enumerate(plan.vws) for s in range(len(vwp.stages))]
            streams = {f"vw{v}/stage{s}": records_path(out_dir, v, s) for v, s in keys}
            if not any(p.exists() for p in streams.values()):
                return
            stages = {
                f"vw{v}/stage{s}": {
                    # a stage that did not finish: its last progress report stands in
                    **js.stage_results.get((v, s), {"stats": dict(js.progress.get((v, s), {}))}),
                    "replicas": list(plan.vws[v].stages[s].replicas),
                    **drift.stage_record(js, v),
                }
                for v, s in keys
            }
            devices = {f"vw{v}/stage{s}": plan.device_of(v, s) for v, s in keys}
            loop = asyncio.get_running_loop()
            marks = drift.decisions_of(js)
            summarised = await loop.run_in_executor(
                None, _write_outputs, out_dir, stages, streams, devices, js.id, True, marks
            )
            js.result = {
                **js.result,
                **({"records_summarised": summarised} if summarised else {}),
                "stages_path": str((out_dir / STAGES).resolve()),
                "trace_path": str((out_dir / TRACE).resolve()),
                "records_path": str((out_dir / RECORDS).resolve()),
            }
        except Exception as exc:  # best effort: logged, never hides the job's own error
            self.log.warning("cannot write the ended job's records", job=js.id, error=str(exc))

    async def _fetch_state(self, js: JobState) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The job's global weights, gathered from its shards, and each shard's clocks."""
        assert js.plan is not None
        state: dict[str, torch.Tensor] = {}
        clocks = {}
        for index in js.plan.shards_used():
            ch = await self.registry.shard(index)
            reply = await ch.request(
                Kind.SHARD_FETCH,
                {"job": js.wire_id},
                timeout=SHARD_TIMEOUT_S,
                what=f"shard {index}",
            )
            state.update({k: v.clone() for k, v in reply.tensors.items()})
            clocks[str(index)] = reply.get("info")
        return state, clocks

    def _worker_evals(self, js: JobState) -> WorkerEvals:
        """The current attempt's :class:`~hetpipe.head.evals.WorkerEvals` (a new one for a
        new attempt)."""
        assert js.plan is not None
        ev = js.worker_evals
        if ev is None or ev.of is not js.plan:
            ev = js.worker_evals = WorkerEvals(len(js.plan.vws[0].stages), of=js.plan)
        return ev

    def _took_evaluation(
        self,
        js: JobState,
        key: tuple[int, int],
        evaluation: dict[str, Any],
        tensors: dict[str, torch.Tensor],
    ) -> None:
        """A stage's report of a validation pass while training (figures, or its weights for
        the best model): kept for :meth:`_evaluate_every` (:mod:`hetpipe.head.evals`)."""
        if js.plan is None or key[0] != 0 or not workers_evaluate(js.spec, js.plan):
            return
        try:
            self._worker_evals(js).took(key[1], evaluation, tensors)
        except ValueError as exc:
            self.log.warning("validation report refused", job=js.id, error=str(exc))

    async def _evaluate_every(self, js: JobState, waves: int, seconds: float | None) -> None:
        """Validation figures while the job trains, every ``waves`` waves (iterations) or
        every ``seconds`` (``train.eval_every``). A metric that raises fails the job, naming
        it.

        Where virtual worker 0's weights are the global ones (:func:`~hetpipe.head.evals.
        workers_evaluate`), its pipeline runs the passes on the workers at its wave
        boundaries (:mod:`hetpipe.evalpass`) and the figures are taken here as they come;
        else the head gathers the global weights from the shards at the global clock's
        boundaries (or every ``seconds``) and scores them on its copy of the model."""
        assert js.plan is not None and js.started is not None
        if workers_evaluate(js.spec, js.plan):
            ev = self._worker_evals(js)
            while True:
                item = await ev.queue.get()
                ev.taking = asyncio.ensure_future(self._took_pass(js, ev, item))
                await asyncio.shield(ev.taking)  # a job that ends meanwhile waits for it
                if js.stopped is not None:
                    js.all_done.set()  # a clean end: the workers drop the job
                    return
        js.worker_evals = None
        loop = asyncio.get_running_loop()
        next_wave = waves
        while True:
            if seconds:
                await asyncio.sleep(seconds)
            else:
                await asyncio.sleep(0.05)
                if js.info().get("global_clock", 0) < next_wave:
                    continue
            info = js.info()
            wave = info.get("global_clock", 0)
            if waves:
                next_wave = (wave // waves + 1) * waves
            state, _ = await self._fetch_state(js)
            try:
                figures = await loop.run_in_executor(None, js.plan.validate, state)
            except MetricError as exc:
                js.fail(str(exc))
                return
            await self._took_figures(
                js, figures, time.time() - js.started, info.get("minibatches", 0), wave, state
            )
            if js.stopped is not None:
                js.all_done.set()  # a clean end: _finish exports the weights evaluated last
                return

    async def _took_pass(self, js: JobState, ev: WorkerEvals, item: dict[str, Any]) -> None:
        """One pass's figures from the workers (:meth:`_took_figures`, ``on = "workers"``):
        the minibatches every virtual worker had trained at its boundary; the best model
        from the stages' weights of that boundary."""
        plan = js.plan
        assert plan is not None and js.started is not None
        c = item["wave"]
        done = sum(min(c * vw.nm, plan.minibatches_of(v)) for v, vw in enumerate(plan.vws))
        await self._took_figures(
            js,
            item["figures"],
            item["t"] - js.started,
            done,
            c,
            lambda: ev.state(c),
            "workers",
            item["seconds"],
        )

    async def _took_figures(
        self,
        js: JobState,
        figures: dict[str, float],
        seconds: float,
        done: int,
        wave: int | None,
        state: dict[str, torch.Tensor] | Callable[[], Awaitable[dict[str, torch.Tensor] | None]],
        on: str = "head",
        validation_s: float | None = None,
    ) -> None:
        """One evaluation's figures: into the job's status and ``metrics.jsonl``; the best
        model written where it improves ``train.keep_best``; the job told to stop after
        ``train.stop_after_no_gain`` evaluations without a gain. ``on``: where the figures
        were computed (``"workers"``: a validation pass through virtual worker 0's pipeline;
        ``"head"``: the global weights gathered from the shards). ``state``: the weights
        evaluated, or (a pass on the workers) how to get them, asked for only where they
        improve ``keep_best``; ``validation_s``: the pass's seconds at the last stage.

        The job's final figures (``state`` the weights themselves) come after every pass's
        the workers reported (:meth:`hetpipe.head.evals.WorkerEvals.drain`)."""
        assert js.plan is not None
        ev = js.worker_evals
        if ev is not None and not callable(state):  # the job's end: the passes' figures first
            for item in await ev.drain():
                await self._took_pass(js, ev, item)
            js.worker_evals = None  # no weights held past the job
        spec = js.spec
        entry = {"seconds": seconds, "minibatches": done, "wave": wave, "on": on, **figures}
        if validation_s is not None:
            entry["validation_s"] = validation_s
        js.validation.append(entry)
        if figures.get("accuracy") is not None or not figures:
            js.evals.append([seconds, done, figures.get("accuracy")])
        # a line of the telemetry's shape, with the figures
        self.metrics_file(js).append(metrics_line(js.info(), validation=entry))
        if not figures or not (spec.keep_best or spec.stop_after_no_gain):
            return
        if js.best is None:
            js.best = Best(*best_rule(spec.keep_best, spec.metrics))
        if js.best.offer(figures):
            js.best_entry = entry
            if spec.keep_best:
                if callable(state):
                    try:
                        state = await state()  # None: a later pass's weights supersede these
                    except TimeoutError as exc:
                        js.fail(str(exc))
                        return
                if state is not None:
                    loop = asyncio.get_running_loop()
                    await loop.run_in_executor(
                        None, js.plan.save_state, state, self.job_dir(js), BEST_MODEL
                    )
        elif (
            spec.stop_after_no_gain
            and js.best.since >= spec.stop_after_no_gain
            and js.stopped is None
            and not js.all_done.is_set()  # the job's end: nothing left to stop
        ):
            js.stopped = (
                f"no gain in {js.best.name} for {js.best.since} evaluations "
                f"(train.stop_after_no_gain = {spec.stop_after_no_gain}; best "
                f"{js.best.value:.6g})"
            )
            self.log.info("job stops early", job=js.id, why=js.stopped)

    def _best_result(self, js: JobState, out_dir: Path) -> dict[str, Any]:
        """The result's ``best`` (the best evaluation, its metric and the model's path)."""
        if js.best is None or js.best.value is None:
            return {}
        out: dict[str, Any] = {
            "best": {"metric": js.best.name, "value": js.best.value, **js.best_entry}
        }
        if js.spec.keep_best:
            out["best_model_path"] = str((out_dir / BEST_MODEL).resolve())
        return out

    async def _abort(self, js: JobState, reason: str) -> None:
        """Tell the live workers of ``js`` to drop it."""
        assert self.channel is not None
        for w in self.registry.workers.values():
            if w.job == js.id and not w.lost:
                with contextlib.suppress(ConnectionError, zmq.ZMQError):
                    await self.channel.send(
                        Kind.ABORT, {"job": js.wire_id, "reason": reason}, to=w.ident
                    )

    async def _drop_shards(self, js: JobState) -> None:
        """Tell the shards of ``js`` to drop its state (the lost ones are skipped)."""
        if js.plan is None:
            return
        for index in js.plan.shards_used():
            if index in self.registry.shards_lost:
                continue  # nothing to drop there, and no answer to wait for
            with contextlib.suppress(Exception):
                ch = await self.registry.shard(index)
                await ch.request(
                    Kind.SHARD_DROP, {"job": js.wire_id}, timeout=10.0, what=f"shard {index}"
                )


def _write_outputs(
    out_dir: Path,
    stages: dict[str, dict[str, Any]],
    streams: dict[str, Path],
    devices: dict[str, str],
    job: str,
    keep: bool = False,
    marks: Sequence[dict[str, Any]] = (),
) -> dict[str, dict[str, Any]]:
    """A job's ``stages.json`` and trace from its stages' streams; a finished job's streams
    are then dropped (both files hold all they held), an ended one's ``keep`` them. Returns
    the range each compacted stream summarises (:mod:`hetpipe.jobdir`)."""
    summarised = write_stages(out_dir, {where: (r, streams[where]) for where, r in stages.items()})
    write_chrome_trace(
        out_dir / TRACE,
        {
            where: (lambda p=p: (s for c in read_chunks(p) for s in c["spans"]))
            for where, p in streams.items()
        },
        devices,
        job,
        marks,
        {where: read_summaries(streams[where]) for where in summarised},
    )
    if not keep:
        shutil.rmtree(out_dir / RECORDS, ignore_errors=True)
    return summarised
