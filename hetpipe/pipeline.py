"""Runs one stage of one job: executes the actions its schedule gives, moves the messages.

What the stage does next (admission, 1F1B, waves, pulls and pushes, the synchronous kinds'
microbatch order and flushes) is decided by :class:`hetpipe.core.schedule.StageSchedule`, the
same object the planner's simulator asks; this module only executes: compute on the
worker's single compute thread, messages on the event loop, so receives keep flowing while
the stage computes.

Compute actions that need no input from outside run in one hand-off to the compute thread:
a backward, the optimizer step after it and the push of the wave it closed (its copy to the
host started there, :mod:`hetpipe.hostcopy`), on the last stage its forward (with the loss)
before them, and on the first stage the next forward after them. What a run made is sent
afterwards in order, once its copy to the host is done (waited for on a copy thread, never
on the compute thread). The clock a forward saw is recorded with it, so staleness is
observable afterwards; the losses come back in batches (:mod:`hetpipe.readback`).

A device may run several stages (of one virtual worker): each has its runner, all on the
device's one compute thread. What goes to a stage of the same device (``local`` kinds) is
handed over as the tensors it is, never copied to the host; on a GPU each such stage computes
on its own CUDA stream, and a handed-over tensor carries its producer's event, which the
receiver's stream waits for (so stages overlap where the schedule lets them).

One file on purpose: :class:`StageRunner` is one executor whose message handlers and
actions share the minibatches in flight, their pieces and the wave's pushes; the compute
itself is :mod:`hetpipe.stage`'s and the order :mod:`hetpipe.core.schedule`'s.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

import torch

from hetpipe import carry, hostshm
from hetpipe.carry import Carry, Target
from hetpipe.checkpoint import is_cut
from hetpipe.computethread import InlinePolicy
from hetpipe.core.schedule import (
    DEVICE_KINDS,
    Action,
    Backward,
    BackwardInput,
    BackwardWeight,
    Done,
    Forward,
    Merge,
    OptimizerStep,
    Pull,
    Push,
    ScheduleError,
    StageSchedule,
    Wait,
)
from hetpipe.core.wsp import pull_need, wave_of
from hetpipe.cudaipc import Shared, parse, share
from hetpipe.cudapeak import allocator_peaks, reset_allocator_peaks
from hetpipe.data import Batch, MinibatchStream, rows_of
from hetpipe.devturn import DeviceTurn
from hetpipe.evalpass import Passes, on_workers
from hetpipe.hostcopy import HostCopy
from hetpipe.metrics import parse_every
from hetpipe.replicas import gather, piece, pieces_for
from hetpipe.stage import StageCompute
from hetpipe.timeline import Timeline, shares
from hetpipe.transport import Channel
from hetpipe.wire import Kind, Message

__all__ = [
    "PULL_TIMEOUT_S",
    "PUSH_TIMEOUT_S",
    "Record",
    "StageRunner",
    "TieRoute",
    "stage_schedule",
    "unsettled",
]

PUSH_TIMEOUT_S = 120.0
# A pull may be parked for as long as the slowest virtual worker needs to finish a wave.
PULL_TIMEOUT_S = 3600.0

# a report to the head: stats, and the tensors some carry (a stage's weights for the best
# model of train.keep_best: hetpipe.evalpass); a report without tensors passes none
Report = Callable[..., Awaitable[None]]
# (kind, p, host tensors, device tensors of this host's GPUs shared by handle or None, the
# receiver's place in its group: act to stage + 1, grad to stage - 1, replica_grad to this
# stage's replicas (hetpipe.replicas), more header fields)
Send = Callable[
    [str, int, dict[str, torch.Tensor], dict[str, Any] | None, int, dict[str, Any]], Awaitable[None]
]
# a stage's state at a cut (wave, meta, tensors): to the head, for a checkpoint
Snapshot = Callable[[int, dict[str, Any], dict[str, torch.Tensor]], Awaitable[None]]
# the names of an activation of one tensor with its target, and of its gradient (sorted)
_ACT_NAMES = ("x", "y")
_GRAD_NAMES = ("g",)
# in a run's inputs: the first stage's minibatch, read on the compute thread (StageRunner._compute)
_READ = object()
# a chunk of finished minibatches' records (rows of Record.FIELDS, ascending p) and the
# timeline spans since the previous chunk: to the head while the stage trains, so no message
# and no daemon's memory grows with the length of the job
RecordsOut = Callable[[list[list[Any]], list[list[Any]]], Awaitable[None]]
# while finished records wait, a chunk goes at least this often (else every records_every)
RECORDS_EVERY_S = 2.0


@dataclass
class Record:
    """What one minibatch saw at this stage: the observable staleness and weight versions."""

    p: int
    wave: int
    clock: int  # global clock of the weights its forward used
    vw_clock: int  # this VW's clock as the shard saw it then
    fwd_version: int = -1
    fwd_fingerprint: float = 0.0
    bwd_version: int = -1  # version current when its backward ran
    bwd_fingerprint: float = 0.0  # of the weights the backward differentiated
    t_fwd: float = 0.0  # wall-clock start of its forward here (comparable across daemons)
    t_bwd: float = 0.0  # wall-clock end of its backward here
    loss: float | None = None  # last stage only

    FIELDS = (
        "p",
        "wave",
        "clock",
        "vw_clock",
        "fwd_version",
        "fwd_fingerprint",
        "bwd_version",
        "bwd_fingerprint",
        "t_fwd",
        "t_bwd",
        "loss",
    )

    def row(self) -> list[Any]:
        return [getattr(self, f) for f in self.FIELDS]


def unsettled(acks: list[asyncio.Future[Message]]) -> list[asyncio.Future[Message]]:
    """The push acknowledgements of one shard that still say something, in order.

    A shard handles one stage's pushes in the order they were sent, and answers each once it
    has applied it. So an answered push settles every earlier one: each was applied, whether
    or not its own answer arrived. The answers before the last successful one leave (those
    never answered are cancelled); an error answer stays until it is raised.
    """
    last = max(
        (i for i, f in enumerate(acks) if f.done() and not f.cancelled() and f.exception() is None),
        default=-1,
    )
    for f in acks[:last]:
        if not f.done():
            f.cancel()
    failed = [f for f in acks[:last] if not f.cancelled() and f.exception() is not None]
    return failed + acks[last + 1 :]


def stage_schedule(compute: StageCompute) -> StageSchedule:
    """The schedule of the stage ``compute`` runs.

    A virtual worker alone in its job exchanges nothing with the shards after the initial
    weights: its global weights hold nothing but its own pushed updates, which its local
    weights already include exactly (re-adding them would only change the rounding), and a
    synchronous iteration has nobody to average gradients with.

    A stage that does not stash (``train.weights``) runs the lock-step order its s was
    counted on (:class:`hetpipe.core.staleness.StageTable`). One the plan limits runs its
    ``in_flight_fill`` forwards before its first backward and holds at most its
    ``in_flight_limit`` minibatches (:func:`hetpipe.planner.plan.make_plan`).

    A stage holding a copy of a tie that spans stages pulls every wave in the asynchronous
    kind even alone: the other copies' updates reach it only through the shards
    (:meth:`StageRunner._pull`).
    """
    task = compute.task
    table = compute.table
    tied = bool(task.tied) and not compute.spec.sync
    orders = compute.spec.order  # train.order: checked against the job's split at submit
    if orders is not None and len(orders) != task.k:
        raise ScheduleError(f"train.order has {len(orders)} stages, this virtual worker {task.k}")
    devices = None
    if compute.spec.schedule in DEVICE_KINDS:  # each stage's order: its device's projected
        devices = len(set(compute.spec.vws[task.vw].devices))
    return StageSchedule(
        compute.spec.schedule,
        k=task.k,
        stage=task.stage,
        nm=task.nm,
        total=task.minibatches,
        staleness=task.staleness,
        pulls=(task.num_vws > 1 or tied) and compute.has_state,
        pushes=compute.has_state,
        sequence=table.op if table is not None else None,
        replicated=task.replicated,
        warmup=compute.spec.warmup_forwards or 0,
        limit=task.in_flight_limit or None,
        fill=task.in_flight_fill,
        order=orders[task.stage] if orders is not None else None,
        devices=devices,
        # a spec without the key (a test's stand-in) defers nothing
        defer=getattr(compute.spec, "defer_weight_grad", False),
    )


class StageRunner:
    """Runs one stage of one job to the end, or until cancelled."""

    def __init__(
        self,
        compute: StageCompute,
        executor: Executor,
        *,
        send: Send,
        shards: dict[int, Channel],
        report: Report,
        stream: MinibatchStream | None,
        report_every_s: float = 0.5,
        copy_executor: Executor | None = None,
        snapshot: Snapshot | None = None,
        direct: frozenset[str] = frozenset(),
        inline_s: float = 0.0,
        inbox: hostshm.Inbox | None = None,
        records_out: RecordsOut | None = None,
        records_every: int = 1024,
        local: frozenset[str] = frozenset(),
        own_stream: bool = False,
        turn: DeviceTurn | None = None,
    ) -> None:
        """``inline_s``: compute runs the stage measured shorter than this run on the event
        loop, not the compute thread (:mod:`hetpipe.computethread`; 0: never). ``inbox``:
        reads the tensors its neighbours of this host put in shared memory (its owner unmaps
        it when the job ends; a new one if not given). ``records_out``: where finished
        records and spans go in chunks of at most ``records_every`` records while the stage
        trains (None: all of them stay for :meth:`final_stats`). ``local``: the kinds (act,
        grad) whose neighbour stage runs on this device too (``send`` hands their tensors
        over in process: they are never copied to the host). ``own_stream``: on a GPU, this
        stage computes on a CUDA stream of its own (its device runs several stages).
        ``turn``: the gate its device's stages take their passes through, in the device's
        order (a device-level schedule, :mod:`hetpipe.devturn`)."""
        self.compute = compute
        self.turn = turn
        self.local = local
        self.cuda_stream: Any = (
            torch.cuda.Stream(torch.device(compute.dev))
            if own_stream and str(compute.dev).startswith("cuda")
            else None
        )
        self.task = compute.task
        self.sync = compute.spec.sync
        self.executor = executor
        self.send = send
        self.shards = shards
        self.report = report
        self.stream = stream
        self.report_every_s = report_every_s
        self.snapshot = snapshot
        self.inbox = inbox if inbox is not None else hostshm.Inbox()
        self.schedule = stage_schedule(compute)
        reset_allocator_peaks(compute.dev)  # its weights are live: the peak counts them
        self.inline = InlinePolicy(
            executor,
            inline_s,
            device=compute.dev,
            speed=compute.speed,
            pulls=self.schedule.pulls,
            stalls=bool(compute.stalls or compute.slowdowns),
        )
        spec = compute.spec
        # train.eval_every, and whether its passes run on the workers (hetpipe.evalpass)
        waves, seconds = parse_every(spec.eval_every)
        seconds = seconds or spec.eval_every_s
        workers = on_workers(
            sync=self.sync,
            num_vws=compute.task.num_vws,
            ties=bool(compute.task.ties),
            bn_recalibrate=spec.bn_recalibrate,
        )
        # waves between the pushes that carry this stage's update (see _flushes): 0 for
        # only at checkpoints and the end; every wave where the head scores the shards'
        # weights while training, or exports them when the job stops for lack of gain (they
        # must hold what was trained)
        self.push_every = (
            1
            if self.schedule.pulls
            or (
                not spec.push_every
                and (waves or seconds)
                and (not workers or spec.stop_after_no_gain)
            )
            else spec.push_every
        )
        self.flushed = 0  # waves whose update has been sent to the shards
        self.asked: set[int] = set()  # cuts asked for on demand (hetpipe checkpoint)
        self.copying = -1  # the last wave whose push was decided (on the compute thread)
        self.cut_lock = threading.Lock()  # orders the two
        self.copy_executor = copy_executor or executor
        if compute.restored:  # its checkpointed weights hold the first wave's merge
            self.schedule.done(Pull(0))
            self.schedule.done(Merge(0))
        # received carries (hetpipe.carry) with their targets, and gradients, by minibatch
        self.acts: dict[int, tuple[Carry, Target]] = {}
        # validation passes (_validation_pass): (boundary, minibatch i) -> (count, tensors)
        # as the previous stage sent them; the last stage's figures of the job's end pass
        self.eval_in: dict[tuple[int, int], tuple[int, dict[str, Any]]] = {}
        self.validation: dict[str, float] | None = None
        self.validation_s = 0.0  # this stage's time in validation passes (left out of training)
        # the validation passes while training (hetpipe.evalpass): where this stage takes
        # part in them, their bookkeeping; the passes it ran
        self.passes: Passes | None = None
        if workers and self.validates and (waves or seconds):
            self.passes = Passes(
                waves, seconds, self.schedule.waves, spec.keep_best, tuple(spec.metrics)
            )
        self.validations = 0
        self.grads: dict[int, Carry] = {}
        # stage replicas (hetpipe.replicas): the rows this device holds, and each side's split
        task = self.task
        n = compute.spec.minibatch
        self.mine = task.my_rows(n)
        self.prev_rows = task.prev_rows or [0, n]
        self.next_rows = task.next_rows or [0, n]
        # whether messages carry rows: a stage on either side of a link is replicated
        self.split = {
            Kind.ACT: task.replicated or len(task.next_group) > 1,
            Kind.GRAD: task.replicated or len(task.prev_group) > 1,
        }
        # kinds (act, grad) whose tensors reach their neighbour device to device: the
        # neighbour is a GPU of this host (hetpipe.cudaipc) and no rows are scattered (a
        # whole-tensor handle does not scatter: pieces travel by host)
        self.direct = frozenset(k for k in direct if not self.split[k] and k not in local)
        self.pieces: dict[tuple[str, int], dict[int, dict[str, Any]]] = {}
        self.replica_grads: dict[int, dict[int, dict[str, torch.Tensor]]] = {}
        self.replica_copies: dict[int, HostCopy] = {}
        self.wakeup = asyncio.Event()
        self.answers: dict[tuple[int, bool], asyncio.Task[list[Message]]] = {}
        self.push_acks: dict[int, list[asyncio.Future[Message]]] = {}  # shard -> unsettled
        self.records: dict[int, Record] = {}
        self.records_out = records_out
        self.records_every = max(1, records_every)
        self.records_finished = 0  # backwards since the last chunk
        self.records_sent_at = 0.0  # monotonic time of the last chunk
        self.records_lock = asyncio.Lock()  # chunks leave in order (main loop and reporter)
        self.clock = 0
        self.vw_clock = 0
        self.started = 0.0
        self.timeline = Timeline()
        self.waiting: dict[str, Any] | None = None  # what the stage waits for, since when
        self.doing: dict[str, Any] | None = None  # the compute running now, since when
        # the stages' agreement on each step's gradient norm and verdict (_agree): step ->
        # stage -> (squared norm, finite), as this stage learnt them
        self.agrees = compute.agrees
        self.agreement: dict[int, dict[int, tuple[float, bool]]] = {}
        # sync: the ties' gradient sums each stage holding a copy contributed (_exchange):
        # iteration -> (stage, tie) -> its sum, as this stage learnt them; the last iteration
        # exchanged
        self.tie_sums: dict[int, dict[Key, torch.Tensor]] = {}
        self.exchanged = -1
        self.tie_route = TieRoute(self.task.ties, self.task.stage) if self.sync else None
        # live layer migration at a wave or iteration boundary (hetpipe.migrate.Migrator)
        self.migration: Any = None

    # -- agreement across the stages of a virtual worker -----------------------------------

    def _take_agreement(self, msg: Message) -> None:
        """Keep the stages' entries an ``agree`` field of a neighbour's message carries:
        ``[step, [[stage, squared norm, finite], ...]]`` (``ValueError``, one line, if
        malformed)."""
        try:
            step, entries = msg["agree"]
            got = {int(st): (float(sq), bool(ok)) for st, sq, ok in entries}
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{msg.kind} carries a malformed agree field: {exc}") from None
        if not all(0 <= st < self.task.k for st in got):
            raise ValueError(f"{msg.kind} agrees for stages {sorted(got)} of k = {self.task.k}")
        self.agreement.setdefault(int(step), {}).update(got)

    async def _agree(self, i: int) -> None:
        """Before the step of iteration ``i``: agree with the other stages of the virtual
        worker on the iteration's global gradient norm and on whether it is finite
        everywhere, and leave the verdict in the compute's ``agreed``.

        Each stage contributes its squared norm (:meth:`StageCompute.step_stats`). The
        entries travel along the pipeline's own links both ways at once: down (to stage - 1)
        go the entries of this stage and of every stage after it, once known; up (to stage
        + 1) those of this stage and every stage before it. So every stage holds all k
        after at most k - 1 hops, and each sums the same entries in stage order: every stage
        computes the same bits. A stage has sent both its messages before it has all k
        entries, so no stage waits on one that already stepped."""
        sq, finite = await self._run(self.compute.step_stats, i)
        k, stage = self.task.k, self.task.stage
        got = self.agreement.setdefault(i, {})
        got[stage] = (sq, finite)
        down = stage == 0  # sent (or nothing to send)
        up = stage == k - 1
        self._wait_for("agree", c=i)
        with self.timeline.span("gate", None, i):
            while True:
                if not down and all(s in got for s in range(stage, k)):
                    await self._send_agreement(Kind.GRAD, i, range(stage, k))
                    down = True
                if not up and all(s in got for s in range(stage + 1)):
                    await self._send_agreement(Kind.ACT, i, range(stage + 1))
                    up = True
                if len(got) == k:
                    break
                await self.wakeup.wait()
                self.wakeup.clear()
        del self.agreement[i]
        total = sum(got[s][0] for s in range(k))
        self.compute.agreed[i] = (total, all(got[s][1] for s in range(k)))

    async def _send_agreement(self, kind: str, i: int, stages: range) -> None:
        got = self.agreement[i]
        entries = [[s, got[s][0], got[s][1]] for s in stages]
        group = self.task.next_group if kind == Kind.ACT else self.task.prev_group
        for j in range(len(group)):
            await self.send(kind, i, {}, None, j, {"agree": [i, entries]})

    # -- a tie's gradient, summed over the stages that hold a copy -------------------------

    def _take_tied(self, msg: Message) -> None:
        """Keep the ties' gradient sums a neighbour's message carries (``tied``: the
        iteration; tensors ``<stage>/<tie>``); ``ValueError``, one line, for one this stage
        neither uses nor passes on."""
        i = int(msg["tied"])
        got = self.tie_sums.setdefault(i, {})
        route = self.tie_route
        for name in self._names(msg):
            stage, _, tie = name.partition("/")
            key = (int(stage) if stage.isdigit() else -1, tie)
            if route is None or key not in route.wanted:
                raise ValueError(f"{msg.kind} {i} carries a tie's gradient {name!r} not for here")
            got[key] = self._received(msg, name)  # type: ignore[assignment]

    async def _exchange(self, i: int) -> None:
        """Before the step of iteration ``i`` (several virtual workers: before its reduce),
        in the synchronous kinds: sum the gradient of every tie spanning stages over the
        stages holding a copy, so that every copy steps on the tied model's gradient (the sum
        of all its uses) and the copies stay equal, as Megatron's all-reduce of the embedding
        does.

        Each copy's sample-weighted sum travels along the pipeline's own links, as the
        agreement (:meth:`_agree`) does: down (to stage - 1) go the sums of this stage and the
        stages after it that a stage before it holds a copy for, once known; up, likewise. A
        stage between two copies only passes them on. Each copy adds the sums in stage order,
        so every copy has the same bits."""
        route = self.tie_route
        if route is None or i <= self.exchanged or not route.takes_part:
            return
        self.exchanged = i
        got = self.tie_sums.setdefault(i, {})
        if self.task.tied:
            own = await self._host(await self._run(self.compute.tie_gradients))
            for tie, g in own.items():
                got[(self.task.stage, tie)] = g
        down, up = not route.down, not route.up
        self._wait_for("tie", c=i)
        with self.timeline.span("gate", None, i):
            while True:
                if not down and route.down <= got.keys():
                    await self._send_tied(Kind.GRAD, i, route.down)
                    down = True
                if not up and route.up <= got.keys():
                    await self._send_tied(Kind.ACT, i, route.up)
                    up = True
                if down and up and route.used <= got.keys():
                    break
                await self.wakeup.wait()
                self.wakeup.clear()
        del self.tie_sums[i]
        if self.task.tied:
            await self._run(self.compute.sum_tied, {key: got[key] for key in route.used})

    async def _send_tied(self, kind: str, i: int, keys: frozenset[Key]) -> None:
        got = self.tie_sums[i]
        tensors = {f"{stage}/{tie}": got[(stage, tie)] for stage, tie in sorted(keys)}
        await self.send(kind, i, tensors, None, 0, {"tied": i})

    # -- inbox (the schedule's Inputs) -----------------------------------------------------

    def on_message(self, msg: Message) -> None:
        """Take an activation or a gradient addressed to this stage (``ValueError``, one
        line, if its tensors' names form no carry, or it carries a malformed handle).

        An activation's tensors are its carry (``x``, or ``x.0`` ... for a tuple) and the
        minibatch's target (``y``, ``y.<key>`` for a dict, none for a model that computes its
        own loss); a gradient's, its carry ``g`` (:mod:`hetpipe.carry`)."""
        if msg.get("event") is not None:  # handed over by a stage of this device (a GPU's)
            self._after_event(msg)
        if msg.get("eval") is not None:  # a validation pass's message (_validation_pass)
            self._take_eval(msg)
            self.wakeup.set()
            return
        if msg.get("agree") is not None:
            self._take_agreement(msg)
        elif msg.get("tied") is not None:
            self._take_tied(msg)
        elif msg.kind == Kind.ACT:
            names = self._names(msg)
            plain = names == _ACT_NAMES  # one activation and its target: nothing to walk
            if not plain:  # refused before any piece of it is kept
                carry.message_parts(dict.fromkeys(names), f"{msg.kind} {msg['p']}")
            got = self._piece(msg, names, self.prev_rows)
            if got is not None:
                self.acts[msg["p"]] = (
                    (got["x"], got["y"]) if plain else carry.message_parts(got, "")
                )
        elif msg.kind == Kind.GRAD:
            names = self._names(msg)
            plain = names == _GRAD_NAMES
            if not plain:
                carry.gradient_of(dict.fromkeys(names), f"{msg.kind} {msg['p']}")
            got = self._piece(msg, names, self.next_rows)
            if got is not None:
                self.grads[msg["p"]] = got["g"] if plain else carry.gradient_of(got, "")
        elif msg.kind == Kind.REPLICA_GRAD:
            grads = {
                name: self._received(msg, name) for name in (*msg.tensors, *(msg.get("shm") or {}))
            }
            self.replica_grads.setdefault(msg["p"], {})[msg["replica"]] = grads
        self.wakeup.set()

    def _after_event(self, msg: Message) -> None:
        """A message of another stage of this GPU: its tensors are read on this stage's
        stream only after the event its producer recorded, and the allocator keeps them for
        this stream's work (they were made on the producer's)."""
        stream = self.cuda_stream
        if stream is None:
            msg.fields["event"].synchronize()  # no stream of its own: wait here (never hot)
            return
        stream.wait_event(msg.fields["event"])
        for t in msg.tensors.values():
            if t.is_cuda:
                t.record_stream(stream)

    def _take_eval(self, msg: Message) -> None:
        """A validation pass's message (``ValueError``, one line, if malformed): on an
        activation, ``[c]`` announces a pass at boundary ``c``, ``[i, n, c]`` is its minibatch
        ``i`` of ``n`` (``[i, n]``: the pass at the job's end); on a gradient, ``[c,
        improved]`` is the last stage's verdict on the pass's figures (``train.keep_best``)."""
        ev = msg["eval"]
        try:
            got = [int(v) for v in ev]
        except (TypeError, ValueError):
            raise ValueError(f"{msg.kind} carries a malformed eval field: {ev!r}") from None
        if msg.kind == Kind.GRAD and len(got) == 2 and self.passes is not None:
            self.passes.verdicts[got[0]] = bool(got[1])
        elif msg.kind == Kind.ACT and len(got) == 1 and self.passes is not None:
            self.passes.announce(got[0])
        elif msg.kind == Kind.ACT and len(got) in (2, 3):
            i, n = got[0], got[1]
            c = got[2] if len(got) == 3 else self.schedule.waves
            names = self._names(msg)
            self.eval_in[(c, i)] = (n, {name: self._received(msg, name) for name in names})
        else:
            raise ValueError(f"{msg.kind} carries an eval field {ev!r} this stage does not take")

    @staticmethod
    def _names(msg: Message) -> tuple[str, ...]:
        """The names of a message's tensors, wherever they travel (frames, shared memory, a
        GPU's handle), sorted."""
        placed = msg.get("shm")
        shared = msg.get("ipc")
        if not placed and not shared:
            return tuple(sorted(msg.tensors))
        return tuple(sorted({*msg.tensors, *(placed or {}), *(shared or {})}))

    def _received(self, msg: Message, name: str) -> torch.Tensor | Shared:
        """Tensor ``name`` of a received message: in its frames, in this host's shared memory
        (checked and read here: hetpipe.hostshm), or shared by a GPU's handle (checked here,
        opened by the stage on its compute thread)."""
        if name in msg.tensors:
            return msg.tensors[name]
        placed = msg.get("shm") or {}
        if name in placed:
            return self.inbox.take(hostshm.parse(placed[name]))
        shared = msg.get("ipc") or {}
        if name not in shared:
            raise ValueError(f"{msg.kind} {msg['p']} carries no tensor {name!r}")
        return parse(shared[name])

    def _piece(
        self, msg: Message, names: tuple[str, ...], theirs: list[int]
    ) -> dict[str, Any] | None:
        """Keep one sender's rows of a message; once every overlapping sender's rows are here,
        the whole input by name (rows gathered in order), else None."""
        tensors = {name: self._received(msg, name) for name in names}
        rows = msg.get("rows")
        if rows is None:
            return tensors
        expected = {(lo, hi) for _, lo, hi in pieces_for(self.mine, theirs)}
        if not isinstance(rows, list) or tuple(rows) not in expected:
            raise ValueError(
                f"{msg.kind} {msg['p']} carries rows {rows!r}, none of this "
                f"stage's pieces {sorted(expected)}"
            )
        key = (msg.kind, msg["p"])
        got = self.pieces.setdefault(key, {})
        got[rows[0]] = tensors
        if len(got) < len(expected):
            return None
        del self.pieces[key]
        # a tensor that is not row-major (it travelled whole to every replica): an activation
        # is the same in every piece; a gradient is the sum of the replicas' parts of it
        ends = dict(expected)
        add = msg.kind == Kind.GRAD
        return {
            name: gather({lo: t[name] for lo, t in got.items()}, ends, add=add) for name in names
        }

    def combined(self, p: int) -> bool:
        return len(self.replica_grads.get(p, ())) >= len(self.task.group) - 1

    def has_activation(self, p: int) -> bool:
        return p in self.acts

    def has_gradient(self, p: int) -> bool:
        return p in self.grads

    def pulled(self, c: int, grads: bool) -> bool:
        answer = self.answers.get((c, grads))
        return answer is not None and answer.done()

    # -- main loop --------------------------------------------------------------------------

    async def run(self) -> dict[str, Any]:
        """Train this stage through all minibatches of the job; return its final stats."""
        self.started = time.monotonic()
        if self.passes is not None:  # train.eval_every in seconds counts from here
            self.passes.last_t = self.started
        self.timeline = Timeline()
        reporter = asyncio.create_task(self._report_loop())
        try:
            while not isinstance(action := self.schedule.next(self), Done):
                if self.passes is not None and await self._pass_at_boundary():
                    continue
                if self.migration is not None and await self.migration.at(self, action):
                    continue
                if isinstance(action, Wait):
                    self._wait_for(action.what, p=action.p, wave=action.c, need=action.need)
                    kind = (
                        "gate"
                        if action.what in ("pull", "reduce")
                        else "replicas"
                        if action.what == "replicas"
                        else "bubble"
                    )
                    with self.timeline.span(kind, action.p, action.c):
                        await self.wakeup.wait()
                    self.wakeup.clear()
                    continue
                self.schedule.done(action)
                await self._execute(action)
            self._wait_for("push_ack")
            with self.timeline.span("push"):
                await self._wait_pushes()
            if self.task.is_last:
                self._losses(await self._run(self.compute.read_losses, True))
            await self._run(self.compute.read_quality, True)
            if self.validates:  # after the timeline's last span: no share of training time
                t0 = time.monotonic()
                self.validation = await self._validation_pass(self.schedule.waves)
                self.validation_s += time.monotonic() - t0
            await self._send_records(final=True)
            self.waiting = None
        finally:
            reporter.cancel()
            for t in self.answers.values():
                t.cancel()
        return self.final_stats()

    async def _execute(self, action: Action) -> None:
        match action:
            case Pull(c, grads):
                if grads:  # the ties' copies sum their gradients before the shards see one
                    await self._exchange(c)
                task = asyncio.create_task(
                    self._reduce(c) if grads else self._pull(c), name=f"pull:{c}:{grads}"
                )
                task.add_done_callback(lambda _t: self.wakeup.set())
                self.answers[c, grads] = task
            case Merge(c, grads):
                replies = self.answers.pop((c, grads)).result()
                with self.timeline.span("merge", None, c):
                    if grads:
                        await self._run(self.compute.merge_gradients, _union(replies))
                    else:
                        await self._merge(c, replies)
            case (
                Forward()
                | Backward()
                | BackwardInput()
                | BackwardWeight()
                | OptimizerStep()
                | Push()
            ):
                # with what joins it in one hand-off to the compute thread
                run = self.schedule.trip(action, self)
                turn = self.turn  # a device-level order: another stage of the device first
                if (
                    turn is not None
                    and turn.gated(action)
                    and not turn.is_turn(self.task.stage, action)
                ):
                    self._wait_for("its device's turn", p=action.p)  # type: ignore[union-attr]
                    await turn.wait(self.task.stage, action)
                await self._compute_run(run)

    def _wait_for(self, kind: str, **what: Any) -> None:
        """Say what the stage waits for (the head diagnoses hangs from it)."""
        what = {k: v for k, v in what.items() if v is not None}
        if (
            self.waiting is None
            or self.waiting["kind"] != kind
            or any(self.waiting.get(k) != v for k, v in what.items())
        ):
            self.waiting = {"kind": kind, "since": time.time(), **what}

    async def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        loop = asyncio.get_running_loop()
        if self.cuda_stream is None:
            return await loop.run_in_executor(self.executor, fn, *args)
        return await loop.run_in_executor(self.executor, self._on_stream, fn, *args)

    def _on_stream(self, fn: Callable[..., Any], *args: Any) -> Any:
        """On the compute thread: ``fn`` with this stage's CUDA stream current."""
        with torch.cuda.stream(self.cuda_stream):
            return fn(*args)

    async def _host(self, copy: HostCopy) -> dict[str, torch.Tensor]:
        """The host tensors of a device-to-host copy: at once if it is done (always on the
        CPU), else waited for on the copy thread, never on the compute thread."""
        if copy.ready:
            return copy.wait()
        return await asyncio.get_running_loop().run_in_executor(self.copy_executor, copy.wait)

    async def _compute_run(self, run: list[Action]) -> None:
        """Execute forwards, backwards, steps and pushes' copies in one hand-off; then send
        what they made, in order. A step the stages agree on first (:meth:`_agree`) splits
        the hand-off: what comes before it runs and is sent before the agreement."""
        if self.agrees or (self.tie_route is not None and self.tie_route.takes_part):
            at = next((j for j, a in enumerate(run) if isinstance(a, OptimizerStep)), None)
            if at is not None:
                if at:
                    await self._compute_run_now(run[:at])
                i = run[at].i  # type: ignore[attr-defined]
                await self._exchange(i)
                if self.agrees:
                    await self._agree(i)
                run = run[at:]
        await self._compute_run_now(run)

    async def _compute_run_now(self, run: list[Action]) -> None:
        if self.passes is not None and self.task.is_first:
            await self._decide_passes(run)
        head = run[0]
        inputs: list[Any] = []
        for a in run:
            if isinstance(a, Forward):
                self._opening(a.p)
                batch = _READ if self.task.is_first else self.acts.pop(a.p)
                self.records[a.p] = Record(
                    p=a.p, wave=wave_of(a.p, self.task.nm), clock=self.clock, vw_clock=self.vw_clock
                )
                inputs.append(batch)
            elif isinstance(a, Backward | BackwardInput) and not self.task.is_last:
                inputs.append(self.grads.pop(a.p))
            elif isinstance(a, OptimizerStep) and self.task.replicated:
                inputs.append(self.replica_grads.pop(a.i))
            else:
                inputs.append(None)
        p = (
            head.i
            if isinstance(head, OptimizerStep)
            else head.c
            if isinstance(head, Push)
            else head.p
        )
        kind = "forward" if isinstance(head, Forward) else "backward"
        self.doing = {"kind": kind, "p": p, "since": time.time()}
        what = "+".join(type(a).__name__ for a in run)
        t0 = time.time()
        try:
            if self.inline.inline(what):
                outs, spans, losses = self._compute(run, inputs)
            else:
                outs, spans, losses = await self._run(self._compute, run, inputs)
        finally:
            self.doing = None
        if self.turn is not None and self.turn.gated(head):
            self.turn.passed(self.task.stage, head)  # the device's next may run (sends wait)
        self.inline.ran(what, time.time() - t0)
        if spans:
            # the hand-off to and from the compute thread counts as the compute's own time
            spans[0][1], spans[-1][2] = t0, time.time()
        for span in spans:
            self.timeline.add(*span)
            if span[0] == "forward":
                self.records[span[3]].t_fwd = span[1]
        self._losses(losses)
        for a, made, given in zip(run, outs, inputs, strict=True):
            if isinstance(a, Forward) and made is not None:
                with self.timeline.span("send", a.p, wave_of(a.p, self.task.nm)):
                    host, shared = await self._outgoing(made)
                    y = given[1]
                    target = {"y": y} if isinstance(y, torch.Tensor) else carry.names(y, "y")
                    await self._send_rows(Kind.ACT, a.p, {**host, **target}, shared, self.next_rows)
            elif isinstance(a, BackwardInput):  # its gradient goes out before any W runs
                if not self.task.is_first and made is not None:
                    with self.timeline.span("send", a.p, wave_of(a.p, self.task.nm)):
                        await self._send_rows(
                            Kind.GRAD, a.p, *await self._outgoing(made), self.prev_rows
                        )
            elif isinstance(a, BackwardWeight):
                self._after_backward(a.p)
                if self.records_finished >= self.records_every:
                    await self._send_records()
            elif isinstance(a, Backward):
                if not self.task.is_first and made is not None:
                    with self.timeline.span("send", a.p, wave_of(a.p, self.task.nm)):
                        await self._send_rows(
                            Kind.GRAD, a.p, *await self._outgoing(made), self.prev_rows
                        )
                if self.task.replicated:
                    with self.timeline.span("replicas", a.p, wave_of(a.p, self.task.nm)):
                        await self._share_gradients(a.p)
                self._after_backward(a.p)
                if self.records_finished >= self.records_every:
                    await self._send_records()
            elif isinstance(a, Push):
                with self.timeline.span("push", None, a.c):
                    await self._push(a.c, made)

    def _my_batch(self, p: int) -> Batch:
        """The first stage's input of minibatch ``p`` as ``(inputs, target)``: this replica's
        rows of it. Read in order through the stream's ``DataLoader`` (one reader for the
        run, opened at the VW's data position ``task.start``, and a stateful stream's state
        there: a restarted stage reads on from where the stopped one was)."""
        reader = getattr(self, "_reader", None)
        if reader is None:
            state = (self.task.restore or {}).get("data")
            kw = {} if state is None else {"state": state}
            reader = self._reader = self.stream.reader(self.task.start, **kw)  # type: ignore[union-attr]
        batch = reader.get(self.task.start + p)
        if not self.task.replicated:
            return batch
        lo, hi = self.mine
        return rows_of(batch, lo, hi)

    async def _send_rows(
        self,
        kind: str,
        p: int,
        host: dict[str, torch.Tensor],
        shared: dict[str, Any] | None,
        theirs: list[int],
    ) -> None:
        """Send what a forward (``act``) or backward (``grad``) made to the neighbour, or, where
        either side is replicated, each of the neighbour's replicas its rows of it."""
        if not self.split[kind]:
            await self.send(kind, p, host, shared, 0, {})
            return
        for j, lo, hi in pieces_for(self.mine, theirs):
            part = {n: piece(t, self.mine, lo, hi) for n, t in host.items()}
            await self.send(kind, p, part, None, j, {"rows": [lo, hi]})

    async def _share_gradients(self, p: int) -> None:
        """Send this replica's weight gradients of ``p`` to the stage's other replicas."""
        grads = await self._host(self.replica_copies.pop(p))
        fields = {"stage": self.task.stage, "replica": self.task.replica}
        for r in range(len(self.task.group)):
            if r != self.task.replica:
                await self.send(Kind.REPLICA_GRAD, p, grads, None, r, fields)

    async def _outgoing(
        self, made: HostCopy | dict[str, Any]
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
        """What a forward or backward made, as (host tensors, shared handles)."""
        if isinstance(made, dict):
            return {}, made
        return await self._host(made), None

    def _made(self, kind: str, name: str, t: Carry) -> HostCopy | dict[str, Any]:
        """On the compute thread: carry ``t`` on its way to the neighbour, its tensors named
        after ``name`` (:func:`hetpipe.carry.names`), shared by handle where they go device
        to device (exported here, behind the kernels that made them), else copied to the
        host."""
        if kind in self.local:  # to a stage of this device: the tensors themselves
            return HostCopy(carry.names(t, name))
        if isinstance(t, torch.Tensor):
            if kind in self.direct and t.is_cuda:
                return {name: share(t)}
            return self.compute.copier.to_host({name: t})
        named = carry.names(t, name)
        if kind in self.direct and named and all(v.is_cuda for v in named.values()):
            return {n: share(v) for n, v in named.items()}
        return self.compute.copier.to_host(named)

    def _compute(
        self, run: list[Action], inputs: list[Any]
    ) -> tuple[list[HostCopy | dict[str, Any] | None], list, list[tuple[int, float]]]:
        """On the compute thread: run the actions in order. Returns what each made for
        sending (its copy to the host started, or its handle), the spans as (kind, t0, t1,
        p, wave), and the losses read back meanwhile (in batches, never waiting for the
        device).

        An async optimizer step counts as part of the backward before it (one span); a
        push's copy is the push's own time (its span is taken around the send). The first
        stage's minibatches are read here too: waiting for the data loader stalls the
        compute, never the event loop that answers heartbeats and messages.
        """
        c = self.compute
        outs: list[HostCopy | dict[str, Any] | None] = []
        spans: list[list[Any]] = []
        for i, a in enumerate(run):
            given = inputs[i]
            if given is _READ:  # read here, so the event loop never waits for the data loader
                given = inputs[i] = self._my_batch(a.p)
            t0 = time.time()
            made: HostCopy | dict[str, Any] | None = None
            if isinstance(a, Forward):
                out = c.forward(a.p, *given)
                if out is not None:
                    made = self._made(Kind.ACT, "x", out)
                spans.append(["forward", t0, time.time(), a.p, wave_of(a.p, self.task.nm)])
            elif isinstance(a, Backward):
                grad_in = c.backward(a.p, given)
                if grad_in is not None and not self.task.is_first:
                    made = self._made(Kind.GRAD, "g", grad_in)
                if self.task.replicated:  # on its way to the other replicas meanwhile
                    self.replica_copies[a.p] = c.copier.to_host(c.pending[a.p])
                spans.append(["backward", t0, time.time(), a.p, wave_of(a.p, self.task.nm)])
            elif isinstance(a, BackwardInput):
                grad_in = c.backward_input(a.p, given)
                if grad_in is not None and not self.task.is_first:
                    made = self._made(Kind.GRAD, "g", grad_in)
                spans.append(["backward", t0, time.time(), a.p, wave_of(a.p, self.task.nm)])
            elif isinstance(a, BackwardWeight):
                c.backward_weight(a.p)
                spans.append(["backward", t0, time.time(), a.p, wave_of(a.p, self.task.nm)])
            elif isinstance(a, Push):
                made = self._push_copy(a.c)
            else:
                c.step(a.i, given)
                if self.sync:  # the iteration's one step, after its flush
                    spans.append(["step", t0, time.time(), None, a.i])
                elif spans:  # a local update belongs to the backward before it
                    spans[-1][2] = time.time()
                else:
                    spans.append(["backward", t0, time.time(), None, wave_of(a.i, self.task.nm)])
            outs.append(made)
        c.read_quality()
        return outs, spans, c.read_losses() if self.task.is_last else []

    def _losses(self, losses: list[tuple[int, float]]) -> None:
        """Give read-back losses to the records of their minibatches."""
        for p, loss in losses:
            self.records[p].loss = loss

    def _opening(self, p: int) -> None:
        """At the first forward of a wave/iteration: the clock of the weights it will use,
        where no pull reports it (a virtual worker alone in its job, or synchronous)."""
        nm = self.task.nm
        if p % nm or p == 0:
            return
        if self.sync:
            # its weights are the global weights of the iteration, pushed or not yet
            self.clock = self.vw_clock = p // nm
        elif not self.schedule.pulls and self.push_every != 1:
            # a virtual worker alone, pushing its updates in batches: its clock (which the
            # head checkpoints on) counts the waves whose updates the shards hold
            self.clock = self.vw_clock = self.flushed
        elif not self.schedule.pulls:
            self.clock = self.vw_clock = self.schedule.nb // nm

    def _after_backward(self, p: int) -> None:
        rec = self.records[p]
        fv, ffp, bv, bfp = self.compute.versions.pop(p)
        rec.fwd_version, rec.fwd_fingerprint = fv, ffp
        rec.bwd_version, rec.bwd_fingerprint = bv, bfp
        rec.t_bwd = time.time()
        self.records_finished += 1

    def _finished(self, rec: Record) -> bool:
        """Whether nothing more will be written into ``rec``: its backward ran and, at the
        last stage, its loss was read back."""
        return rec.t_bwd > 0.0 and (not self.task.is_last or rec.loss is not None)

    async def _send_records(self, final: bool = False) -> None:
        """Send the finished records in ascending ``p`` up to the first unfinished one (all
        of them when ``final``), with the spans so far, in chunks of ``records_every``."""
        if self.records_out is None:
            return
        async with self.records_lock:
            await self._send_records_locked(self.records_out, final)

    async def _send_records_locked(self, out: RecordsOut, final: bool) -> None:
        rows: list[list[Any]] = []
        for p in sorted(self.records):
            rec = self.records[p]
            if not final and not self._finished(rec):
                break
            rows.append(rec.row())
            del self.records[p]
        spans, self.timeline.spans = self.timeline.spans, []
        self.records_finished = 0
        self.records_sent_at = time.monotonic()
        n = self.records_every
        for i in range(0, max(len(rows), 1), n):
            chunk = rows[i : i + n]
            if chunk or spans:
                await out(chunk, spans)
            spans = []

    # -- parameter server -------------------------------------------------------------------

    def _shard_names(self) -> dict[int, list[str]]:
        by_shard: dict[int, list[str]] = {}
        for name in self.compute.state_names():
            by_shard.setdefault(self.task.placement[name], []).append(name)
        return by_shard

    def _ids(self) -> dict[str, Any]:
        return {"job": self.task.job, "vw": self.task.vw, "stage": self.task.stage}

    def _flushes(self, wave: int) -> bool:
        """Whether the push of ``wave`` carries the update (else its update is carried into
        the next wave's and the push only moves the shards' clock): always where several
        virtual workers read each other's updates and in the synchronous kinds (an
        iteration's clock is its weights'); for an async virtual worker alone in its job
        every ``train.push_every`` waves, at every checkpoint and at the end."""
        every = self.push_every
        return (
            every == 1
            or wave + 1 >= self.schedule.waves
            or (every > 1 and (wave + 1) % every == 0)
            or self.cut_at(wave + 1)
        )

    def cut_at(self, c: int) -> bool:
        """Whether the end of wave ``c - 1`` is a checkpoint's cut of this stage: periodic
        (counted on the shards' waves, :attr:`StageTask.wave_base`), its end, or asked for
        on demand. A live migration's boundary is never one (:mod:`hetpipe.migrate`)."""
        every = self.compute.spec.checkpoint_every
        return is_cut(c, every, self.schedule.waves, self.asked, self.task.wave_base)

    def _push_copy(self, wave: int) -> HostCopy | None:
        """On the compute thread: start the copy of ``wave``'s update to the host, or carry
        it into the next wave's (None). The update stays until a pull shows it applied only
        where weights are pulled again."""
        with self.cut_lock:
            self.copying, flushes = wave, self._flushes(wave)
        if not flushes:
            self.compute.carry(wave)
            return None
        keep = self.schedule.pulls and not self.sync
        if not self.task.leader:  # its leader pushes the stage's (identical) update
            if not keep:
                self.compute.acc.pop(wave, None)
            return None
        return self.compute.push_deltas(wave, keep)

    async def _push(self, wave: int, copy: HostCopy | None) -> None:
        """Send this stage's update of ``wave`` to each shard (an empty push where it was
        carried on); acks are awaited later."""
        if not self.task.leader:
            return  # the stage's leader pushes and checkpoints for every replica
        deltas = {} if copy is None else await self._host(copy)
        for shard, names in self._shard_names().items():
            part = {n: deltas[n] for n in names if n in deltas}
            ch = self.shards[shard]
            # settled acks leave now: kept to the end, a job's worth would pile up
            acks = self.push_acks[shard] = unsettled(self.push_acks.get(shard, []))
            acks.append(
                await ch.send_request(
                    Kind.PUSH,
                    {**self._ids(), "wave": wave},
                    part,
                    what=f"shard {shard} ({ch.name})",
                )
            )
        if copy is not None:
            self.flushed = wave + 1
        if self.snapshot is not None and self.cut_at(wave + 1):
            await self._snapshot(wave + 1)

    def ask_cut(self, c: int) -> int | None:
        """Send this stage's state at cut ``c`` too (its last wave where it ends before):
        None where it still can, else the earliest cut it could (past its end: its end + 1).
        ``c`` and the answer are the shards' waves (:attr:`StageTask.wave_base`)."""
        base = getattr(self.task, "wave_base", 0)
        with self.cut_lock:
            at = min(c - base, self.schedule.waves)
            if at - 1 <= self.copying:
                return base + self.copying + 2
            if any(o.at // self.task.nm == at for o in getattr(self.migration, "orders", ())):
                return base + at + 1  # a migration's boundary is no cut (hetpipe.migrate)
            self.asked.add(at)
        return None

    async def _snapshot(self, cut: int) -> None:
        """This stage's state right after its push of wave ``cut - 1``, to the head: with the
        shards' cut of the same wave it makes one checkpoint (:mod:`hetpipe.checkpoint`).
        Its time counts in the push span around it."""
        assert self.snapshot is not None
        t0 = time.perf_counter()
        meta, tensors = await self._run(self.compute.state, cut)
        meta["merged"] = self.sync or not self.schedule.pulls or self.schedule.merged >= cut
        reader = getattr(self, "_reader", None)
        at = self.task.start + min(cut * self.task.nm, self.task.minibatches)
        if reader is not None and (data := reader.state(at)) is not None:
            meta["data"] = data  # a stateful stream's position at the cut (hetpipe.data.stream)
        meta["state_s"] = time.perf_counter() - t0
        await self.snapshot(self.task.wave_base + cut, meta, tensors)  # the shards' wave

    async def _wait_pushes(self) -> None:
        """Until every push has landed: each shard's last answer settles the ones before."""
        for acks in self.push_acks.values():
            if acks:
                await asyncio.wait_for(acks[-1], PUSH_TIMEOUT_S)
            for fut in unsettled(acks):
                await asyncio.wait_for(fut, PUSH_TIMEOUT_S)  # an error answer raises here
        self.push_acks.clear()

    async def _pull(self, c: int) -> list[Message]:
        """Ask each shard for this stage's weights of wave ``c`` (parked until WSP allows).

        A virtual worker alone in its job whose stage holds a copy of a tie spanning stages
        waits for every stage's push of wave ``c - 1`` (its own clock is the global one):
        the copy then holds every copy's updates of the waves before ``c``, as WSP's rule
        for a virtual worker's own updates asks (with Nm = 1, the tied model's own steps)."""
        if not self.compute.has_state:
            return []
        need = pull_need(c, self.task.staleness)
        if self.task.tied and self.task.num_vws == 1:
            need = c
        fields = {**self._ids(), "need": need, "wave": c}
        waits = [
            self.shards[shard].request(
                Kind.PULL, fields, timeout=PULL_TIMEOUT_S, what=f"shard {shard}"
            )
            for shard in self._shard_names()
        ]
        return list(await asyncio.gather(*waits))

    async def _reduce(self, c: int) -> list[Message]:
        """Send iteration ``c``'s gradient sum to each shard; its answer is every virtual
        worker's mean (parked until all have contributed)."""
        copy, samples = await self._run(self.compute.gradient_sum)
        grads = await self._host(copy)
        fields = {**self._ids(), "iteration": c, "samples": samples}
        copies = self.task.copies  # a tie's summed gradient counts once: the owner's
        waits = [
            self.shards[shard].request(
                Kind.REDUCE,
                fields,
                {n: grads[n] for n in names if n in grads and n not in copies},
                timeout=PULL_TIMEOUT_S,
                what=f"shard {shard}",
            )
            for shard, names in self._shard_names().items()
        ]
        return list(await asyncio.gather(*waits))

    async def _merge(self, c: int, replies: list[Message]) -> None:
        applied: dict[str, list[list[int]]] = {}
        clock = vw_clock = None
        for r in replies:
            for name in r.tensors:
                applied[name] = r["applied"]  # [first, end) runs of waves, one list per shard
            clock = r["clock"] if clock is None else min(clock, r["clock"])
            vw_clock = r["vw_clock"] if vw_clock is None else min(vw_clock, r["vw_clock"])
        pulled = _union(replies)
        if pulled:
            await self._run(self.compute.load, pulled, applied)
        self.clock = clock if clock is not None else c
        self.vw_clock = vw_clock if vw_clock is not None else c

    # -- reporting --------------------------------------------------------------------------

    # -- validation on the workers (train.metrics) -----------------------------------------

    @property
    def validates(self) -> bool:
        """Whether this stage takes part in the job's validation pass at its end: the leaders
        of virtual worker 0's stages (a replica holds its leader's weights), where that
        virtual worker's final weights are the job's global weights: alone in its job, or
        synchronous (every virtual worker steps on the same merged gradient). Otherwise the
        head scores the global weights it gathers from the shards. The passes while training
        run on the same stages, where :func:`hetpipe.evalpass.on_workers` holds."""
        return (
            self.task.vw == 0 and self.task.replica == 0 and (self.task.num_vws == 1 or self.sync)
        )

    async def _decide_passes(self, run: list[Action]) -> None:
        """Stage 0, before a run holding the forward that opens wave ``c``: whether a
        validation pass runs at boundary ``c`` (:meth:`hetpipe.evalpass.Passes.decide`);
        announced down the pipeline ahead of that forward's activation."""
        assert self.passes is not None
        nm = self.task.nm
        for a in run:
            if isinstance(a, Forward) and a.p % nm == 0:
                self.passes.decide(a.p // nm, time.monotonic())
        await self._pass_on_announcements()

    async def _pass_on_announcements(self) -> None:
        assert self.passes is not None
        for c in self.passes.passing_on():
            if not self.task.is_last:
                await self.send(Kind.ACT, c * self.task.nm, {}, None, 0, {"eval": [c]})

    async def _pass_at_boundary(self) -> bool:
        """Before each action: pass announced validation passes on, and run one whose
        boundary this stage has reached (the steps of every minibatch before it taken, none
        after: :meth:`hetpipe.evalpass.Passes.due`); True where one ran. Training waits
        meanwhile, so the pass scores the weights as they were at the boundary.

        The last stage reports the figures to the head (a report with ``evaluation``:
        boundary, figures, the pass's seconds here). With ``train.keep_best`` the verdict goes
        back up the pipeline, and each stage, holding its weights until the verdict, sends
        them to the head where the figures improved (:mod:`hetpipe.evalpass`)."""
        ps = self.passes
        assert ps is not None
        await self._pass_on_announcements()
        c = ps.due(self.schedule.steps, 1 if self.sync else self.task.nm)
        if c is None:
            return False
        ps.ran(c)
        t0 = time.monotonic()
        figures = await self._validation_pass(c)
        improved = False
        if self.task.is_last:
            improved = ps.best is not None and ps.offer(figures or {})
            evaluation = {"wave": c, "figures": figures or {}, "seconds": time.monotonic() - t0}
            await self.report({"evaluation": evaluation})
        elif ps.best is not None:
            self._wait_for("validation verdict", c=c)
            while c not in ps.verdicts:
                await self.wakeup.wait()
                self.wakeup.clear()
            improved = ps.verdicts.pop(c)
        if ps.best is not None:
            if not self.task.is_first:
                await self.send(
                    Kind.GRAD, c * self.task.nm, {}, None, 0, {"eval": [c, int(improved)]}
                )
            if improved:
                weights = await self._run(self.compute.best_weights)
                await self.report({"evaluation": {"wave": c, "stage": self.task.stage}}, weights)
        self.validation_s += time.monotonic() - t0
        self.validations += 1
        return True

    async def _validation_pass(self, c: int) -> dict[str, float] | None:
        """The validation set through this virtual worker's pipeline at boundary ``c`` (the
        job's last wave: its end), forward only, on each stage's current weights
        (:meth:`StageCompute.eval_forward`: eval mode, ``no_grad``): the first stage reads
        the validation minibatches in order and sends each output on (tagged ``eval = [i, n,
        c]`` on an activation message, the target with it; ``n`` the count on the last, -1 on
        the others); a middle stage passes each on;
        the last scores them with the job's loss and ``train.metrics``
        (:class:`hetpipe.metrics.Tally`) and returns the figures (None elsewhere, and where
        there is no validation set). A first stage without a validation set sends ``n = 0``.
        A metric that raises ends the stage with its :class:`~hetpipe.metrics.MetricError`."""
        from hetpipe.data.evaluate import val_batches
        from hetpipe.metrics import Tally, resolve

        tally = Tally(resolve(self.compute.spec.metrics)) if self.task.is_last else None
        self._wait_for("validation pass", c=c)

        async def through(i: int, n: int, x: Any, y: Any) -> None:
            out = await self._run(self.compute.eval_forward, x)
            if tally is None:
                host = {n_: t.cpu() for n_, t in carry.names(out, "x").items()}
                target = {n_: t.cpu() for n_, t in carry.names(y, "y").items()}
                await self.send(Kind.ACT, i, {**host, **target}, None, 0, {"eval": [i, n, c]})
                return
            target = carry.mapped(y, lambda t: t.to(self.compute.dev)) if y is not None else None
            loss = await self._run(self.compute.loss_fn, out, target)
            await self._run(tally.add, out, target, float(loss), carry.samples(y, x))

        if self.task.is_first:
            source = self.stream.source if self.stream is not None else None
            val = getattr(source, "val", None)
            # read on the compute thread one minibatch ahead, as training minibatches are
            # (never on the loop, never the whole set at once): the last carries the count,
            # the others -1 (more follow)
            batches = iter(val_batches(source) if val is not None else ())
            cur = await self._run(next, batches, None)
            if cur is None and tally is None:
                await self.send(Kind.ACT, 0, {}, None, 0, {"eval": [0, 0, c]})
            i = 0
            while cur is not None:
                nxt = await self._run(next, batches, None)
                await through(i, -1 if nxt is not None else i + 1, *cur)
                cur, i = nxt, i + 1
        else:
            i, n = 0, -1
            while n < 0 or i < n:
                if (c, i) not in self.eval_in:
                    await self.wakeup.wait()
                    self.wakeup.clear()
                    continue
                n, got = self.eval_in.pop((c, i))
                if n == 0:  # no validation set: said on
                    if tally is None:
                        await self.send(Kind.ACT, 0, {}, None, 0, {"eval": [0, 0, c]})
                    break
                x, y = carry.message_parts(got, f"validation minibatch {i}")
                await through(i, n, x, y)
                i += 1
        return (tally.result() or None) if tally is not None else None

    def progress(self) -> dict[str, Any]:
        s = self.compute.stats
        recent = s.losses
        elapsed = self.timeline.elapsed()
        return {
            "timing": dict(self.timeline.totals),
            "shares": shares(self.timeline.totals, elapsed),
            "timeline_elapsed_s": elapsed,
            "waiting": self.doing or self.waiting,
            "done": self.schedule.nb,
            "forwards": self.schedule.nf,
            "total": self.task.minibatches,
            "loss": sum(recent) / len(recent) if recent else None,
            "elapsed_s": time.monotonic() - self.started,
            "forward_s": s.forward_s,
            "backward_s": s.backward_s,
            "peak_bytes": s.peak_bytes,
            "peak_memory": dict(s.peak_memory),
            "peak_in_flight": s.peak_in_flight,
            "allocator_peak": allocator_peaks(self.compute.dev),
            "clock": self.clock,
            "vw_clock": self.vw_clock,
            "wave": wave_of(max(self.schedule.nf - 1, 0), self.task.nm),
        }

    async def _report_loop(self) -> None:
        while True:
            await asyncio.sleep(self.report_every_s)
            await self.report(self.progress())
            if time.monotonic() - self.records_sent_at >= RECORDS_EVERY_S:
                await self._send_records()

    def final_stats(self) -> dict[str, Any]:
        out = self.progress()
        out["records"] = [self.records[p].row() for p in sorted(self.records)]
        out["spans"] = self.timeline.spans
        out["record_fields"] = list(Record.FIELDS)
        q = self.compute.stats.prediction_quality
        # weights = "predict": < 1 means the predicted weights were nearer to the weights the
        # minibatch aimed at than the stale ones were (mean over this stage's probes)
        out["prediction_quality"] = sum(q) / len(q) if q else None
        out["prediction_probes"] = len(q)
        # fp16: the steps skipped for an inf or NaN in some stage's gradients, and the loss
        # scale at the end (hetpipe.core.lr.LossScale)
        scaler = getattr(self.compute, "scaler", None)
        if scaler is not None:
            out["skipped_steps"] = list(self.compute.stats.skipped)
            out["loss_scale"] = scaler.scale
        # compute runs on the event loop and on the compute thread (hetpipe.computethread)
        out["inline_runs"] = self.inline.inline_runs
        out["thread_runs"] = self.inline.thread_runs
        if self.validation is not None:  # the last stage's figures of the validation pass
            out["validation"] = self.validation
        if self.validation_s:  # every validation pass's time here, the end's included
            out["validation_s"] = self.validation_s
        if self.validations:  # the passes while training
            out["validations"] = self.validations
        if self.migration is not None and self.migration.done:
            out["migrations"] = list(self.migration.done)
        return out


Key = tuple[int, str]  # a copy's gradient sum: (the stage holding the copy, the tie)


class TieRoute:
    """Which ties' gradient sums one stage sends each way and uses (:meth:`StageRunner._exchange`),
    from its virtual worker's ties (canonical name -> the stages holding a copy)."""

    def __init__(self, ties: dict[str, list[int]], stage: int) -> None:
        def keys(want: Callable[[list[int], int], bool]) -> frozenset[Key]:
            return frozenset(
                (t, tie) for tie, holders in ties.items() for t in holders if want(holders, t)
            )

        # to stage - 1: the sums of this stage and later ones that an earlier stage holds
        self.down = keys(lambda h, t: t >= stage and min(h) < stage)
        # to stage + 1: the sums of this stage and earlier ones that a later stage holds
        self.up = keys(lambda h, t: t <= stage and max(h) > stage)
        # every copy's sum of each tie this stage holds
        self.used = keys(lambda h, _t: stage in h)
        # what may reach it from a neighbour
        self.wanted = (self.down | self.up | self.used) - keys(lambda _h, t: t == stage)

    @property
    def takes_part(self) -> bool:
        """Whether the stage holds a copy or passes one on."""
        return bool(self.down or self.up or self.used)


def _union(replies: list[Message]) -> dict[str, torch.Tensor]:
    """The tensors of several shards' answers, by name (each name lives on one shard)."""
    out: dict[str, torch.Tensor] = {}
    for r in replies:
        out.update(r.tensors)
    return out
