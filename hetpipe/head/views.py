"""What the head shows of its jobs and its cluster: status views, live telemetry, and the
diagnosis of a job that makes no progress.

Everything here reads the head's state and changes nothing but the job's ``diagnosis`` and
its metrics file; the views are plain data for ``job_status``/``cluster_status`` and the CLI.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hetpipe.config import ClusterConfig
from hetpipe.head import drift
from hetpipe.head.reform import pushed_before_reforms
from hetpipe.head.states import FINISHED
from hetpipe.jobplan import JobPlan
from hetpipe.jobstore import TRACE, job_dir, read_result, summary
from hetpipe.rotation import RotatingJsonl

if TYPE_CHECKING:
    from hetpipe.head.jobs import JobState
    from hetpipe.head.registry import Registry

__all__ = [
    "cluster_view",
    "diagnose",
    "job_summary",
    "job_view",
    "metrics_line",
    "progress_signature",
    "stage_time",
    "telemetry",
    "trace_of",
]

# the figures of each stage a status shows
_STAGE_FIGURES = (
    "done",
    "forward_s",
    "backward_s",
    "peak_bytes",
    "peak_memory",
    "peak_in_flight",
    "allocator_peak",
    "shares",
    "waiting",
)
# the fields of each line of a job's metrics file
_METRICS = ("minibatches", "samples_per_s", "global_clock", "loss", "vws", "stages", "evals")
# (and, on the line written at each evaluation, "validation": its figures, hetpipe.head.jobs)


def stage_time(progress: dict[str, Any]) -> float | None:
    """Measured compute time per minibatch of a stage (forward + backward)."""
    done = progress.get("done")
    if not done:
        return None
    return (progress.get("forward_s", 0.0) + progress.get("backward_s", 0.0)) / done


def job_view(js: JobState) -> dict[str, Any]:
    """A job as plain data for ``job_status`` and the CLI."""
    out: dict[str, Any] = {
        "id": js.id,
        "name": js.spec.name,
        "owner": js.owner,
        "state": js.state.value,
        "error": js.error,
        "minibatch": js.spec.minibatch,
    }
    now = js.finished or time.time()
    if js.started:
        out["seconds"] = now - js.started
    plan = js.plan
    if plan is not None:
        out.update(_plan_view(js, plan))
    if js.resume is not None:
        meta = js.resume.meta
        out["resumed_from"] = {
            "job": js.resumed_of or meta.get("job"),
            "checkpoint": str(js.resume.path),
            "minibatches_done": meta.get("minibatches_done"),
            "positions": meta.get("positions"),
            "wave": meta.get("wave"),
            **({"lost": js.lost} if js.lost is not None else {}),
        }
    if js.checkpoints:
        out["checkpoints"] = js.checkpoints
        out["checkpoint_s"] = js.checkpoint_s
        out["checkpoint_stage_s"] = js.checkpoint_stage_s
        out["last_checkpoint"] = js.last_checkpoint
    if js.checkpoints_superseded:
        out["checkpoints_superseded"] = js.checkpoints_superseded
    if js.waiting is not None:  # paused for a lost shard (hetpipe.head.shardwait)
        out["waiting"] = dict(js.waiting)
    if js.shard_waits:
        out["shard_waits"] = js.shard_waits
    if js.replans:
        out["replans"] = [{k: v for k, v in r.items() if not k.startswith("_")} for r in js.replans]
    if js.migrations:
        out["migrations"] = js.migrations
    if js.reforms:  # VWs re-formed or left out after a lost worker (hetpipe.head.reform)
        out["reforms"] = [{k: v for k, v in r.items() if not k.startswith("_")} for r in js.reforms]
    if js.evals:
        out["evals"] = js.evals
    if js.validation:
        out["validation"] = js.validation
    if js.diagnosis:
        out["diagnosis"] = js.diagnosis
    if js.watch is not None and js.watch.decisions:
        out["replan_decisions"] = js.watch.records()
    out.update(js.result)
    return out


def _plan_view(js: JobState, plan: JobPlan) -> dict[str, Any]:
    """The part of a job's view that its plan and its stages' progress make."""
    # a re-formed VW's plan owes it only what was left at its restart
    pushed = pushed_before_reforms(js.reforms, plan.job)
    out: dict[str, Any] = {"total": plan.total_minibatches + pushed}
    vws = []
    done_all = 0
    for v, vwp in enumerate(plan.vws):
        last = js.progress.get((v, len(vwp.stages) - 1), {})
        done = last.get("done", 0)
        done_all += done
        vws.append(
            {
                "vw": v,
                "devices": [s.device for s in vwp.stages],
                "nm": vwp.nm,
                "done": done,
                "loss": last.get("loss"),
                "clock": last.get("vw_clock", 0),
                "wave": last.get("wave", 0),
                "samples_per_s": done * js.spec.minibatch / last["elapsed_s"]
                if last.get("elapsed_s")
                else 0.0,
            }
        )
    out["vws"] = vws
    out["minibatches"] = done_all + pushed
    # each VW's place in the whole job (a resumed attempt starts further on)
    out["positions"] = [plan.start_of(v) + vw["done"] for v, vw in enumerate(vws)]
    out["global_clock"] = min((v["clock"] for v in vws), default=0)
    losses = [v["loss"] for v in vws if v["loss"] is not None]
    out["loss"] = sum(losses) / len(losses) if losses else None
    out["samples_per_s"] = sum(v["samples_per_s"] for v in vws)
    out["stages"] = [
        {
            "vw": v,
            "stage": s,
            "device": st.device,
            "layers": [st.first, st.last],
            "replicas": list(st.replicas),  # the devices beside it (hetpipe.replicas)
            **{k: js.progress.get((v, s), {}).get(k) for k in _STAGE_FIGURES},
            "time_s": stage_time(js.progress.get((v, s), {})),
        }
        for v, vwp in enumerate(plan.vws)
        for s, st in enumerate(vwp.stages)
    ]
    out["placement"] = plan.placement_summary()
    if "samples_per_s" in plan.predicted:
        out["predicted"] = {k: v for k, v in plan.predicted.items() if k != "state_bytes"}
    return out


def job_summary(js: JobState) -> dict[str, Any]:
    """A few fields for listings: a finished job's whole view is kilobytes."""
    return summary(job_view(js))


def cluster_view(
    cluster: ClusterConfig,
    registry: Registry,
    jobs: dict[str, JobState],
    current: JobState | None,
) -> dict[str, Any]:
    """The cluster as plain data for ``cluster_status``: every device of the cluster file
    with its worker (``down`` where none registered), the shards, and the jobs."""
    now = time.monotonic()
    workers = []
    for dev in cluster.devices:
        w = registry.workers.get(dev.name)
        workers.append(
            {
                "device": dev.name,
                "type": dev.type,
                "speed": dev.speed,
                "memory": dev.memory,
                "node": dev.node,
                "state": "down" if w is None else ("lost" if w.lost else w.state),
                "pid": None if w is None else w.pid,
                "address": None if w is None else w.address,
                "job": None if w is None else w.job,
                "vw": None if w is None else w.vw,
                "stage": None if w is None else w.stage,
                "seen_s_ago": None if w is None else now - w.last_seen,
            }
        )
    views = [job_summary(js) if js.state in FINISHED else job_view(js) for js in jobs.values()]
    return {
        "workers": workers,
        "shards": {str(k): v for k, v in registry.shards.items()},
        "shards_lost": sorted(registry.shards_lost),
        "security": {"curve": cluster.security.curve},
        "jobs": views,
        "current": current.id if current else None,
    }


def trace_of(
    run_dir: Path, jobs: dict[str, JobState], job: str
) -> tuple[dict[str, Any] | None, str | None]:
    """A finished job's trace from its directory (also for jobs the head forgot), or why
    there is none: ``(trace, None)`` or ``(None, problem)``."""
    d = job_dir(run_dir, job)
    path = d / TRACE if d is not None else None
    if path is not None and path.exists():
        return json.loads(path.read_text()), None
    js = jobs.get(job)
    if js is None and read_result(run_dir, job) is None:
        return None, f"no job {job!r}"
    if js is not None and js.state not in FINISHED:
        return None, f"no trace for job {job!r} yet: it is {js.state}"
    return None, f"job {job!r} left no trace (it ended before its stages finished)"


# -- hangs --------------------------------------------------------------------------------------


def progress_signature(progress: dict[tuple[int, int], dict[str, Any]]) -> tuple[Any, ...]:
    """What changes whenever any stage runs a forward or a backward: a job whose signature
    stays the same for ``hang_after_s`` makes no progress."""
    return tuple((p.get("done"), p.get("forwards")) for _, p in sorted(progress.items()))


def diagnose(
    plan: JobPlan,
    progress: dict[tuple[int, int], dict[str, Any]],
    now: float,
    global_clock: int | None,
) -> list[str]:
    """One line per stage: what it has been waiting for (or computing), and how long."""
    lines = []
    for v, vw in enumerate(plan.vws):
        for s in range(len(vw.stages)):
            where = plan.where(v, s)
            w = progress.get((v, s), {}).get("waiting")
            if not w:
                lines.append(f"{where} reports nothing it waits for")
                continue
            dt = now - w.get("since", now)
            kind, p = w.get("kind"), w.get("p")
            if kind in ("forward", "backward"):
                lines.append(f"{where} has been running the {kind} of minibatch {p} for {dt:.0f} s")
            elif kind == "activation":
                lines.append(
                    f"{where} waits {dt:.0f} s for the activation of minibatch {p} "
                    f"from {plan.where(v, s - 1)}"
                )
            elif kind == "gradient":
                lines.append(
                    f"{where} waits {dt:.0f} s for the gradient of minibatch {p} "
                    f"from {plan.where(v, s + 1)}"
                )
            elif kind == "pull":
                lines.append(
                    f"{where} waits {dt:.0f} s at the WSP gate: the pull of wave "
                    f"{w.get('wave')} needs global clock >= {w.get('need')}, "
                    f"it is {global_clock}"
                )
            elif kind == "reduce":
                lines.append(
                    f"{where} waits {dt:.0f} s for the other virtual workers' "
                    f"gradients of iteration {w.get('wave')}"
                )
            elif kind == "replicas":
                lines.append(
                    f"{where} waits {dt:.0f} s for its replicas' gradients of "
                    f"minibatch {p} ({', '.join(vw.stages[s].replicas)})"
                )
            else:
                lines.append(f"{where} waits {dt:.0f} s for {kind}")
    return lines


def metrics_line(info: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """One line of a job's metrics file from its view ``info``: the live figures, and
    ``extra`` (an evaluation's ``validation`` entry, hetpipe.head.jobs)."""
    return {"t": time.time(), **{k: info.get(k) for k in _METRICS}, **extra}


async def telemetry(js: JobState, metrics: RotatingJsonl, log: Any, every_s: float = 1.0) -> None:
    """Append the live figures of ``js`` to its metrics file every ``every_s``; diagnose a
    hang.

    A job hangs when no stage ran a forward or a backward for ``hang_after_s``; the
    diagnosis says, for each stage, what it has been waiting for and since when.
    """
    last_sig: tuple[Any, ...] = ()
    last_change = time.time()

    def record() -> dict[str, Any]:
        info = job_view(js)
        metrics.append(metrics_line(info))
        return info

    try:
        while True:
            await asyncio.sleep(every_s)
            info = record()
            for decision in drift.tick(js, log):  # [replan]: hetpipe.head.drift
                metrics.append(metrics_line(info, replan=decision))
            for gain in drift.gains(js, log):  # a migration's measured gain
                metrics.append(gain)
            now = time.time()
            sig = progress_signature(js.progress)
            if sig != last_sig:
                last_sig, last_change = sig, now
                if js.diagnosis:
                    log.info("job moving again", job=js.id)
                js.diagnosis = []
            elif now - last_change >= js.spec.hang_after_s and js.plan is not None:
                diagnosis = diagnose(js.plan, js.progress, now, info.get("global_clock"))
                if diagnosis != js.diagnosis:
                    js.diagnosis = diagnosis
                    log.warning(
                        "job makes no progress",
                        job=js.id,
                        silent_s=round(now - last_change, 1),
                        diagnosis=diagnosis,
                    )
    finally:
        record()  # the last figures, also for a job shorter than one tick
        for gain in drift.gains(js, log):  # one that ended right after its migration
            metrics.append(gain)
