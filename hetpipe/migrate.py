"""Live layer migration inside one virtual worker: a new split carried out while it trains.

A migration moves the layers that change stage between the live stages of a virtual worker,
with everything that belongs to them: their weights and buffers (and non-persistent
buffers), the optimizer state and step count of each parameter, and the update accumulated
per wave that the shards have not confirmed yet (:class:`hetpipe.versions.WeightVersions`).
Nothing restarts: the job, its attempt, its data position, its clocks and the other virtual
workers go on; only the stages of this virtual worker pause.

**Who asks.** The job's ``replan.migrate_at`` / ``migrate_to`` / ``migrate_vw`` (a drill:
:func:`attach`, the order known from the start), or the head while the job trains
(:meth:`hetpipe.head.migration.MigrationPart.migrate`, the online re-plan's entry point,
which sends each stage an order: :func:`order`; stage 0, told first, picks the boundary, and
a later stage's refusal cancels it where it was taken: :func:`cancel`).

**Where.** At the *boundary* ``at`` (a minibatch that opens a wave in ``async``, an
iteration in ``gpipe``/``1f1b``: ``at % nm == 0``; not a checkpoint's cut), the
schedule's own cut between waves:

1. each stage runs every action of the waves before: the backwards of the minibatches
   ``< at``, their optimizer steps and the pushes of the waves they close, and waits for the
   shards to acknowledge those pushes; stage 0 admits no minibatch ``>= at`` until its
   pipeline is empty (:meth:`Migrator.install` turns the schedule's answers of the new
   wave into a wait; :meth:`Migrator.at`, which the runner calls before each action,
   carries the migration out once drained);
2. each stage packs the state of the layers it gives away (:func:`pack`; which ones it
   knows from its own range and the new split alone: :func:`outgoing`), the stages swap
   those parcels (a :class:`Bus`: in one process :class:`LocalBus`, across workers the
   head, :class:`HeadBus`), and each builds the compute of its new layer range from what it
   keeps and what it receives (:func:`prepare`), checking it against its device's memory;
3. the stages agree: if any stage's new layers would not fit (or would hold state where the
   stage held none, or the reverse: its schedule pushes and pulls by that), every stage
   keeps its old compute (nothing was given away: parcels are copies) and the refusal,
   with its reason, is recorded; else every stage takes its new compute;
4. each stage tells its shards which names it pushes and pulls there from the boundary's
   wave on (a ``push`` with ``migrate``: :meth:`hetpipe.shard.JobShard.migrate`), and
   admission resumes. A pull of the boundary's wave sent before with the old names is
   dropped and sent again.

The shards keep the placement of each state name (every virtual worker pushes a name to
the same shard, so the global weights of a moved layer never move); what follows the
migration is which stage of this virtual worker pushes and pulls each name there, and WSP's
clock of the virtual worker counts on without a gap.

**Lossless.** No update is lost or applied twice: every step before the boundary was taken
(and its wave pushed) by the old owner, every step after it by the new one, and what the
shards have not confirmed travels with the layer. In the synchronous kinds and in ``async``
with Nm = 1 nothing is in flight at a boundary, so a job that migrates runs the same
computation as one that does not and ends with the same weights. In ``async`` with Nm > 1
a layer's staleness depends on its stage: stage 0's forward of ``p`` sees its virtual
worker's updates up to ``p - Nm``, a later stage's (1F1B: its backwards come sooner) more
recent ones, the last stage's up to ``p - 1``. Any job whose split changes therefore trains
otherwise than one whose split never does, whether it migrates or not. The comparable job
is the one that changes its split at the same boundary by the path that exists without
migration: it stops there (its pipeline drained, every update pushed) and a new attempt
runs on the new split from the weights and per-parameter optimizer state at the cut
(:func:`hetpipe.head.recovery.stage_restores`); the two end with the same weights.

**Refused** (:class:`MigrationError`, when the order is taken): another count of stages, a
stage left without layers, a boundary that does not open a wave or lies on a checkpoint's
cut, replicated stages, ties spanning stages, ``train.weights`` other than ``stash`` (the
prediction's step counts follow the stage's own order). A stage lost during a migration
ends the others' wait after ``timeout_s`` with an error naming it (:meth:`Migrator._meet`):
the attempt then ends as for any failed stage (re-planned or failed).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from hetpipe.checkpoint import is_cut
from hetpipe.config import DeviceSpec
from hetpipe.core.layout import StageLayout
from hetpipe.core.schedule import Action, Forward, Merge, Wait, max_in_flight
from hetpipe.core.wsp import wave_of
from hetpipe.modelstate import layer_of
from hetpipe.task import StageTask
from hetpipe.wire import Kind

if TYPE_CHECKING:
    from hetpipe.pipeline import StageRunner
    from hetpipe.stage import StageCompute

__all__ = [
    "Bus",
    "Cancelled",
    "HeadBus",
    "LocalBus",
    "MigrationError",
    "Migrator",
    "Move",
    "Order",
    "Parcel",
    "attach",
    "cancel",
    "check_order",
    "cut_points",
    "moves",
    "order",
    "outgoing",
    "pack",
    "prepare",
]

# how long a stage waits at the boundary for the other stages' parcels and verdicts: a lost
# stage must end the migration (and the job's attempt) with an error naming it, not a hang
EXCHANGE_TIMEOUT_S = 120.0


class MigrationError(ValueError):
    """A migration that cannot be carried out; ``str(e)`` is one line saying why."""


class Cancelled(Exception):
    """The head dropped a migration this stage was carrying out (another stage refused its
    order, :func:`cancel`): ``str(e)`` says why; the stage keeps its layers and goes on."""


@dataclass(frozen=True)
class Order:
    """Carry out the split ``layers`` (layers per stage) before minibatch ``at``."""

    at: int
    layers: tuple[int, ...]
    reason: str = "job"


@dataclass(frozen=True)
class Move:
    """Layers ``first``..``last``-1 go from stage ``src`` to stage ``dst``."""

    first: int
    last: int
    src: int
    dst: int


def cut_points(layers: Sequence[int]) -> tuple[int, ...]:
    """The stage boundaries of a split given as layers per stage: ``(0, a, a + b, ...)``."""
    return (0, *itertools.accumulate(layers))


def moves(old: Sequence[int], new: Sequence[int]) -> tuple[Move, ...]:
    """The layer ranges that change stage from split ``old`` to split ``new`` (layers per
    stage), in layer order, each range with one source and one destination."""
    a, b = cut_points(old), cut_points(new)
    if a[-1] != b[-1]:
        raise MigrationError(f"the splits hold {a[-1]} and {b[-1]} layers")

    def owner(bounds: tuple[int, ...], j: int) -> int:
        return next(s for s in range(len(bounds) - 1) if bounds[s] <= j < bounds[s + 1])

    out: list[Move] = []
    for j in range(a[-1]):
        src, dst = owner(a, j), owner(b, j)
        if src == dst:
            continue
        if out and (out[-1].last, out[-1].src, out[-1].dst) == (j, src, dst):
            out[-1] = dataclasses.replace(out[-1], last=j + 1)
        else:
            out.append(Move(j, j + 1, src, dst))
    return tuple(out)


def check_order(order: Order, k: int, nm: int, *, total: int | None = None, what: str = "") -> None:
    """Refuse (:class:`MigrationError`) a split that cannot replace one of ``k`` stages (of
    ``total`` layers, where known) at its boundary: another count of stages or layers, an
    empty stage, a boundary inside a wave or iteration of ``nm`` minibatches."""
    where = f"{what}: " if what else ""
    if len(order.layers) != k:
        raise MigrationError(
            f"{where}the new split has {len(order.layers)} stages, the virtual worker {k}"
        )
    if any(n < 1 for n in order.layers):
        raise MigrationError(f"{where}every stage keeps at least one layer: {list(order.layers)}")
    if total is not None and sum(order.layers) != total:
        raise MigrationError(
            f"{where}the new split holds {sum(order.layers)} layers, the model {total}"
        )
    if order.at <= 0 or order.at % nm:
        raise MigrationError(
            f"{where}minibatch {order.at} opens no wave or iteration (nm = {nm}): a "
            f"migration happens at a multiple of nm above 0"
        )


def outgoing(stage: int, first: int, last: int, bounds: Sequence[int]) -> list[Move]:
    """What stage ``stage`` holding layers ``first``..``last``-1 gives away under the new
    cut points ``bounds``: each range with its new owner (what a stage knows alone; the
    whole list is :func:`moves`, the union over the stages)."""
    out: list[Move] = []
    for j in range(first, last):
        dst = next(t for t in range(len(bounds) - 1) if bounds[t] <= j < bounds[t + 1])
        if dst == stage:
            continue
        if out and (out[-1].last, out[-1].dst) == (j, dst):
            out[-1] = dataclasses.replace(out[-1], last=j + 1)
        else:
            out.append(Move(j, j + 1, stage, dst))
    return out


# -- the state that travels --------------------------------------------------------------------


@dataclass
class Parcel:
    """The state of the layers ``move`` gives away, as the stage held it at the boundary:
    tensors under :mod:`hetpipe.stagestate`'s names (``param/``, ``buffer/``, ``local/``,
    ``opt/<key>/``, ``acc/<wave>/``), CPU copies; ``meta``: each parameter's optimizer step
    count, each name's shard, the layers' activation policies and their measured bytes."""

    move: Move
    meta: dict[str, Any]
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def _saved_per_layer(compute: StageCompute) -> dict[int, int]:
    """Global layer -> the activation bytes it keeps per minibatch (the largest input shape
    measured so far; a layer never run yet: absent)."""
    first = compute.task.first
    out: dict[int, int] = {}
    for known in compute.mem.layer_bytes.values():
        for j, (s, i) in enumerate(zip(known.saved, known.inputs, strict=True)):
            out[first + j] = max(out.get(first + j, 0), s + i)
    return out


def pack(compute: StageCompute, move: Move) -> Parcel:
    """On the compute thread, at the boundary: the state of layers ``move.first`` ..
    ``move.last - 1`` of ``compute`` (copies: ``compute`` is unchanged, so a refused
    migration goes on with it)."""
    wv = compute.wv

    def mine(name: str) -> bool:
        return move.first <= layer_of(name) < move.last

    def cpu(t: torch.Tensor) -> torch.Tensor:
        return t.detach().to("cpu", copy=True)

    tensors: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for kind, held in (("param", wv.params), ("buffer", wv.buffers), ("local", wv.local)):
            tensors.update({f"{kind}/{n}": cpu(t) for n, t in held.items() if mine(n)})
        for n, st in wv.optimizer.state.items():
            if mine(n):
                tensors.update({f"opt/{key}/{n}": cpu(t) for key, t in st.items()})
        for w, acc in wv.acc.items():
            tensors.update({f"acc/{w}/{n}": cpu(t) for n, t in acc.items() if mine(n)})
    task = compute.task
    saved = _saved_per_layer(compute)
    meta = {
        "opt_steps": {n: int(s) for n, s in wv.optimizer.steps.items() if mine(n)},
        "placement": {n: s for n, s in task.placement.items() if mine(n)},
        "shards": dict(task.shards),
        "recompute": [j for j in task.recompute if move.first <= j < move.last],
        "swap": [j for j in task.swap if move.first <= j < move.last],
        "saved": {str(j): b for j, b in saved.items() if move.first <= j < move.last},
    }
    return Parcel(move, meta, tensors)


def _pack_all(compute: StageCompute, mine: Sequence[Move]) -> list[Parcel]:
    return [pack(compute, m) for m in mine]


def relaid(task: StageTask, bounds: Sequence[int], parcels: Sequence[Parcel]) -> StageTask:
    """``task`` with the layers of ``bounds`` (stage cut points): its own and its neighbours'
    ranges, the activation policies of what it keeps and receives, the placement of each
    name it holds."""
    s = task.stage
    first, last = bounds[s], bounds[s + 1]

    def within(js: Sequence[int]) -> tuple[int, ...]:
        return tuple(j for j in js if first <= j < last)

    recompute = set(within(task.recompute))
    swap = set(within(task.swap))
    placement = {n: v for n, v in task.placement.items() if first <= layer_of(n) < last}
    shards = dict(task.shards)
    for parcel in parcels:
        recompute.update(parcel.meta["recompute"])
        swap.update(parcel.meta["swap"])
        placement.update(parcel.meta["placement"])
        shards.update(parcel.meta.get("shards", {}))
    used = {str(v) for v in placement.values()}
    shards = {i: a for i, a in shards.items() if i in used or i in task.shards}
    layout = dataclasses.replace(
        task.layout,
        first=first,
        last=last,
        recompute=tuple(sorted(recompute)),
        swap=tuple(sorted(swap)),
    )

    def side(lay: StageLayout | None, t: int) -> StageLayout | None:
        if lay is None:
            return None
        return dataclasses.replace(
            lay,
            first=bounds[t],
            last=bounds[t + 1],
            recompute=tuple(j for j in lay.recompute if bounds[t] <= j < bounds[t + 1]),
            swap=tuple(j for j in lay.swap if bounds[t] <= j < bounds[t + 1]),
        )

    return dataclasses.replace(
        task,
        layout=layout,
        prev=side(task.prev, s - 1),
        next=side(task.next, s + 1),
        placement=placement,
        shards=shards,
    )


def prepare(
    old: StageCompute,
    device: DeviceSpec,
    bounds: Sequence[int],
    parcels: Sequence[Parcel],
) -> tuple[StageCompute | None, str | None]:
    """On the compute thread, at the boundary: the compute of this stage's new layer range
    (``bounds``: every stage's cut points) from the state ``old`` keeps and the ``parcels``
    it receives, and None; or None and why it would not fit the device's memory. ``old`` is
    unchanged."""
    from hetpipe.stage import StageCompute

    task = relaid(old.task, bounds, parcels)
    got: dict[str, dict[str, torch.Tensor]] = {"param": {}, "buffer": {}, "local": {}}
    opt: dict[str, dict[str, torch.Tensor]] = {}
    acc: dict[int, dict[str, torch.Tensor]] = {}
    steps: dict[str, int] = {}
    for parcel in parcels:
        steps.update(parcel.meta["opt_steps"])
        for key, t in parcel.tensors.items():
            kind, _, rest = key.partition("/")
            if kind == "opt":
                okey, _, name = rest.partition("/")
                opt.setdefault(name, {})[okey] = t
            elif kind == "acc":
                w, _, name = rest.partition("/")
                acc.setdefault(int(w), {})[name] = t
            else:
                got[kind][rest] = t
    wv = old.wv
    dev = old.dev
    local = {
        **{n: t for n, t in wv.local.items() if task.first <= layer_of(n) < task.last},
        **got["local"],
    }
    # building the stage's module initialises weights it never uses (the state it runs on is
    # installed below): the global generator must not move, so dropout and data order after
    # the boundary are those of a job that never migrated
    with torch.random.fork_rng(devices=[]):
        new = StageCompute(task, device, local)
    nw = new.wv

    def take(kind: str, name: str, held: Mapping[str, torch.Tensor]) -> torch.Tensor:
        if name in held:
            return held[name]  # kept: the very tensor, its version included
        if name not in got[kind]:
            raise MigrationError(f"{task.where}: no parcel brought {kind} {name!r}")
        return got[kind][name].to(dev, copy=True)

    with torch.no_grad():
        nw.params = {
            n: take("param", n, wv.params).requires_grad_(n not in nw.layout.frozen)
            for n in nw.param_names
        }
        nw.buffers = {n: take("buffer", n, wv.buffers) for n in nw.buffer_names}
    optimizer = nw.optimizer
    optimizer.lr = wv.optimizer.lr
    for n in nw.param_names:
        if n in wv.optimizer.state:
            optimizer.state[n] = wv.optimizer.state[n]
        elif n in opt:
            optimizer.state[n] = {k: t.to(dev, copy=True) for k, t in opt[n].items()}
        if n in wv.optimizer.steps:
            optimizer.steps[n] = wv.optimizer.steps[n]
        elif n in steps:
            optimizer.steps[n] = steps[n]
    names = set(nw.param_names) | set(nw.buffer_names)
    for w, held in wv.acc.items():
        kept = {n: t for n, t in held.items() if n in names}
        if kept:
            nw.acc.setdefault(w, {}).update(kept)
    for w, held in acc.items():
        nw.acc.setdefault(w, {}).update({n: t.to(dev, copy=True) for n, t in held.items()})
    nw.version, nw.steps_taken = wv.version, wv.steps_taken
    # what the stage keeps across its layer sets: counters, read-back losses not read yet,
    # the weight versions of finished backwards (for their records), the loss scale
    new.stats = old.stats
    new._losses = old._losses
    new.versions = old.versions
    new.scaler = old.scaler
    new.agreed, new.ready = old.agreed, old.ready
    refusal = _fits(new, old, parcels)
    return (None, refusal) if refusal is not None else (new, None)


def _fits(new: StageCompute, old: StageCompute, parcels: Sequence[Parcel]) -> str | None:
    """Why ``new`` would not fit its device's memory, or None: its state counted from its
    real tensors (weights, optimizer state, accumulators) plus, for the most minibatches
    its schedule may hold, the activation bytes its layers kept per minibatch where they
    ran before (:func:`_saved_per_layer`; a layer not run yet counts nothing)."""
    state = new.memory().total
    saved = _saved_per_layer(old)
    for parcel in parcels:
        saved.update({int(j): b for j, b in parcel.meta["saved"].items()})
    task = new.task
    per = sum(b for j, b in saved.items() if task.first <= j < task.last)
    held = max_in_flight(
        new.spec.schedule,
        task.k,
        task.stage,
        task.nm,
        warmup=new.spec.warmup_forwards or 0,
        limit=task.in_flight_limit or None,
    )
    need = state + per * held
    cap = new.mem.cap
    if need <= cap:
        return None
    return (
        f"{task.where}: layers {task.first}..{task.last - 1} would need {need} bytes "
        f"({state} of state, {per} of activations per minibatch for {held} in flight) on "
        f"a device with a cap of {cap}"
    )


# -- the exchange between the stages -----------------------------------------------------------


class Bus(Protocol):
    """How the stages of a virtual worker swap parcels and agree on a migration."""

    def begin(self, order: Order) -> None:
        """A migration begins at this stage (before its first :meth:`exchange`)."""
        ...

    async def exchange(self, stage: int, out: Sequence[Parcel]) -> list[Parcel]:
        """Give this stage's parcels; get the ones addressed to it once every stage gave."""
        ...

    async def verdict(self, stage: int, refusal: str | None) -> str | None:
        """Give this stage's refusal (None: it fits); get the first refusal of any stage."""
        ...


class LocalBus:
    """A :class:`Bus` for stages that run in one process on one event loop (tests, and a
    worker serving several stages of one virtual worker)."""

    def __init__(self, k: int) -> None:
        self.k = k
        self._given: dict[int, list[Parcel]] = {}
        self._refusals: dict[int, str | None] = {}
        self._round = 0
        self._all_given = asyncio.Event()
        self._all_judged = asyncio.Event()

    def begin(self, order: Order) -> None:
        pass

    async def exchange(self, stage: int, out: Sequence[Parcel]) -> list[Parcel]:
        self._given[stage] = list(out)
        if len(self._given) == self.k:
            self._all_given.set()
        await self._all_given.wait()
        return [p for given in self._given.values() for p in given if p.move.dst == stage]

    async def verdict(self, stage: int, refusal: str | None) -> str | None:
        self._refusals[stage] = refusal
        if len(self._refusals) == self.k:
            self._all_judged.set()
        await self._all_judged.wait()
        first = next((r for _, r in sorted(self._refusals.items()) if r is not None), None)
        self._done(stage)
        return first

    def missing(self) -> list[int]:
        """The stages that have not reached the step the others wait at."""
        waiting = self._refusals if self._refusals else self._given
        return [s for s in range(self.k) if s not in waiting]

    def _done(self, stage: int) -> None:
        """Once every stage read the verdict, the bus is ready for the next migration."""
        self._round += 1
        if self._round == self.k:
            self._given, self._refusals, self._round = {}, {}, 0
            self._all_given = asyncio.Event()
            self._all_judged = asyncio.Event()


class HeadBus:
    """A :class:`Bus` through the head, for stages on workers of their own: each step is a
    ``migrate`` request the head answers once every stage of the virtual worker sent its
    own (:mod:`hetpipe.head.migration`)."""

    def __init__(self, head: Any, job: str, vw: int, timeout_s: float = EXCHANGE_TIMEOUT_S):
        """``head``: the worker's channel to the head (:class:`hetpipe.transport.Channel`)."""
        self.head = head
        self.job = job
        self.vw = vw
        self.timeout_s = timeout_s
        self.order: Order | None = None
        self.verdicts = 0  # the verdicts of this migration asked so far

    def begin(self, order: Order) -> None:
        self.order = order
        self.verdicts = 0

    def _fields(self, stage: int, step: str) -> dict[str, Any]:
        assert self.order is not None
        return {
            "job": self.job,
            "vw": self.vw,
            "stage": stage,
            "at": self.order.at,
            "step": step,  # the head meets the stages per boundary ``at`` and step
            "layers": list(self.order.layers),
            "reason": self.order.reason,
        }

    async def exchange(self, stage: int, out: Sequence[Parcel]) -> list[Parcel]:
        described = [
            {
                "move": [p.move.first, p.move.last, p.move.src, p.move.dst],
                "meta": p.meta,
                "names": list(p.tensors),
            }
            for p in out
        ]
        tensors = {f"{i}/{n}": t for i, p in enumerate(out) for n, t in p.tensors.items()}
        reply = await self.head.request(
            Kind.MIGRATE,
            {**self._fields(stage, "parcels"), "parcels": described},
            tensors,
            timeout=self.timeout_s,
            what="the head",
        )
        if (why := reply["info"].get("cancelled")) is not None:
            raise Cancelled(why)
        return [
            Parcel(Move(*d["move"]), d["meta"], {n: reply.tensors[f"{j}/{n}"] for n in d["names"]})
            for j, d in enumerate(reply["info"]["parcels"])
        ]

    async def verdict(self, stage: int, refusal: str | None) -> str | None:
        fields = self._fields(stage, "verdict")
        fields["step"] += f":{self.verdicts}"
        self.verdicts += 1
        if refusal is not None:
            fields["refusal"] = refusal
        reply = await self.head.request(
            Kind.MIGRATE, fields, timeout=self.timeout_s, what="the head"
        )
        return reply["info"].get("refusal")


class _Refused:
    """Stands for a :class:`Migrator` whose orders this stage cannot carry out: the stage
    fails at its first action with the reason (the head reports it as for any failure)."""

    def __init__(self, error: MigrationError) -> None:
        self.error = error
        self.done: list[dict[str, Any]] = []

    async def at(self, _runner: StageRunner, _action: Action) -> bool:
        raise self.error


def attach(
    runner: StageRunner,
    device: DeviceSpec,
    head: Any,
    connect: Callable[[int, str], Any] | None = None,
) -> None:
    """Give ``runner`` a :class:`Migrator` met through the head (:class:`HeadBus`), with its
    virtual worker's order from ``replan.migrate_at``, if any; the head may add orders while
    it trains (:func:`order`). Orders it cannot carry out fail the stage; a stage that
    cannot migrate at all (replicated, tied, not stashing) gets no migrator and refuses
    later orders.
    ``connect``: as :class:`Migrator` takes it."""
    task = runner.task
    orders = [
        Order(m.minibatch, tuple(m.layers), "job")
        for m in runner.compute.spec.migrations
        if m.vw == task.vw
    ]
    try:
        Migrator.validate(runner.compute, orders)
    except MigrationError as exc:
        if orders:
            runner.migration = _Refused(exc)
        return
    migrator = Migrator(orders, HeadBus(head, task.job, task.vw), device, connect=connect)
    migrator.install(runner)


def order(runner: StageRunner, new: Order, *, pick: bool = False) -> int:
    """Add a migration the head decided while the stage trains (:func:`attach` gave it a
    :class:`Migrator`) and return its boundary; :class:`MigrationError` if this stage cannot
    carry it out.

    ``pick`` (stage 0, the furthest ahead of its virtual worker): the boundary is
    ``new.at`` or the first free one after it, past every minibatch this stage admitted or
    may be about to admit, and no checkpoint's cut. The head's view of the stage's progress
    lags its reports, so only the stage itself can choose a boundary that nothing has
    passed; the later stages, which are behind it, then take that boundary as it is.
    Without ``pick`` a boundary this stage admitted already is refused."""
    migrator = runner.migration
    task = runner.task
    where = task.where
    if not isinstance(migrator, Migrator):
        raise MigrationError(f"{where}: this stage does not migrate layers")
    at = new.at
    if pick:
        # past the next minibatch too: the runner may have decided its forward already
        at = max(at, -(-(runner.schedule.nf + 1) // task.nm) * task.nm)
        while runner.cut_at(at // task.nm) and at < task.minibatches:
            at += task.nm
        new = dataclasses.replace(new, at=at)
    elif runner.schedule.nf > at:
        raise MigrationError(
            f"{where}: minibatch {at} is behind this stage (it admitted {runner.schedule.nf - 1})"
        )
    Migrator.validate(runner.compute, [new], cut=runner.cut_at)
    if any(o.at == at for o in migrator.orders):
        raise MigrationError(f"{where}: a migration at minibatch {at} is pending already")
    migrator.orders = sorted([*migrator.orders, new], key=lambda o: o.at)
    return at


def cancel(runner: StageRunner, at: int) -> bool:
    """Drop the pending migration at minibatch ``at`` (the head's: another stage of the
    virtual worker refused it) and let the stage go on; False where there is none, or where
    this stage carries it out already (the head's answer at the exchange ends that one:
    :class:`Cancelled`)."""
    migrator = runner.migration
    if not isinstance(migrator, Migrator):
        return False
    return migrator.cancel(runner, at)


# -- the hook in the runner ----------------------------------------------------------------------

Record = Callable[[dict[str, Any]], Awaitable[None] | None]


class Migrator:
    """Carries out one stage's part of the migrations of its virtual worker, in order: the
    runner asks :meth:`at` before each action (:meth:`hetpipe.pipeline.StageRunner.run`)."""

    def __init__(
        self,
        orders: Sequence[Order],
        bus: Bus,
        device: DeviceSpec,
        *,
        record: Record | None = None,
        timeout_s: float = EXCHANGE_TIMEOUT_S,
        connect: Callable[[int, str], Any] | None = None,
    ) -> None:
        """``record`` gets one dict per migration carried out or refused
        (:meth:`_carry_out`); ``timeout_s`` bounds each wait for the other stages;
        ``connect(index, address)`` opens a channel to a shard the stage did not use before
        (a worker's; None: the runner has a channel to every shard)."""
        self.connect = connect
        self.orders = sorted(orders, key=lambda o: o.at)
        self.bus = bus
        self.device = device
        self.record = record
        self.timeout_s = timeout_s
        self.held_since: float | None = None  # when this stage first held at the boundary
        self.carrying: Order | None = None  # the order being carried out (past its drain)
        self.done: list[dict[str, Any]] = []  # what each migration did, as recorded

    @staticmethod
    def validate(
        compute: StageCompute, orders: Sequence[Order], cut: Callable[[int], bool] | None = None
    ) -> None:
        """Refuse (:class:`MigrationError`) orders this stage's job cannot carry out.
        ``cut(c)``: whether the end of wave ``c - 1`` is a checkpoint's cut (the runner's own
        answer, :meth:`hetpipe.pipeline.StageRunner.cut_at`; None: the job's periodic cuts
        from wave 0)."""
        task = compute.task
        if task.replicated or task.prev_group[1:] or task.next_group[1:]:
            raise MigrationError(f"{task.where}: replicated stages do not migrate layers")
        if task.ties or compute.layout.aliases:
            raise MigrationError(f"{task.where}: a model with tied weights does not migrate")
        if compute.weights != "stash":
            raise MigrationError(
                f"{task.where}: train.weights = {compute.weights!r} does not migrate (stash does)"
            )
        spec = compute.spec
        waves = -(-task.minibatches // task.nm)
        for order in orders:
            check_order(order, task.k, task.nm, what=task.where)
            if order.at >= task.minibatches:
                raise MigrationError(
                    f"{task.where}: minibatch {order.at} is past the job's {task.minibatches}"
                )
            c = order.at // task.nm
            if cut(c) if cut is not None else is_cut(c, spec.checkpoint_every, waves):
                raise MigrationError(
                    f"{task.where}: minibatch {order.at} opens wave {order.at // task.nm}, a "
                    f"checkpoint's cut (train.checkpoint_every = {spec.checkpoint_every}): "
                    f"a migration takes another boundary"
                )

    def install(self, runner: StageRunner) -> None:
        """Attach to ``runner``: its schedule's answers that belong to a pending boundary's
        wave or later become ``Wait("migration")`` until the migration is carried out (also
        inside a hand-off, :meth:`hetpipe.core.schedule.StageSchedule.trip`), and the runner
        calls :meth:`at` before each action."""
        ask = runner.schedule.next

        def next_(inputs: Any) -> Action:
            action = ask(inputs)
            if self.orders:
                at = self.orders[0].at
                c = at // runner.task.nm
                if self._concerns(action, at, c):
                    deferred = runner.schedule.deferred()  # train.defer_weight_grad
                    if deferred is not None:
                        return deferred  # drained before the boundary, as a backward is
                    if self.held_since is None:
                        self.held_since = time.monotonic()
                    return Wait("migration", p=at, c=c)
            return action

        runner.schedule.next = next_  # type: ignore[method-assign]
        runner.migration = self

    def cancel(self, runner: StageRunner, at: int) -> bool:
        """:func:`cancel`'s work: drop the pending order at ``at`` unless it is being
        carried out, and wake the runner where it held at the boundary."""
        if self.carrying is not None and self.carrying.at == at:
            return False
        kept = [o for o in self.orders if o.at != at]
        if len(kept) == len(self.orders):
            return False
        if self.orders[0].at == at:
            self.held_since = None
        self.orders = kept
        runner.wakeup.set()
        return True

    def _drained(self, runner: StageRunner, at: int) -> bool:
        """Whether this stage ran everything of the waves before ``at`` and nothing after."""
        sched = runner.schedule
        c = at // runner.task.nm
        return (
            sched.nb >= at
            and sched.nf == at
            and not runner.compute.in_flight
            and sched.steps >= (c if runner.sync else at)
            and (not sched.pushes or sched.pushed >= c)
        )

    @staticmethod
    def _concerns(action: Action, at: int, c: int) -> bool:
        """Whether ``action`` belongs to the boundary's wave or later (a pull may go out
        before the boundary: it is sent again after, :meth:`_carry_out`; a wait for a
        gradient or a pull answer stays what it is)."""
        if isinstance(action, Forward):
            return action.p >= at
        if isinstance(action, Merge):
            return not action.grads and action.c >= c
        if isinstance(action, Wait):
            return action.what == "activation" and action.p is not None and action.p >= at
        return False

    async def at(self, runner: StageRunner, action: Action) -> bool:
        """Before ``action``: carry out the pending migration if ``action`` is its wait and
        this stage is drained. True when it did (the runner asks its schedule again); False
        otherwise (a wait not drained yet: the runner waits as for any other)."""
        if not (isinstance(action, Wait) and action.what == "migration" and self.orders):
            return False
        if not self._drained(runner, self.orders[0].at):
            return False
        await self._carry_out(runner, self.orders[0])
        return True

    async def _meet(self, runner: StageRunner, at: int, step: Awaitable[Any]) -> Any:
        """Wait for the other stages at one step of the migration at ``at``: a stage lost
        meanwhile ends this one with a :class:`MigrationError` naming it (the head then
        re-plans or fails the job, as for any failed stage), never a hang."""
        try:
            return await asyncio.wait_for(step, self.timeout_s)
        except TimeoutError:
            missing = getattr(self.bus, "missing", lambda: [])()
            who = ", ".join(f"stage {s}" for s in missing) or "another stage"
            raise MigrationError(
                f"{runner.task.where}: {who} of vw{runner.task.vw} did not reach the "
                f"migration at minibatch {at} within {self.timeout_s:g}s (lost?)"
            ) from None

    async def _rekey(
        self, runner: StageRunner, before: dict[int, list[str]], c: int, at: int
    ) -> None:
        """Tell each shard which names this stage pushes and pulls there from wave ``c`` on:
        first where it holds names now, then, once every stage did (a barrier on the bus,
        so that a virtual worker is never without a stage on a shard), where it holds none
        any more (:meth:`hetpipe.shard.JobShard.migrate`)."""
        from hetpipe.pipeline import PUSH_TIMEOUT_S

        after = runner._shard_names() if runner.compute.has_state else {}
        fields = {"job": runner.task.job, "vw": runner.task.vw, "stage": runner.task.stage}

        async def tell(shard: int, names: list[str]) -> None:
            await runner.shards[shard].request(
                Kind.PUSH,  # with ``migrate``: no update, the names from wave c on
                {**fields, "wave": c, "migrate": names},
                timeout=PUSH_TIMEOUT_S,
                what=f"shard {shard}",
            )

        for shard, names in sorted(after.items()):
            if sorted(names) != sorted(before.get(shard, [])):
                await tell(shard, names)
        await self._meet(runner, at, self.bus.verdict(runner.task.stage, None))
        for shard in sorted(set(before) - set(after)):
            await tell(shard, [])

    async def _carry_out(self, runner: StageRunner, order: Order) -> None:
        """Steps 2-4 of the module's sequence at a drained boundary."""
        task = runner.task
        c = order.at // task.nm
        runner._wait_for("migration", p=order.at, wave=c)
        drained = time.monotonic()
        held = drained - (self.held_since or drained)
        self.carrying = order
        incoming: list[Parcel] = []
        with runner.timeline.span("bubble", order.at, c):  # nothing computes meanwhile
            await runner._wait_pushes()  # the shards hold every push of the waves before
            self.bus.begin(order)
            mine = outgoing(task.stage, task.first, task.last, cut_points(order.layers))
            # one hand-off to the compute thread whatever moves: the stages resume in the
            # same order whatever they exchanged
            out = await runner._run(_pack_all, runner.compute, mine)
            try:
                incoming = await self._meet(runner, order.at, self.bus.exchange(task.stage, out))
                refusal = await self._swap(runner, order, incoming)
            except Cancelled as exc:
                refusal = str(exc)
        self.carrying = None
        self.orders.pop(0)
        self.held_since = None
        resumed = time.monotonic()
        rec = {
            "event": "migration" if refusal is None else "migration_refused",
            "vw": task.vw,
            "stage": task.stage,
            "at": order.at,
            "wave": wave_of(order.at, task.nm),
            "reason": order.reason,
            "layers": list(order.layers),
            # what this stage gave and took (the virtual worker's moves: the union over its
            # stages, :func:`moves`)
            "moves": [
                dataclasses.asdict(m)
                for m in sorted([*mine, *(p.move for p in incoming)], key=lambda m: m.first)
            ],
            "range": [runner.task.first, runner.task.last],
            "bytes_out": sum(p.nbytes for p in out),
            "bytes_in": sum(p.nbytes for p in incoming),
            "drain_s": held,
            "exchange_s": resumed - drained,
            # the pause of this stage's admission: from the first action it held back to
            # the resumption (stage 0's is the virtual worker's migration_stall_s)
            "migration_stall_s": held + (resumed - drained),
            "time": time.time(),
        }
        if refusal is not None:
            rec["refused"] = refusal
        self.done.append(rec)
        if self.record is not None:
            res = self.record(rec)
            if asyncio.iscoroutine(res):
                await res

    async def _swap(self, runner: StageRunner, order: Order, incoming: list[Parcel]) -> str | None:
        """Step 3 and 4 once the parcels are in: build the new compute, agree with the other
        stages, and take it (telling the shards the new names); the refusal agreed, or
        None where the stages took their new layers."""
        task = runner.task
        c = order.at // task.nm
        bounds = cut_points(order.layers)
        new, refusal = await runner._run(prepare, runner.compute, self.device, bounds, incoming)
        if task.is_last and bounds[-1] != task.last:
            new = None
            refusal = (
                f"{task.where}: the new split holds {bounds[-1]} layers, the model {task.last}"
            )
        if new is not None and new.has_state != runner.compute.has_state:
            refusal = (
                f"{task.where}: layers {new.task.first}..{new.task.last - 1} would "
                f"{'hold' if new.has_state else 'hold no'} state, its schedule was made "
                f"for the other"
            )
        refusal = await self._meet(runner, order.at, self.bus.verdict(task.stage, refusal))
        if refusal is not None:
            return refusal
        assert new is not None
        before = runner._shard_names() if runner.compute.has_state else {}
        runner.compute = new
        runner.task = new.task
        for index, address in new.task.shards.items():
            if int(index) not in runner.shards and self.connect is not None:
                runner.shards[int(index)] = self.connect(int(index), address)
        await self._rekey(runner, before, c, order.at)
        # a pull of the boundary's wave already sent asked for the old names
        for key in [k for k in runner.answers if not k[1] and k[0] >= c]:
            runner.answers.pop(key).cancel()
            runner.schedule.sent.discard(key)
        return None
