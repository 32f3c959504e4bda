"""The head (inside shard 0): registry of workers and shards, job queue, job life cycle.

The head accepts jobs, turns each into stage assignments, hands the initial weights to the
shards, starts the stages, follows their progress, fails a job whose worker or shard goes
silent or reports an error (telling the other stages to drop it), and at the end gathers the
global weights, evaluates them, and writes them as one PyTorch state_dict. Jobs run one after
another; the daemons stay up between them.

Durability: every ``train.checkpoint_every`` waves (and at the end) each stage sends the
head its state right after its push of that wave, the shards keep the cut of the global
weights at the same wave (:mod:`hetpipe.shard`), and the head writes both as one checkpoint
(:mod:`hetpipe.checkpoint`) once the shards' applied sets prove the cut whole.
``submit --resume`` (and a restarted head, by itself) starts a job from its last complete
checkpoint: the shards get the cut, each stage its local weights and optimizer state, each
virtual worker its data position. With ``train.on_worker_loss = "replan"`` a lost worker
starts a new *attempt* of the job on the live devices, from the last checkpoint where there
is one; each attempt has its own wire id (``<job>.r<n>``), so nothing an abandoned attempt
still sends is taken for the current one's, and a stage of a job the head does not run (it
restarted) is told to stop. An attempt counts waves from 0 on fresh shard clocks; its
stages read data from their virtual worker's position on.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import zmq

from hetpipe import checkpoint
from hetpipe import log as logmod
from hetpipe.config import ClusterConfig, ConfigError, check_address
from hetpipe.daemon import Owner
from hetpipe.job import JobError, JobSpec
from hetpipe.jobcheck import check_job
from hetpipe.jobplan import JobPlan, JobPlanError, plan_job, requested_layouts
from hetpipe.jobstore import TRACE, job_dir, next_number, read_result, write_result
from hetpipe.modelstate import layer_of
from hetpipe.planner import ModelProfile, PlanError, ProfileStore
from hetpipe.planner.profile import at_speed
from hetpipe.profiling import (
    call_from,
    computes_on_cores,
    layers_from,
    live_cluster,
    model_key,
    plan_for,
    plan_vws,
    predicted_summary,
    replica_rows,
)
from hetpipe.ratelog import Throttle, excerpt
from hetpipe.security import CLIENT, CodeError, shard_user, worker_user
from hetpipe.security import check_job as check_code
from hetpipe.trace import chrome_trace
from hetpipe.transport import Channel, RemoteError, make_socket
from hetpipe.wire import Kind, Message

__all__ = ["Head"]

ASSIGN_TIMEOUT_S = 120.0
SHARD_TIMEOUT_S = 120.0
MEASURE_TIMEOUT_S = 600.0
FINISHED = frozenset({"done", "failed", "cancelled"})


@dataclass
class WorkerInfo:
    """A registered ``hetpipe-worker`` as the head sees it."""

    device: str
    ident: bytes
    address: str
    pid: int
    host: str
    type: str
    last_seen: float
    state: str = "idle"
    job: str | None = None
    vw: int | None = None
    stage: int | None = None
    lost: bool = False


@dataclass
class JobState:
    """One submitted job, from queue to result."""

    id: str
    spec: JobSpec
    submitted: float
    state: str = "queued"
    error: str | None = None
    started: float | None = None
    finished: float | None = None
    plan: JobPlan | None = None
    progress: dict[tuple[int, int], dict[str, Any]] = field(default_factory=dict)
    stage_results: dict[tuple[int, int], dict[str, Any]] = field(default_factory=dict)
    result: dict[str, Any] = field(default_factory=dict)
    evals: list[list[float]] = field(default_factory=list)  # [seconds, minibatches, accuracy]
    diagnosis: list[str] = field(default_factory=list)  # what each stage waits for, if hung
    failure: asyncio.Future[str] | None = None
    all_done: asyncio.Event = field(default_factory=asyncio.Event)
    cancelled: bool = False  # the user asked; the job ends "cancelled", not "failed"

    def summary(self) -> dict[str, Any]:
        """A few fields for listings: a finished job's whole ``info`` is kilobytes."""
        info = self.info()
        return {
            k: info[k]
            for k in (
                "id",
                "name",
                "state",
                "error",
                "seconds",
                "total",
                "minibatches",
                "loss",
                "samples_per_s",
                "test_accuracy",
            )
            if info.get(k) is not None
        }

    lost_device: str | None = None  # set when the failure is a lost worker (may re-plan)
    replans: list[dict[str, Any]] = field(default_factory=list)  # what each re-plan did
    resume: checkpoint.Checkpoint | None = None  # submitted with --resume: start from it
    totals: tuple[int, ...] = ()  # minibatches each VW runs in the whole job
    lost: list[int] | None = None  # per VW, minibatches trained after the checkpoint resumed
    checkpoints: int = 0
    checkpoints_superseded: int = 0  # cuts not written: a newer one was ready first
    checkpoint_s: float = 0.0  # head time spent fetching cuts and writing checkpoints
    checkpoint_stage_s: float = 0.0  # stages' time taking their state (slowest, per cut)
    last_checkpoint: dict[str, Any] | None = None
    recovered: bool = False  # queued by a restarted head: wait for the cluster first
    # checkpointed state each stage of the next launch starts from: (meta, tensors)
    restores: dict[tuple[int, int], tuple[dict[str, Any], dict[str, torch.Tensor]]] = field(
        default_factory=dict
    )
    # stage states received for cuts not written yet: (vw, stage) -> wave -> (meta, tensors)
    states: dict[tuple[int, int], dict[int, tuple[dict[str, Any], dict[str, torch.Tensor]]]] = (
        field(default_factory=dict)
    )
    cut_next: int | None = None  # the next cut to write
    cut_queued: int = -1  # the newest cut handed to a writer
    cut_writes: list[asyncio.Task[None]] = field(default_factory=list)
    cut_lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one write at a time

    @property
    def wire_id(self) -> str:
        """The job's name on the wire: one per attempt, so that a stale activation, push or
        report of an attempt given up is never taken for the current one's."""
        return self.plan.job if self.plan is not None else self.id

    def fail(self, reason: str) -> None:
        if self.failure is not None and not self.failure.done():
            self.failure.set_result(reason)

    def info(self) -> dict[str, Any]:
        """Plain data for ``job_status`` and the CLI."""
        out: dict[str, Any] = {
            "id": self.id,
            "name": self.spec.name,
            "state": self.state,
            "error": self.error,
            "minibatch": self.spec.minibatch,
        }
        now = self.finished or time.time()
        if self.started:
            out["seconds"] = now - self.started
        plan = self.plan
        if plan is not None:
            out["total"] = plan.total_minibatches
            vws = []
            done_all = 0
            for v, vwp in enumerate(plan.vws):
                last = self.progress.get((v, len(vwp.stages) - 1), {})
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
                        "samples_per_s": done * self.spec.minibatch / last["elapsed_s"]
                        if last.get("elapsed_s")
                        else 0.0,
                    }
                )
            out["vws"] = vws
            out["minibatches"] = done_all
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
                    **{
                        k: self.progress.get((v, s), {}).get(k)
                        for k in (
                            "done",
                            "forward_s",
                            "backward_s",
                            "peak_bytes",
                            "peak_memory",
                            "peak_in_flight",
                            "shares",
                            "waiting",
                        )
                    },
                    "time_s": _stage_time(self.progress.get((v, s), {})),
                }
                for v, vwp in enumerate(plan.vws)
                for s, st in enumerate(vwp.stages)
            ]
            out["placement"] = plan.placement_summary()
            if "samples_per_s" in plan.predicted:
                out["predicted"] = {k: v for k, v in plan.predicted.items() if k != "state_bytes"}
        if self.resume is not None:
            meta = self.resume.meta
            out["resumed_from"] = {
                "job": meta.get("job"),
                "checkpoint": str(self.resume.path),
                "minibatches_done": meta.get("minibatches_done"),
                "positions": meta.get("positions"),
                "wave": meta.get("wave"),
                **({"lost": self.lost} if self.lost is not None else {}),
            }
        if self.checkpoints:
            out["checkpoints"] = self.checkpoints
            out["checkpoint_s"] = self.checkpoint_s
            out["checkpoint_stage_s"] = self.checkpoint_stage_s
            out["last_checkpoint"] = self.last_checkpoint
        if self.checkpoints_superseded:
            out["checkpoints_superseded"] = self.checkpoints_superseded
        if self.replans:
            out["replans"] = [
                {k: v for k, v in r.items() if not k.startswith("_")} for r in self.replans
            ]
        if self.evals:
            out["evals"] = self.evals
        if self.diagnosis:
            out["diagnosis"] = self.diagnosis
        out.update(self.result)
        return out


class Head:
    """The cluster's head: lives in the shard-0 process and shares its ROUTER socket."""

    def __init__(
        self, cluster: ClusterConfig, owner: Owner, address: str, run_dir: str | None = None
    ) -> None:
        self.cluster = cluster
        self.owner = owner
        self.address = address
        self.run_dir = Path(run_dir or cluster.runtime.run_dir)
        self.workers: dict[str, WorkerInfo] = {}
        self.shards: dict[int, str] = {0: address}
        self.shard_seen: dict[int, float] = {}  # monotonic time of each shard's last hello
        self.shards_lost: set[int] = set()
        self.shard_channels: dict[int, Channel] = {}
        self.jobs: dict[str, JobState] = {}
        self.queue: asyncio.Queue[JobState] = asyncio.Queue()
        self.current: JobState | None = None
        self.channel: Channel | None = None
        self._ids = itertools.count(next_number(self.run_dir))
        self._stopping = False
        self.profiles = ProfileStore(self.run_dir / "profiles.json")
        self._profiling = asyncio.Lock()
        self.log = logmod.get("head")
        # refused registrations and requests outside a peer's role, once per peer a while
        self._refused = Throttle(self.log)

    async def start(self, channel: Channel) -> None:
        self.channel = channel
        self._recover()
        self.owner.spawn(self._run_jobs(), "jobs")
        self.owner.spawn(self._watch(), "watch")

    async def stop(self) -> None:
        self._stopping = True  # the current job is interrupted, not failed: resume it later
        if self.current is not None:
            self.current.fail("the head is shutting down")
            await asyncio.sleep(0.2)

    # -- authority: who may send what (Curve user ids; None = security off, all trusted) ----

    CLIENT_KINDS = frozenset(
        {
            Kind.SUBMIT,
            Kind.JOB_STATUS,
            Kind.CLUSTER_STATUS,
            Kind.CANCEL,
            Kind.TRACE,
            Kind.PROFILE,
            Kind.PLAN,
        }
    )

    def _allowed(self, msg: Message) -> bool:
        """Clients submit, read and cancel jobs; a worker speaks only for its own device and
        its own stage; a shard only for its own index."""
        user, k = msg.user, msg.kind
        if user is None:
            return True
        if k in self.CLIENT_KINDS:
            return user == CLIENT
        if k in (Kind.HELLO, Kind.HEARTBEAT):
            return user == worker_user(msg["device"])
        if k == Kind.SHARD_HELLO:
            return user == shard_user(msg["shard"])
        if k in (Kind.REPORT, Kind.STAGE_DONE, Kind.STAGE_FAILED, Kind.STAGE_STATE):
            js = self._by_wire(msg["job"])
            return js is not None and any(
                user == worker_user(w.device)
                and w.job == js.id
                and (w.vw, w.stage) == (msg["vw"], msg["stage"])
                for w in self.workers.values()
            )
        return True  # replies, and kinds the head refuses anyway

    # -- messages ---------------------------------------------------------------------------

    async def handle(self, peer: bytes | None, msg: Message) -> None:
        assert self.channel is not None and peer is not None
        k = msg.kind
        if self._orphan(msg):
            # a stage of a job this head does not run (it restarted, or gave the attempt
            # up): tell its worker to drop it rather than let it wait for shards forever
            await self.channel.send(
                Kind.ABORT,
                {
                    "job": msg["job"],
                    "reason": ("the head does not run this job (it restarted or gave it up)"),
                },
                to=peer,
            )
            return
        if not self._allowed(msg):
            self._refused.warning(
                "request refused: not this peer's role",
                str(msg.user),
                f"{msg.user} may not send {k}",
                kind=str(k),
            )
            await self.channel.reply_error(peer, f"{msg.user} may not send {k}", msg.get("rid"))
            return
        if k == Kind.HELLO:
            problem = self._hello(peer, msg)
            if problem is not None:
                self._refused.warning("registration refused", _who(peer), problem)
                await self.channel.reply_error(peer, problem)
                return
            await self.channel.send(
                Kind.WELCOME,
                {
                    "heartbeat_s": self.cluster.runtime.heartbeat_s,
                    "lost_after_s": self.cluster.runtime.lost_after_s,
                },
                to=peer,
            )
        elif k == Kind.HEARTBEAT:
            w = self.workers.get(msg["device"])
            if w is None or w.ident != peer or w.lost:
                # a lost worker that speaks again registers afresh (clean bookkeeping)
                await self.channel.reply_error(peer, "unregistered: say hello")
                return
            w.last_seen = time.monotonic()
            w.state = msg["state"]
        elif k == Kind.SHARD_HELLO:
            problem = self._shard_problem(msg)
            if problem is not None:
                self._refused.warning("registration refused", _who(peer), problem)
                await self.channel.reply_error(peer, problem)
                return
            self.shard_seen[msg["shard"]] = time.monotonic()
            if msg["shard"] in self.shards_lost:
                self.shards_lost.discard(msg["shard"])
                self.log.info("shard back", shard=msg["shard"])
            if self.shards.get(msg["shard"]) != msg["address"]:
                self.log.info("shard registered", shard=msg["shard"], address=msg["address"])
                old = self.shard_channels.pop(msg["shard"], None)
                if old is not None:
                    await old.close()
            self.shards[msg["shard"]] = msg["address"]
        elif k == Kind.SUBMIT:
            await self._submit(peer, msg)
        elif k == Kind.JOB_STATUS:
            info = self.job_info(msg["job"])
            if info is None:
                await self.channel.reply_error(peer, f"no job {msg['job']!r}", msg["rid"])
            else:
                await self.channel.send(Kind.OK, {"rid": msg["rid"], "info": info}, to=peer)
        elif k == Kind.CLUSTER_STATUS:
            await self.channel.send(
                Kind.OK, {"rid": msg["rid"], "info": self.cluster_info()}, to=peer
            )
        elif k == Kind.CANCEL:
            js = self.jobs.get(msg["job"])
            if js is None:
                await self.channel.reply_error(peer, f"no job {msg['job']!r}", msg["rid"])
                return
            if js.state in FINISHED:
                await self.channel.reply_error(
                    peer, f"job {js.id} has already ended ({js.state})", msg["rid"]
                )
                return
            js.cancelled = True
            if js.state == "queued":
                js.state, js.error = "cancelled", "cancelled by the user"
                js.finished = time.time()
                self._retire(js)
            js.fail("cancelled by the user")
            self.log.info("job cancel requested", job=js.id)
            await self.channel.send(
                Kind.OK, {"rid": msg["rid"], "info": {"state": js.state}}, to=peer
            )
        elif k in (Kind.REPORT, Kind.STAGE_DONE, Kind.STAGE_FAILED):
            self._stage_message(msg)
        elif k == Kind.STAGE_STATE:
            self._stage_state(msg)
        elif k == Kind.TRACE:
            await self._trace(peer, msg)
        elif k in (Kind.PROFILE, Kind.PLAN):
            # these wait on workers' answers, which arrive through this same reader
            self.owner.spawn(self._plan_request(peer, msg), f"{k}:{msg['rid']}")
        else:
            await self.channel.reply_error(peer, f"the head does not take {k}", msg.get("rid"))

    def job_info(self, job: str) -> dict[str, Any] | None:
        """A job's status from memory, else from its directory; ``source`` says which."""
        js = self.jobs.get(job)
        if js is not None:
            return {**js.info(), "source": "head"}
        info = read_result(self.run_dir, job)
        if info is not None:
            return {**info, "source": "disk"}
        return None

    async def _trace(self, peer: bytes, msg: Message) -> None:
        """A finished job's trace from its directory, also for jobs this head forgot."""
        assert self.channel is not None
        job, rid = msg["job"], msg["rid"]
        d = job_dir(self.run_dir, job)
        path = d / TRACE if d is not None else None
        if path is not None and path.exists():
            await self.channel.send(
                Kind.OK, {"rid": rid, "info": json.loads(path.read_text())}, to=peer
            )
            return
        js = self.jobs.get(job)
        if js is None and read_result(self.run_dir, job) is None:
            problem = f"no job {job!r}"
        elif js is not None and js.state not in FINISHED:
            problem = f"no trace for job {job!r} yet: it is {js.state}"
        else:
            problem = f"job {job!r} left no trace (it ended before its stages finished)"
        await self.channel.reply_error(peer, problem, rid)

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

    async def _plan_request(self, peer: bytes, msg: Message) -> None:
        """Answer ``profile`` (the profiles of every type) or ``plan`` (the plan it would run)."""
        assert self.channel is not None
        try:
            spec = JobSpec.from_dict(msg["job"], source="job")
            # the job checks start with the code policy (nothing is imported before it)
            await asyncio.get_running_loop().run_in_executor(
                None, check_job, spec, self.cluster, "job"
            )
            if msg.kind == Kind.PLAN:
                profile, rows = await self._profiles(spec)
            else:
                profile = await self._profile(spec)
            info: dict[str, Any] = {"profile": profile.to_dict()}
            if msg.kind == Kind.PLAN:
                loop = asyncio.get_running_loop()
                cluster = live_cluster(self.cluster, self._idle())
                plan = await loop.run_in_executor(None, plan_for, spec, cluster, profile, rows)
                info = {"plan": plan.to_dict(), "table": plan.table()}
        except (JobError, CodeError, PlanError, _JobFailed) as exc:
            await self.channel.reply_error(peer, str(exc), msg["rid"])
            return
        await self.channel.send(Kind.OK, {"rid": msg["rid"], "info": info}, to=peer)

    def _idle(self) -> set[str]:
        return {d for d, w in self._alive().items() if w.job is None}

    async def _profiles(self, spec: JobSpec) -> tuple[ModelProfile, dict[int, ModelProfile]]:
        """The job's profile, and its model profiled at the rows its stage replicas may hold
        (:func:`hetpipe.profiling.replica_rows`; stored like every profile). A replica's
        compute is read off the latter against the former, so both are measured back to
        back: where a row profile is missing, the stored full one is measured again, lest
        the planner decide on two different moments' load on a shared host."""
        rows = replica_rows(spec)
        key = model_key(spec)
        types = {w.type for w in self._alive().values()}
        if any(self.profiles.get(key, r, t) is None for r in rows for t in types):
            self.profiles.forget(key, spec.minibatch)
        profile = await self._profile(spec)
        return profile, {
            r: await self._profile(dataclasses.replace(spec, minibatch=r)) for r in rows
        }

    async def _profile(self, spec: JobSpec) -> ModelProfile:
        """Profiles of the job's model for every device type with a live worker.

        Missing ones are measured by an idle worker of that type and stored, so each
        (model, minibatch, type) is measured once per run directory; the emulated types of
        one node are measured once, on one of them (:func:`computes_on_cores`).
        """
        assert self.channel is not None
        key = model_key(spec)
        async with self._profiling:
            types = sorted({w.type for w in self._alive().values()})
            on_cores: dict[str, tuple[float, dict[str, Any]]] = {}  # node: (speed, measured)
            for dtype in types:
                if self.profiles.get(key, spec.minibatch, dtype) is not None:
                    continue
                of_type = [w for w in self._alive().values() if w.type == dtype]
                twin = next(
                    (
                        d
                        for d in (self.cluster.device(w.device) for w in of_type)
                        if d.node in on_cores and computes_on_cores(d)
                    ),
                    None,
                )
                if twin is not None:  # its node's cores measured already: over its speed
                    speed, info = on_cores[twin.node]
                    layers, call = at_speed(layers_from(info), call_from(info), speed, twin.speed)
                    self.log.info(
                        "profile from the same cores",
                        model=spec.model.name,
                        type=dtype,
                        device=twin.name,
                    )
                else:
                    worker, info = await self._measure(spec, dtype, of_type)
                    layers, call = layers_from(info), call_from(info)
                    device = self.cluster.device(worker.device)
                    if computes_on_cores(device):
                        on_cores[device.node] = (device.speed, info)
                self.profiles.put(
                    key, spec.minibatch, dtype, layers, input_bytes=info["input_bytes"], call=call
                )
            self.profiles.save()
            if not types:
                raise _JobFailed("no live worker: start them (`hetpipe up`)")
            return self.profiles.model_profile(key, spec.minibatch, types)

    async def _measure(
        self, spec: JobSpec, dtype: str, of_type: list[WorkerInfo]
    ) -> tuple[WorkerInfo, dict[str, Any]]:
        """Profile ``spec``'s model on an idle worker of ``dtype``: the worker, its answer."""
        assert self.channel is not None
        worker = next((w for w in of_type if w.job is None), None)
        if worker is None:
            raise _JobFailed(f"no idle worker of type {dtype} to profile {spec.model.name} on")
        self.log.info("profiling", model=spec.model.name, type=dtype, device=worker.device)
        try:
            reply = await self.channel.request(
                Kind.MEASURE,
                {"job": spec.to_dict()},
                to=worker.ident,
                timeout=MEASURE_TIMEOUT_S,
                what=f"worker {worker.device}",
            )
        except (RemoteError, TimeoutError, ConnectionError) as exc:
            raise _JobFailed(f"profiling on {worker.device}: {exc}") from None
        return worker, reply["info"]

    def _shard_problem(self, msg: Message) -> str | None:
        """Why a ``shard_hello`` is refused, or None: only the cluster file's shards register.

        The head is shard 0 itself; an index outside the file (or a malformed address) once
        took the place of a real shard and broke every later job that placed state there.
        """
        index, n = msg["shard"], len(self.cluster.ps)
        if not 1 <= index < n:
            return (
                f"shard_hello refused: shard {index} is not a shard of "
                f"{self.cluster.path} (1..{n - 1} register; 0 is this head)"
            )
        try:
            check_address(msg["address"])
        except ValueError as exc:
            return f"shard_hello refused: shard {index}: {exc}"
        return None

    def _hello(self, peer: bytes, msg: Message) -> str | None:
        """Register a worker; the reason it is refused, or None."""
        device = msg["device"]
        try:
            spec = self.cluster.device(device)
        except ConfigError:
            return f"hello refused: {device!r} is not a device of {self.cluster.path}"
        if msg["type"] != spec.type:
            return (
                f"hello refused: {device} is of type {spec.type!r} in "
                f"{self.cluster.path}, the worker says {msg['type']!r}"
            )
        try:
            check_address(msg["address"])
        except ValueError as exc:
            return f"hello refused: {device}: {exc}"
        old = self.workers.get(device)
        if old is not None and old.job is not None and old.ident != peer:
            js = self.jobs.get(old.job)
            if js is not None:
                js.lost_device = device
                js.fail(f"worker {device} restarted (pid {old.pid} -> {msg['pid']})")
        self.workers[device] = WorkerInfo(
            device=device,
            ident=peer,
            address=msg["address"],
            pid=msg["pid"],
            host=msg["host"],
            type=spec.type,
            last_seen=time.monotonic(),
        )
        self.log.info("worker registered", device=device, address=msg["address"], pid=msg["pid"])
        return None

    def _orphan(self, msg: Message) -> bool:
        """A worker's message about a job (attempt) this head does not know."""
        if msg.kind not in (
            Kind.HEARTBEAT,
            Kind.REPORT,
            Kind.STAGE_DONE,
            Kind.STAGE_FAILED,
            Kind.STAGE_STATE,
        ):
            return False
        job = msg.get("job")
        if not job or self._by_wire(job) is not None:
            return False
        return msg.user is None or msg.user.startswith("worker-")

    def _by_wire(self, wire_id: str) -> JobState | None:
        """The job whose current attempt is ``wire_id`` (None for an attempt given up)."""
        js = self.jobs.get(wire_id.rpartition(".r")[0]) or self.jobs.get(wire_id)
        return js if js is not None and js.wire_id == wire_id else None

    def _stage_message(self, msg: Message) -> None:
        js = self._by_wire(msg["job"])
        if js is None or js.state != "running":
            return
        key = (msg["vw"], msg["stage"])
        if msg.kind == Kind.REPORT:
            js.progress[key] = msg["stats"]
        elif msg.kind == Kind.STAGE_DONE:
            js.progress[key] = msg["stats"]
            js.stage_results[key] = {"stats": msg["stats"], "records": msg["records"]}
            assert js.plan is not None
            if len(js.stage_results) == js.plan.n_stages:
                js.all_done.set()
        else:
            where = js.plan.where(*key) if js.plan else f"vw{key[0]}/stage{key[1]}"
            js.fail(f"{where} failed: {msg['error']}")

    async def _submit(self, peer: bytes, msg: Message) -> None:
        assert self.channel is not None
        try:
            resume = self._checkpoint_of(msg["resume"]) if msg.get("resume") else None
            job = msg.get("job") or (resume.meta["spec"] if resume is not None else None)
            if job is None:
                raise CodeError("submit: give a job, or the id of one to resume")
            check_code(job, self.cluster.security.allowed_modules)
            spec = JobSpec.from_dict(job, source="job")
        except (JobError, CodeError, _JobFailed) as exc:
            self.log.warning("job refused at submit", error=excerpt(exc))
            await self.channel.reply_error(peer, str(exc), msg["rid"])
            return
        job_id = self._new_id(spec.name)
        js = JobState(id=job_id, spec=spec, submitted=time.time(), resume=resume)
        self.jobs[job_id] = js
        await self.queue.put(js)
        self.log.info("job queued", job=job_id)
        await self.channel.send(Kind.OK, {"rid": msg["rid"], "info": {"job": job_id}}, to=peer)

    def _new_id(self, name: str) -> str:
        """A job id not used by this head nor by any job in its run directory (a restarted
        head must not write over an earlier job's outputs and checkpoints)."""
        return f"{name}-{next(self._ids)}"  # the count starts after the jobs on disk

    # -- after a restart: jobs the previous head was running ---------------------------------

    def _record(self, js: JobState, **extra: Any) -> None:
        """``<job dir>/job.json``: the job's state as the head last knew it (atomic)."""
        path = self.job_dir(js) / "job.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"id": js.id, "state": js.state, "error": js.error, **extra}))
        tmp.replace(path)

    def _recover(self) -> None:
        """Queue again, from their last checkpoint, the jobs a previous head left running.

        A job whose ``job.json`` still says ``running`` was cut off by the head's death (or
        ``interrupted``, by its shutdown); one with a complete checkpoint is resumed as a new
        job once the cluster is back (its old record then names the new id), one without is
        recorded as lost.
        """
        for record in sorted((self.run_dir / "jobs").glob("*/job.json")):
            try:
                old = json.loads(record.read_text())
            except (OSError, ValueError):
                continue
            if old.get("state") not in ("running", "interrupted"):
                continue
            skipped: list[str] = []
            ck = checkpoint.latest(record.parent, skipped)
            for why in skipped:
                self.log.warning(
                    "damaged checkpoint skipped", job=old.get("id"), error=excerpt(why, 300)
                )
            try:
                if ck is None:
                    raise JobError("no complete checkpoint")
                spec = JobSpec.from_dict(ck.meta["spec"], source=str(ck.path))
                check_code(spec, self.cluster.security.allowed_modules)
            except (JobError, CodeError, KeyError) as exc:
                old.update(state="lost", error=f"the head restarted; cannot resume: {exc}")
                record.write_text(json.dumps(old))
                continue
            js = JobState(
                id=self._new_id(spec.name),
                spec=spec,
                submitted=time.time(),
                resume=ck,
                recovered=True,
            )
            self.jobs[js.id] = js
            self.queue.put_nowait(js)
            old.update(state="resumed", resumed_as=js.id)
            record.write_text(json.dumps(old))
            self.log.warning(
                "resuming a job the previous head was running",
                job=old["id"],
                new=js.id,
                checkpoint=str(ck.path),
            )

    async def _wait_for_cluster(self, timeout: float) -> None:
        """Until every device and shard of the cluster file has registered (or ``timeout``)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while loop.time() < deadline:
            devices = {d.name for d in self.cluster.devices}
            if devices <= set(self._alive()) and len(self.shards) == len(self.cluster.ps):
                return
            await asyncio.sleep(0.2)

    def _checkpoint_of(self, job_id: str) -> checkpoint.Checkpoint:
        """The last complete checkpoint of job ``job_id`` in this head's run directory."""
        d = job_dir(self.run_dir, job_id)
        if d is None:
            raise _JobFailed(f"resume: {excerpt(job_id, 80)!r} is not a job id")
        skipped: list[str] = []
        ck = checkpoint.latest(d, skipped)
        for why in skipped:
            self.log.warning("damaged checkpoint skipped", job=job_id, error=excerpt(why, 300))
        if ck is None:
            raise _JobFailed(
                f"no complete checkpoint of job {job_id!r} in {d.resolve() / 'checkpoints'}"
            )
        return ck

    def cluster_info(self) -> dict[str, Any]:
        now = time.monotonic()
        workers = []
        for dev in self.cluster.devices:
            w = self.workers.get(dev.name)
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
        jobs = [js.summary() if js.state in FINISHED else js.info() for js in self.jobs.values()]
        return {
            "workers": workers,
            "shards": {str(k): v for k, v in self.shards.items()},
            "shards_lost": sorted(self.shards_lost),
            "security": {"curve": self.cluster.security.curve},
            "jobs": jobs,
            "current": self.current.id if self.current else None,
        }

    # -- liveness ---------------------------------------------------------------------------

    async def _watch(self) -> None:
        lost_after = self.cluster.runtime.lost_after_s
        while True:
            await asyncio.sleep(min(0.5, lost_after / 4))
            now = time.monotonic()
            for w in list(self.workers.values()):
                silent = now - w.last_seen
                if w.lost or silent <= lost_after:
                    continue
                w.lost = True
                self.log.warning(
                    "worker lost", device=w.device, pid=w.pid, silent_s=round(silent, 1)
                )
                if w.job is not None and w.job in self.jobs:
                    self.jobs[w.job].lost_device = w.device
                    self.jobs[w.job].fail(
                        f"worker {w.device} (pid {w.pid}, vw{w.vw}/stage{w.stage}) lost: "
                        f"no heartbeat for {silent:.1f} s"
                    )
            self._watch_shards(now, lost_after)

    def _watch_shards(self, now: float, lost_after: float) -> None:
        """A shard silent for ``lost_after_s`` is lost: the job using it fails, never hangs.

        Shards say ``shard_hello`` every ``max(heartbeat_s, 1)`` seconds; shard 0 is this
        process. A lost shard is left out of new plans until it says hello again.
        """
        for index, seen in self.shard_seen.items():
            silent = now - seen
            if index in self.shards_lost or silent <= lost_after + 1.0:
                continue
            self.shards_lost.add(index)
            self.log.warning("shard lost", shard=index, silent_s=round(silent, 1))
            js = self.current
            if js is not None and js.plan is not None and index in js.plan.shards_used():
                js.fail(
                    f"shard {index} ({self.shards.get(index)}) lost: no hello for {silent:.1f} s"
                )

    # -- jobs -------------------------------------------------------------------------------

    async def _run_jobs(self) -> None:
        while True:
            js = await self.queue.get()
            if js.state != "queued":
                continue
            self.current = js
            try:
                await self._run_job(js)
            except Exception as exc:  # a bug in one job must not stop the queue
                self.log.exception("job crashed", job=js.id)
                js.state, js.error = "failed", f"internal error: {exc}"
            finally:
                js.finished = js.finished or time.time()
                self.current = None
                self._retire(js)

    async def _run_job(self, js: JobState) -> None:
        loop = asyncio.get_running_loop()
        js.failure = loop.create_future()
        if js.recovered:
            await self._wait_for_cluster(self.cluster.runtime.lost_after_s * 6)
        js.state = "planning"
        log = self.log.bind(job=js.id)
        try:
            vws, predicted = None, None
            spec = js.spec
            try:  # the CLI checked this already; other clients may not have
                await loop.run_in_executor(None, check_job, spec, self.cluster, "job")
            except JobError as exc:
                raise JobPlanError(str(exc)) from None
            needs_plan = not spec.vws or any(v.layers is None for v in spec.vws)
            try:
                profile, rows = await self._profiles(spec)
                cluster = live_cluster(self.cluster, self._idle())
                plan = await loop.run_in_executor(None, plan_for, spec, cluster, profile, rows)
                if spec.schedule == "auto":  # the planner chose: the job runs its choice
                    spec = js.spec = dataclasses.replace(
                        spec, schedule=plan.schedule, nm=plan.vws[0].nm, warmup=plan.warmup
                    )
                    log.info("schedule chosen", why=plan.details.get("schedule_choice"))
                elif spec.warmup is None:  # train.warmup = "auto": the planner's order
                    spec = js.spec = dataclasses.replace(spec, warmup=plan.warmup)
                    log.info("warm-up chosen", warmup=plan.warmup)
                predicted = predicted_summary(plan)
                if needs_plan:
                    vws = plan_vws(plan, spec.activations)
                    log.info("planned", policy=plan.policy, vws=[v.devices for v in plan.vws])
                elif spec.activations == "auto":  # the user's split, the planner's policy
                    vws = requested_layouts(spec, policies=plan_vws(plan, spec.activations))
            except (PlanError, _JobFailed) as exc:
                if needs_plan:
                    raise JobPlanError(f"cannot plan: {exc}") from None
                log.warning("no prediction for this split", error=str(exc))
                if spec.warmup is None:  # nothing chose the order: 1F1B as published
                    spec = js.spec = dataclasses.replace(spec, warmup=0)
            shards = {i: a for i, a in self.shards.items() if i not in self.shards_lost}
            js.plan = await loop.run_in_executor(
                None,
                lambda: plan_job(
                    spec, js.id, self.cluster, self._alive(), shards, vws=vws, predicted=predicted
                ),
            )
            if js.resume is not None:
                self._restore(js, js.plan, js.resume)
                js.lost = self._lost_since(js.resume)
            else:
                js.totals = tuple(js.plan.minibatches_of(v) for v in range(len(js.plan.vws)))
        except JobPlanError as exc:
            js.state, js.error = "failed", str(exc)
            log.warning("job refused", error=str(exc))
            return
        if js.cancelled:  # cancelled while it was being planned
            js.state, js.error = "cancelled", "cancelled by the user"
            return
        try:
            js.state = "running"
            js.started = time.time()
            self._record(js)
            while True:
                try:
                    await self._run_attempt(js)
                    break
                except _JobFailed as exc:
                    if not self._may_replan(js):
                        raise
                    await self._replan(js, str(exc))
            js.result = await self._race(js, self._finish(js))
            js.finished = time.time()
            js.state = "done"
            log.info(
                "job done",
                accuracy=js.result.get("test_accuracy"),
                seconds=round(js.finished - js.started, 2),
            )
        except _JobFailed as exc:
            js.state = "cancelled" if js.cancelled else "failed"
            js.error, js.finished = str(exc), time.time()
            log.warning("job failed", error=str(exc))
            await self._abort(js, str(exc))
        finally:
            with contextlib.suppress(OSError, _JobFailed):
                interrupted = self._stopping and js.state == "failed" and not js.cancelled
                self._record(js, **({"state": "interrupted"} if interrupted else {}))
            self._drop_cuts(js)
            await self._drop_shards(js)
            for w in self.workers.values():
                if w.job == js.id:
                    w.job = w.vw = w.stage = None

    def _restore(self, js: JobState, plan: JobPlan, ck: checkpoint.Checkpoint) -> None:
        """Start ``plan`` from checkpoint ``ck``: the shards from its cut of the global
        weights, every virtual worker from its data position, every stage from its state.

        A stage of the same virtual worker with the same layers as in the checkpoint's plan
        takes its whole state (local weights, buffers, optimizer state). A stage whose layers
        moved (a re-plan, another split) takes its weights from the shards' cut, as at a
        job's start, and the optimizer state of each of its parameters from the stage of the
        same virtual worker that held it (of virtual worker 0 where the count of virtual
        workers changed). With another count of virtual workers the data is sharded
        differently: each one starts at the smallest position of the old ones.
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
        totals = [
            int(x) for x in meta.get("totals", [meta.get("minibatches_total", plan.minibatches)])
        ]
        same = len(positions) == n and len(totals) == n
        starts = tuple(positions) if same else (min(positions),) * n
        js.totals = tuple(totals) if same else (totals[0],) * n
        owed = [t - p for t, p in zip(js.totals, starts, strict=True)]
        if max(owed) <= 0:
            raise JobPlanError(
                f"checkpoint {ck.path} is the end of job {meta.get('job')}: "
                f"it has nothing left to train"
            )
        plan.starts = starts
        if js.spec.sync:  # iterations stay aligned: every VW runs VW 0's count
            plan.minibatches = max(1, owed[0])
        else:
            plan.owed = tuple(max(1, o) for o in owed)
        js.restores = _stage_restores(plan, ck, same)
        whole = sorted(
            f"vw{v}/stage{s}" for (v, s), (m, _) in js.restores.items() if m.get("weights")
        )
        self.log.info(
            "resuming",
            job=js.id,
            checkpoint=str(ck.path),
            wave=meta.get("wave"),
            positions=list(starts),
            owed=list(owed),
            stages_restored=whole,
            stages_from_global=len(js.restores) - len(whole),
        )

    def _lost_since(self, ck: checkpoint.Checkpoint) -> list[int] | None:
        """Per VW, the minibatches the checkpointed job trained after ``ck`` (where its
        final status says how far it got): the work a resume does again."""
        old = read_result(self.run_dir, str(ck.meta.get("job")))
        got, at = (old or {}).get("positions"), ck.meta.get("positions")
        if not got or not at or len(got) != len(at):
            return None
        return [max(0, int(a) - int(b)) for a, b in zip(got, at, strict=True)]

    # -- checkpoints: the stages' states and the shards' cut of one wave ----------------------

    def _stage_state(self, msg: Message) -> None:
        """Keep a stage's state at a cut; once every stage's is in, write the checkpoint."""
        js = self._by_wire(msg["job"])
        if js is None or js.state != "running" or js.plan is None:
            return
        meta = dict(msg["meta"])
        js.states.setdefault((msg["vw"], msg["stage"]), {})[msg["wave"]] = (meta, msg.tensors)
        plan, every = js.plan, js.spec.checkpoint_every
        last = max(plan.waves(v) for v in range(len(plan.vws)))
        expected = [
            (v, s)
            for v, vw in enumerate(plan.vws)
            for s in range(len(vw.stages))
            if plan.stage_names(v, s)
        ]
        while js.cut_next is not None:
            c = js.cut_next
            picks = {}
            for v, s in expected:
                got = js.states.get((v, s), {}).get(min(c, plan.waves(v)))
                if got is None:
                    return
                picks[(v, s)] = got
            js.cut_queued = c
            js.cut_writes.append(asyncio.ensure_future(self._write_cut(js, plan, c, picks)))
            js.cut_next = checkpoint.cut_after(c, every, last)
            for v, s in picks:  # a VW at its end keeps its last state for the later cuts
                held = js.states[(v, s)]
                for w in [w for w in held if w < min(c, plan.waves(v))]:
                    del held[w]

    async def _write_cut(
        self,
        js: JobState,
        plan: JobPlan,
        c: int,
        picks: dict[tuple[int, int], tuple[dict[str, Any], dict[str, torch.Tensor]]],
    ) -> None:
        """Fetch the shards' cut ``c``, check it against the stages' states, write both."""
        async with js.cut_lock:
            if js.plan is not plan:  # the attempt was given up meanwhile
                return
            if c < js.cut_queued:
                # a newer cut is ready: writing this one would only delay that one, and a
                # head that fell behind would ask the shards for cuts they no longer keep
                # (they keep the newest JobShard.KEEP_CUTS), failing every write after
                js.checkpoints_superseded += 1
                self.log.info("checkpoint superseded", job=js.id, wave=c, newest=js.cut_queued)
                return
            t0 = time.perf_counter()
            try:
                weights: dict[str, torch.Tensor] = {}
                applied: dict[str, dict[str, list[list[int]]]] = {}
                shards = plan.shards_used()
                channels = [await self._shard(index) for index in shards]
                replies = await asyncio.gather(
                    *(
                        ch.request(
                            Kind.SHARD_CUT,
                            {"job": plan.job, "wave": c},
                            timeout=SHARD_TIMEOUT_S,
                            what=f"shard {index}",
                        )
                        for index, ch in zip(shards, channels, strict=True)
                    )
                )
                for index, reply in zip(shards, replies, strict=True):
                    weights.update(reply.tensors)
                    applied[str(index)] = reply["info"]["applied"]
                problem = _cut_problem(plan, c, applied, picks)
                if problem is not None:
                    self.log.warning(
                        "checkpoint not written: inconsistent cut",
                        job=js.id,
                        wave=c,
                        problem=problem,
                    )
                    return
                n = len(plan.vws)
                positions = [
                    plan.start_of(v)
                    + min(min(c, plan.waves(v)) * plan.vws[v].nm, plan.minibatches_of(v))
                    for v in range(n)
                ]
                stages = {}
                files = {}
                for (v, s), (m, tensors) in sorted(picks.items()):
                    name = checkpoint.stage_file(v, s)
                    st = plan.vws[v].stages[s]
                    stages[name] = tensors
                    files[name] = {
                        "vw": v,
                        "stage": s,
                        "device": st.device,
                        "first": st.first,
                        "last": st.last,
                        "meta": m,
                    }
                meta = {
                    "job": js.id,
                    "attempt": plan.job,
                    "spec": js.spec.to_dict(),
                    "wave": c,
                    "positions": positions,
                    "totals": list(js.totals),
                    "minibatches_done": min(positions),
                    "minibatches_total": max(js.totals),
                    "applied": applied,
                    "plan": [
                        {
                            "nm": vw.nm,
                            "stages": [[st.device, st.first, st.last] for st in vw.stages],
                        }
                        for vw in plan.vws
                    ],
                    "stages": files,
                    "t": time.time(),
                }
                out = self.job_dir(js)
                loop = asyncio.get_running_loop()
                seq = checkpoint.next_seq(out)
                fetched = time.perf_counter()
                path = await loop.run_in_executor(
                    None, lambda: checkpoint.write(out, seq, weights, meta, stages=stages)
                )
                self.log.info(
                    "checkpoint written",
                    job=js.id,
                    wave=c,
                    path=str(path),
                    fetch_s=round(fetched - t0, 4),
                    write_s=round(time.perf_counter() - fetched, 4),
                )
                js.checkpoints += 1
                js.checkpoint_stage_s += max(
                    (m.get("state_s", 0.0) for m, _ in picks.values()), default=0.0
                )
                js.last_checkpoint = {"path": str(path), "wave": c, "positions": positions}
            except (RemoteError, TimeoutError, ConnectionError, OSError, _JobFailed) as exc:
                self.log.warning("checkpoint failed", job=js.id, wave=c, error=excerpt(exc))
            finally:
                js.checkpoint_s += time.perf_counter() - t0

    async def _cuts_written(self, js: JobState) -> None:
        """Wait for the checkpoints under way (the last one is the job's end)."""
        writes, js.cut_writes = js.cut_writes, []
        if writes:
            await asyncio.gather(*writes)

    def _drop_cuts(self, js: JobState) -> None:
        """An attempt ends: checkpoints under way are given up, states held dropped."""
        for t in js.cut_writes:
            t.cancel()
        js.cut_writes = []
        js.states.clear()
        js.cut_next = None
        js.cut_queued = -1  # the next attempt counts its waves afresh

    async def _run_attempt(self, js: JobState) -> None:
        """Launch the job's current plan and follow it until every stage is done."""
        await self._race(js, self._launch(js))
        if js.replans and "resumed_s" not in js.replans[-1]:
            js.replans[-1]["resumed_s"] = round(time.monotonic() - js.replans[-1]["_t"], 2)
        watchers = [asyncio.ensure_future(self._telemetry(js))]
        if js.spec.eval_every_s:
            watchers.append(asyncio.ensure_future(self._evaluate_every(js, js.spec.eval_every_s)))
        done = asyncio.ensure_future(js.all_done.wait())
        try:
            await self._race(js, done)
        finally:
            for w in watchers:
                w.cancel()
            js.diagnosis = []  # a diagnosis describes a running job only

    # -- keep going when a worker dies (train.on_worker_loss = "replan") ----------------------

    MAX_REPLANS = 3

    def _may_replan(self, js: JobState) -> bool:
        return (
            js.spec.on_worker_loss == "replan"
            and js.lost_device is not None
            and not js.cancelled
            and len(js.replans) < self.MAX_REPLANS
        )

    async def _replan(self, js: JobState, reason: str) -> None:
        """Go on without the lost worker: plan the job again on the live devices and start it
        from the job's last complete checkpoint (:meth:`_restore`: the shards' cut, each
        stage's state where its layers stayed, the optimizer state per parameter where they
        moved, each virtual worker's data position). The work since that checkpoint is done
        again (``lost_minibatches`` of the re-plan says how much).

        A job without a checkpoint yet starts from the global weights the shards hold now:
        the lost stage's unpushed updates and every stage's optimizer state are gone, and
        every virtual worker goes on from the slowest one's position.
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
                raise _JobFailed(f"{reason}; cannot re-plan: the shards' weights: {exc}") from None
        await self._abort(js, reason)
        await self._drop_shards(js)
        for w in self.workers.values():
            if w.job == js.id:
                w.job = w.vw = w.stage = None
        spec = dataclasses.replace(js.spec, vws=(), num_vws=js.spec.num_vws or len(old.vws))
        try:
            profile, rows = await self._profiles(spec)
            cluster = live_cluster(self.cluster, self._idle())
            plan = await loop.run_in_executor(None, plan_for, spec, cluster, profile, rows)
            shards = {i: a for i, a in self.shards.items() if i not in self.shards_lost}
            wire = f"{js.id}.r{len(js.replans) + 1}"
            new = await loop.run_in_executor(
                None,
                lambda: plan_job(
                    spec,
                    wire,
                    self.cluster,
                    self._alive(),
                    shards,
                    vws=plan_vws(plan, spec.activations),
                    predicted=predicted_summary(plan),
                ),
            )
            if ck is not None:
                self._restore(js, new, ck)
        except (PlanError, JobPlanError, _JobFailed) as exc:
            raise _JobFailed(f"{reason}; cannot re-plan without it: {exc}") from None
        if ck is None:
            new.initial = {k: state[k] for k in new.initial or {}}
            start = min(positions)
            total = js.totals[0] if js.totals else old.minibatches
            new.starts = (start,) * len(new.vws)
            if spec.sync:
                new.minibatches = max(1, total - start)
            else:
                new.owed = (max(1, total - start),) * len(new.vws)
            js.totals = (total,) * len(new.vws)
            lost_mb = None
        else:
            at = ck.meta.get("positions") or []
            lost_mb = (
                [max(0, a - b) for a, b in zip(positions, at, strict=True)]
                if len(at) == len(positions)
                else None
            )
        js.plan = new
        js.failure = loop.create_future()
        js.lost_device = None
        js.progress.clear()
        js.stage_results.clear()
        js.all_done = asyncio.Event()
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

    def _latest_of(self, js: JobState) -> checkpoint.Checkpoint | None:
        """The newest complete checkpoint of the job: its own, else the one it resumed from."""
        skipped: list[str] = []
        ck = checkpoint.latest(self.job_dir(js), skipped)
        for why in skipped:
            self.log.warning("damaged checkpoint skipped", job=js.id, error=excerpt(why, 300))
        return ck if ck is not None else js.resume

    async def _race(self, js: JobState, aw: Any) -> Any:
        """Await ``aw`` unless the job fails first (lost worker, stage error, cancel)."""
        assert js.failure is not None
        task = asyncio.ensure_future(aw)
        await asyncio.wait({task, js.failure}, return_when=asyncio.FIRST_COMPLETED)
        if js.failure.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            raise _JobFailed(js.failure.result())
        try:
            return task.result()
        except (RemoteError, TimeoutError, ConnectionError, OSError) as exc:
            raise _JobFailed(str(exc)) from None

    def _alive(self) -> dict[str, WorkerInfo]:
        return {d: w for d, w in self.workers.items() if not w.lost}

    async def _shard(self, index: int) -> Channel:
        ch = self.shard_channels.get(index)
        if ch is None:
            address = self.shards.get(index)
            if address is None:
                raise _JobFailed(
                    f"shard {index} has not registered with the head: "
                    f"is hetpipe-ps --shard {index} running?"
                )
            sock = make_socket(
                self.owner.ctx,
                zmq.DEALER,
                connect=address,
                hwm=self.cluster.runtime.hwm,
                max_frame_bytes=self.cluster.runtime.max_frame_bytes,
                curve=self.owner.curve,
            )
            ch = Channel(
                sock,
                None,
                name=f"to-shard{index}",
                max_frame_bytes=self.cluster.runtime.max_frame_bytes,
            ).start()
            self.owner.channels.append(ch)
            self.shard_channels[index] = ch
        return ch

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
            ch = await self._shard(index)
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
        js.states.clear()
        js.cut_queued = -1
        js.cut_next = checkpoint.cut_after(
            0, js.spec.checkpoint_every, max(plan.waves(v) for v in range(len(plan.vws)))
        )
        waits = []
        for task in plan.tasks(self.shards, self.workers):
            w = self.workers[task.group[task.replica]]
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
        for w in self.workers.values():
            if w.job == js.id:
                await self.channel.send(Kind.START, {"job": plan.job}, to=w.ident)
        self.log.info("job started", job=js.id, stages=plan.n_stages)

    async def _finish(self, js: JobState) -> dict[str, Any]:
        """Gather global weights, evaluate and export them; return the job's result."""
        plan = js.plan
        assert plan is not None and js.started is not None
        train_s = time.time() - js.started
        await self._cuts_written(js)  # the last checkpoint: the job's end
        state, clocks = await self._fetch_state(js)
        out_dir = self.job_dir(js)
        loop = asyncio.get_running_loop()
        accuracy, trained_bn = await loop.run_in_executor(None, plan.export, state, out_dir)
        js.evals.append([train_s, plan.total_minibatches, accuracy])
        stages = {
            f"vw{v}/stage{s}": {**r, "replicas": list(plan.vws[v].stages[s].replicas)}
            for (v, s), r in sorted(js.stage_results.items())
        }
        (out_dir / "stages.json").write_text(json.dumps(stages))
        devices = {f"vw{v}/stage{s}": plan.device_of(v, s) for v, s in js.stage_results}
        trace = chrome_trace({k: r["stats"] for k, r in stages.items()}, devices, js.id)
        (out_dir / "trace.json").write_text(json.dumps(trace))
        samples = plan.total_minibatches * js.spec.minibatch
        quality = {
            k: r["stats"].get("prediction_quality")
            for k, r in stages.items()
            if r["stats"].get("prediction_quality") is not None
        }
        return {
            **({"prediction_quality": quality} if quality else {}),
            # train.bn_recalibrate: the accuracy with the running statistics as trained
            **({"test_accuracy_trained_bn": trained_bn} if trained_bn is not None else {}),
            "status": "done",
            "test_accuracy": accuracy,
            "samples_per_s": samples / train_s,
            "minibatches": plan.total_minibatches,
            "seconds": train_s,
            "model_path": str((out_dir / "model.pt").resolve()),
            "stages_path": str((out_dir / "stages.json").resolve()),
            "trace_path": str((out_dir / "trace.json").resolve()),
            "metrics_path": str((out_dir / "metrics.jsonl").resolve()),
            "shard_clocks": clocks,
            "checkpoints": js.checkpoints,
            "checkpoints_superseded": js.checkpoints_superseded,
            "checkpoint_s": js.checkpoint_s,
            "checkpoint_stage_s": js.checkpoint_stage_s,
        }

    async def _fetch_state(self, js: JobState) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The job's global weights, gathered from its shards, and each shard's clocks."""
        assert js.plan is not None
        state: dict[str, torch.Tensor] = {}
        clocks = {}
        for index in js.plan.shards_used():
            ch = await self._shard(index)
            reply = await ch.request(
                Kind.SHARD_FETCH,
                {"job": js.wire_id},
                timeout=SHARD_TIMEOUT_S,
                what=f"shard {index}",
            )
            state.update({k: v.clone() for k, v in reply.tensors.items()})
            clocks[str(index)] = reply.get("info")
        return state, clocks

    async def _evaluate_every(self, js: JobState, every_s: float) -> None:
        """Test accuracy of the global weights while the job trains (time-to-accuracy)."""
        assert js.plan is not None and js.started is not None
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(every_s)
            seconds = time.time() - js.started
            done = js.info().get("minibatches", 0)
            state, _ = await self._fetch_state(js)
            accuracy = await loop.run_in_executor(None, js.plan.evaluate, state)
            js.evals.append([seconds, done, accuracy])

    def job_dir(self, js: JobState) -> Path:
        """Where a job's outputs go: always under ``<run_dir>/jobs`` (names are validated at
        submit; :func:`hetpipe.jobstore.job_dir` refuses any id that is a path)."""
        d = job_dir(self.run_dir, js.id)  # None for anything that is not a job id
        if d is None:
            raise _JobFailed(
                f"job id {excerpt(js.id, 80)!r} is not a job id: it would "
                f"write outside {self.run_dir / 'jobs'}"
            )
        return d.resolve()

    async def _telemetry(self, js: JobState, every_s: float = 1.0) -> None:
        """Append the live figures to the job's metrics file; diagnose a hang.

        A job hangs when no stage ran a forward or a backward for ``hang_after_s``; the
        diagnosis says, for each stage, what it has been waiting for and since when.
        """
        path = self.job_dir(js) / "metrics.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        last_sig: tuple[Any, ...] = ()
        last_change = time.time()

        def record() -> dict[str, Any]:
            info = js.info()
            metrics.write(
                json.dumps(
                    {
                        "t": time.time(),
                        **{
                            k: info.get(k)
                            for k in (
                                "minibatches",
                                "samples_per_s",
                                "global_clock",
                                "loss",
                                "vws",
                                "stages",
                                "evals",
                            )
                        },
                    }
                )
                + "\n"
            )
            metrics.flush()
            return info

        with open(path, "a") as metrics:
            try:
                while True:
                    await asyncio.sleep(every_s)
                    info = record()
                    now = time.time()
                    sig = tuple(
                        (p.get("done"), p.get("forwards")) for _, p in sorted(js.progress.items())
                    )
                    if sig != last_sig:
                        last_sig, last_change = sig, now
                        if js.diagnosis:
                            self.log.info("job moving again", job=js.id)
                        js.diagnosis = []
                    elif now - last_change >= js.spec.hang_after_s and js.plan is not None:
                        diagnosis = diagnose(js.plan, js.progress, now, info.get("global_clock"))
                        if diagnosis != js.diagnosis:
                            js.diagnosis = diagnosis
                            self.log.warning(
                                "job makes no progress",
                                job=js.id,
                                silent_s=round(now - last_change, 1),
                                diagnosis=diagnosis,
                            )
            finally:
                record()  # the last figures, also for a job shorter than one tick

    async def _abort(self, js: JobState, reason: str) -> None:
        assert self.channel is not None
        for w in self.workers.values():
            if w.job == js.id and not w.lost:
                with contextlib.suppress(ConnectionError, zmq.ZMQError):
                    await self.channel.send(
                        Kind.ABORT, {"job": js.wire_id, "reason": reason}, to=w.ident
                    )

    async def _drop_shards(self, js: JobState) -> None:
        if js.plan is None:
            return
        for index in js.plan.shards_used():
            if index in self.shards_lost:
                continue  # nothing to drop there, and no answer to wait for
            with contextlib.suppress(Exception):
                ch = await self._shard(index)
                await ch.request(
                    Kind.SHARD_DROP, {"job": js.wire_id}, timeout=10.0, what=f"shard {index}"
                )


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


def _stage_time(progress: dict[str, Any]) -> float | None:
    """Measured compute time per minibatch of a stage (forward + backward)."""
    done = progress.get("done")
    if not done:
        return None
    return (progress.get("forward_s", 0.0) + progress.get("backward_s", 0.0)) / done


def _who(peer: bytes) -> str:
    return peer.decode("utf-8", "replace")


class _JobFailed(Exception):
    """The running job must stop; the text is what the user reads."""


def _cut_problem(
    plan: JobPlan,
    c: int,
    applied: dict[str, dict[str, list[int]]],
    picks: dict[tuple[int, int], tuple[dict[str, Any], Any]],
) -> str | None:
    """Why the shards' cut ``c`` and the stages' states are not one consistent checkpoint:
    every stage's applied set on every shard holding its state must be exactly waves
    0 .. min(c, its VW's waves) - 1, and cover the accumulators the stage still keeps."""
    for (v, s), (meta, _) in picks.items():
        end = min(c, plan.waves(v))
        want = [[0, end]] if end else []
        for index in sorted({plan.placement[n] for n in plan.stage_names(v, s)}):
            got = applied.get(str(index), {}).get(f"{v}/{s}")
            if got != want:
                return (
                    f"shard {index} applied waves {excerpt(got, 80)} of vw{v}/stage{s} "
                    f"at cut {c}, not [0, {end})"
                )
        if int(meta.get("wave", -1)) != min(c, plan.waves(v)):
            return f"vw{v}/stage{s} sent its state of wave {meta.get('wave')} for cut {c}"
        outside = [w for w in meta.get("kept_waves", []) if not 0 <= w < end]
        if outside:
            return f"vw{v}/stage{s} keeps updates of waves {outside[:3]} outside cut {c}"
    return None


def _stage_restores(
    plan: JobPlan, ck: checkpoint.Checkpoint, same_vws: bool
) -> dict[tuple[int, int], tuple[dict[str, Any], dict[str, torch.Tensor]]]:
    """What each stage of ``plan`` starts from (see :meth:`Head._restore`)."""
    old: dict[int, list[tuple[str, dict[str, Any]]]] = {}
    for name, info in ck.meta.get("stages", {}).items():
        if name in ck.stages:
            old.setdefault(int(info["vw"]), []).append((name, info))
    out = {}
    for v, vw in enumerate(plan.vws):
        source = old.get(v if same_vws else 0, [])
        for s, st in enumerate(vw.stages):
            if not plan.stage_names(v, s):
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
                    if st.first <= layer_of(param) < st.last:
                        tensors[key] = t
                        steps[param] = int(info["meta"].get("opt_steps", {}).get(param, 0))
                        optimizer = info["meta"].get("optimizer")
            meta: dict[str, Any] = {"weights": False, "opt_steps": steps}
            if optimizer is not None:
                meta["optimizer"] = optimizer
            out[(v, s)] = (meta, tensors)
    return out
