"""The head's server: its state, and the routing of every message it takes.

The head lives in the shard-0 process and shares its ROUTER socket (:mod:`hetpipe.ps`). Each
message is first checked against :data:`hetpipe.security.AUTHORITY` (who may send it), then
goes to the part of the head whose job it is: registration and liveness
(:mod:`~hetpipe.head.registry`), the queue and the life cycle of jobs
(:mod:`~hetpipe.head.jobs`), checkpoint cuts (:mod:`~hetpipe.head.cuts`), recovery and re-plan
(:mod:`~hetpipe.head.recovery`), profiling requests (:mod:`~hetpipe.head.profiles`), status
views and diagnosis (:mod:`~hetpipe.head.views`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
from collections.abc import Collection
from pathlib import Path
from typing import Any

from hetpipe import log as logmod
from hetpipe.config import ClusterConfig
from hetpipe.daemon import Owner
from hetpipe.head import drift
from hetpipe.head.cuts import CutsPart
from hetpipe.head.jobs import JobsPart, JobState
from hetpipe.head.migration import MigrationPart
from hetpipe.head.profiles import Profiler
from hetpipe.head.recovery import RecoveryPart
from hetpipe.head.reform import ReformPart
from hetpipe.head.registry import Registry, hello_problem, shard_problem
from hetpipe.head.shardwait import ShardWaitPart
from hetpipe.head.states import JobFailed, JobStatus
from hetpipe.head.views import cluster_view, trace_of
from hetpipe.job import JobError, JobSpec
from hetpipe.jobdir import compact, stream_budget
from hetpipe.jobstore import append_records, job_dir, next_number, read_result, records_path
from hetpipe.ratelog import Throttle, excerpt
from hetpipe.rotation import Thinning
from hetpipe.security import (
    CodeError,
    Role,
    check_code,
    may_act,
    may_send,
    owner_of,
    worker_user,
)
from hetpipe.transport import Channel
from hetpipe.wire import Kind, Message

__all__ = ["Head"]

# a worker's messages about a job (attempt); one the head does not run is an orphan
_JOB_KINDS = frozenset(
    {
        Kind.HEARTBEAT,
        Kind.REPORT,
        Kind.STAGE_DONE,
        Kind.STAGE_RECORDS,
        Kind.STAGE_FAILED,
        Kind.STAGE_STATE,
        Kind.MIGRATE,
    }
)


class Head(JobsPart, CutsPart, RecoveryPart, ShardWaitPart, MigrationPart, ReformPart):
    """The cluster's head: lives in the shard-0 process and shares its ROUTER socket."""

    def __init__(
        self, cluster: ClusterConfig, owner: Owner, address: str, run_dir: str | None = None
    ) -> None:
        self.cluster = cluster
        self.owner = owner
        self.address = address
        self.run_dir = Path(run_dir or cluster.runtime.run_dir)
        self.log = logmod.get("head")
        self.registry = Registry(cluster, owner, address)
        self.profiler = Profiler(cluster, self.registry, self.run_dir, self.log)
        self.jobs: dict[str, JobState] = {}
        self.queue: asyncio.Queue[JobState] = asyncio.Queue()
        self.current: JobState | None = None
        self.channel: Channel | None = None
        self._ids = itertools.count(next_number(self.run_dir))
        self._stopping = False
        # refused registrations and requests outside a peer's role, once per peer a while
        self._refused = Throttle(self.log)
        self.recovered: list[dict[str, Any]] = []  # what _recover did with the last head's jobs

    async def start(self, channel: Channel) -> None:
        self.channel = channel
        self.profiler.channel = channel
        self._recover()
        self.owner.spawn(self._run_jobs(), "jobs")
        self.owner.spawn(self._watch(), "watch")

    async def stop(self) -> None:
        self._stopping = True  # the current job is interrupted, not failed: resume it later
        while not self.queue.empty():  # none starts now: they stay queued for the next head
            self.queue.get_nowait()
        if self.current is not None:
            self.current.fail("the head is shutting down")
            await asyncio.sleep(0.2)

    # -- authority --------------------------------------------------------------------------

    def _holders(self, msg: Message, role: Role) -> Collection[str]:
        """Who holds a stage role for ``msg`` here: the workers the head assigned to the
        message's stage of the job's current attempt (none for another attempt)."""
        if role != Role.STAGE_GROUP:
            return ()
        js = self._by_wire(msg["job"])
        if js is None:
            return ()
        stage = (msg["vw"], msg["stage"])
        also: tuple[str, ...] = ()  # a device that runs several stages holds each of them
        if js.spec.several_stages and js.plan is not None and 0 <= stage[0] < len(js.plan.vws):
            stages = js.plan.vws[stage[0]].stages
            also = stages[stage[1]].devices if 0 <= stage[1] < len(stages) else ()
        return {
            worker_user(w.device)
            for w in self.registry.workers.values()
            if w.job == js.id and ((w.vw, w.stage) == stage or w.device in also)
        }

    def _allowed(self, msg: Message) -> bool:
        """Whether the sender may send this (:func:`hetpipe.security.may_send`)."""
        return may_send(msg.kind, msg.user, msg.fields, lambda role: self._holders(msg, role))

    def _orphan(self, msg: Message) -> bool:
        """A worker's message about a job (attempt) this head does not know."""
        if msg.kind not in _JOB_KINDS:
            return False
        job = msg.get("job")
        if not job or self._by_wire(job) is not None:
            return False
        return msg.user is None or msg.user.startswith("worker-")

    def _by_wire(self, wire_id: str) -> JobState | None:
        """The job whose current attempt is ``wire_id`` (None for an attempt given up)."""
        js = self.jobs.get(wire_id.rpartition(".r")[0]) or self.jobs.get(wire_id)
        return js if js is not None and js.wire_id == wire_id else None

    def _refusal(self, act: str, user: str | None, job: str, owner: str | None) -> str | None:
        """Why peer ``user`` may not ``act`` on job ``job`` of ``owner`` (one line), or None
        (:func:`hetpipe.security.may_act`: its owner and the admin may)."""
        if may_act(user, owner):
            return None
        self.log.warning(
            "request refused: not the job's owner", job=job, owner=owner, user=user, act=act
        )
        whose = f"belongs to {owner}" if owner else "has no recorded owner (the admin's alone)"
        who = owner_of(user)
        return f"{act}: job {excerpt(job, 80)} {whose}; user {who} may {act} only their own jobs"

    def _owner_of(self, job: str) -> str | None:
        """The owner of job ``job``: in memory, else as its directory records it (its final
        status, else ``job.json``); None when nothing names one (no such job, or one recorded
        before owners were)."""
        js = self.jobs.get(job)
        if js is not None:
            return js.owner
        owner = (read_result(self.run_dir, job) or {}).get("owner")
        d = job_dir(self.run_dir, job)
        if owner is None and d is not None:
            with contextlib.suppress(OSError, ValueError, AttributeError):
                owner = json.loads((d / "job.json").read_text()).get("owner")
        return owner if isinstance(owner, str) else None

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
            await self._hello(peer, msg)
        elif k == Kind.HEARTBEAT:
            if not self.registry.heartbeat(peer, msg.fields):
                await self.channel.reply_error(peer, "unregistered: say hello")
        elif k == Kind.SHARD_HELLO:
            problem = shard_problem(self.cluster, msg.fields)
            if problem is not None:
                self._refused.warning("registration refused", _who(peer), problem)
                await self.channel.reply_error(peer, problem)
                return
            for change in await self.registry.shard_hello(msg.fields):
                if change == "back":
                    self.log.info("shard back", shard=msg["shard"])
                elif change == "restarted":  # back before it was missed: its state is gone
                    self._shard_restarted(msg["shard"], msg["pid"])
                else:
                    self.log.info("shard registered", shard=msg["shard"], address=msg["address"])
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
                problem: str | None = f"no job {msg['job']!r}"
            else:
                problem = self._refusal("cancel", msg.user, js.id, js.owner) or self.cancel(js)
            if problem is not None:
                await self.channel.reply_error(peer, problem, msg["rid"])
                return
            assert js is not None
            await self.channel.send(
                Kind.OK, {"rid": msg["rid"], "info": {"state": js.state.value}}, to=peer
            )
        elif k == Kind.CHECKPOINT:
            self._checkpoint_request(peer, msg)
        elif k in (Kind.REPORT, Kind.STAGE_DONE, Kind.STAGE_RECORDS, Kind.STAGE_FAILED):
            self._stage_message(msg)
        elif k == Kind.STAGE_STATE:
            self._stage_state(msg)
        elif k == Kind.MIGRATE:
            await self._on_migrate(peer, msg)
        elif k == Kind.TRACE:
            trace, problem = trace_of(self.run_dir, self.jobs, msg["job"])
            if problem is not None:
                await self.channel.reply_error(peer, problem, msg["rid"])
            else:
                await self.channel.send(Kind.OK, {"rid": msg["rid"], "info": trace}, to=peer)
        elif k in (Kind.PROFILE, Kind.PLAN):
            # these wait on workers' answers, which arrive through this same reader
            self.owner.spawn(self.profiler.answer(peer, msg), f"{k}:{msg['rid']}")
        else:
            await self.channel.reply_error(peer, f"the head does not take {k}", msg.get("rid"))

    async def _hello(self, peer: bytes, msg: Message) -> None:
        """Register a worker (a restarted one fails the job its old process ran)."""
        assert self.channel is not None
        problem = hello_problem(self.cluster, msg.fields)
        if problem is not None:
            self._refused.warning("registration refused", _who(peer), problem)
            await self.channel.reply_error(peer, problem)
            return
        old = self.registry.register(peer, msg.fields)
        if old is not None and old.job is not None and (js := self.jobs.get(old.job)):
            why = f"worker {old.device} restarted (pid {old.pid} -> {msg['pid']})"
            if not self._reform_on_loss(js, old, why):  # only its VW stops (head.reform)
                js.lost_device = old.device
                js.fail(why)
        self.log.info(
            "worker registered", device=msg["device"], address=msg["address"], pid=msg["pid"]
        )
        await self.channel.send(
            Kind.WELCOME,
            {
                "heartbeat_s": self.cluster.runtime.heartbeat_s,
                "lost_after_s": self.cluster.runtime.lost_after_s,
            },
            to=peer,
        )

    async def _submit(self, peer: bytes, msg: Message) -> None:
        assert self.channel is not None
        owner = owner_of(msg.user)
        try:
            resume = None
            if msg.get("resume"):
                # a resumed job stays its first owner's: only they and the admin may resume it
                recorded = self._owner_of(msg["resume"])
                d = job_dir(self.run_dir, msg["resume"])
                if recorded is not None or (d is not None and d.exists()):
                    problem = self._refusal("resume", msg.user, msg["resume"], recorded)
                    if problem is not None:
                        raise JobFailed(problem)
                owner = recorded or owner
                resume = self._resume_source(msg["resume"])  # refused: one successor a job
            job = msg.get("job") or (resume.meta["spec"] if resume is not None else None)
            if job is None:
                raise CodeError("submit: give a job, or the id of one to resume")
            check_code(job, self.cluster.security.allowed_modules)
            # a job as a client wrote it is held to the job file's rules; a checkpoint's
            # is the head's own record of one already running
            spec = JobSpec.from_dict(job, source="job", strict=msg.get("job") is not None)
        except (JobError, CodeError, JobFailed) as exc:
            self.log.warning("job refused at submit", error=excerpt(exc))
            await self.channel.reply_error(peer, str(exc), msg["rid"])
            return
        job_id = self._new_id(spec.name)
        js = JobState(id=job_id, spec=spec, submitted=time.time(), owner=owner, resume=resume)
        self.jobs[job_id] = js
        if resume is not None:
            self._link(msg["resume"], js)  # each names the other (hetpipe.head.recovery)
        # known to a head that restarts before it runs, which queues it again from this
        extra: dict[str, Any] = {"submitted": js.submitted, "resume": msg.get("resume") or None}
        with contextlib.suppress(TypeError, ValueError):
            extra["job"] = json.loads(json.dumps(job))  # as submitted (a resume's: its own)
        with contextlib.suppress(OSError, JobFailed):
            self._record(js, **extra)
        await self.queue.put(js)
        self.log.info("job queued", job=job_id, owner=owner)
        await self.channel.send(Kind.OK, {"rid": msg["rid"], "info": {"job": job_id}}, to=peer)

    def _stage_message(self, msg: Message) -> None:
        """A stage's report, result or failure, for the running attempt it names."""
        js = self._by_wire(msg["job"])
        if js is None or js.state != JobStatus.RUNNING:
            return
        key = (msg["vw"], msg["stage"])
        if msg.kind == Kind.REPORT and "evaluation" in msg["stats"]:
            # a validation pass's figures, or a stage's weights for the best model
            self._took_evaluation(js, key, msg["stats"]["evaluation"], msg.tensors)
        elif msg.kind == Kind.REPORT:
            js.progress[key] = msg["stats"]
            drift.noted(js, key, msg["stats"])  # the pace a migration's gain is measured by
        elif msg.kind == Kind.STAGE_RECORDS:
            # appended to the job's directory as it arrives: the head keeps none in memory
            self._append_records(js, key, msg["records"], msg["spans"])
        elif msg.kind == Kind.STAGE_DONE:
            if msg.get("records"):
                self._append_records(js, key, msg["records"], [])
            js.progress[key] = msg["stats"]
            drift.noted(js, key, msg["stats"])
            js.stage_results[key] = {"stats": msg["stats"]}
            assert js.plan is not None
            if len(js.stage_results) == js.plan.n_stages:
                js.all_done.set()
        elif not self._reform_ignores(js, key[0]):  # its VW is being re-formed: no failure
            where = js.plan.where(*key) if js.plan else f"vw{key[0]}/stage{key[1]}"
            js.fail(f"{where} failed: {msg['error']}")

    def _append_records(
        self, js: JobState, key: tuple[int, int], records: list[Any], spans: list[Any]
    ) -> None:
        """Append a chunk of a stage's records and spans to its stream in the job's
        directory (:func:`hetpipe.jobstore.append_records`), thinned to stay under
        ``[runtime] records_max_bytes`` (:mod:`hetpipe.rotation`) and compacted to keep the
        job's directory under ``job_dir_max_bytes`` (:mod:`hetpipe.jobdir`); one not written
        fails the job."""
        stream = js.chunks.get(key)
        if stream is None:
            stream = js.chunks[key] = Thinning(self.cluster.runtime.records_max_bytes)
        if not stream.keep():
            return
        try:
            d = self.job_dir(js)
            append_records(d, *key, records, spans, every=stream.every)
            path = records_path(d, *key)
            n = js.plan.n_stages if js.plan is not None else 1
            compact(path, stream_budget(self.cluster.runtime.job_dir_max_bytes, n))
            stream.written(path)
        except (OSError, JobFailed) as exc:
            js.fail(f"records of vw{key[0]}/stage{key[1]} not written: {exc}")

    # -- views ------------------------------------------------------------------------------

    def job_info(self, job: str) -> dict[str, Any] | None:
        """A job's status from memory, else from its directory; ``source`` says which."""
        js = self.jobs.get(job)
        if js is not None:
            return {**js.info(), "source": "head"}
        info = read_result(self.run_dir, job)
        if info is not None:
            return {**info, "source": "disk"}
        return None

    def cluster_info(self) -> dict[str, Any]:
        """The cluster's status (:func:`hetpipe.head.views.cluster_view`)."""
        view = cluster_view(self.cluster, self.registry, self.jobs, self.current)
        return {**view, "recovered": self.recovered}

    # -- liveness ---------------------------------------------------------------------------

    async def _watch(self) -> None:
        """Every fraction of ``lost_after_s``: a lost worker fails its job, a lost shard the
        running job that uses it (a job never hangs on a dead daemon)."""
        lost_after = self.cluster.runtime.lost_after_s
        while True:
            await asyncio.sleep(min(0.5, lost_after / 4))
            workers, shards = self.registry.newly_lost(time.monotonic())
            for w, silent in workers:
                self.log.warning(
                    "worker lost", device=w.device, pid=w.pid, silent_s=round(silent, 1)
                )
                if w.job is not None and w.job in self.jobs:
                    why = (
                        f"worker {w.device} (pid {w.pid}, vw{w.vw}/stage{w.stage}) lost: "
                        f"no heartbeat for {silent:.1f} s"
                    )
                    if not self._reform_on_loss(self.jobs[w.job], w, why):  # head.reform
                        self.jobs[w.job].lost_device = w.device
                        self.jobs[w.job].fail(why)
            for index, silent in shards:
                self.log.warning("shard lost", shard=index, silent_s=round(silent, 1))
                js = self.current
                if js is not None and js.plan is not None and index in js.plan.shards_used():
                    if js.lost_shard is None:  # the job may wait for it (shardwait)
                        js.lost_shard = index
                    js.fail(
                        f"shard {index} ({self.registry.shards.get(index)}) lost: "
                        f"no hello for {silent:.1f} s"
                    )


def _who(peer: bytes) -> str:
    return peer.decode("utf-8", "replace")
