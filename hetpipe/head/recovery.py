"""Recovery: resuming a job from a checkpoint, re-planning it when a worker is lost, and
queueing again, after a restart of the head, the jobs the previous head was running.

``submit --resume`` (and a restarted head, by itself) starts a job from its last complete
checkpoint: the shards get the cut, each stage its local weights and optimizer state, each
virtual worker its data position (:func:`resume_plan`, :func:`stage_restores`). With
``train.on_worker_loss = "replan"`` a lost worker starts a new *attempt* of the job on the
live devices, from the last checkpoint where there is one; each attempt has its own wire id
(``<job>.r<n>``), so nothing an abandoned attempt still sends is taken for the current one's.
An attempt counts waves from 0 on fresh shard clocks; its stages read data from their
virtual worker's position on.

:class:`RecoveryPart` is the part of :class:`hetpipe.head.server.Head` that does it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from hetpipe import checkpoint
from hetpipe.head.jobs import JobState, StageState
from hetpipe.head.registry import SHARD_TIMEOUT_S
from hetpipe.head.states import FINISHED, JobFailed, JobStatus, transition
from hetpipe.job import JobError, JobSpec
from hetpipe.jobplan import JobPlan, JobPlanError, plan_job
from hetpipe.jobstore import job_dir, read_result, safe_name, update_result
from hetpipe.planner import PlanError
from hetpipe.profiling import live_cluster, plan_for, predicted_summary
from hetpipe.ratelog import excerpt
from hetpipe.security import CodeError, check_code
from hetpipe.transport import RemoteError

__all__ = [
    "MAX_REPLANS",
    "RecoveryPart",
    "lost_since",
    "restart_from_global",
    "resume_plan",
    "stage_restores",
]

MAX_REPLANS = 3  # a job re-planned this often without finishing fails


# -- pure: what a plan starts from ------------------------------------------------------------


def stage_restores(
    plan: JobPlan, ck: checkpoint.Checkpoint, same_vws: bool
) -> dict[tuple[int, int], StageState]:
    """What each stage of ``plan`` starts from (see :func:`resume_plan`)."""
    old: dict[int, list[tuple[str, dict[str, Any]]]] = {}
    for name, info in ck.meta.get("stages", {}).items():
        if name in ck.stages:
            old.setdefault(int(info["vw"]), []).append((name, info))
    out = {}
    for v, vw in enumerate(plan.vws):
        source = old.get(v if same_vws else 0, [])
        for s, st in enumerate(vw.stages):
            held = set(plan.stage_names(v, s))  # a tie's copy included
            if not held:
                continue
            exact = next(
                (
                    n
                    for n, info in source
                    if same_vws and (info["first"], info["last"]) == (st.first, st.last)
                ),
                None,
            )
            if exact is not None:
                info = dict(ck.meta["stages"][exact]["meta"])
                out[(v, s)] = ({**info, "weights": True}, ck.stages[exact])
                continue
            tensors: dict[str, torch.Tensor] = {}
            steps: dict[str, int] = {}
            optimizer = None
            for name, info in source:
                for key, t in ck.stages[name].items():
                    if not key.startswith("opt/"):
                        continue
                    param = key.split("/", 2)[2]
                    if param in held:
                        tensors[key] = t
                        steps[param] = int(info["meta"].get("opt_steps", {}).get(param, 0))
                        optimizer = info["meta"].get("optimizer")
            meta: dict[str, Any] = {"weights": False, "opt_steps": steps}
            if optimizer is not None:
                meta["optimizer"] = optimizer
            data = [i["meta"].get("data") for _, i in source if s == 0 and int(i["stage"]) == 0]
            if same_vws and data and data[0] is not None:  # its stream's position there
                meta["data"] = data[0]  # (hetpipe.data.stream)
            out[(v, s)] = (meta, tensors)
    return out


def resume_plan(
    plan: JobPlan, ck: checkpoint.Checkpoint, sync: bool
) -> tuple[tuple[int, ...], dict[tuple[int, int], StageState], list[int]]:
    """Start ``plan`` from checkpoint ``ck``: the shards from its cut of the global weights
    (``plan.initial``), every virtual worker from its data position (``plan.starts``, and
    what it still owes), every stage from its state. Returns the minibatches each VW runs in
    the whole job, each stage's state to start from, and what each VW owes.

    A stage of the same virtual worker with the same layers as in the checkpoint's plan
    takes its whole state (local weights, buffers, optimizer state). A stage whose layers
    moved (a re-plan, another split) takes its weights from the shards' cut, as at a
    job's start, and the optimizer state of each of its parameters from the stage of the
    same virtual worker that held it (of virtual worker 0 where the count of virtual
    workers changed). With another count of virtual workers the data is sharded
    differently: each one starts at the smallest position of the old ones. A synchronous
    job (``sync``) keeps its iterations aligned: every VW runs VW 0's count.
    """
    assert plan.initial is not None
    missing = sorted(set(plan.initial) - set(ck.state))
    if missing:
        raise JobPlanError(f"checkpoint {ck.path} has no {missing[:3]}: another model?")
    plan.initial = {k: ck.state[k] for k in plan.initial}
    meta = ck.meta
    n = len(plan.vws)
    done = int(meta.get("minibatches_done", 0))
    positions = [int(x) for x in meta.get("positions", [done])]
    totals = [int(x) for x in meta.get("totals", [meta.get("minibatches_total", plan.minibatches)])]
    same = len(positions) == n and len(totals) == n
    starts = tuple(positions) if same else (min(positions),) * n
    job_totals = tuple(totals) if same else (totals[0],) * n
    owed = [t - p for t, p in zip(job_totals, starts, strict=True)]
    if max(owed) <= 0:
        raise JobPlanError(
            f"checkpoint {ck.path} is the end of job {meta.get('job')}: "
            f"it has nothing left to train"
        )
    plan.starts = starts
    if sync:
        plan.minibatches = max(1, owed[0])
    else:
        plan.owed = tuple(max(1, o) for o in owed)
    return job_totals, stage_restores(plan, ck, same), owed


def restart_from_global(
    plan: JobPlan,
    state: dict[str, torch.Tensor],
    positions: Sequence[int],
    total: int,
    sync: bool,
) -> tuple[int, ...]:
    """Start ``plan`` without a checkpoint: from the global weights ``state`` the shards hold
    now, every virtual worker from the slowest one's position; the minibatches each VW runs
    in the whole job (``total`` each)."""
    plan.initial = {k: state[k] for k in plan.initial or {}}
    start = min(positions)
    plan.starts = (start,) * len(plan.vws)
    if sync:
        plan.minibatches = max(1, total - start)
    else:
        plan.owed = (max(1, total - start),) * len(plan.vws)
    return (total,) * len(plan.vws)


def lost_since(got: Sequence[int] | None, at: Sequence[int] | None) -> list[int] | None:
    """Per VW, the minibatches trained past a checkpoint at positions ``at`` by a run that
    got to ``got``: the work a resume does again (None where the two do not compare)."""
    if not got or not at or len(got) != len(at):
        return None
    return [max(0, int(a) - int(b)) for a, b in zip(got, at, strict=True)]


# -- the head's part --------------------------------------------------------------------------


class RecoveryPart:
    """Resume, re-plan and restart recovery (a part of :class:`hetpipe.head.server.Head`)."""

    def _restore(self, js: JobState, plan: JobPlan, ck: checkpoint.Checkpoint) -> None:
        """Start ``plan`` of ``js`` from checkpoint ``ck`` (:func:`resume_plan`)."""
        js.totals, js.restores, owed = resume_plan(plan, ck, js.spec.sync)
        whole = sorted(
            f"vw{v}/stage{s}" for (v, s), (m, _) in js.restores.items() if m.get("weights")
        )
        self.log.info(
            "resuming",
            job=js.id,
            checkpoint=str(ck.path),
            wave=ck.meta.get("wave"),
            positions=list(plan.starts),
            owed=list(owed),
            stages_restored=whole,
            stages_from_global=len(js.restores) - len(whole),
        )

    def _lost_since(self, ck: checkpoint.Checkpoint) -> list[int] | None:
        """Per VW, the minibatches the checkpointed job trained after ``ck`` (where its
        final status says how far it got): the work a resume does again."""
        old = read_result(self.run_dir, str(ck.meta.get("job")))
        return lost_since((old or {}).get("positions"), ck.meta.get("positions"))

    def _checkpoint_of(self, job_id: str) -> checkpoint.Checkpoint:
        """The last complete checkpoint of job ``job_id`` in this head's run directory."""
        d = job_dir(self.run_dir, job_id)
        if d is None:
            raise JobFailed(f"resume: {excerpt(job_id, 80)!r} is not a job id")
        ck = self._latest(d, job_id)
        if ck is None:  # a resumed job that wrote none: the one it started from
            ck = self._origin_of(job_id)
        if ck is None:
            raise JobFailed(
                f"no complete checkpoint of job {job_id!r} in {d.resolve() / 'checkpoints'}"
            )
        return ck

    def _origin_of(self, job_id: str) -> checkpoint.Checkpoint | None:
        """The checkpoint job ``job_id`` was resumed from, where it was (None otherwise, or
        where that checkpoint is gone or damaged)."""
        js = self.jobs.get(job_id)
        if js is not None:
            return js.resume
        came = (read_result(self.run_dir, job_id) or {}).get("resumed_from")
        if not isinstance(came, dict) or not isinstance(came.get("checkpoint"), str):
            return None
        try:
            return checkpoint.verify(Path(came["checkpoint"]))
        except Exception as exc:  # any damage: there is nothing to resume from
            self.log.warning("damaged checkpoint skipped", job=job_id, error=excerpt(exc, 300))
            return None

    def _latest_of(self, js: JobState) -> checkpoint.Checkpoint | None:
        """The newest complete checkpoint of the job: its own, else the one it resumed from."""
        ck = self._latest(self.job_dir(js), js.id)
        return ck if ck is not None else js.resume

    def _latest(self, d: Any, job: Any) -> checkpoint.Checkpoint | None:
        """The newest complete checkpoint under job directory ``d``; damaged ones logged."""
        skipped: list[str] = []
        ck = checkpoint.latest(d, skipped)
        for why in skipped:
            self.log.warning("damaged checkpoint skipped", job=job, error=excerpt(why, 300))
        return ck

    # -- resuming by hand: one successor per job ------------------------------------------

    def _resume_source(self, job_id: str) -> checkpoint.Checkpoint:
        """The checkpoint ``submit --resume JOB`` starts from (:meth:`_checkpoint_of`);
        refused in one line where JOB has not ended or was already resumed (a second
        resume would train the same job twice, side by side)."""
        js = self.jobs.get(job_id)
        if js is not None and js.state not in FINISHED:
            raise JobFailed(f"resume: job {job_id} is {js.state}, not ended: nothing to resume")
        successor = self._successor_of(job_id)
        if successor is not None:
            now = self.jobs.get(successor)
            state = now.state.value if now is not None else _recorded_state(self, successor)
            raise JobFailed(
                f"resume: job {job_id} was already resumed as {successor}"
                + (f" ({state})" if state else "")
                + f": follow {successor}, or resume it once it has ended"
            )
        return self._checkpoint_of(job_id)

    def _successor_of(self, job_id: str) -> str | None:
        """The job that continues ``job_id`` (resumed by hand or by a restarted head), as
        the head holds it or the job's records on disk say; None when none does."""
        for js in self.jobs.values():
            if js.resumed_of == job_id:
                return js.id
        old = self.jobs.get(job_id)
        if old is not None and old.result.get("resumed_as"):
            return str(old.result["resumed_as"])
        for info in (read_result(self.run_dir, job_id), _job_record(self.run_dir, job_id)):
            if info and isinstance(info.get("resumed_as"), str):
                return str(info["resumed_as"])
        return None

    def _link(self, old_id: str, js: JobState) -> None:
        """Job ``js`` continues ``old_id``: each names the other, in the head's memory and
        in ``old_id``'s records on disk (``resumed_as``), so that ``status`` and ``jobs``
        show the link whatever answers them."""
        js.resumed_of = old_id
        old = self.jobs.get(old_id)
        if old is not None:
            old.result["resumed_as"] = js.id
        d = job_dir(self.run_dir, old_id)
        if d is None or not d.is_dir():
            return
        record = _job_record(self.run_dir, old_id) or {"id": old_id}
        base = {
            "id": old_id,
            "name": _name_of(old_id),
            "owner": record.get("owner"),
            "state": record.get("state"),
            "error": record.get("error"),
        }
        try:
            update_result(self.run_dir, old_id, base, resumed_as=js.id)
            if (d / "job.json").exists():
                _write_record(d, {**record, "resumed_as": js.id})
        except OSError as exc:
            self.log.warning("cannot record the resumed job's link", job=old_id, error=str(exc))

    # -- after a restart: jobs the previous head was running --------------------------------

    def _recover(self) -> None:
        """Queue again, from their last checkpoint, the jobs a previous head left running.

        A job whose ``job.json`` still says ``running`` was cut off by the head's death (or
        ``interrupted``, by its shutdown); one with a complete checkpoint is resumed as a new
        job once the cluster is back (its old record then names the new id), one without is
        recorded as lost, and its final status says it failed and why. A job still queued
        (or being planned) when the head stopped or died is queued again under its own id,
        after the resumed ones and in the order it had (:meth:`_requeued`); one whose record
        does not hold what to run is recorded as failed. So a job the previous head knew is
        never unknown to this one; what was done with each is in ``self.recovered`` (``hetpipe
        up`` prints it).
        """
        self.recovered: list[dict[str, Any]] = []
        later: list[tuple[tuple[bool, float], JobState]] = []  # still queued: in their order
        for record in sorted((self.run_dir / "jobs").glob("*/job.json")):
            try:
                old = json.loads(record.read_text())
            except (OSError, ValueError):
                continue
            if not isinstance(old, dict) or not safe_name(old.get("id")):
                continue
            was = old.get("state")
            job_id = old["id"]
            if was in (JobStatus.QUEUED, JobStatus.PLANNING):
                if read_result(self.run_dir, job_id) is None:  # it never ended: never ran
                    again = self._requeued(record, old)
                    if again is not None:  # a job resumed by a head goes first, as it did
                        later.append(((not old.get("recovered"), again.submitted), again))
                continue
            if was not in (JobStatus.RUNNING, JobStatus.INTERRUPTED):
                continue
            ck = self._latest(record.parent, job_id)
            try:
                if ck is None:
                    raise JobError("no complete checkpoint")
                spec = JobSpec.from_dict(ck.meta["spec"], source=str(ck.path))
                check_code(spec, self.cluster.security.allowed_modules)
            except (JobError, CodeError, KeyError) as exc:
                self._recovered_lost(
                    record,
                    old,
                    transition(was, JobStatus.LOST),
                    f"the head restarted; cannot resume: {exc}",
                )
                continue
            js = JobState(
                id=self._new_id(spec.name),
                spec=spec,
                submitted=time.time(),
                owner=old.get("owner"),
                resume=ck,
                recovered=True,
                resumed_of=job_id,
            )
            self.jobs[js.id] = js
            self.queue.put_nowait(js)
            old.update(state=transition(was, JobStatus.RESUMED).value, resumed_as=js.id)
            try:
                d = record.parent.parent / js.id  # queued: a head stopped before it runs it
                d.mkdir(exist_ok=True)  # queues it again (its job from the same checkpoint)
                _write_record(d, {**_queued(js), "resume": job_id, "recovered": True})
                _write_record(record.parent, old)
                update_result(
                    self.run_dir,
                    job_id,
                    _base(old, spec.name),
                    state=JobStatus.RESUMED.value,
                    resumed_as=js.id,
                )
            except OSError as exc:
                self.log.warning("cannot record the resumed job", job=job_id, error=str(exc))
            self.recovered.append(
                {
                    "job": job_id,
                    "as": js.id,
                    "wave": ck.meta.get("wave"),
                    "checkpoint": str(ck.path),
                }
            )
            self.log.warning(
                "resuming a job the previous head was running",
                job=job_id,
                new=js.id,
                checkpoint=str(ck.path),
            )
        for _order, js in sorted(later, key=lambda item: item[0]):
            self.jobs[js.id] = js
            self.queue.put_nowait(js)

    def _requeued(self, record: Path, old: dict[str, Any]) -> JobState | None:
        """A job the previous head had queued, as it was (its id, owner, job, the checkpoint
        a resume starts from) and waiting for the cluster like a resumed one; None where it
        cannot be (recorded as failed: a record that does not hold its job, a job refused)."""
        job_id = old["id"]
        if not old.get("job") and not old.get("resume"):
            self._recovered_lost(
                record, old, JobStatus.FAILED, "the head restarted before the job ran"
            )
            return None
        try:
            resume = self._checkpoint_of(old["resume"]) if old.get("resume") else None
            job = old.get("job") or (resume.meta["spec"] if resume is not None else None)
            check_code(job, self.cluster.security.allowed_modules)
            spec = JobSpec.from_dict(job, source=str(record))
        except (JobError, CodeError, JobFailed, KeyError, TypeError) as exc:
            why = f"the head restarted; cannot queue the job again: {excerpt(exc, 300)}"
            self._recovered_lost(record, old, JobStatus.FAILED, why)
            return None
        submitted = old.get("submitted")
        js = JobState(
            id=job_id,
            spec=spec,
            submitted=float(submitted) if isinstance(submitted, int | float) else time.time(),
            owner=old.get("owner"),
            resume=resume,
            recovered=True,
            resumed_of=old.get("resume"),
        )
        self.recovered.append({"job": job_id, "queued": True})
        self.log.warning("queueing again a job the previous head had queued", job=job_id)
        return js

    def _recovered_lost(self, record: Any, old: dict[str, Any], state: JobStatus, why: str) -> None:
        """A job of the previous head that cannot go on: its record in ``state``, its
        final status ``failed`` with ``why`` (and the error it had, if any)."""
        error = why if not old.get("error") else f"{why} (it had stopped: {old['error']})"
        old.update(state=state.value, error=error)
        try:
            _write_record(record.parent, old)
            update_result(
                self.run_dir,
                old["id"],
                _base(old, _name_of(old["id"])),
                state=JobStatus.FAILED.value,
                error=error,
            )
        except OSError as exc:
            self.log.warning("cannot record the lost job", job=old["id"], error=str(exc))
        self.recovered.append({"job": old["id"], "error": error})
        self.log.warning("a job of the previous head is lost", job=old["id"], error=error)

    # -- keep going when a worker dies (train.on_worker_loss = "replan") ----------------------

    def _may_replan(self, js: JobState) -> bool:
        # "reform" where the loss is not its VW's alone to take (hetpipe.head.reform): a
        # synchronous job, or stages not started yet; a VW it could not re-form sets no
        # lost_device (its line names the worker)
        return (
            js.spec.on_worker_loss in ("replan", "reform")
            and js.lost_device is not None
            and not js.cancelled
            and len(js.replans) < MAX_REPLANS
        )

    async def _replan(self, js: JobState, reason: str) -> None:
        """Go on without the lost worker: plan the job again on the live devices and start it
        from the job's last complete checkpoint (:func:`resume_plan`: the shards' cut, each
        stage's state where its layers stayed, the optimizer state per parameter where they
        moved, each virtual worker's data position). The work since that checkpoint is done
        again (``lost_minibatches`` of the re-plan says how much).

        A job without a checkpoint yet starts from the global weights the shards hold now
        (:func:`restart_from_global`): the lost stage's unpushed updates and every stage's
        optimizer state are gone, and every virtual worker goes on from the slowest one's
        position.
        """
        assert js.plan is not None
        loop = asyncio.get_running_loop()
        t0 = time.monotonic()
        old, lost = js.plan, js.lost_device
        log = self.log.bind(job=js.id)
        log.warning("worker lost: re-planning the job without it", device=lost, reason=reason)
        positions = js.info().get("positions") or [0]
        self._drop_cuts(js)
        ck = self._latest_of(js)
        state: dict[str, torch.Tensor] = {}
        if ck is None:
            try:
                state, _ = await asyncio.wait_for(self._fetch_state(js), SHARD_TIMEOUT_S)
            except (RemoteError, TimeoutError, ConnectionError) as exc:
                raise JobFailed(f"{reason}; cannot re-plan: the shards' weights: {exc}") from None
        await self._abort(js, reason)
        await self._drop_shards(js)
        self.registry.release(js.id)
        spec = dataclasses.replace(js.spec, vws=(), num_vws=js.spec.num_vws or len(old.vws))
        try:
            profile, rows = await self.profiler.profiles(spec)
            cluster = live_cluster(self.cluster, self.registry.idle())
            plan = await loop.run_in_executor(None, plan_for, spec, cluster, profile, rows)
            shards = self.registry.live_shards()
            alive = self.registry.alive()
            wire = self._next_wire(js)  # hetpipe.head.shardwait: one count of attempts
            new = await loop.run_in_executor(
                None,
                lambda: plan_job(
                    spec,
                    wire,
                    self.cluster,
                    alive,
                    shards,
                    vws=plan.run_layouts(spec.activations),
                    predicted=predicted_summary(plan),
                ),
            )
            if ck is not None:
                self._restore(js, new, ck)
        except (PlanError, JobPlanError, JobFailed) as exc:
            raise JobFailed(f"{reason}; cannot re-plan without it: {exc}") from None
        if ck is None:
            total = js.totals[0] if js.totals else old.minibatches
            js.totals = restart_from_global(new, state, positions, total, spec.sync)
            lost_mb = None
        else:
            lost_mb = lost_since(positions, ck.meta.get("positions") or [])
        js.start_attempt(new)
        js.lost_device = None
        js.replans.append(
            {
                "lost": lost,
                "reason": reason,
                "after_minibatches": positions,
                "checkpoint": str(ck.path) if ck is not None else None,
                "checkpoint_positions": ck.meta.get("positions") if ck is not None else None,
                "lost_minibatches": lost_mb,
                "vws": [[s.device for s in vw.stages] for vw in new.vws],
                "starts": list(new.starts),
                "minibatches_left": [new.minibatches_of(v) for v in range(len(new.vws))],
                "planned_s": round(time.monotonic() - t0, 2),
                "_t": t0,
            }
        )
        log.warning(
            "re-planned",
            lost=lost,
            vws=js.replans[-1]["vws"],
            checkpoint=js.replans[-1]["checkpoint"],
            lost_minibatches=lost_mb,
            minibatches_left=js.replans[-1]["minibatches_left"],
        )


def _job_record(run_dir: Path, job_id: str) -> dict[str, Any] | None:
    """A job's ``job.json`` (its state as the head last knew it), or None."""
    d = job_dir(run_dir, job_id)
    if d is None:
        return None
    try:
        record = json.loads((d / "job.json").read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _write_record(d: Path, record: dict[str, Any]) -> None:
    """Write a job's ``job.json`` atomically."""
    tmp = d / ".job.json.tmp"
    tmp.write_text(json.dumps(record))
    tmp.replace(d / "job.json")


def _queued(js: JobState) -> dict[str, Any]:
    """A queued job's ``job.json``: what a head that starts before it runs needs to queue
    it again (:meth:`RecoveryPart._requeued`; ``job`` and ``resume`` are the submitter's)."""
    return {
        "id": js.id,
        "owner": js.owner,
        "state": JobStatus.QUEUED.value,
        "error": None,
        "submitted": js.submitted,
    }


def _recorded_state(head: Any, job_id: str) -> str | None:
    """A job's state as its final status on disk records it, or None."""
    info = read_result(head.run_dir, job_id) or _job_record(head.run_dir, job_id) or {}
    state = info.get("state")
    return state if isinstance(state, str) else None


def _name_of(job_id: str) -> str:
    """The name a job was submitted as: its id without the ``-<n>``."""
    name, dash, n = job_id.rpartition("-")
    return name if dash and n.isdigit() else job_id


def _base(record: dict[str, Any], name: str) -> dict[str, Any]:
    """A final status for a job whose head died before it wrote one: its record's fields."""
    return {
        "id": record["id"],
        "name": name,
        "owner": record.get("owner"),
        "state": record.get("state"),
        "error": record.get("error"),
    }
