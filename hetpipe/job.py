"""A training job: model, data, optimizer, schedule and (optionally) an explicit VW split.

A job is written as a TOML file by the user and travels to the head as a plain dict, so the
dict form *is* the file's shape: ``load_job`` parses the TOML and hands it to
``JobSpec.from_dict``, and the head validates what it receives with that same code. Every
rejection is one line ``"<file>: <key>: <problem>"``.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from hetpipe._toml import Table, kind, read_toml
from hetpipe.core.memory import ACTIVATION_POLICIES
from hetpipe.core.schedule import KINDS as SCHEDULE_KINDS
from hetpipe.core.schedule import SYNC_KINDS

__all__ = [
    "DataSpec",
    "JobError",
    "JobSpec",
    "ModelSpec",
    "OptimizerSpec",
    "VWSpec",
    "load_job",
]

OPTIMIZERS = ("sgd", "adam", "adamw")
# torch.optim.AdamW's default decay: what a user writing name = "adamw" expects
ADAMW_WEIGHT_DECAY = 1e-2
ON_WORKER_LOSS = ("fail", "replan")
POLICIES = ("auto", "np", "ed", "hd")
# train.weights: how the async kind handles stale weights (see hetpipe.stage, README)
WEIGHTS = ("stash", "latest", "predict")
PREDICT_VARIANTS = ("paper", "consistent")
# train.precision: the compute dtype of forwards and backwards (master weights stay float32)
PRECISIONS = ("fp32", "bf16")
# train.in_flight: what bounds the minibatches an async stage holds between a forward and its
# backward in a plan the planner made (hetpipe.planner.plan.make_plan)
IN_FLIGHT = ("plan", "nm")

# Upper bounds of counts: far beyond any real job, and well inside the wire's 64-bit
# integers even after the runtime multiplies them (minibatch numbers across epochs and VWs).
MAX_MINIBATCH = 1 << 24
MAX_COUNT = 1 << 40  # minibatches (per VW) and fault minibatch numbers
MAX_EPOCHS = 1 << 20
MAX_SMALL = 1 << 16  # nm, staleness, vws, warmup
MAX_SECONDS = 86400.0 * 365


class JobError(ValueError):
    """A bad job; ``str(e)`` is one line ``"<file>: <key>: <problem>"``."""


@dataclass(frozen=True)
class ModelSpec:
    """A builtin model name (``"mlp"``, ``"cnn"``, …) or ``"pkg.module:function"``."""

    name: str
    args: dict = field(default_factory=dict)


@dataclass(frozen=True)
class DataSpec:
    """A dataset name (``"digits"`` or ``"synthetic"``) and its keyword arguments."""

    name: str
    args: dict = field(default_factory=dict)


@dataclass(frozen=True)
class OptimizerSpec:
    """Applied locally by each stage after every backward (its updates are what waves push).

    ``sgd`` (``momentum``, L2 ``weight_decay``, ``nesterov``), ``adam`` (L2 ``weight_decay``)
    or ``adamw`` (decoupled ``weight_decay``, 0.01 when the file gives none), each with the
    arithmetic of its ``torch.optim`` namesake.
    """

    name: str = "sgd"
    lr: float = 0.05
    momentum: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8


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
class VWSpec:
    """One virtual worker: devices in pipeline order, layers per stage, optional own Nm."""

    devices: tuple[str, ...]
    layers: tuple[int, ...] | None = None
    nm: int | None = None
    # per stage, the global layers whose activations are recomputed: set by the planner
    # (never read from a job file); None = as ``train.activations`` pins it
    recompute: tuple[tuple[int, ...], ...] | None = None
    # per stage, the global layers whose activations are swapped to host memory: set by the
    # planner like ``recompute``; None = as ``train.activations`` pins it
    swap: tuple[tuple[int, ...], ...] | None = None
    # per stage, the devices that replicate it beside ``devices[i]`` (its leader); () for a
    # stage on one device. None: no stage is replicated (hetpipe.replicas)
    replicas: tuple[tuple[str, ...], ...] | None = None
    # per stage, the most minibatches it may hold between a forward and its backward (0:
    # the schedule's own maximum): set by the planner under ``train.in_flight = "plan"``
    # (never read from a job file); None = no stage is limited
    in_flight: tuple[int, ...] | None = None

    def group(self, stage: int) -> tuple[str, ...]:
        """The devices of ``stage``: its leader, then its replicas."""
        extra = self.replicas[stage] if self.replicas is not None else ()
        return (self.devices[stage], *extra)

    def all_devices(self) -> tuple[str, ...]:
        """Every device of this virtual worker, replicas included."""
        return tuple(d for s in range(len(self.devices)) for d in self.group(s))


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
    seed: int = 0
    vws: tuple[VWSpec, ...] = ()
    num_vws: int | None = None
    policy: str = "auto"
    eval_every_s: float | None = None  # evaluate the global weights this often while training
    hang_after_s: float = 30.0  # no stage progressed this long: the head diagnoses a hang
    on_worker_loss: str = "fail"  # "replan": go on without a lost worker (see hetpipe.head)
    checkpoint_every: int = 50  # waves of the global clock between checkpoints; 0: none
    faults: tuple[FaultSpec, ...] = ()
    schedule: str = "async"  # hetpipe.core.schedule.KINDS or "auto"; in gpipe/1f1b nm is M
    weights: str = "stash"  # WEIGHTS: what the async kind's forward and backward run on
    predict_variant: str = "paper"  # PREDICT_VARIANTS, with weights = "predict"
    bn_recalibrate: int = 0  # minibatches re-estimating batch-norm statistics before eval
    activations: str = "keep"  # hetpipe.planner.memory.ACTIVATION_POLICIES
    precision: str = "fp32"  # PRECISIONS: "bf16" runs forwards and backwards under autocast
    # waves between the pushes of a virtual worker alone in its job (nothing reads its global
    # weights before a checkpoint or the end); 0: at checkpoints and the end only (every
    # wave with eval_every_s); several virtual workers, and the synchronous kinds, push
    # every wave/iteration whatever it says
    push_every: int = 0
    verify: bool = False  # fingerprint the weights each forward and backward used (stashing)
    # the most devices the planner may group into one replicated stage of a split it makes
    # (async; hetpipe.planner.replicas decides where it pays), and that ``hetpipe plan``
    # proposes beside a given split; 1: no replicas
    max_replicas: int = 1
    # 1f1b: extra warm-up forwards of each stage before its first backward
    # (hetpipe.core.schedule.microbatch_order); None: the planner picks ("auto"; the default with
    # schedule "auto", where the head then fixes the job's schedule and warm-up together)
    warmup: int | None = 0
    # IN_FLIGHT: "plan": a planned async stage holds at most the minibatches its predicted
    # timeline held, so its memory peak is the plan's; "nm": up to the schedule's maximum
    in_flight: str = "plan"

    @property
    def sync(self) -> bool:
        """Whether the schedule is synchronous (an iteration of nm microbatches, one step)."""
        return self.schedule in SYNC_KINDS

    def to_dict(self) -> dict:
        """The job in its file's shape, as plain msgpack-able data (absent optionals omitted)."""
        opt = self.optimizer
        train: dict[str, Any] = {
            "minibatch": self.minibatch,
            "staleness": self.staleness,
            "seed": self.seed,
            "policy": self.policy,
            "schedule": self.schedule,
            "weights": self.weights,
            "predict_variant": self.predict_variant,
            "bn_recalibrate": self.bn_recalibrate,
            "activations": self.activations,
            "precision": self.precision,
            "push_every": self.push_every,
            "verify": self.verify,
            "max_replicas": self.max_replicas,
            "warmup": "auto" if self.warmup is None else self.warmup,
            "in_flight": self.in_flight,
        }
        if self.nm is not None:
            train["nm"] = self.nm
        if self.epochs is not None:
            train["epochs"] = self.epochs
        if self.minibatches is not None:
            train["minibatches"] = self.minibatches
        if self.num_vws is not None:
            train["vws"] = self.num_vws
        if self.eval_every_s is not None:
            train["eval_every_s"] = self.eval_every_s
        train["hang_after_s"] = self.hang_after_s
        if self.on_worker_loss != "fail":
            train["on_worker_loss"] = self.on_worker_loss
        train["checkpoint_every"] = self.checkpoint_every
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
        return {
            "name": self.name,
            "model": {"name": self.model.name, "args": _plain(self.model.args)},
            "data": {"name": self.data.name, "args": _plain(self.data.args)},
            "optimizer": {
                "name": opt.name,
                "lr": opt.lr,
                "momentum": opt.momentum,
                "weight_decay": opt.weight_decay,
                "nesterov": opt.nesterov,
                "betas": list(opt.betas),
                "eps": opt.eps,
            },
            "train": train,
            "vw": vws,
            "fault": [dataclasses.asdict(f) for f in self.faults],
        }

    @classmethod
    def from_dict(cls, d: dict, source: str = "<job>") -> JobSpec:
        """Validate a job dict (a parsed file or one received from the wire)."""
        root = Table(
            d,
            source,
            JobError,
            allowed=("name", "model", "data", "optimizer", "train", "vw", "fault"),
        )
        name = root.text("name")
        mt = root.table("model", ("name", "args"))
        model = ModelSpec(mt.text("name"), _args(mt))
        dt = root.table("data", ("name", "args"))
        data = DataSpec(dt.text("name", "digits"), _args(dt))
        optimizer = _optimizer(root)

        train = root.table(
            "train",
            (
                "minibatch",
                "nm",
                "staleness",
                "seed",
                "epochs",
                "minibatches",
                "vws",
                "policy",
                "eval_every_s",
                "hang_after_s",
                "schedule",
                "weights",
                "predict_variant",
                "bn_recalibrate",
                "on_worker_loss",
                "checkpoint_every",
                "activations",
                "precision",
                "push_every",
                "verify",
                "max_replicas",
                "warmup",
                "in_flight",
            ),
        )
        minibatch = train.at_least("minibatch", 1, high=MAX_MINIBATCH)
        nm = train.at_least("nm", 1, None, high=MAX_SMALL)
        staleness = train.at_least("staleness", 0, 0, high=MAX_SMALL)
        seed = train.at_least("seed", 0, 0)
        epochs = train.at_least("epochs", 1, None, high=MAX_EPOCHS)
        minibatches = train.at_least("minibatches", 1, None, high=MAX_COUNT)
        if epochs is None and minibatches is None:
            train.fail("epochs", "missing: give exactly one of epochs / minibatches")
        if epochs is not None and minibatches is not None:
            train.fail("minibatches", "give exactly one of epochs / minibatches, not both")
        num_vws = train.at_least("vws", 1, None, high=MAX_SMALL)
        eval_every_s = train.positive("eval_every_s", None, low=0.1, high=MAX_SECONDS)
        hang_after_s = train.positive("hang_after_s", 30.0, low=1.0, high=MAX_SECONDS)
        schedule = train.text("schedule", "async")
        if schedule not in (*SCHEDULE_KINDS, "auto"):
            train.fail(
                "schedule",
                f"unknown schedule {schedule!r} (one of: {', '.join(SCHEDULE_KINDS)}, auto)",
            )
        weights = train.text("weights", "stash")
        if weights not in WEIGHTS:
            train.fail("weights", f"unknown mode {weights!r} (one of: {', '.join(WEIGHTS)})")
        if weights != "stash" and schedule in SYNC_KINDS:
            train.fail(
                "weights", f"{weights!r} needs the async schedule (in {schedule} nothing is stale)"
            )
        predict_variant = train.text("predict_variant", "paper")
        if predict_variant not in PREDICT_VARIANTS:
            train.fail(
                "predict_variant",
                f"unknown variant {predict_variant!r} (one of: {', '.join(PREDICT_VARIANTS)})",
            )
        if weights == "predict":
            # hetpipe.optim computes with torch: imported here, reading a job file does not
            from hetpipe.optim import unpredictable

            why = unpredictable(optimizer)
            if why:
                train.fail("weights", f"predict cannot extrapolate {why}")
        bn_recalibrate = train.at_least("bn_recalibrate", 0, 0, high=MAX_COUNT)
        on_worker_loss = train.text("on_worker_loss", "fail")
        if on_worker_loss not in ON_WORKER_LOSS:
            train.fail(
                "on_worker_loss",
                f"unknown value {on_worker_loss!r} (one of: {', '.join(ON_WORKER_LOSS)})",
            )
        checkpoint_every = train.at_least("checkpoint_every", 0, 50, high=MAX_COUNT)
        activations = train.text("activations", "keep")
        if activations not in ACTIVATION_POLICIES:
            train.fail(
                "activations",
                f"unknown policy {activations!r} (one of: {', '.join(ACTIVATION_POLICIES)})",
            )
        precision = train.text("precision", "fp32")
        if precision not in PRECISIONS:
            train.fail(
                "precision", f"unknown precision {precision!r} (one of: {', '.join(PRECISIONS)})"
            )
        push_every = train.at_least("push_every", 0, 0, high=MAX_COUNT)
        max_replicas = train.at_least("max_replicas", 1, 1, high=MAX_SMALL)
        verify = train.flag("verify", False)
        warmup = _warmup(train, schedule)
        in_flight = train.text("in_flight", "plan")
        if in_flight not in IN_FLIGHT:
            train.fail("in_flight", f"unknown bound {in_flight!r} (one of: {', '.join(IN_FLIGHT)})")
        policy = train.text("policy", "auto")
        if policy not in POLICIES:
            train.fail("policy", f"unknown policy {policy!r} (one of: {', '.join(POLICIES)})")

        vws = _vws(root)
        if schedule == "auto" and vws:
            train.fail(
                "schedule",
                "auto needs a job without [[vw]] tables (the planner "
                "picks the schedule with the split)",
            )
        if schedule in SYNC_KINDS and any(v.replicas for v in vws):
            train.fail(
                "schedule",
                f"replicated stages need the async schedule ({schedule} "
                "would exchange gradients twice: within the stage and across virtual "
                "workers)",
            )
        if vws and num_vws is not None and num_vws != len(vws):
            train.fail("vws", f"is {num_vws} but {len(vws)} [[vw]] tables are given")
        return cls(
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
            hang_after_s=hang_after_s,
            schedule=schedule,
            weights=weights,
            predict_variant=predict_variant,
            bn_recalibrate=bn_recalibrate,
            on_worker_loss=on_worker_loss,
            checkpoint_every=checkpoint_every,
            activations=activations,
            precision=precision,
            push_every=push_every,
            verify=verify,
            max_replicas=max_replicas,
            warmup=warmup,
            in_flight=in_flight,
            faults=tuple(
                FaultSpec(
                    ft.at_least("vw", 0, high=MAX_SMALL),
                    ft.at_least("stage", 0, high=MAX_SMALL),
                    ft.at_least("minibatch", 0, high=MAX_COUNT),
                    ft.positive("seconds", high=MAX_SECONDS),
                )
                for ft in root.tables("fault", ("vw", "stage", "minibatch", "seconds"))
            ),
        )


def _warmup(train: Table, schedule: str) -> int | None:
    """``train.warmup``: an integer >= 0 or "auto" (None), for the 1f1b order; the schedule
    "auto" may pick it too (there it defaults to "auto", elsewhere to 0)."""
    value = train.raw("warmup", "auto" if schedule == "auto" else 0)
    if value == "auto":
        if schedule not in ("1f1b", "auto"):
            train.fail("warmup", f"auto picks 1f1b's warm-up; schedule {schedule!r} has none")
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        train.fail("warmup", f'must be an integer >= 0 or "auto", got {value!r}')
    if not 0 <= value <= MAX_SMALL:
        train.fail("warmup", f"must be in 0..{MAX_SMALL}, got {value}")
    if value and schedule not in ("1f1b", "auto"):
        train.fail(
            "warmup",
            f"extra warm-up forwards are for the 1f1b order; schedule {schedule!r} has none",
        )
    return value


def load_job(path: str | os.PathLike[str]) -> JobSpec:
    """Read and validate a job file; raises JobError (one line) on any problem."""
    data, source = read_toml(path, JobError)
    return JobSpec.from_dict(data, source=source)


def _plain(value: Any) -> Any:
    """Deep copy of free-form args, tuples as lists (what msgpack and TOML both carry)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def _args(t: Table) -> dict:
    """Free-form keyword arguments: any keys, but only values that survive the wire."""
    args = t.raw("args", {})
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
    d = OptimizerSpec()
    ot = root.table(
        "optimizer", ("name", "lr", "momentum", "weight_decay", "nesterov", "betas", "eps")
    )
    name = ot.text("name", d.name)
    if name not in OPTIMIZERS:
        ot.fail("name", f"unknown optimizer {name!r} (one of: {', '.join(OPTIMIZERS)})")
    lr, eps = ot.positive("lr", d.lr), ot.positive("eps", d.eps)
    momentum = ot.number("momentum", d.momentum)
    if not 0 <= momentum < 1:
        ot.fail("momentum", f"must be in [0, 1), got {momentum}")
    weight_decay = ot.number(
        "weight_decay", ADAMW_WEIGHT_DECAY if name == "adamw" else d.weight_decay
    )
    if weight_decay < 0:
        ot.fail("weight_decay", f"must be >= 0, got {weight_decay}")
    nesterov = ot.flag("nesterov", d.nesterov)
    if nesterov and momentum == 0:
        ot.fail("nesterov", "needs momentum > 0")
    betas = ot.array("betas", "number", list(d.betas))
    if len(betas) != 2:
        ot.fail("betas", f"expected 2 numbers, got {len(betas)}")
    for i, beta in enumerate(betas):
        if not 0 <= beta < 1:
            ot.fail(f"betas[{i}]", f"must be in [0, 1), got {beta}")
    return OptimizerSpec(name, lr, momentum, weight_decay, nesterov, (betas[0], betas[1]), eps)


def _vws(root: Table) -> tuple[VWSpec, ...]:
    owner: dict[str, str] = {}  # device -> the vw that holds it
    vws = []
    for vt in root.tables("vw", ("devices", "layers", "nm")):
        groups = _device_groups(vt)
        devices = [g[0] for g in groups]
        seen: list[str] = []
        for i, group in enumerate(groups):
            for device in group:
                if device in seen:
                    vt.fail(
                        f"devices[{i}]", f"duplicate device {device!r} (a device runs one stage)"
                    )
                if device in owner:
                    vt.fail(f"devices[{i}]", f"device {device!r} is already in {owner[device]}")
                seen.append(device)
        owner.update(dict.fromkeys(seen, vt.key))
        layers = vt.array("layers", "integer", None)
        if layers is not None:
            if len(layers) != len(devices):
                vt.fail("layers", f"{len(layers)} entries for {len(devices)} devices (one each)")
            for i, n in enumerate(layers):
                if n < 1:
                    vt.fail(f"layers[{i}]", f"must be >= 1, got {n}")
                if n > MAX_SMALL:
                    vt.fail(f"layers[{i}]", f"must be <= {MAX_SMALL}, got {n}")
        nm = vt.at_least("nm", 1, None, high=MAX_SMALL)
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


def _device_groups(vt: Table) -> list[list[str]]:
    """A ``[[vw]]``'s ``devices``, one group per stage: a device name, or an array of names
    (the stage replicated on them, its leader first; :mod:`hetpipe.replicas`)."""
    value = vt.raw("devices")
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
