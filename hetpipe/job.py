"""A training job: model, data, optimizer, schedule and (optionally) an explicit VW split.

A job is written as a TOML file by the user and travels to the head as a plain dict, so the
dict form *is* the file's shape: ``load_job`` parses the TOML and hands it to
``JobSpec.from_dict``, and the head validates what it receives with that same code. Every
rejection is one line ``"<file>: <key>: <problem>"``.

Each key (its type, default, bounds, choices, meaning and where it has an effect) is declared
once in :data:`hetpipe.core.keys.JOB`; this module reads the tables through those
declarations and adds the checks across keys. A file (:func:`load_job`) is also refused for
a key it sets where that key has no effect.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from typing import Any

from hetpipe._toml import DECLARED, Table, kind, read_toml
from hetpipe.core import keys, schedule_csv
from hetpipe.core.keys import JOB
from hetpipe.core.layout import VWSpec
from hetpipe.core.lr import KINDS as LR_KINDS
from hetpipe.core.lr import LrSchedule, is_function
from hetpipe.core.schedule import DEVICE_KINDS, SYNC_KINDS, SYNCHRONOUS, ScheduleError
from hetpipe.usercode import digest

__all__ = [
    "DataSpec",
    "JobError",
    "JobSpec",
    "LossScaleSpec",
    "LrSchedule",
    "MigrationSpec",
    "ModelSpec",
    "OptimizerSpec",
    "VWSpec",
    "load_job",
]

# each key's default, bounds and choices are declared in hetpipe.core.keys.JOB
_d = JOB.default


class JobError(ValueError):
    """A bad job; ``str(e)`` is one line ``"<file>: <key>: <problem>"``."""


@dataclass(frozen=True)
class ModelSpec:
    """A builtin model name (``"mlp"``, ``"cnn"``, …) or ``"pkg.module:function"``."""

    name: str
    args: dict = field(default_factory=dict)
    split_points: tuple[str, ...] = ()  # submodules of a captured model that start a block
    loss: str | None = None  # "pkg.module:function" (outputs, labels) -> scalar; None: default


@dataclass(frozen=True)
class DataSpec:
    """A data set name (see :mod:`hetpipe.data.source`), its keyword arguments, the collate
    function batching its samples, and how each first stage's ``DataLoader`` reads it."""

    name: str
    args: dict = field(default_factory=dict)
    collate: str | None = None
    workers: int = 0
    prefetch: int = 2


@dataclass(frozen=True)
class OptimizerSpec:
    """Applied locally by each stage after every backward (its updates are what waves push).

    ``sgd`` (``momentum``, L2 ``weight_decay``, ``nesterov``), ``adam`` (L2 ``weight_decay``)
    or ``adamw`` (decoupled ``weight_decay``, 0.01 when the file gives none), each with the
    arithmetic of its ``torch.optim`` namesake.
    """

    name: str = _d("optimizer.name")
    lr: float = _d("optimizer.lr")
    momentum: float = _d("optimizer.momentum")
    weight_decay: float = _d("optimizer.weight_decay")
    nesterov: bool = _d("optimizer.nesterov")
    betas: tuple[float, float] = _d("optimizer.betas")
    eps: float = _d("optimizer.eps")
    # the gradients' L2 norm bound (sync: global over the iteration's stages; async: per
    # stage and minibatch); None: no clipping
    clip_norm: float | None = _d("optimizer.clip_norm")
    # how the shards combine the virtual workers' pushed updates (async): "sum" or "mean"
    merge: str = _d("optimizer.merge")


@dataclass(frozen=True)
class LossScaleSpec:
    """``[loss_scale]``: ``torch.amp.GradScaler``'s settings for ``precision = "fp16"``."""

    init: float = _d("loss_scale.init")
    growth_factor: float = _d("loss_scale.growth_factor")
    backoff_factor: float = _d("loss_scale.backoff_factor")
    growth_interval: int = _d("loss_scale.growth_interval")


@dataclass(frozen=True)
class FaultSpec:
    """Deterministic fault injection for tests and drills: stall a stage at a minibatch.

    The stage's compute blocks for ``seconds`` before the forward of ``minibatch``, as a
    hung kernel or a stuck device would; the head's hang diagnosis must then name it.
    """

    vw: int
    stage: int
    minibatch: int
    seconds: float


@dataclass(frozen=True)
class SlowSpec:
    """``[[fault]] kind = "slow"``: device ``device`` runs each forward and backward
    ``factor`` times longer from minibatch ``at_minibatch`` (of each virtual worker) on, as a
    throttled or shared GPU would; the head's drift detection must then notice it
    (:mod:`hetpipe.head.drift`)."""

    device: str
    factor: float
    at_minibatch: int


@dataclass(frozen=True)
class ReplanSpec:
    """``[replan]``: drift detection and online re-planning (:mod:`hetpipe.head.drift`)."""

    enabled: bool = _d("replan.enabled")
    threshold: float = _d("replan.threshold")
    window: int = _d("replan.window")
    min_gain: float = _d("replan.min_gain")
    window_s: float = _d("replan.window_s")
    # a live layer migration to drill (hetpipe.migrate): before minibatch migrate_at (0:
    # none) of virtual worker migrate_vw, to the split migrate_to
    migrate_at: int = _d("replan.migrate_at")
    migrate_to: tuple[int, ...] | None = _d("replan.migrate_to")
    migrate_vw: int = _d("replan.migrate_vw")


@dataclass(frozen=True)
class MigrationSpec:
    """A live layer migration of virtual worker ``vw`` to split ``layers`` (layers per
    stage) before ``minibatch`` (:mod:`hetpipe.migrate`)."""

    vw: int
    minibatch: int
    layers: tuple[int, ...]


@dataclass(frozen=True)
class JobSpec:
    """A validated job. ``minibatches`` counts per virtual worker; ``staleness`` is WSP's D."""

    name: str
    model: ModelSpec
    data: DataSpec
    optimizer: OptimizerSpec
    minibatch: int
    nm: int | None  # None: the planner picks (an explicit split without one fills its pipe)
    staleness: int
    epochs: int | None
    minibatches: int | None
    # the defaults and meanings of these fields are declared with their keys in
    # hetpipe.core.keys.JOB ("train.<field>", "train.vws" for num_vws)
    seed: int = _d("train.seed")
    vws: tuple[VWSpec, ...] = ()
    num_vws: int | None = _d("train.vws")
    policy: str = _d("train.policy")
    eval_every_s: float | None = _d("train.eval_every_s")
    # train.eval_every as given: waves (an int, 0: only at the end) or "<seconds>s"
    eval_every: int | str = _d("train.eval_every")
    metrics: tuple[str, ...] = _d("train.metrics")
    keep_best: str | None = _d("train.keep_best")
    stop_after_no_gain: int = _d("train.stop_after_no_gain")
    hang_after_s: float = _d("train.hang_after_s")
    on_worker_loss: str = _d("train.on_worker_loss")  # "replan": see hetpipe.head
    several_stages: bool = _d("train.several_stages")  # a device may run several stages
    shard_wait_s: float = _d("train.shard_wait_s")  # a lost shard: hetpipe.head.shardwait
    checkpoint_every: int = _d("train.checkpoint_every")
    faults: tuple[FaultSpec, ...] = ()
    slowdowns: tuple[SlowSpec, ...] = ()  # [[fault]] kind = "slow"
    replan: ReplanSpec = field(default_factory=ReplanSpec)
    schedule: str = _d("train.schedule")  # hetpipe.core.schedule.KINDS or "auto"
    weights: str = _d("train.weights")
    predict_variant: str = _d("train.predict_variant")
    bn_recalibrate: int = _d("train.bn_recalibrate")
    activations: str = _d("train.activations")
    precision: str = _d("train.precision")
    # waves between the pushes of a virtual worker alone in its job (nothing reads its global
    # weights before a checkpoint or the end); 0: at checkpoints and the end only (every
    # wave with eval_every_s); several virtual workers, and the synchronous kinds, push
    # every wave/iteration whatever it says
    push_every: int = _d("train.push_every")
    verify: bool = _d("train.verify")
    # async: each backward split, its weight gradient and step deferred until the stage has
    # nothing else ready (hetpipe.core.schedule.StageSchedule's ``defer``)
    defer_weight_grad: bool = _d("train.defer_weight_grad")
    # the most devices the planner may group into one replicated stage of a split it makes
    # (async; hetpipe.planner.replicas decides where it pays), and that ``hetpipe plan``
    # proposes beside a given split; 1: no replicas
    max_replicas: int = _d("train.max_replicas")
    # the most Nm the planner may give a virtual worker (hetpipe.planner.staleness); None:
    # its own limit
    max_nm: int | None = _d("train.max_nm")
    # 1f1b: extra pipeline warm-up forwards of each stage before its first backward
    # (hetpipe.core.schedule.microbatch_order); None: the planner picks ("auto"; the default with
    # schedule "auto", where the head then fixes the job's schedule and warm-up together)
    warmup_forwards: int | None = _d("train.warmup_forwards")
    # "plan": a planned async stage holds at most the minibatches its predicted
    # timeline held, so its memory peak is the plan's; "nm": up to the schedule's maximum
    in_flight: str = _d("train.in_flight")
    # where the shards keep each layer's state: "local" (on its stage's host) or "default"
    # (round-robin, the HetPipe paper's default placement; hetpipe.planner.placement)
    placement: str = _d("train.placement")
    # each stage's order of an iteration (hetpipe.core.schedule_csv); None: the kind's own
    order: tuple[schedule_csv.Order, ...] | None = _d("train.order")
    # module -> sha256 of its source as submitted (hetpipe.usercode); empty: not compared
    code: dict[str, str] = field(default_factory=dict)
    # module -> its source, shipped with the job ([security] ship_code); empty: not shipped
    sources: dict[str, str] = field(default_factory=dict)
    # [lr_schedule]: the learning rate's factor per step (hetpipe.core.lr); total_steps as
    # the file gives it (None: the job's length, filled in by the stage)
    lr_schedule: LrSchedule = field(default_factory=LrSchedule)
    # [loss_scale]: precision "fp16"'s dynamic loss scale
    loss_scale: LossScaleSpec = field(default_factory=LossScaleSpec)

    @property
    def sync(self) -> bool:
        """Whether the schedule is synchronous (an iteration of nm microbatches, one step)."""
        return self.schedule in SYNCHRONOUS

    def to_dict(self) -> dict:
        """The job in its file's shape, as plain msgpack-able data.

        Absent optionals are omitted, and so is a key that has no effect in this job while
        it holds its default: the dict of a loaded job passes ``from_dict(strict=True)``.
        """
        tables = self._tables()
        values = self.key_values()
        for section, table in tables.items():
            for name in list(table):
                key = JOB[f"{section}.{name}"]
                unset = table[name] is None
                idle = key.applies is not None and not key.applies.holds(values)
                if unset or (idle and table[name] == key.default):
                    del table[name]
        vws = []
        for vw in self.vws:
            entry: dict[str, Any] = {
                "devices": [
                    list(vw.group(s)) if len(vw.group(s)) > 1 else d
                    for s, d in enumerate(vw.devices)
                ]
            }
            if vw.layers is not None:
                entry["layers"] = list(vw.layers)
            if vw.nm is not None:
                entry["nm"] = vw.nm
            vws.append(entry)
        for section in ("lr_schedule", "loss_scale", "replan"):  # only what differs from defaults
            table = tables[section]
            for name in [n for n, v in table.items() if v == JOB[f"{section}.{n}"].default]:
                del table[name]
            if not table:
                del tables[section]
        return {
            "name": self.name,
            **({"code": dict(self.code)} if self.code else {}),
            **({"sources": dict(self.sources)} if self.sources else {}),
            **tables,
            "vw": vws,
            "fault": [dataclasses.asdict(f) for f in self.faults]
            + [{"kind": "slow", **dataclasses.asdict(f)} for f in self.slowdowns],
        }

    @classmethod
    def from_dict(cls, d: dict, source: str = "<job>", *, strict: bool = False) -> JobSpec:
        """Validate a job dict (a parsed file or one received from the wire).

        ``strict``: also refuse a key the dict sets where it has no effect (its rule in
        :data:`hetpipe.core.keys.JOB`), as :func:`load_job` does for what a user wrote. Off
        for dicts made by :meth:`to_dict`: a job built in code may hold such a value.
        """
        root = Table(d, source, JobError, allowed=JOB.allowed(""))
        name = _read(root, "name")
        code = _code(root)
        sources = _sources(root, code)
        mt = root.table("model", JOB.allowed("model"))
        model = ModelSpec(
            _read(mt, "name"), _args(mt), tuple(_read(mt, "split_points")), _read(mt, "loss")
        )
        dt = root.table("data", JOB.allowed("data"))
        data = DataSpec(
            _read(dt, "name"),
            _args(dt),
            _read(dt, "collate"),
            _read(dt, "workers"),
            _read(dt, "prefetch"),
        )
        optimizer = _optimizer(root)
        lr_schedule = _lr_schedule(root)
        lt = root.table("loss_scale", JOB.allowed("loss_scale"))
        loss_scale = LossScaleSpec(*(_read(lt, f.name) for f in dataclasses.fields(LossScaleSpec)))

        raw_train = d.get("train")
        if isinstance(raw_train, dict) and "warmup" in raw_train:
            raise JobError(
                f"{source}: train.warmup: renamed train.warmup_forwards (the 1f1b order's "
                "pipeline warm-up forwards; a learning-rate warm-up is "
                "lr_schedule.warmup_steps)"
            )
        train = root.table("train", JOB.allowed("train"))
        minibatch = _read(train, "minibatch")
        nm = _read(train, "nm")
        staleness = _read(train, "staleness")
        seed = _read(train, "seed")
        epochs = _read(train, "epochs")
        minibatches = _read(train, "minibatches")
        if epochs is None and minibatches is None:
            train.fail("epochs", "missing: give exactly one of epochs / minibatches")
        if epochs is not None and minibatches is not None:
            train.fail("minibatches", "give exactly one of epochs / minibatches, not both")
        num_vws = _read(train, "vws")
        eval_every_s = _read(train, "eval_every_s")
        eval_every, metrics, keep_best, stop_after_no_gain = _evals(train, eval_every_s)
        hang_after_s = _read(train, "hang_after_s")
        schedule = _read(train, "schedule")
        weights = _read(train, "weights")
        if weights != "stash" and schedule in SYNCHRONOUS:
            train.fail(
                "weights", f"{weights!r} needs the async schedule (in {schedule} nothing is stale)"
            )
        predict_variant = _read(train, "predict_variant")
        if weights == "predict":
            # hetpipe.optim computes with torch: imported here, reading a job file does not
            from hetpipe.optim import unpredictable

            why = unpredictable(optimizer)
            if why:
                train.fail("weights", f"predict cannot extrapolate {why}")
        bn_recalibrate = _read(train, "bn_recalibrate")
        on_worker_loss = _read(train, "on_worker_loss")
        several_stages = _read(train, "several_stages")
        shard_wait_s = _read(train, "shard_wait_s")
        checkpoint_every = _read(train, "checkpoint_every")
        activations = _read(train, "activations")
        precision = _read(train, "precision")
        if precision == "fp16" and schedule not in SYNCHRONOUS:
            train.fail(
                "precision",
                f"fp16 needs schedule gpipe or 1f1b, not {schedule!r} (its loss scale "
                "skips a step on every stage at once, which only an iteration's one step "
                "can agree on)",
            )
        push_every = _read(train, "push_every")
        max_replicas = _read(train, "max_replicas")
        max_nm = _read(train, "max_nm")
        verify = _read(train, "verify")
        defer_weight_grad = _read(train, "defer_weight_grad")
        warmup_forwards = _warmup_forwards(train, schedule)
        in_flight = _read(train, "in_flight")
        placement = _read(train, "placement")
        policy = _read(train, "policy")

        vws = _vws(root, several_stages)
        if several_stages and any(len(set(v.devices)) < v.k for v in vws):
            _several_stages_refusals(train, vws, schedule, on_worker_loss, activations)
        for given in (nm, *(v.nm for v in vws)):
            if max_nm is not None and given is not None and given > max_nm:
                train.fail("max_nm", f"is {max_nm} but the job gives nm = {given}")
        order = _order(train, source, schedule, warmup_forwards, vws, nm)
        if schedule in DEVICE_KINDS:
            _device_schedule_refusals(train, vws, schedule, nm, minibatches, order is not None)
        faults = [_fault(ft) for ft in root.tables("fault", JOB.allowed("fault"))]
        if schedule == "auto" and vws:
            train.fail(
                "schedule",
                "auto needs a job without [[vw]] tables (the planner "
                "picks the schedule with the split)",
            )
        if schedule in SYNCHRONOUS and any(v.replicas for v in vws):
            train.fail(
                "schedule",
                f"replicated stages need the async schedule ({schedule} "
                "would exchange gradients twice: within the stage and across virtual "
                "workers)",
            )
        if defer_weight_grad:
            _defer_refusals(train, schedule, weights, vws)
        if vws and num_vws is not None and num_vws != len(vws):
            train.fail("vws", f"is {num_vws} but {len(vws)} [[vw]] tables are given")
        spec = cls(
            name=name,
            model=model,
            data=data,
            optimizer=optimizer,
            minibatch=minibatch,
            nm=nm,
            staleness=staleness,
            epochs=epochs,
            minibatches=minibatches,
            seed=seed,
            vws=vws,
            num_vws=num_vws,
            policy=policy,
            eval_every_s=eval_every_s,
            eval_every=eval_every,
            metrics=metrics,
            keep_best=keep_best,
            stop_after_no_gain=stop_after_no_gain,
            hang_after_s=hang_after_s,
            schedule=schedule,
            weights=weights,
            predict_variant=predict_variant,
            bn_recalibrate=bn_recalibrate,
            on_worker_loss=on_worker_loss,
            several_stages=several_stages,
            shard_wait_s=shard_wait_s,
            checkpoint_every=checkpoint_every,
            activations=activations,
            precision=precision,
            push_every=push_every,
            verify=verify,
            defer_weight_grad=defer_weight_grad,
            max_replicas=max_replicas,
            max_nm=max_nm,
            warmup_forwards=warmup_forwards,
            in_flight=in_flight,
            placement=placement,
            order=order,
            code=code,
            sources=sources,
            lr_schedule=lr_schedule,
            loss_scale=loss_scale,
            faults=tuple(f for f in faults if isinstance(f, FaultSpec)),
            slowdowns=tuple(f for f in faults if isinstance(f, SlowSpec)),
            replan=_replan(root),
        )
        if strict:
            given = [
                k.path
                for k in JOB.declared()
                if not JOB.section(k.section).array and _given(d, k.section, k.name)
            ]
            problem = keys.no_effect(JOB, spec.key_values(), given)
            if problem is not None:
                raise JobError(f"{source}: {problem}")
        return spec

    @property
    def migrations(self) -> tuple[MigrationSpec, ...]:
        """The live layer migrations the job asks for (``replan.migrate_at``)."""
        r = self.replan
        if not r.migrate_at or r.migrate_to is None:
            return ()
        return (MigrationSpec(r.migrate_vw, r.migrate_at, r.migrate_to),)

    def key_values(self) -> dict[str, Any]:
        """Each key of the job's tables (not of ``[[vw]]`` or ``[[fault]]``) by its path,
        with the value it holds in this job (a default as much as a value given), and
        ``"vw"``: the number of ``[[vw]]`` tables; what the rules of
        :mod:`hetpipe.core.keys` read."""
        out: dict[str, Any] = {"vw": len(self.vws)}
        for section, table in self._tables().items():
            out.update({f"{section}.{k}": v for k, v in table.items()})
        out["name"] = self.name
        out["code"] = dict(self.code)
        out["sources"] = dict(self.sources)
        return out

    def _tables(self) -> dict[str, dict[str, Any]]:
        """The job's tables in the file's shape, every key present (None: unset)."""
        opt = self.optimizer
        return {
            "model": {
                "name": self.model.name,
                "args": _plain(self.model.args),
                "split_points": list(self.model.split_points),
                "loss": self.model.loss,
            },
            "data": {
                "name": self.data.name,
                "args": _plain(self.data.args),
                "collate": self.data.collate,
                "workers": self.data.workers,
                "prefetch": self.data.prefetch,
            },
            "optimizer": {
                "name": opt.name,
                "lr": opt.lr,
                "momentum": opt.momentum,
                "weight_decay": opt.weight_decay,
                "nesterov": opt.nesterov,
                "betas": list(opt.betas),
                "eps": opt.eps,
                "clip_norm": opt.clip_norm,
                "merge": opt.merge,
            },
            "lr_schedule": {
                f.name: _plain(getattr(self.lr_schedule, f.name))
                for f in dataclasses.fields(LrSchedule)
                if f.name != "function"
            },
            "loss_scale": dataclasses.asdict(self.loss_scale),
            "replan": dataclasses.asdict(self.replan),
            "train": {
                "minibatch": self.minibatch,
                "nm": self.nm,
                "staleness": self.staleness,
                "seed": self.seed,
                "epochs": self.epochs,
                "minibatches": self.minibatches,
                "vws": self.num_vws,
                "policy": self.policy,
                "eval_every_s": self.eval_every_s,
                "eval_every": self.eval_every,
                "metrics": list(self.metrics),
                "keep_best": self.keep_best,
                "stop_after_no_gain": self.stop_after_no_gain,
                "hang_after_s": self.hang_after_s,
                "schedule": self.schedule,
                "weights": self.weights,
                "predict_variant": self.predict_variant,
                "bn_recalibrate": self.bn_recalibrate,
                "on_worker_loss": self.on_worker_loss,
                "several_stages": self.several_stages,
                "shard_wait_s": self.shard_wait_s,
                "checkpoint_every": self.checkpoint_every,
                "activations": self.activations,
                "precision": self.precision,
                "push_every": self.push_every,
                "verify": self.verify,
                "defer_weight_grad": self.defer_weight_grad,
                "max_replicas": self.max_replicas,
                "max_nm": self.max_nm,
                "warmup_forwards": "auto" if self.warmup_forwards is None else self.warmup_forwards,
                "in_flight": self.in_flight,
                "placement": self.placement,
                "order": schedule_csv.rows(self.order) if self.order else None,
            },
        }


def _read(t: Table, name: str, default: Any = DECLARED) -> Any:
    """Key ``name`` of table ``t`` as :data:`hetpipe.core.keys.JOB` declares it."""
    section = t.key.partition("[")[0] if t.key else ""
    return t.read(JOB[f"{section}.{name}" if section else name], default)


def _fault(t: Table) -> FaultSpec | SlowSpec:
    """One ``[[fault]]`` table: each key read (a wrong type refused naming it), then the
    keys of its kind required and the other kind's refused."""
    kind = _read(t, "kind")
    values = {k: _read(t, k) for kinds in keys.FAULT_KEYS.values() for k in kinds}
    for name, value in values.items():
        if value is not None and name not in keys.FAULT_KEYS[kind]:
            t.fail(name, f'has no effect with kind "{kind}"')
    for name in keys.FAULT_KEYS[kind]:
        if values[name] is None:
            t.fail(name, f'missing: kind "{kind}" needs it')
    if kind == "slow":
        return SlowSpec(values["device"], values["factor"], values["at_minibatch"])
    return FaultSpec(values["vw"], values["stage"], values["minibatch"], values["seconds"])


def _replan(root: Table) -> ReplanSpec:
    """The ``[replan]`` table (every key has a default)."""
    rt = root.table("replan", JOB.allowed("replan"))
    values = {f.name: _read(rt, f.name) for f in dataclasses.fields(ReplanSpec)}
    if values["migrate_at"] and not values["migrate_to"]:
        rt.fail("migrate_at", "needs replan.migrate_to, the split to carry out")
    if values["migrate_to"] is not None:
        values["migrate_to"] = tuple(values["migrate_to"])
    return ReplanSpec(**values)


def _given(d: Any, section: str, name: str) -> bool:
    """Whether the job dict ``d`` sets ``section.name`` (None counts as absent)."""
    table = d.get(section) if section else d
    return isinstance(table, dict) and table.get(name) is not None


def _evals(
    train: Table, eval_every_s: float | None
) -> tuple[int | str, tuple[str, ...], str | None, int]:
    """``train.eval_every``, ``metrics``, ``keep_best`` and ``stop_after_no_gain``, each
    refused in one line naming the key (:mod:`hetpipe.metrics` holds their rules)."""
    from hetpipe.metrics import best_rule, check_metrics, parse_every

    every = train.raw("eval_every", JOB["train.eval_every"].default)
    try:
        waves, _seconds = parse_every(every)
    except ValueError as exc:
        train.fail("eval_every", str(exc))
    if waves > JOB["train.eval_every"].high:
        train.fail("eval_every", f"must be <= {JOB['train.eval_every'].high}, got {waves}")
    if every and eval_every_s is not None:
        train.fail("eval_every", "give one of eval_every / eval_every_s, not both")
    metrics = tuple(_read(train, "metrics"))
    try:
        check_metrics(metrics)
    except ValueError as exc:
        train.fail("metrics", str(exc))
    keep_best = _read(train, "keep_best")
    try:
        best_rule(keep_best, metrics)
    except ValueError as exc:
        train.fail("keep_best", str(exc))
    no_gain = _read(train, "stop_after_no_gain")
    if no_gain and not every and eval_every_s is None:
        train.fail(
            "stop_after_no_gain",
            "has no effect without train.eval_every (the job evaluates only at its end)",
        )
    return every, metrics, keep_best, no_gain


def _warmup_forwards(train: Table, schedule: str) -> int | None:
    """``train.warmup_forwards``: an integer >= 0 or "auto" (None), for the 1f1b order; the
    schedule "auto" may pick it too (there it defaults to "auto", elsewhere to the declared
    0)."""
    name = "warmup_forwards"
    key = JOB[f"train.{name}"]
    value = train.raw(name, "auto" if schedule == "auto" else key.default)
    if value == "auto":
        if schedule not in ("1f1b", "auto"):
            train.fail(name, f"auto picks 1f1b's warm-up; schedule {schedule!r} has none")
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        train.fail(name, f'must be an integer >= 0 or "auto", got {value!r}')
    if not key.low <= value <= key.high:
        train.fail(name, f"must be in {key.low}..{key.high}, got {value}")
    if value and schedule not in ("1f1b", "auto"):
        train.fail(
            name,
            f"extra warm-up forwards are for the 1f1b order; schedule {schedule!r} has none",
        )
    return value


def _order(
    train: Table,
    source: str,
    schedule: str,
    warmup: int | None,
    vws: tuple[VWSpec, ...],
    nm: int | None,
) -> tuple[schedule_csv.Order, ...] | None:
    """``train.order``: a CSV file (relative to the job file) or its rows, refused in one
    line where the job cannot run it (:func:`hetpipe.core.schedule_csv.job_order_problem`)."""
    value = train.raw("order", None)
    if value is None:
        return None
    try:
        orders = schedule_csv.order_value(value, os.path.dirname(source) or ".")
    except schedule_csv.ScheduleCsvError as exc:
        train.fail("order", str(exc))
    if schedule in SYNC_KINDS:  # a device-level kind refuses an order (its devices' own)
        problem = schedule_csv.job_order_problem(
            orders,
            kind=schedule,
            warmup=warmup or 0,
            stages=[len(v.devices) for v in vws],
            ms=[v.nm or nm for v in vws],
        )
        if problem is not None:
            train.fail("order", problem)
    return orders


def _lr_schedule(root: Table) -> LrSchedule:
    """``[lr_schedule]``: the factor of ``optimizer.lr`` per step (:mod:`hetpipe.core.lr`)."""
    lt = root.table("lr_schedule", JOB.allowed("lr_schedule"))
    values = {
        f.name: _read(lt, f.name)
        for f in dataclasses.fields(LrSchedule)
        if f.name not in ("args", "function")
    }
    kind = values["kind"]
    if kind not in LR_KINDS and not is_function(kind):
        lt.fail(
            "kind",
            f"unknown schedule kind {kind!r} (one of: {', '.join(LR_KINDS)}, or "
            "'package.module:function')",
        )
    values["args"] = _args(lt)
    if values["kind"] == "step" and values["step_every"] is None:
        lt.fail("step_every", "missing: kind 'step' decays every step_every steps")
    total = values["total_steps"]
    if total is not None and total <= values["warmup_steps"]:
        lt.fail(
            "total_steps",
            f"is {total}, not more than warmup_steps {values['warmup_steps']} (cosine "
            "needs steps after the warm-up)",
        )
    return LrSchedule(**values)


def load_job(path: str | os.PathLike[str]) -> JobSpec:
    """Read and validate a job file; raises JobError (one line) on any problem, a key set
    where it has no effect included."""
    data, source = read_toml(path, JobError)
    return JobSpec.from_dict(data, source=source, strict=True)


_MODULE = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
_SHA256 = re.compile(r"[0-9a-f]{64}")


def _code(root: Table) -> dict[str, str]:
    """``code``: module name -> the sha256 (64 lowercase hex digits) of its source."""
    code = root.raw("code", JOB.default("code"))
    if not isinstance(code, dict):
        root.fail("code", f"expected a table of module = sha256, got {kind(code)}")
    for module, value in code.items():
        if not isinstance(module, str) or not _MODULE.fullmatch(module):
            root.fail("code", f"{module!r} is not a module name")
        if not isinstance(value, str) or not _SHA256.fullmatch(value):
            root.fail(f"code.{module}", "expected a sha256 as 64 lowercase hex digits")
    return dict(code)


MAX_SOURCES_BYTES = 4 << 20  # the user modules a job ships, together


def _sources(root: Table, code: dict[str, str]) -> dict[str, str]:
    """``sources``: module name -> its source text, each matching its ``code`` hash (so what a
    host runs is what the job was checked with), at most :data:`MAX_SOURCES_BYTES` in all."""
    sources = root.raw("sources", JOB.default("sources"))
    if not isinstance(sources, dict):
        root.fail("sources", f"expected a table of module = source text, got {kind(sources)}")
    total = 0
    for module, text in sources.items():
        if not isinstance(module, str) or not _MODULE.fullmatch(module):
            root.fail("sources", f"{module!r} is not a module name")
        if not isinstance(text, str):
            root.fail(f"sources.{module}", f"expected the module's source text, got {kind(text)}")
        data = text.encode()
        total += len(data)
        want = code.get(module)
        if want is None or digest(data) != want:
            root.fail(
                f"sources.{module}",
                "does not match the module's hash in `code` (ship a source with its hash)",
            )
    if total > MAX_SOURCES_BYTES:
        root.fail("sources", f"{total} bytes of source: at most {MAX_SOURCES_BYTES} may be shipped")
    return dict(sources)


def _plain(value: Any) -> Any:
    """Deep copy of free-form args, tuples as lists (what msgpack and TOML both carry)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def _args(t: Table) -> dict:
    """Free-form keyword arguments: any keys, but only values that survive the wire."""
    args = t.raw("args", JOB.default(f"{t.key}.args"))
    if not isinstance(args, dict):
        t.fail("args", f"expected a table of keyword arguments, got {kind(args)}")

    def check(value: Any, key: str) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                if not isinstance(k, str):
                    t.fail(key, f"key {k!r} is not a string")
                check(v, f"{key}.{k}")
        elif isinstance(value, list | tuple):
            for i, v in enumerate(value):
                check(v, f"{key}[{i}]")
        elif value is not None and not isinstance(value, str | int | float | bool):
            t.fail(key, f"unsupported value type {kind(value)} (use strings, numbers, arrays)")

    check(args, "args")
    return _plain(args)


def _optimizer(root: Table) -> OptimizerSpec:
    ot = root.table("optimizer", JOB.allowed("optimizer"))
    name = _read(ot, "name")
    lr, eps = _read(ot, "lr"), _read(ot, "eps")
    momentum = _read(ot, "momentum")
    weight_decay = _read(
        ot, "weight_decay", keys.ADAMW_WEIGHT_DECAY if name == "adamw" else DECLARED
    )
    nesterov = _read(ot, "nesterov")
    if nesterov and momentum == 0:
        ot.fail("nesterov", "needs momentum > 0")
    betas = _read(ot, "betas")
    if len(betas) != 2:
        ot.fail("betas", f"expected 2 numbers, got {len(betas)}")
    return OptimizerSpec(
        name,
        lr,
        momentum,
        weight_decay,
        nesterov,
        (betas[0], betas[1]),
        eps,
        _read(ot, "clip_norm"),
        _read(ot, "merge"),
    )


def _vws(root: Table, several: bool = False) -> tuple[VWSpec, ...]:
    """The ``[[vw]]`` tables; ``several`` (``train.several_stages``): a device may be named
    for several stages of its virtual worker (none of them replicated)."""
    owner: dict[str, str] = {}  # device -> the vw that holds it
    vws = []
    for vt in root.tables("vw", JOB.allowed("vw")):
        groups = _device_groups(vt)
        devices = [g[0] for g in groups]
        seen: list[str] = []
        replicated = {d for g in groups if len(g) > 1 for d in g}
        for i, group in enumerate(groups):
            for device in group:
                if device in seen and not (several and device not in replicated):
                    why = (
                        "a replicated stage's device runs that stage only"
                        if several
                        else "a device runs one stage unless train.several_stages = true"
                    )
                    vt.fail(f"devices[{i}]", f"duplicate device {device!r} ({why})")
                if device in owner:
                    vt.fail(f"devices[{i}]", f"device {device!r} is already in {owner[device]}")
                seen.append(device)
        owner.update(dict.fromkeys(seen, vt.key))
        layers = _read(vt, "layers")
        if layers is not None and len(layers) != len(devices):
            vt.fail("layers", f"{len(layers)} entries for {len(devices)} devices (one each)")
        nm = _read(vt, "nm")
        replicas = tuple(tuple(g[1:]) for g in groups) if any(len(g) > 1 for g in groups) else None
        if replicas is not None and layers is None:
            vt.fail(
                "layers",
                "a split with replicated stages gives its layers (the planner "
                "cuts only plain splits)",
            )
        vws.append(
            VWSpec(tuple(devices), None if layers is None else tuple(layers), nm, replicas=replicas)
        )
    return tuple(vws)


def _defer_refusals(train: Table, schedule: str, weights: str, vws: tuple[VWSpec, ...]) -> None:
    """What ``train.defer_weight_grad`` cannot go with, each refused in one line: the
    synchronous kinds (zb-h1, zb-h2 and zbv split their backwards already), weights other
    than stashed (their backward reruns or rebinds the forward at its own time), and
    replicated stages (their replicas combine each whole backward's gradients)."""
    if schedule != "async":
        train.fail(
            "defer_weight_grad",
            f"needs schedule = async, not {schedule!r} (for a synchronous kind, zb-h1, "
            "zb-h2 and zbv defer weight gradients)",
        )
    if weights != "stash":
        train.fail("defer_weight_grad", f"needs weights = stash, not {weights!r}")
    if any(v.replicas for v in vws):
        train.fail("defer_weight_grad", "replicated stages are not supported")


def _several_stages_refusals(
    train: Table,
    vws: tuple[VWSpec, ...],
    schedule: str,
    on_worker_loss: str,
    activations: str,
) -> None:
    """What a job whose devices run several stages cannot have yet, each refused in one
    line: the planner's choices (it plans one stage a device), re-forming or re-planning
    on a worker's loss (a lost device takes all its stages; the job fails or resumes), a
    split without its layers, and replicated stages beside a repeated device."""
    for v, vw in enumerate(vws):
        if len(set(vw.devices)) < vw.k and vw.replicas:
            train.fail(
                "several_stages",
                f"vw[{v}] repeats a device: its stages are not replicated (not supported yet)",
            )
        if len(set(vw.devices)) < vw.k and vw.layers is None:
            train.fail(
                "several_stages",
                f"vw[{v}] repeats a device: give its layers (the planner cuts a split of "
                "one stage per device)",
            )
    if schedule == "auto" or activations == "auto":
        key = "schedule" if schedule == "auto" else "activations"
        train.fail(key, "auto is the planner's choice, which plans one stage per device")
    if on_worker_loss in ("replan", "reform"):
        train.fail(
            "on_worker_loss",
            f"{on_worker_loss!r} is not supported where a device runs several stages "
            "(use fail, and resume from a checkpoint)",
        )


def _device_schedule_refusals(
    train: Table,
    vws: tuple[VWSpec, ...],
    schedule: str,
    nm: int | None,
    minibatches: int | None,
    ordered: bool,
) -> None:
    """What a device-level schedule (:mod:`hetpipe.core.devschedule`) cannot run, each
    refused in one line: no ``[[vw]]`` split (the planner plans one stage a device), a
    ``train.order`` (each stage's order is its device's), a placement the schedule cannot
    use, and (interleaved) microbatches per iteration, or a last short iteration's, that
    are not a multiple of the virtual worker's devices."""
    from hetpipe.core.devschedule import (
        check_microbatches,
        check_placement,
        last_iteration_problem,
    )

    if not vws:
        train.fail(
            "schedule",
            f"{schedule} runs the job's own [[vw]] split (the planner plans one stage a device)",
        )
    if ordered:
        train.fail("order", f"{schedule} orders each stage by its device's order: leave it out")
    for v, vw in enumerate(vws):
        m = vw.nm or nm
        try:
            devices = check_placement(schedule, vw.devices)
            if m is not None:
                check_microbatches(schedule, devices, m)
        except ScheduleError as exc:
            train.fail("schedule", f"vw[{v}]: {exc}")
        if v == 0 and m is not None and minibatches is not None:
            problem = last_iteration_problem(schedule, devices, minibatches, m)
            if problem is not None:
                train.fail("minibatches", problem)


def _device_groups(vt: Table) -> list[list[str]]:
    """A ``[[vw]]``'s ``devices``, one group per stage: a device name, or an array of names
    (the stage replicated on them, its leader first; :mod:`hetpipe.replicas`)."""
    value = vt.raw("devices")  # JOB["vw.devices"]: required
    if not isinstance(value, list | tuple):
        vt.fail("devices", f"expected an array, got {kind(value)} {value!r}")
    if not value:
        vt.fail("devices", "must list at least one device")
    groups = []
    for i, item in enumerate(value):
        if isinstance(item, str):
            groups.append([item])
            continue
        if (
            not isinstance(item, list | tuple)
            or not item
            or not all(isinstance(d, str) for d in item)
        ):
            vt.fail(
                f"devices[{i}]",
                f"expected a string (a device) or a non-empty array of "
                f"strings (a replicated stage's devices), got {kind(item)} {item!r}",
            )
        groups.append(list(item))
    return groups
