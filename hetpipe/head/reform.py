"""A lost worker costs only its own virtual worker (``train.on_worker_loss = "reform"``).

When a worker of a running asynchronous job is lost (no heartbeat for ``lost_after_s``, or
its process restarted), the job's attempt goes on: only the lost worker's virtual worker
(VW) ``v`` stops, and the others never wait for it.

1. **Leave.** The surviving workers of ``v`` drop the job (``abort``), and every shard
   removes ``v`` from the job (``shard_init`` with ``reform.leave``): its clock holds the
   global clock back no longer, so the other VWs' pulls it was holding are answered at once,
   its own parked pulls and later pushes are refused. Each shard says ``v``'s clock there:
   the waves every stage of ``v`` has pushed, i.e. what the global weights hold of it.
   The lost worker is told too (one silent past ``lost_after_s`` may be alive), and the
   head waits (up to :data:`IDLE_WAIT_S`) until the survivors' heartbeats say they dropped
   it, so that no stage of the old VW still pushes once the new one joins.
2. **Re-plan.** The planner plans one VW on ``v``'s surviving devices (a worker restarted by
   its supervisor, idle again under the same device, is one of them)
   (:func:`hetpipe.profiling.plan_for` on the cluster restricted to them: split, Nm and
   activation policy, under each device's memory cap).
3. **Join.** Where they hold the model, ``v`` is re-formed on them: every shard makes it a
   member again, its clock restarting at that shard's global clock ``g``, or past the last
   wave its old stages pushed there where they had run ahead
   (:meth:`hetpipe.shard.JobShard.rejoin_vw`); the head then moves it on, on the shards that
   joined it earlier, to the latest of those, its *base* (:func:`common_base`,
   :meth:`hetpipe.shard.JobShard.rebase_vw`): its waves ``0 .. base - 1`` count as pushed,
   its own wave ``c`` is wave ``base + c`` on every shard, so the WSP bound
   ``c_local - c_global <= D`` stays one bound for every VW, the global clock never goes
   back, and a cut means one point of every VW's run (``JobPlan.bases``; its stages take it
   as ``StageTask.wave_base``). Its stages start from the shards'
   *current* global weights (a stage pulls them before its first forward), not from a
   checkpoint, and read ``v``'s data from the position the shards hold: the minibatches of
   the waves every stage had pushed. What ``v`` had trained past that position (its
   in-flight minibatches and its unpushed partial wave) is trained again; a wave some of
   whose stages had pushed is trained again whole (those stages' share of it counts twice,
   as a re-trained minibatch of asynchronous SGD would).
4. **Drop.** Where the survivors cannot hold the model (or none survived), ``v`` is left
   out: the job goes on with the other VWs and finishes without it (its status' ``reforms``
   names the lost worker and why). A job whose every VW is lost fails with that line.

A job with one VW takes the same path: it resumes from the weights the shards hold now. The
shards hold them while they live; a lost *shard* pauses the job instead
(:mod:`hetpipe.head.shardwait`), and resumes from the last cut.

Checkpoints go on: the job's cuts are waves of the shards' count, and the first one after a
re-form is the first cut point past the VW's base (:func:`hetpipe.head.cuts.next_cut_past`):
there the shards' cut holds every update its old stages pushed and exactly its new waves
before the cut, and its new stages have a state of their own (sent at the shards' wave). A
checkpoint records each VW's own data position (its restart position plus the minibatches of
its waves since its base), so a job resumed from it reads every VW from its own place on
fresh clocks. A left-out VW holds no state in later cuts, which go on from past every wave it
pushed (its base then). ``hetpipe checkpoint`` is refused while a VW is being re-formed. A
later attempt of the job (a re-plan, a lost shard's return) starts from such a checkpoint and
counts only its own re-forms in the job's minibatches (:func:`pushed_before_reforms`).

Limits: synchronous schedules (``gpipe``, ``1f1b``) reduce every VW's gradients each
iteration, so a lost worker there re-plans the whole job as ``"replan"`` does, and so does a
loss before the lost worker's stage started (the attempt is still being launched). The drift
watch (``[replan]``) watches a re-formed VW again against its new split's predicted times; a
VW left out stays unwatched (the result's ``replan_unwatched`` names it and why). Merging
the survivors into another VW's pipeline is not done. A VW left out whose pushes reached
past the other VWs' last wave leaves the job without a cut at its end (its last checkpoint
is the one before).

:class:`ReformPart` is the part of :class:`hetpipe.head.server.Head` that does it; the pure
helpers (:func:`restart_position`, :func:`reform_outcome`) are tested on their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import zmq

from hetpipe.core.layout import VWLayout
from hetpipe.head.cuts import next_cut_past
from hetpipe.head.registry import SHARD_TIMEOUT_S
from hetpipe.head.states import JobStatus
from hetpipe.jobplan import JobPlan, JobPlanError, plan_job
from hetpipe.planner import PlanError
from hetpipe.profiling import live_cluster, plan_for
from hetpipe.security import worker_user
from hetpipe.wire import Kind

if TYPE_CHECKING:
    from hetpipe.head.jobs import JobState
    from hetpipe.head.registry import WorkerInfo

__all__ = [
    "IDLE_WAIT_S",
    "MAX_REFORMS",
    "ReformPart",
    "common_base",
    "pushed_before_reforms",
    "reform_outcome",
    "restart_position",
    "without_migration",
]

MAX_REFORMS = 8  # a job that lost this many workers fails at the next loss
IDLE_WAIT_S = 5.0  # how long the head waits for the survivors to say they dropped the job


# -- pure -------------------------------------------------------------------------------------


def restart_position(start: int, clocks: Sequence[int], nm: int, total: int) -> int:
    """Where a re-formed VW reads its data on from: ``start`` (its position at the attempt's
    start) plus the minibatches of the waves every stage had pushed to every shard (the
    smallest of the shards' ``clocks``, in the VW's own waves of ``nm`` minibatches), at most
    ``total`` (the minibatches it runs in the whole job)."""
    done = min(clocks, default=0) * nm
    return min(total, start + done)


def pushed_before_reforms(reforms: Sequence[Mapping[str, Any]], attempt: str | None = None) -> int:
    """The minibatches the job's re-formed or left-out VWs had pushed before their losses.

    A re-form moves the VW's start to its restart position and owes it only what is left, so
    the plan's totals no longer hold them; the job's count of what it trained adds them back
    (each once: the minibatches re-trained after the restart are in the plan's count). Only
    the re-forms of ``attempt`` (the plan's wire id; None: every one) count: a later attempt
    (a re-plan, a lost shard's return) starts from a checkpoint's positions, which hold
    them already."""
    return sum(
        int(r.get("pushed", 0))
        for r in reforms
        if attempt is None or r.get("attempt", attempt) == attempt
    )


def common_base(offsets: Sequence[int]) -> int:
    """The one wave a re-formed VW's own wave 0 is on every shard: the latest one a shard
    joined it at (each joins it at its global clock, or past the waves its old stages pushed
    there), so that no shard's global clock goes back and a cut means one point of its run."""
    return max(offsets, default=0)


def reform_outcome(
    lost: str, v: int, survivors: Sequence[str], others: int, why_not: str | None
) -> tuple[str, str]:
    """What becomes of VW ``v`` after worker ``lost``: ``("reformed", line)`` where the
    planner placed the model on ``survivors`` (``why_not`` None), else ``("dropped", line)``
    where ``others`` VWs go on, else ``("failed", line)``: the one line the job fails with."""
    on = ", ".join(survivors) if survivors else "no device"
    if why_not is None:
        return "reformed", f"vw{v} re-formed on {on} after worker {lost} was lost"
    why = f"worker {lost} lost: vw{v}'s surviving devices ({on}) cannot hold the model: {why_not}"
    if others:
        return "dropped", f"{why}; vw{v} is left out, the job goes on with {others} other VWs"
    return "failed", why


def vw_members(plan: JobPlan, v: int) -> dict[int, dict[str, Any]]:
    """Per shard: ``members`` of a ``shard_init`` holding VW ``v`` alone (its stages' names
    on that shard, and its waves)."""
    out: dict[int, dict[str, Any]] = {}
    for s in range(len(plan.vws[v].stages)):
        for name in plan.stage_names(v, s):
            shard = plan.placement[name]
            member = out.setdefault(shard, {str(v): {"waves": plan.waves(v), "stages": {}}})
            member[str(v)]["stages"].setdefault(str(s), []).append(name)
    return out


# -- the head's part --------------------------------------------------------------------------


class ReformPart:
    """Re-form a lost worker's VW while the others train (a part of
    :class:`hetpipe.head.server.Head`)."""

    def _reform_on_loss(self, js: JobState, w: WorkerInfo, reason: str) -> bool:
        """Worker ``w`` of job ``js`` was lost: True where its VW alone is re-formed (or left
        out) and the job goes on; False where the job's attempt must end as before (another
        ``on_worker_loss``, a synchronous schedule, no VW known, too many losses)."""
        if (
            js.spec.on_worker_loss != "reform"
            or js.spec.sync
            or js.plan is None
            or js.state != JobStatus.RUNNING
            or js.cancelled
            or w.vw is None
            or len(js.reforms) >= MAX_REFORMS
        ):
            return False
        v = int(w.vw)
        if not js.progress and w.state != "running":  # still launching: the attempt ends
            return False  # (as for any other loss; a started stage says "running")
        plan = js.plan
        if all((v, s) in js.stage_results for s in range(len(plan.vws[v].stages))):
            self.log.info("worker lost after its VW finished", job=js.id, device=w.device)
            return True
        pending = js.reforming.get(v)
        if pending is not None:  # a second worker of a VW being re-formed: one re-form
            pending["lost"].append(w.device)
            return True
        js.reforming[v] = {
            "lost": [w.device],
            "reason": reason,
            "detected": time.monotonic(),
            "detected_at": time.time(),  # wall clock: comparable with the stages' records
        }
        task = asyncio.ensure_future(self._reform(js, v))
        js.reform_tasks.append(task)
        return True

    def _end_reforms(self, js: JobState) -> None:
        """The job has ended: a re-form under way stops (it assigns nothing more)."""
        for task in js.reform_tasks:
            task.cancel()
        js.reform_tasks.clear()
        js.reforming.clear()

    def _reform_ignores(self, js: JobState, vw: int) -> bool:
        """Whether a stage's failure in ``vw`` belongs to a VW being re-formed (its survivors
        fail on their refused pulls before the head's ``abort`` reaches them)."""
        return vw in js.reforming

    async def _reform(self, js: JobState, v: int) -> None:
        """Leave, re-plan, join again or drop VW ``v`` of ``js`` (see the module's text); a
        failure here fails the job with the line that says why."""
        try:
            await self._reform_vw(js, v)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the job must not hang on a re-form that broke
            pending = js.reforming.pop(v, None) or {}
            lost = ", ".join(pending.get("lost") or ["?"])
            self.log.exception("re-form failed", job=js.id, vw=v)
            js.fail(f"worker {lost} lost; vw{v} could not be re-formed: {exc}")

    async def _reform_vw(self, js: JobState, v: int) -> None:
        plan = js.plan
        assert plan is not None and self.channel is not None
        loop = asyncio.get_running_loop()
        pending = js.reforming[v]
        log = self.log.bind(job=js.id, vw=v)
        log.warning("worker lost: re-forming its virtual worker", lost=pending["lost"])
        old_devices = list(plan.vws[v].all_devices())
        # 1. leave: the survivors drop the job, the shards the VW; the lost workers are told
        # too (one silent past lost_after_s on a loaded host may be alive, and would train on)
        survivors = [
            w for w in self.registry.workers.values() if w.job == js.id and w.vw == v and not w.lost
        ]
        for w in [w for w in self.registry.workers.values() if w.job == js.id and w.vw == v]:
            with contextlib.suppress(ConnectionError, zmq.ZMQError):
                await self.channel.send(
                    Kind.ABORT,
                    {"job": js.wire_id, "reason": f"vw{v} is re-formed: {pending['reason']}"},
                    to=w.ident,
                )
        for w in self.registry.workers.values():
            if w.job == js.id and w.vw == v:
                w.job = w.vw = w.stage = None
        for key in [k for k in js.states if k[0] == v]:  # the cuts wait for its new stages
            del js.states[key]
        _drop_meets(self, js.wire_id, v)
        if js.watch is not None:  # the other VWs stay watched for drift
            js.watch.unwatch(v, f"re-formed or left out after worker {pending['lost'][0]} was lost")
        clocks, reach = [], 0
        for shard in plan.shards_used():
            info = await self._reform_shard(js, shard, {"vw": v, "leave": True})
            clocks.append(int(info.get("clock", 0)))
            reach = max(reach, int(info.get("reach", 0)))
        left_at = time.monotonic()
        # how far it had got: the furthest stage's last report (reports lag a little)
        done_before = max(
            (js.progress.get((v, s), {}).get("done", 0) for s in range(len(plan.vws[v].stages))),
            default=0,
        )
        for key in [k for k in js.progress if k[0] == v]:
            del js.progress[key]
        for key in [k for k in js.stage_results if k[0] == v]:
            del js.stage_results[key]
        total = js.totals[v] if v < len(js.totals) else plan.minibatches_of(v)
        position = restart_position(plan.start_of(v), clocks, plan.vws[v].nm, total)
        trained = max(position, plan.start_of(v) + done_before)
        # 2. re-plan on the survivors, once they said they dropped the job
        await self._idle(survivors, IDLE_WAIT_S)
        alive = self.registry.alive()
        devices = [d for d in old_devices if d in alive and alive[d].job is None]
        why_not: str | None = None
        layout = None
        times: list[float] = []  # its new stages' predicted compute per minibatch
        if position >= total:
            why_not = "it had pushed every wave already"
        elif not devices:
            why_not = "none survived"
        else:
            try:
                spec = dataclasses.replace(js.spec, vws=(), num_vws=1)
                profile, rows = await self.profiler.profiles(spec)
                layout, times = await loop.run_in_executor(
                    None, self._plan_vw, spec, plan, devices, profile, rows
                )
            except (PlanError, JobPlanError, ValueError) as exc:
                why_not = str(exc)
        others = sum(
            1 for u in range(len(plan.vws)) if u != v and not _dropped(js, u)
        )  # VWs that go on
        what, line = reform_outcome(
            ", ".join(pending["lost"]), v, devices, others, why_not if layout is None else None
        )
        if position >= total and layout is None:
            lost = ", ".join(pending["lost"])
            what, line = "finished", f"vw{v} had pushed every wave when worker {lost} was lost"
        record: dict[str, Any] = {
            "vw": v,
            "lost": list(pending["lost"]),
            "reason": pending["reason"],
            "outcome": what,
            "why": line,
            "devices_before": old_devices,
            "shard_clocks": clocks,
            "trained_to": trained,
            "restart_at": position,
            # pushed by its old layout, out of the plan's count from here (see above)
            "pushed": max(0, position - plan.start_of(v)),
            "minibatches_redone": max(0, trained - position),
            "detected_at": pending["detected_at"],
            "left_s": round(left_at - pending["detected"], 3),
            "attempt": plan.job,
            "_t": pending["detected"],
        }
        if what == "failed":  # (no lost_device: the job fails, it is not re-planned)
            js.reforms.append(record)
            js.reforming.pop(v, None)
            js.fail(line)
            return
        if layout is None:  # left out (or at its end): the others finish the job
            # its base: past every wave it pushed, where the job's cuts go on from
            new = _with_vw(js.plan, v, None, position, 0, reach)
            js.plan = new
            for s in range(len(plan.vws[v].stages)):
                js.stage_results[(v, s)] = {"stats": {"done": 0, "left_out": line}}
            js.reforms.append(record)
            js.reforming.pop(v, None)
            self._cuts_go_on(js, new)
            log.warning("virtual worker left out", why=line)
            if len(js.stage_results) >= new.n_stages:
                js.all_done.set()
            return
        # 3. join again on the survivors, from the shards' current weights
        new = _with_vw(plan, v, layout, position, total - position, 0)
        owners = {
            f"{v}/{s}" + (f"/{r}" if r else ""): worker_user(d)
            for s, st in enumerate(layout.stages)
            for r, d in enumerate(st.devices)
        }
        offsets = {}
        for shard, members in vw_members(new, v).items():
            reform = {"vw": v, "waves": new.waves(v)}
            info = await self._reform_shard(js, shard, reform, members, owners)
            offsets[shard] = int(info.get("offset", 0))
        # one base on every shard: each holds the VW at its offset now, so none's global
        # clock passes it; those that joined it earlier move it on (it has pushed nothing)
        base = common_base(list(offsets.values()))
        for shard in [i for i, o in offsets.items() if o < base]:
            info = await self._reform_shard(js, shard, {"vw": v, "base": base})
            offsets[shard] = int(info.get("offset", base))
        # from the job's plan as it is now: another VW may have been re-formed meanwhile
        new = _with_vw(js.plan, v, layout, position, total - position, base)
        js.plan = new
        self._cuts_go_on(js, new)
        if js.watch is not None:  # watched for drift again, against its new split
            js.watch.rewatch(v, layout, times)
        await self._assign_vw(js, new, v)
        record.update(
            devices=[list(st.devices) for st in layout.stages],
            layers=[[st.first, st.last] for st in layout.stages],
            nm=layout.nm,
            wave_base=base,
            wave_offsets=[offsets[i] for i in sorted(offsets)],
            minibatches_left=total - position,
            started_s=round(time.monotonic() - pending["detected"], 3),
        )
        js.reforms.append(record)
        js.reforming.pop(v, None)
        log.warning(
            "virtual worker re-formed",
            devices=record["devices"],
            restart_at=position,
            wave_base=base,
            started_s=record["started_s"],
        )

    def _cuts_go_on(self, js: JobState, plan: JobPlan) -> None:
        """VW ``v`` of ``js`` was re-formed or left out (``plan`` says how): the job's cuts go
        on from the first one past its base (:func:`hetpipe.head.cuts.next_cut_past`), and
        one whose every state is in already is written."""
        js.cut_next = next_cut_past(plan, js.cut_next, js.spec.checkpoint_every, js.cut_asked)
        self._take_ready(js, plan)

    def _plan_vw(
        self, spec: Any, plan: JobPlan, devices: list[str], profile: Any, rows: Any
    ) -> tuple[VWLayout, list[float]]:
        """One VW planned on ``devices`` (the survivors) for ``spec`` (the job as one VW),
        laid out to run in ``plan``: the planner's split, Nm and activation policy under
        their memory caps, and each stage's predicted compute per minibatch (the drift
        watch's reference); :class:`PlanError` (or :class:`JobPlanError`) where they cannot
        hold the model."""
        planned = plan_for(spec, live_cluster(self.cluster, set(devices)), profile, rows)
        layouts = planned.run_layouts(spec.activations)
        if len(layouts) != 1:
            raise PlanError(f"the planner made {len(layouts)} VWs of {devices}")
        one = plan_job(
            spec,
            plan.job,
            self.cluster,
            {d: w for d, w in self.registry.alive().items() if d in devices},
            self.registry.live_shards(),
            vws=layouts,
        )
        return one.vws[0], [float(st.time_s) for st in planned.vws[0].stages]

    async def _reform_shard(
        self,
        js: JobState,
        shard: int,
        reform: dict[str, Any],
        members: Mapping[str, Any] | None = None,
        owners: Mapping[str, str] | None = None,
    ) -> dict[str, Any]:
        """One step of a re-form on ``shard`` (``reform``: the VW leaving, joining with its
        ``members`` and their ``owners``, or moving to a base); the shard's ``info`` reply."""
        body: dict[str, Any] = {
            "job": js.wire_id,
            "members": dict(members or {}),
            "staleness": js.spec.staleness,
            "reform": reform,
        }
        if owners is not None:
            body["owners"] = dict(owners)
        ch = await self.registry.shard(shard)
        reply = await ch.request(
            Kind.SHARD_INIT, body, timeout=SHARD_TIMEOUT_S, what=f"shard {shard}"
        )
        return reply.get("info") or {}

    async def _idle(self, survivors: Sequence[WorkerInfo], timeout: float) -> None:
        """Until every survivor's heartbeat says it dropped the job (or ``timeout``): a
        survivor that still ran would push to the shards as the re-formed VW."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while loop.time() < deadline:
            if all(w.lost or w.state == "idle" for w in survivors):
                return
            await asyncio.sleep(0.05)
        self.log.warning(
            "survivors of a re-formed VW still busy",
            devices=[w.device for w in survivors if w.state != "idle"],
        )

    async def _assign_vw(self, js: JobState, plan: JobPlan, v: int) -> None:
        """Assign VW ``v``'s stages of ``plan`` to their workers, then start them."""
        assert self.channel is not None
        workers = self.registry.workers
        waits = []
        for task in plan.tasks(self.registry.live_shards(), workers):
            if task.vw != v:
                continue
            w = workers[task.group[task.replica]]
            w.job, w.vw, w.stage = js.id, task.vw, task.stage
            task = dataclasses.replace(task, spec=without_migration(task.spec))
            waits.append(
                self.channel.request(
                    Kind.ASSIGN,
                    {"job": plan.job, "task": task.to_dict()},
                    plan.local_state(task.vw, task.stage),
                    to=w.ident,
                    timeout=ASSIGN_S,
                    what=f"worker {w.device}",
                )
            )
        await asyncio.gather(*waits)
        for w in workers.values():
            if w.job == js.id and w.vw == v:
                await self.channel.send(Kind.START, {"job": plan.job}, to=w.ident)


ASSIGN_S = 120.0  # as hetpipe.head.jobs.ASSIGN_TIMEOUT_S: a stage builds its layers first


def without_migration(spec: dict[str, Any]) -> dict[str, Any]:
    """A job's spec (``JobSpec.to_dict()``) for a re-formed VW's stages: without the job's
    pinned live migration (``replan.migrate_*``), a split of the layout that is gone."""
    replan = {k: v for k, v in (spec.get("replan") or {}).items() if not k.startswith("migrate")}
    return {**spec, "replan": replan}


def _dropped(js: JobState, u: int) -> bool:
    """Whether VW ``u`` was left out of the job by an earlier loss."""
    return any(r["vw"] == u and r["outcome"] in ("dropped", "finished") for r in js.reforms)


def _with_vw(
    plan: JobPlan | None, v: int, layout: VWLayout | None, position: int, left: int, base: int
) -> JobPlan:
    """``plan`` with VW ``v`` re-formed as ``layout`` (None: as it was, left out), reading
    its data on from ``position`` for ``left`` more minibatches, its own wave 0 the shards'
    wave ``base``; the other VWs unchanged."""
    assert plan is not None
    vws = list(plan.vws)
    if layout is not None:
        vws[v] = layout
    n = len(plan.vws)
    bases = tuple(base if u == v else plan.base_of(u) for u in range(n))
    return dataclasses.replace(
        plan,
        vws=tuple(vws),
        owed=_owed(plan, v, left),
        starts=_starts(plan, v, position),
        bases=bases,
    )


def _owed(plan: JobPlan, v: int, left: int) -> tuple[int, ...]:
    """Each VW's minibatches in the plan, VW ``v``'s now ``left``."""
    return tuple(left if u == v else plan.minibatches_of(u) for u in range(len(plan.vws)))


def _starts(plan: JobPlan, v: int, position: int) -> tuple[int, ...]:
    """Each VW's data position at the attempt's start, VW ``v``'s now ``position``."""
    return tuple(position if u == v else plan.start_of(u) for u in range(len(plan.vws)))


def _drop_meets(head: Any, wire: str, v: int) -> None:
    """Forget the migration steps VW ``v`` was meeting at (its stages are gone)."""
    meets: Mapping[Any, Any] | None = getattr(head, "_migration_meets", None)
    if not meets:
        return
    for key in [k for k in meets if k[0] == wire and k[1] == v]:
        del meets[key]  # type: ignore[attr-defined]
