"""``hetpipe-worker``: one daemon per GPU (or emulated device).

The worker registers with the head (hello -> welcome, retried until the head answers),
sends a heartbeat every ``heartbeat_s``, and runs the stage the head assigns: it receives
activations and gradients on its data port (a PULL socket), sends them on to its neighbours
(PUSH sockets), and pushes/pulls its state to/from the parameter-server shards. Torch runs on
one compute thread; the event loop only moves messages. Between jobs it stays up, idle.

A device may hold several stages of one virtual worker (its name repeated in the VW's
``devices``): the worker then runs every stage the head assigns it, each with its own
:class:`StageRunner`, all on the one compute thread (so an emulated device's speed is the
device's, shared by its stages). Data messages name the stage they are for (``stage``); what
one of its stages sends to another of its stages never leaves the process: the tensors are
handed to that stage's runner as they are (no serialisation, no copy on one GPU).

One file on purpose: the daemon is one object whose handlers (head channel, data port,
heartbeat, the running job) share its sockets and its one job's stages; the stage's compute
(:mod:`hetpipe.stage`) and the schedule's execution (:mod:`hetpipe.pipeline`) live apart.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import click
import torch
import zmq

from hetpipe import hostshm, migrate
from hetpipe import log as logmod
from hetpipe.computethread import ComputeThread
from hetpipe.config import ClusterConfig, ConfigError, DeviceSpec, load_cluster
from hetpipe.daemon import Owner, start_daemon, wait_for_signal, write_ready
from hetpipe.data import MinibatchStream, load_data
from hetpipe.devturn import DeviceTurn, device_turn
from hetpipe.job import JobSpec
from hetpipe.measure import measure
from hetpipe.pipeline import StageRunner
from hetpipe.ratelog import Throttle, excerpt
from hetpipe.security import AUTHORITY, KeysError, Role, check_code, may_send, worker_user
from hetpipe.stage import DeviceMemory, StageCompute
from hetpipe.task import StageTask
from hetpipe.transport import Channel, bound_address, make_socket, tcp
from hetpipe.usercode import check_user_code
from hetpipe.wire import Kind, Message

__all__ = ["Worker", "main", "serve"]

HELLO_RETRY_S = 2.0
LINGER_MS = 2000  # queued activations/gradients still leave when a stage ends


class _Job:
    """What a worker holds for one stage it is assigned: the stage and its job sockets."""

    def __init__(
        self, task: StageTask, compute: StageCompute, closing: set[hostshm.Outbox]
    ) -> None:
        """``closing``: where a closed job's outbox waits for its late removal (the worker
        removes what is there at once when it stops)."""
        self.task = task
        self.compute = compute
        self.outbox = hostshm.Outbox()  # tensors put in shared memory for this host's peers
        self.inbox = hostshm.Inbox()  # the files they put there, kept mapped
        self.closing = closing
        self.channels: list[Channel] = []
        self.shards: dict[int, Channel] = {}
        self.stream: MinibatchStream | None = None
        self.runner: StageRunner | None = None
        self.run_task: asyncio.Task[None] | None = None
        self.early: list[Message] = []  # data that came before the runner existed

    async def close(self) -> None:
        if self.run_task is not None and not self.run_task.done():
            self.run_task.cancel()
            with contextlib.suppress(BaseException):
                await self.run_task
        # the files its neighbours handed back go now, before the sockets' linger (a daemon
        # that stops may not outlive it); the stage reads no more
        self.outbox.settle()
        self.inbox.close()
        if self.stream is not None:  # the first stage's loader workers stop with the stage
            self.stream.close()
        for ch in self.channels:
            await ch.close(linger_ms=LINGER_MS)
        # what a neighbour has not taken yet it may still take (its last message may be in
        # flight as this stage ends): removed once it is surely late (hetpipe.hostshm), or
        # when the worker stops
        self.closing.add(self.outbox)
        asyncio.get_running_loop().call_later(hostshm.UNTAKEN_S, self._closed)

    def _closed(self) -> None:
        self.closing.discard(self.outbox)
        self.outbox.close()


class Worker:
    """One ``hetpipe-worker`` process."""

    def __init__(
        self, cluster: ClusterConfig, device: DeviceSpec, owner: Owner, head: str | None
    ) -> None:
        self.cluster = cluster
        self.device = device
        self.owner = owner
        self.head_address = head or cluster.head.address
        self.executor = ComputeThread(f"compute-{device.name}")
        # waits for device-to-host copies (hetpipe.hostcopy), so the compute never does
        self.copies = ThreadPoolExecutor(1, thread_name_prefix=f"copy-{device.name}")
        # the stages this device runs, by (vw, stage), all of one job
        self.stages: dict[tuple[int, int], _Job] = {}
        self.memory = DeviceMemory(device.name, device.memory)  # their sum against the cap
        self.closing: set[hostshm.Outbox] = set()  # outboxes of closed jobs (_Job.close)
        self.welcomed = asyncio.Event()
        self.address = ""
        self.log = logmod.get("worker").bind(device=device.name)
        self.head: Channel | None = None
        self._refused = Throttle(self.log)  # data from peers outside their role
        # whether this host's shared memory carries tensors between its devices: settled
        # once, not checked per message (hetpipe.hostshm)
        self._host_shm = cluster.runtime.host_shm and hostshm.available()

    @property
    def job(self) -> _Job | None:
        """The first stage this device runs (its lowest vw/stage), None when idle."""
        return self.stages[min(self.stages)] if self.stages else None

    def _of_job(self, job_id: str) -> list[_Job]:
        """The stages of job ``job_id`` this device runs, in vw/stage order."""
        return [self.stages[k] for k in sorted(self.stages) if self.stages[k].task.job == job_id]

    @property
    def state(self) -> str:
        if self.job is None:
            return "idle"
        return "running" if self.job.runner is not None else "assigned"

    async def start(self) -> None:
        rt = self.cluster.runtime
        # shared-memory tensors that a killed worker of this host left behind
        if self._host_shm and (removed := hostshm.sweep()):
            self.log.info("removed leftover shared-memory tensors", files=removed)
        data = make_socket(
            self.owner.ctx,
            zmq.PULL,
            bind=tcp(self.device.host, self.device.port),
            hwm=rt.hwm,
            max_frame_bytes=rt.max_frame_bytes,
            curve=self.owner.curve,
        )
        self.address = bound_address(data)
        self.owner.watch_handshakes(
            self.owner.channel(
                Channel(data, self._on_data, name="data", max_frame_bytes=rt.max_frame_bytes)
            )
        )
        ident = f"{self.device.name}:{os.getpid()}".encode()
        sock = make_socket(
            self.owner.ctx,
            zmq.DEALER,
            connect=self.head_address,
            identity=ident,
            hwm=rt.hwm,
            max_frame_bytes=rt.max_frame_bytes,
            curve=self.owner.curve,
        )
        self.head = self.owner.channel(
            Channel(sock, self._on_head, name="head", max_frame_bytes=rt.max_frame_bytes)
        )
        self.owner.spawn(self._heartbeat(), "heartbeat")

    async def hello(self, timeout: float | None = None) -> None:
        """Register with the head, retrying until it answers (it may start after us)."""
        assert self.head is not None
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        self.welcomed.clear()
        while not self.welcomed.is_set():
            await self.head.send(
                Kind.HELLO,
                {
                    "device": self.device.name,
                    "address": self.address,
                    "pid": os.getpid(),
                    "host": socket.gethostname(),
                    "type": self.device.type,
                },
            )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.welcomed.wait(), HELLO_RETRY_S)
            if deadline is not None and loop.time() > deadline:
                raise TimeoutError(
                    f"the head at {self.head_address} did not answer within "
                    f"{timeout:g} s: is `hetpipe-ps --shard 0` running?"
                )

    async def _heartbeat(self) -> None:
        assert self.head is not None
        while True:
            await asyncio.sleep(self.cluster.runtime.heartbeat_s)
            if not self.welcomed.is_set():
                continue
            fields: dict[str, Any] = {"device": self.device.name, "state": self.state}
            if self.job is not None:
                fields.update(job=self.job.task.job, vw=self.job.task.vw, stage=self.job.task.stage)
            await self.head.send(Kind.HEARTBEAT, fields)

    # -- head messages ----------------------------------------------------------------------

    async def _on_head(self, _peer: bytes | None, msg: Message) -> None:
        assert self.head is not None
        # the head's socket: its messages carry no user id where this worker connects, so
        # this holds by the connection; the table still says who may send each kind
        if not may_send(msg.kind, msg.user, msg.fields):
            self._refused.warning(
                "request refused: not this peer's role",
                str(msg.user),
                f"{msg.user} may not send {msg.kind}",
                kind=str(msg.kind),
            )
            return
        if msg.kind == Kind.WELCOME:
            self.welcomed.set()
            self.log.info("registered", head=self.head_address, address=self.address)
        elif msg.kind == Kind.ERROR:
            if "unregistered" in msg["message"]:
                self.log.warning("the head does not know us; registering again")
                asyncio.get_running_loop().create_task(self.hello())
            else:
                self.log.warning("head error", error=msg["message"])
        elif msg.kind == Kind.ASSIGN:
            await self._assign(msg)
        elif msg.kind == Kind.MEASURE:
            asyncio.get_running_loop().create_task(self._measure(msg))
        elif msg.kind == Kind.START:
            try:
                self._start(msg["job"])
            except Exception as exc:  # its job fails in one line, never waits on this stage
                await self._start_failed(msg["job"], exc)
        elif msg.kind == Kind.MIGRATE_ORDER:  # the head's re-plan (hetpipe.migrate.order)
            await self._migrate_order(msg)
        elif msg.kind == Kind.CUT_AT:  # an on-demand checkpoint (hetpipe.head.cuts)
            runners = [j.runner for j in self._of_job(msg["job"]) if j.runner is not None]
            if not runners:
                await self.head.reply_error(None, f"no stage of {msg['job']} here", msg["rid"])
            else:
                # every stage of this device takes the cut, or the latest earliest one says
                # when all of them could
                later = [a for r in runners if (a := r.ask_cut(msg["wave"])) is not None]
                info = {"earliest": max(later) if later else None}
                await self.head.send(Kind.OK, {"rid": msg["rid"], "info": info})
        elif msg.kind == Kind.ABORT and self._of_job(msg["job"]):
            self.log.warning("job aborted", job=msg["job"], reason=msg["reason"])
            await self._drop_job()

    async def _assign(self, msg: Message) -> None:
        assert self.head is not None
        rid = msg["rid"]
        try:
            task = StageTask.from_dict(msg["task"])
        except ValueError as exc:
            await self.head.reply_error(None, f"{self.device.name}: {exc}", rid)
            return
        job = self.job
        if job is not None and (
            job.task.job != task.job
            or (task.vw, task.stage) in self.stages
            or any(j.runner is not None for j in self.stages.values())
        ):  # another job, or a new attempt of this one: its stages so far go
            await self._drop_job()
        try:
            # the head checked the job at submit; a worker checks again before any import
            check_code(task.spec, self.cluster.security.allowed_modules)
            loop = asyncio.get_running_loop()
            # the job's own modules: this worker's copy as submitted, re-imported if edited
            await loop.run_in_executor(self.executor, check_user_code, task.spec)
            compute = await loop.run_in_executor(
                self.executor, _stage_compute, task, self.device, msg.tensors
            )
            compute.device_memory = self.memory
            job = _Job(task, compute, self.closing)
            rt = self.cluster.runtime
            for address in dict.fromkeys(_destinations(task)):
                if address == self.address:  # a stage of this device: handed over in process
                    continue
                job.channels.append(self.owner.connect(zmq.PUSH, address, f"to:{address}", rt))
            for index, address in task.shards.items():
                ch = self.owner.connect(zmq.DEALER, address, f"shard{index}", rt)
                job.channels.append(ch)
                job.shards[int(index)] = ch
            if task.is_first:
                # the data set object only (a lazy one reads its samples as the loader asks)
                spec = compute.spec
                source = await loop.run_in_executor(
                    self.executor, load_data, spec.data.name, spec.data.args, spec.data.collate
                )
                job.stream = MinibatchStream(
                    source,
                    spec.minibatch,
                    spec.seed,
                    task.vw,
                    task.num_vws,
                    workers=spec.data.workers,
                    prefetch=spec.data.prefetch,
                    pin_memory=str(self.device.device).startswith("cuda"),
                    shares=task.shares or None,
                )
            self.stages[(task.vw, task.stage)] = job
        except Exception as exc:
            self.log.warning("assignment refused", error=excerpt(exc))
            await self.head.reply_error(None, f"{self.device.name}: {exc}", rid)
            return
        logmod.structlog.contextvars.bind_contextvars(job=task.job, vw=task.vw, stage=task.stage)
        if len(self.stages) > 1:  # several stages here: each line names its own
            logmod.structlog.contextvars.unbind_contextvars("stage")
        self.log.info(
            "assigned",
            layers=f"{task.first}..{task.last - 1}",
            k=task.k,
            nm=task.nm,
            where=task.where,
        )
        await self.head.send(Kind.OK, {"rid": rid})

    async def _measure(self, msg: Message) -> None:
        """Profile the job's layers on this device for the planner."""
        assert self.head is not None
        try:
            check_code(msg["job"], self.cluster.security.allowed_modules)
            spec = JobSpec.from_dict(msg["job"], source="job")
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(self.executor, check_user_code, spec)
            info = await loop.run_in_executor(self.executor, measure, spec, self.device)
        except Exception as exc:
            self.log.warning("profiling failed", error=excerpt(exc))
            await self.head.reply_error(
                None, f"{self.device.name}: profiling failed: {exc}", msg["rid"]
            )
            return
        await self.head.send(Kind.OK, {"rid": msg["rid"], "info": info})

    def _start(self, job_id: str) -> None:
        """Start every stage of ``job_id`` assigned here: all runners exist before any runs,
        so a stage of this device always has its neighbour here to hand its tensors to."""
        new = [j for j in self._of_job(job_id) if j.runner is None]
        turn = None  # a device-level schedule: the stages of this device take turns
        if new:
            t = new[0].task
            stages = [j.task.stage for j in new]
            turn = device_turn(new[0].compute.spec, t.vw, stages, t.k, t.nm, t.minibatches)
        for job in new:
            self._make_runner(job, turn)
        for job in new:
            for msg in job.early:
                self._take(job, msg)
            job.early.clear()
            job.run_task = asyncio.get_running_loop().create_task(self._run(job), name="stage")

    async def _start_failed(self, job_id: str, exc: Exception) -> None:
        """A stage of ``job_id`` could not start: each of this device's stages of it tells
        the head so (the job fails naming it), and the device drops them."""
        assert self.head is not None
        self.log.exception("stage could not start", job=job_id)
        why = f"{type(exc).__name__}: {exc}" if str(exc) else repr(exc)
        jobs = self._of_job(job_id)
        for job in jobs:
            t = job.task
            await self.head.send(
                Kind.STAGE_FAILED,
                {"job": t.job, "vw": t.vw, "stage": t.stage, "error": f"could not start: {why}"},
            )
        if jobs:
            await self._drop_job()

    def _make_runner(self, job: _Job, turn: DeviceTurn | None = None) -> None:
        local = self._local_kinds(job.task)
        job.runner = StageRunner(
            job.compute,
            self.executor,
            send=self._sender(job),
            shards=job.shards,
            report=self._reporter(job),
            stream=job.stream,
            copy_executor=self.copies,
            snapshot=self._snapshotter(job),
            direct=frozenset(
                kind
                for kind, group in (
                    (Kind.ACT, job.task.next_group),
                    (Kind.GRAD, job.task.prev_group),
                )
                if len(group) == 1 and self._shares_gpu_with(group[0]) and kind not in local
            ),
            local=local,
            own_stream=len(self._of_job(job.task.job)) > 1,
            inline_s=self.cluster.runtime.inline_ms / 1e3,
            inbox=job.inbox,
            records_out=self._records_sender(job),
            records_every=self.cluster.runtime.records_every,
            turn=turn,
        )

        def connect(index: int, address: str) -> Channel:  # a shard a migration needs
            ch = self.owner.connect(zmq.DEALER, address, f"shard{index}", self.cluster.runtime)
            job.channels.append(ch)
            return ch

        migrate.attach(job.runner, self.device, self.head, connect)  # replan.migrate_at

    def _local_kinds(self, task: StageTask) -> frozenset[str]:
        """The kinds (act, grad) whose neighbour stage runs on this device too."""
        return frozenset(
            kind
            for kind, near in ((Kind.ACT, task.stage + 1), (Kind.GRAD, task.stage - 1))
            if (task.vw, near) in self.stages and self.stages[(task.vw, near)].task.job == task.job
        )

    async def _migrate_order(self, msg: Message) -> None:
        assert self.head is not None
        job = self.job
        try:
            if job is None or job.runner is None or job.task.job != msg["job"]:
                raise migrate.MigrationError(f"{self.device.name} runs no stage of {msg['job']}")
            if len(self.stages) > 1:
                raise migrate.MigrationError(
                    f"{self.device.name} runs {len(self.stages)} stages: a device running "
                    "several stages takes no live migration"
                )
            mode = msg.get("mode")
            if mode == "cancel":
                info = {"cancelled": migrate.cancel(job.runner, msg["at"])}
            elif mode in (None, "pick"):
                new = migrate.Order(msg["at"], tuple(int(n) for n in msg["layers"]), msg["reason"])
                info = {"at": migrate.order(job.runner, new, pick=mode == "pick")}
            else:
                raise migrate.MigrationError(f"migration order: no mode {mode!r}")
        except migrate.MigrationError as exc:
            await self.head.reply_error(None, str(exc), msg["rid"])
            return
        await self.head.send(Kind.OK, {"rid": msg["rid"], "info": info})

    def _sender(self, job: _Job) -> Any:
        channels = {c.name: c for c in job.channels}
        task = job.task
        # the stage each kind is for: data messages name it (a device may run several)
        to_stage = {
            Kind.ACT: task.stage + 1,
            Kind.GRAD: task.stage - 1,
            Kind.REPLICA_GRAD: task.stage,
        }
        local = {kind: self.stages[(task.vw, to_stage[kind])] for kind in self._local_kinds(task)}
        groups = {
            Kind.ACT: task.next_peers,
            Kind.GRAD: task.prev_peers,
            Kind.REPLICA_GRAD: task.peers,
        }
        # activations, gradients and a replica's weight gradients to a device of this host:
        # large host tensors go through shared memory (hetpipe.hostshm), by destination index
        by_host = {
            kind: {to for to, d in enumerate(group) if self._shares_host_with(d)}
            for kind, group in (
                (Kind.ACT, task.next_group),
                (Kind.GRAD, task.prev_group),
                (Kind.REPLICA_GRAD, task.group),
            )
        }
        fields = {"job": task.job, "vw": task.vw}

        async def send(
            kind: str,
            p: int,
            tensors: dict[str, torch.Tensor],
            shared: dict[str, Any] | None = None,
            to: int = 0,
            extra: dict[str, Any] | None = None,
        ) -> None:
            peers = groups[kind]
            assert to < len(peers), f"{kind} has no destination {to} at {task.where}"
            if kind in local:  # a stage of this device: its runner takes the tensors as they are
                here = {**fields, "p": p, **(extra or {})}
                stream = job.runner.cuda_stream if job.runner is not None else None
                if stream is not None:  # after the kernels queued so far that made them
                    here["event"] = torch.cuda.Event()
                    here["event"].record(stream)
                self._hand_over(local[kind], Message(Kind(kind), here, dict(tensors)))
                return
            more: dict[str, Any] = {"ipc": shared} if shared else {}
            if kind != Kind.REPLICA_GRAD:
                more["stage"] = to_stage[kind]
            if to in by_host.get(kind, ()):
                refused_before = job.outbox.error
                placed, tensors = job.outbox.place(tensors)
                if placed:
                    more["shm"] = placed
                if job.outbox.error and not refused_before:  # once: no tensor is put after
                    self.log.warning(
                        "shared memory refused a tensor; it goes through the socket",
                        error=job.outbox.error,
                    )
            await channels[f"to:{peers[to]}"].send(
                kind, {**fields, "p": p, **more, **(extra or {})}, tensors
            )

        return send

    def _hand_over(self, to: _Job, msg: Message) -> None:
        """Give a message of a stage of this device to another of its stages (before that one
        runs: kept for it, as the data port keeps early data)."""
        if to.runner is None:
            to.early.append(msg)
        else:
            self._take(to, msg)

    def _snapshotter(self, job: _Job) -> Any:
        """The stage's state at each cut goes to the head, which writes the checkpoint (the
        job's directory is the head's; no file system is shared with the workers)."""

        async def snapshot(
            wave: int, meta: dict[str, Any], tensors: dict[str, torch.Tensor]
        ) -> None:
            assert self.head is not None
            await self.head.send(
                Kind.STAGE_STATE,
                {
                    "job": job.task.job,
                    "vw": job.task.vw,
                    "stage": job.task.stage,
                    "wave": wave,
                    "meta": meta,
                },
                tensors,
            )

        return snapshot

    def _reporter(self, job: _Job) -> Any:
        async def report(
            stats: dict[str, Any], tensors: dict[str, torch.Tensor] | None = None
        ) -> None:
            assert self.head is not None
            if not job.task.leader:
                return  # a replicated stage's leader reports for it (hetpipe.replicas)
            await self.head.send(
                Kind.REPORT,
                {"job": job.task.job, "vw": job.task.vw, "stage": job.task.stage, "stats": stats},
                tensors,
            )

        return report

    def _records_sender(self, job: _Job) -> Any:
        """Finished records and spans go to the head in chunks while the stage trains (the
        head appends them to the job's directory); a replica's are its leader's to send."""

        async def out(records: list[list[Any]], spans: list[list[Any]]) -> None:
            assert self.head is not None
            if not job.task.leader:
                return  # a replicated stage's leader reports for it (hetpipe.replicas)
            t = job.task
            await self.head.send(
                Kind.STAGE_RECORDS,
                {"job": t.job, "vw": t.vw, "stage": t.stage, "records": records, "spans": spans},
            )

        return out

    async def _run(self, job: _Job) -> None:
        assert self.head is not None and job.runner is not None
        t = job.task
        ids = {"job": t.job, "vw": t.vw, "stage": t.stage}
        try:
            stats = await job.runner.run()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.log.exception("stage failed", where=t.where)
            await self.head.send(
                Kind.STAGE_FAILED,
                {**ids, "error": f"{type(exc).__name__}: {exc}" if str(exc) else repr(exc)},
            )
        else:
            # its records and spans went to the head while it trained: the summary is left
            records, spans = stats.pop("records"), stats.pop("spans")
            stats["shared_memory_sent"] = job.outbox.sent  # tensors to peers of this host
            if records or spans:
                await self._records_sender(job)(records, spans)
            if t.leader:  # a replicated stage is done when its leader is: it waits for all
                await self.head.send(Kind.STAGE_DONE, {**ids, "stats": stats})
            self.log.info("stage done", minibatches=stats["done"], where=t.where)
        finally:
            key = (t.vw, t.stage)
            if self.stages.get(key) is job:
                del self.stages[key]
                self.memory.leave(job.compute.where)
                asyncio.get_running_loop().create_task(job.close())
            if not self.stages:
                logmod.structlog.contextvars.unbind_contextvars("job", "vw", "stage")

    async def _drop_job(self) -> None:
        """Drop every stage this device runs (its job is aborted, or another comes)."""
        stages, self.stages = self.stages, {}
        for key in sorted(stages):
            self.memory.leave(stages[key].compute.where)
            await stages[key].close()
        logmod.structlog.contextvars.unbind_contextvars("job", "vw", "stage")

    # -- data messages ----------------------------------------------------------------------

    async def _on_data(self, _peer: bytes | None, msg: Message) -> None:
        if msg.kind not in (Kind.ACT, Kind.GRAD, Kind.REPLICA_GRAD):
            self.log.warning("unexpected message on the data port", kind=str(msg.kind))
            return
        job = self._addressed(msg)
        if job is None:
            self.log.debug("stale data dropped", job=excerpt(msg["job"], 80))
            return
        # authority (hetpipe.security): activations only from stage - 1, gradients only from
        # stage + 1, weight gradients only from this stage's other replicas
        t = job.task
        neighbours = {
            Role.PREVIOUS_STAGE: t.prev_group,
            Role.NEXT_STAGE: t.next_group,
            Role.OTHER_REPLICA: [d for r, d in enumerate(t.group) if r != t.replica],
        }
        senders = neighbours[AUTHORITY[msg.kind].sender]

        def holders(role: Role) -> set[str]:
            return {worker_user(d) for d in neighbours.get(role, ())}

        if (msg.kind == Kind.REPLICA_GRAD and msg["stage"] != t.stage) or not may_send(
            msg.kind, msg.user, msg.fields, holders
        ):
            self._refused.warning(
                "data refused: not from this stage's neighbour",
                str(msg.user),
                f"{msg.user} sent {msg.kind}",
                kind=str(msg.kind),
                expected=",".join(senders),
            )
            return
        sender = senders[0] if len(senders) == 1 else None
        if msg.get("ipc") and not self._shares_gpu_with(sender):
            self._refused.warning(
                "data refused: a shared GPU tensor from a peer that is not a GPU of this host",
                str(msg.user),
                f"{sender} sent {msg.kind} by handle",
                kind=str(msg.kind),
            )
            return
        # the sender by its key (any of the role's devices where Curve is off)
        if msg.get("shm") and not all(
            self._shares_host_with(d)
            for d in senders
            if msg.user is None or msg.user == worker_user(d)
        ):
            self._refused.warning(
                "data refused: a shared-memory tensor from a peer that is not on this host",
                str(msg.user),
                f"{sender} sent {msg.kind} in shared memory",
                kind=str(msg.kind),
            )
            return
        if job.runner is None:
            job.early.append(msg)
        else:
            self._take(job, msg)

    def _addressed(self, msg: Message) -> _Job | None:
        """The stage a data message is for: the one its ``stage`` names (a sender that names
        none: this device's one stage of the message's vw), None where this device runs no
        such stage of the message's job."""
        if (stage := msg.get("stage")) is not None:
            job = self.stages.get((msg["vw"], stage))
            return job if job is not None and job.task.job == msg["job"] else None
        mine = [j for j in self._of_job(msg["job"]) if j.task.vw == msg["vw"]]
        return mine[0] if len(mine) == 1 else None

    def _take(self, job: _Job, msg: Message) -> None:
        """Give a checked data message to the stage; a malformed one is logged and dropped
        (the stage then waits for it, and the head's hang diagnosis says so)."""
        assert job.runner is not None
        try:
            job.runner.on_message(msg)
        except ValueError as exc:
            self.log.warning("data refused: malformed", kind=str(msg.kind), error=excerpt(exc))

    def _on_this_host(self, peer: str | None) -> DeviceSpec | None:
        """Device ``peer``'s spec if it is a device of this worker's host, else None."""
        if peer is None:
            return None
        try:
            other = self.cluster.device(peer)
        except (KeyError, ValueError):
            return None
        return other if other.host == self.device.host else None

    def _shares_gpu_with(self, peer: str | None) -> bool:
        """Whether tensors to and from device ``peer`` move device to device: both are GPUs
        of this host and ``[runtime] cuda_ipc`` allows it (hetpipe.cudaipc)."""
        other = self._on_this_host(peer) if self.cluster.runtime.cuda_ipc else None
        return (
            other is not None
            and self.device.device.startswith("cuda")
            and other.device.startswith("cuda")
        )

    def _shares_host_with(self, peer: str | None) -> bool:
        """Whether large host tensors to and from device ``peer`` go through this host's
        shared memory: it is a device of this host and ``[runtime] host_shm`` allows it
        (hetpipe.hostshm)."""
        return self._host_shm and self._on_this_host(peer) is not None

    async def close(self) -> None:
        await self._drop_job()
        for box in self.closing:  # stopping: nobody takes their files later
            box.close()
        self.closing.clear()
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.copies.shutdown(wait=False, cancel_futures=True)


def _destinations(task: StageTask) -> list[str]:
    """The data addresses a stage sends to: its neighbours' devices (every replica of a
    replicated neighbour) and its own replicas."""
    return [
        *task.prev_peers,
        *task.next_peers,
        *(a for r, a in enumerate(task.peers) if r != task.replica),
    ]


def _stage_compute(
    task: StageTask, device: DeviceSpec, tensors: dict[str, torch.Tensor]
) -> StageCompute:
    """The stage of an assignment: its non-persistent buffers are named as in the model;
    the checkpointed state of a resumed job (names with a ``/``) is loaded into it."""
    local = {k: t for k, t in tensors.items() if "/" not in k}
    compute = StageCompute(task, device, local)
    if task.restore is not None:
        compute.load_state(
            task.restore,
            {k: t for k, t in tensors.items() if "/" in k},
            weights=bool(task.restore.get("weights")),
        )
    return compute


async def serve(
    cluster: ClusterConfig,
    device: DeviceSpec,
    *,
    head: str | None = None,
    ready_file: str | None = None,
) -> None:
    """Run the worker of ``device`` until SIGTERM/SIGINT."""
    owner = Owner()
    worker = Worker(cluster, device, owner, head)
    try:
        owner.secure(cluster.security, worker_user(device.name), serve=True)
        await worker.start()
        write_ready(
            ready_file, {"role": "worker", "device": device.name, "address": worker.address}
        )
        worker.log.info(
            "ready",
            address=worker.address,
            device=device.device,
            speed=device.speed,
            curve=owner.curve is not None,
        )
        owner.spawn(worker.hello(), "hello")
        sig = await wait_for_signal()
        worker.log.info("stopping", signal=sig)
    finally:
        await worker.close()
        await owner.close()


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--cluster",
    "cluster_path",
    default="cluster.toml",
    show_default=True,
    type=click.Path(dir_okay=False),
    help="Cluster description.",
)
@click.option("--device", required=True, help="Device name in the cluster file (e.g. gpu0).")
@click.option("--head", default=None, help="Head address (tcp://host:port) if not the file's.")
@click.option("--ready-file", default=None, help="Write the bound address here when ready.")
@click.option(
    "--threads",
    default=1,
    show_default=True,
    help="Torch intra-op threads (emulated devices share the host's cores).",
)
@click.option("--log-level", default="info", show_default=True)
@click.option(
    "--log-file",
    default=None,
    type=click.Path(dir_okay=False),
    help="Log here (JSON lines), rotated by the cluster file's log_max_bytes.",
)
def main(
    cluster_path: str,
    device: str,
    head: str | None,
    ready_file: str | None,
    threads: int,
    log_level: str,
    log_file: str | None,
) -> None:
    """Run one worker daemon for one device of the cluster."""
    logmod.configure(f"worker:{device}", level=log_level)
    try:
        cluster = load_cluster(cluster_path)
        spec = cluster.device(device)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    head = start_daemon(f"worker:{device}", cluster, log_file, log_level, head)
    if spec.device.startswith("cuda") and not torch.cuda.is_available():
        raise click.ClickException(
            f"{device} is {spec.device} in {cluster_path}, but this torch has no CUDA device"
        )
    torch.set_num_threads(max(1, threads))
    try:
        asyncio.run(serve(cluster, spec, head=head, ready_file=ready_file))
    except KeysError as exc:
        raise click.ClickException(str(exc)) from None
    except zmq.ZMQError as exc:
        raise click.ClickException(
            f"{device} cannot listen on {spec.host}:{spec.port}: {exc}"
        ) from None
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
