"""Every key of a job file and of cluster.toml, declared once.

A :class:`Key` says a key's table, name, type, default, range or choices, what it means in
one sentence, and where it has an effect (a :class:`Rule`: a predicate over the job's other
values). The parsers (:mod:`hetpipe.job`, :mod:`hetpipe.config`) take from here which keys a
table accepts and each key's default, bounds and choices; loading a job file refuses a key
set where its rule says it has no effect (:func:`no_effect`); and the references
``docs/jobs.md`` and ``docs/cluster.md`` are rendered from these declarations
(``python -m hetpipe.core.keys --write docs``), so that the docs, the parser and the check
cannot drift apart.

What a parser still writes itself is what no declaration can say: checks across keys
(``lost_after_s`` above ``heartbeat_s``, exactly one of ``epochs`` / ``minibatches``), and
the shapes of a few values (sizes, device groups, ``warmup_forwards``'s integer-or-"auto").

Pure: no torch, asyncio or zmq. One file on purpose: it is the table of every key, read
whole by the parsers, the applicability check and the generated reference.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from hetpipe.core.memory import ACTIVATION_POLICIES
from hetpipe.core.schedule import KINDS, SYNC_KINDS

__all__ = [
    "CLUSTER",
    "JOB",
    "REQUIRED",
    "Key",
    "Rule",
    "Schema",
    "Section",
    "no_effect",
    "render",
    "when",
    "without_split",
]


class _Required:
    """The default of a key that must be given."""

    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED: Final = _Required()

# Upper bounds of job counts: far beyond any real job, and well inside the wire's 64-bit
# integers even after the runtime multiplies them (minibatch numbers across epochs and VWs).
MAX_MINIBATCH: Final = 1 << 24
MAX_COUNT: Final = 1 << 40  # minibatches (per VW) and fault minibatch numbers
MAX_EPOCHS: Final = 1 << 20
MAX_SMALL: Final = 1 << 16  # nm, staleness, vws, warmup_forwards
MAX_SECONDS: Final = 86400.0 * 365

# Cluster bounds: where a library or a daemon stops accepting the value.
MAX_HWM: Final = 1 << 20  # ZeroMQ queues this many messages per peer at most (shards use 16x)
MIN_HEARTBEAT_S: Final = 0.05  # below this, heartbeats alone would keep every daemon busy
MAX_DURATION_S: Final = 86400.0
MIN_LOG_BYTES: Final = "64KiB"
MIN_FRAME_BYTES: Final = "1MiB"  # also the limit on headers, which carry job specs and stats
MAX_RETAIN_MIB: Final = 2047  # mallopt takes an int of bytes (hetpipe.hostmem, kept equal)

# The values of the string keys that name a choice (the parsers and the docs read these).
OPTIMIZERS: Final = ("sgd", "adam", "adamw")
SCHEDULES: Final = (*KINDS, "auto")
WEIGHTS: Final = ("stash", "latest", "predict")
PREDICT_VARIANTS: Final = ("paper", "consistent")
POLICIES: Final = ("auto", "np", "ed", "hd")
ON_WORKER_LOSS: Final = ("fail", "replan", "reform")
ACTIVATIONS: Final = ACTIVATION_POLICIES  # the memory model names the policies it prices
PRECISIONS: Final = ("fp32", "bf16", "fp16")
MERGES: Final = ("sum", "mean")
IN_FLIGHT: Final = ("plan", "nm")
# where the shards keep each layer's state (hetpipe.planner.placement prices both)
PLACEMENTS: Final = ("local", "default")
FAULT_KINDS: Final = ("stall", "slow")
# the keys each fault kind takes besides ``kind`` (hetpipe.job reads them)
FAULT_KEYS: Final = {
    "stall": ("vw", "stage", "minibatch", "seconds"),
    "slow": ("device", "factor", "at_minibatch"),
}
MAX_SLOW_FACTOR: Final = 1000.0

ADAMW_WEIGHT_DECAY: Final = 1e-2  # torch.optim.AdamW's default: what name = "adamw" expects


@dataclass(frozen=True)
class Rule:
    """Where a key has an effect: ``holds(values)`` over the other keys' values.

    ``values`` maps key paths (``"train.schedule"``) to their resolved values, and ``"vw"``
    to the number of ``[[vw]]`` tables. ``where`` says it for the docs; ``why(values)``
    says why not, for the one-line refusal ``"<key>: has no effect with ..."``.
    """

    holds: Callable[[Mapping[str, Any]], bool]
    where: str
    why: Callable[[Mapping[str, Any]], str]


def _quoted(values: Iterable[Any]) -> str:
    return " or ".join(f'"{v}"' for v in values)


def when(path: str, values: tuple[str, ...], note: str) -> Rule:
    """The key has an effect only while the key ``path`` holds one of ``values``; ``note``
    says why it has none otherwise (the refusal reads ``has no effect with <name> 'x'
    (<note>)``)."""
    label = path.rpartition(".")[2]
    if label == "name":  # optimizer.name reads "with optimizer 'adam'"
        label = path.partition(".")[0]
    return Rule(
        holds=lambda v: v[path] in values,
        where=f"{path} is {_quoted(values)}",
        why=lambda v: f"has no effect with {label} {v[path]!r} ({note})",
    )


def without_split(what: str) -> Rule:
    """The key has an effect only where the planner forms the virtual workers: a job
    without ``[[vw]]`` tables, or the re-plan of ``on_worker_loss = "replan"`` (which drops
    the job's split and plans on the remaining devices)."""
    return Rule(
        holds=lambda v: v["vw"] == 0 or v["train.on_worker_loss"] == "replan",
        where='no [[vw]] tables, or train.on_worker_loss is "replan"',
        why=lambda v: (
            f"has no effect with [[vw]] tables (the job gives its own split; {what} only "
            'without one, or on a re-plan under on_worker_loss = "replan")'
        ),
    )


ASYNC = when("train.schedule", ("async", "auto"), "synchronous")


@dataclass(frozen=True)
class Key:
    """One key of one table.

    ``default``: :data:`REQUIRED`, or the value an absent key takes (``None``: unset, the
    meaning says what that does). Bounds are inclusive (``low``, ``high``) or exclusive
    (``above``, ``below``) and apply to a number or to each item of an array of numbers;
    ``choices`` are the values a string may take, refused as ``unknown <noun> 'x'``.
    ``default_doc`` is the default as the docs say it, where it depends on other keys.
    """

    name: str
    type: str
    meaning: str
    default: Any = REQUIRED
    low: float | str | None = None  # a size key's bounds are sizes ("1MiB")
    high: float | None = None
    above: float | None = None
    below: float | None = None
    choices: tuple[str, ...] = ()
    noun: str = "value"
    applies: Rule | None = None
    default_doc: str = ""
    section: str = ""  # filled by its Section

    @property
    def path(self) -> str:
        """``"train.staleness"``; a key of an array of tables reads ``"vw.nm"``."""
        return f"{self.section}.{self.name}" if self.section else self.name

    @property
    def required(self) -> bool:
        return self.default is REQUIRED


@dataclass(frozen=True)
class Section:
    """One table (``array``: an array of tables, ``[[path]]``) and its keys."""

    path: str
    meaning: str
    keys: tuple[Key, ...]
    array: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "keys", tuple(_with_section(k, self.path) for k in self.keys))

    @property
    def title(self) -> str:
        if not self.path:
            return "top level"
        return f"[[{self.path}]]" if self.array else f"[{self.path}]"


def _with_section(key: Key, section: str) -> Key:
    return dataclasses.replace(key, section=section)


@dataclass(frozen=True)
class Schema:
    """The sections of one file, in the order the docs list them."""

    title: str
    intro: str
    sections: tuple[Section, ...]
    _by_path: dict[str, Key] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        for key in self.declared():
            assert key.path not in self._by_path, key.path
            self._by_path[key.path] = key

    def declared(self) -> Iterator[Key]:
        """Every key, section by section."""
        for section in self.sections:
            yield from section.keys

    def __getitem__(self, path: str) -> Key:
        return self._by_path[path]

    def section(self, path: str) -> Section:
        for s in self.sections:
            if s.path == path:
                return s
        raise KeyError(path)

    def allowed(self, path: str) -> tuple[str, ...]:
        """What the table ``path`` accepts: its keys, then the tables nested in it."""
        prefix = f"{path}." if path else ""
        nested = [
            s.path[len(prefix) :]
            for s in self.sections
            if s.path and s.path.startswith(prefix) and "." not in s.path[len(prefix) :]
        ]
        return (*(k.name for k in self.section(path).keys), *nested)

    def default(self, path: str) -> Any:
        """The declared default of a key (a list becomes a tuple, as the specs keep it)."""
        value = self[path].default
        return tuple(value) if isinstance(value, list) else value


def no_effect(schema: Schema, values: Mapping[str, Any], given: Iterable[str]) -> str | None:
    """The refusal of the first key of ``given`` (key paths) that has no effect here, as
    ``"<key>: has no effect with ..."``; None when each of them has one."""
    for path in given:
        rule = schema[path].applies
        if rule is not None and not rule.holds(values):
            return f"{path}: {rule.why(values)}"
    return None


# -- the job file ------------------------------------------------------------------------------

_FRACTION = {"low": 0.0, "below": 1.0}

JOB: Final = Schema(
    "Job file keys",
    "A job is a TOML file (`hetpipe submit job.toml`) or the same tables as a dict. Unknown "
    "keys are refused, and so is a key set where it has no effect (the column *has an effect "
    "when* says where it has one). Every refusal is one line `<file>: <key>: <problem>`.",
    (
        Section(
            "",
            "The job's own keys; its tables follow.",
            (
                Key("name", "string", "The job's name; its id is `<name>-<n>`."),
                Key(
                    "code",
                    "table",
                    "The sha256 of each user module's source the job names, by module name "
                    '(`{ mymodel = "9f86..." }`); `hetpipe submit` fills it in, and the head '
                    "and each worker refuse the job where their copy differs. Empty: not "
                    "compared.",
                    default={},
                ),
                Key(
                    "sources",
                    "table",
                    "The source of each user module the job names, by module name; `hetpipe "
                    "submit` fills it in where the cluster sets `[security] ship_code`, and the "
                    "head and each worker run these bytes (each must match its `code` hash) "
                    "instead of a copy of their own. Empty: each host imports its own copy.",
                    default={},
                ),
            ),
        ),
        Section(
            "model",
            "The model to train: a sequence of blocks the planner cuts into stages.",
            (
                Key(
                    "name",
                    "string",
                    'A builtin model ("mlp", "cnn", ...) or "pkg.module:function" returning an '
                    "`nn.Sequential` (cut between its elements) or any `nn.Module` (captured "
                    "into blocks, see docs/own-models.md).",
                ),
                Key("args", "table", "Keyword arguments of the model's builder.", default={}),
                Key(
                    "split_points",
                    "array of strings",
                    'Submodules of a captured model that each start a block (`["layers.4"]`). '
                    "Empty: a block per natural unit (each top-level child, each element of a "
                    "`ModuleList` or `Sequential`).",
                    default=[],
                ),
                Key(
                    "loss",
                    "string",
                    '"pkg.module:function" taking (outputs, labels) and returning a scalar. '
                    "Unset: the loss the model returns (a scalar output, a `loss` attribute or "
                    "key), else the builder's `loss` attribute, else cross entropy.",
                    default=None,
                ),
            ),
        ),
        Section(
            "data",
            "The data set; each virtual worker reads its own shard of it.",
            (
                Key(
                    "name",
                    "string",
                    'A builtin ("digits", "synthetic", "tensors"), an entry point of the '
                    '`hetpipe.data` group, or "pkg.module:function" returning a '
                    "`torch.utils.data` Dataset or IterableDataset, a (train, val) pair or "
                    '`{"train": ..., "val": ...}`.',
                    "digits",
                ),
                Key("args", "table", "Keyword arguments of the data set.", default={}),
                Key(
                    "collate",
                    "string",
                    '"pkg.module:function" batching a list of samples; unset: torch\'s '
                    "`default_collate`.",
                    None,
                ),
                Key(
                    "workers",
                    "integer",
                    "Loader worker processes of each first stage's `DataLoader`; 0 reads in "
                    "the stage's own process.",
                    0,
                    low=0,
                    high=MAX_SMALL,
                ),
                Key(
                    "prefetch",
                    "integer",
                    "Minibatches each loader worker prepares ahead.",
                    2,
                    low=1,
                    high=MAX_SMALL,
                ),
            ),
        ),
        Section(
            "optimizer",
            "Applied by each stage after every backward, with the arithmetic of its "
            "`torch.optim` namesake; its updates are what a wave pushes.",
            (
                Key(
                    "name",
                    "string",
                    "sgd (momentum, L2 decay), adam (L2 decay) or adamw (decoupled decay).",
                    "sgd",
                    choices=OPTIMIZERS,
                    noun="optimizer",
                ),
                Key("lr", "float", "The learning rate.", 0.05, above=0.0),
                Key(
                    "momentum",
                    "float",
                    "SGD's momentum.",
                    0.0,
                    **_FRACTION,
                    applies=when("optimizer.name", ("sgd",), "momentum is sgd's"),
                ),
                Key(
                    "weight_decay",
                    "float",
                    "Weight decay: L2 for sgd and adam, decoupled for adamw.",
                    0.0,
                    low=0.0,
                    default_doc="0 (adamw: 0.01)",
                ),
                Key(
                    "nesterov",
                    "boolean",
                    "Nesterov momentum (needs momentum > 0).",
                    False,
                    applies=when("optimizer.name", ("sgd",), "Nesterov momentum is sgd's"),
                ),
                Key(
                    "betas",
                    "array of 2 floats",
                    "Adam's decay rates of its two moment estimates.",
                    [0.9, 0.999],
                    **_FRACTION,
                    applies=when("optimizer.name", ("adam", "adamw"), "betas are adam's"),
                ),
                Key(
                    "eps",
                    "float",
                    "Adam's term added to the denominator.",
                    1e-8,
                    above=0.0,
                    applies=when("optimizer.name", ("adam", "adamw"), "eps is adam's"),
                ),
                Key(
                    "clip_norm",
                    "float",
                    "Clip the gradients to this L2 norm before each step: under gpipe and 1f1b "
                    "the global norm over every stage of the iteration (as `clip_grad_norm_` "
                    "on the plain model), under async each stage's own norm of its "
                    "minibatch. Unset: no clipping.",
                    None,
                    above=0.0,
                ),
                Key(
                    "merge",
                    "string",
                    "How the shards combine the virtual workers' updates: sum (each VW's "
                    "update added, HetPipe's rule) or mean (each divided by the number of "
                    "VWs). gpipe and 1f1b always average the VWs' gradients.",
                    "sum",
                    choices=MERGES,
                    noun="merge",
                    applies=ASYNC,
                ),
            ),
        ),
        Section(
            "lr_schedule",
            "The learning rate's factor per step, on one clock per virtual worker: the "
            "iteration under gpipe and 1f1b, the virtual worker's minibatch under async.",
            (
                Key(
                    "kind",
                    "string",
                    "constant, cosine (to min_factor at total_steps), step (times gamma "
                    'every step_every steps) or "package.module:function" (called as '
                    "function(t, **args) with t the step after the warm-up, returning the "
                    "factor); each after the warm-up.",
                    "constant",
                ),
                Key(
                    "warmup_steps",
                    "integer",
                    "Steps of linear warm-up from warmup_start x lr to lr (torch's LinearLR).",
                    0,
                    low=0,
                    high=MAX_COUNT,
                ),
                Key(
                    "warmup_start",
                    "float",
                    "The factor the warm-up starts from.",
                    0.0,
                    low=0.0,
                    high=1.0,
                    applies=Rule(
                        holds=lambda v: v["lr_schedule.warmup_steps"] > 0,
                        where="lr_schedule.warmup_steps > 0",
                        why=lambda v: "has no effect with warmup_steps 0 (no warm-up)",
                    ),
                ),
                Key(
                    "total_steps",
                    "integer",
                    "Steps the cosine schedule spans, warm-up included. Unset: the job's "
                    "length (iterations, or minibatches per virtual worker under async).",
                    None,
                    low=1,
                    high=MAX_COUNT,
                    applies=when("lr_schedule.kind", ("cosine",), "only cosine has an end"),
                ),
                Key(
                    "min_factor",
                    "float",
                    "The factor cosine ends at (torch's eta_min / lr).",
                    0.0,
                    low=0.0,
                    high=1.0,
                    applies=when("lr_schedule.kind", ("cosine",), "cosine's floor"),
                ),
                Key(
                    "step_every",
                    "integer",
                    "Steps between two decays of kind step (required there).",
                    None,
                    low=1,
                    high=MAX_COUNT,
                    applies=when("lr_schedule.kind", ("step",), "step's period"),
                ),
                Key(
                    "gamma",
                    "float",
                    "The factor each decay of kind step multiplies by.",
                    0.1,
                    above=0.0,
                    high=1.0,
                    applies=when("lr_schedule.kind", ("step",), "step's decay"),
                ),
                Key(
                    "args",
                    "table",
                    "Keyword arguments of a schedule function.",
                    default={},
                    applies=Rule(
                        holds=lambda v: ":" in str(v["lr_schedule.kind"]),
                        where='lr_schedule.kind is "package.module:function"',
                        why=lambda v: (
                            f"has no effect with schedule kind {v['lr_schedule.kind']!r} (only "
                            "a function takes arguments)"
                        ),
                    ),
                ),
            ),
        ),
        Section(
            "loss_scale",
            'Dynamic loss scaling of train.precision = "fp16", as `torch.amp.GradScaler`: a '
            "step whose gradients hold an inf or NaN on any stage is applied on none.",
            (
                Key(
                    "init",
                    "float",
                    "The initial scale.",
                    65536.0,
                    above=0.0,
                    applies=when("train.precision", ("fp16",), "only fp16 scales the loss"),
                ),
                Key(
                    "growth_factor",
                    "float",
                    "The scale's factor after growth_interval applied steps in a row.",
                    2.0,
                    above=1.0,
                    applies=when("train.precision", ("fp16",), "only fp16 scales the loss"),
                ),
                Key(
                    "backoff_factor",
                    "float",
                    "The scale's factor after a skipped step.",
                    0.5,
                    low=0.01,
                    below=1.0,
                    applies=when("train.precision", ("fp16",), "only fp16 scales the loss"),
                ),
                Key(
                    "growth_interval",
                    "integer",
                    "Applied steps in a row before the scale grows.",
                    2000,
                    low=1,
                    high=MAX_COUNT,
                    applies=when("train.precision", ("fp16",), "only fp16 scales the loss"),
                ),
            ),
        ),
        Section(
            "train",
            "How to train: sizes, length, the schedule, staleness and what the planner may do.",
            (
                Key(
                    "minibatch",
                    "integer",
                    "Samples per minibatch (a microbatch under gpipe and 1f1b).",
                    low=1,
                    high=MAX_MINIBATCH,
                ),
                Key(
                    "nm",
                    "integer",
                    "Minibatches in flight per virtual worker and per wave (Nm); under gpipe "
                    "and 1f1b the microbatches per iteration (M). Unset: the planner picks.",
                    None,
                    low=1,
                    high=MAX_SMALL,
                ),
                Key(
                    "staleness",
                    "integer",
                    "WSP's bound D: how many waves a virtual worker may run ahead of the "
                    "slowest one.",
                    0,
                    low=0,
                    high=MAX_SMALL,
                    applies=ASYNC,
                ),
                Key("seed", "integer", "Seeds the initial weights and the data order.", 0, low=0),
                Key(
                    "epochs",
                    "integer",
                    "Passes over the data (give exactly one of epochs / minibatches).",
                    None,
                    low=1,
                    high=MAX_EPOCHS,
                ),
                Key(
                    "minibatches",
                    "integer",
                    "Minibatches per virtual worker (give exactly one of epochs / minibatches).",
                    None,
                    low=1,
                    high=MAX_COUNT,
                ),
                Key(
                    "vws",
                    "integer",
                    "Number of virtual workers (with [[vw]] tables: their number). Unset: "
                    "the planner picks.",
                    None,
                    low=1,
                    high=MAX_SMALL,
                ),
                Key(
                    "policy",
                    "string",
                    "How the planner forms virtual workers: HetPipe's NP (one per node), ED "
                    "(equal mix of device types), HD (hybrid), or auto (the best predicted).",
                    "auto",
                    choices=POLICIES,
                    noun="policy",
                    applies=without_split("the planner's policy applies"),
                ),
                Key(
                    "eval_every_s",
                    "float",
                    "Evaluate the global weights this often while training; unset: never.",
                    None,
                    above=0.0,
                    low=0.1,
                    high=MAX_SECONDS,
                ),
                Key(
                    "hang_after_s",
                    "float",
                    "No stage progressed this long: the head diagnoses a hang.",
                    30.0,
                    above=0.0,
                    low=1.0,
                    high=MAX_SECONDS,
                ),
                Key(
                    "schedule",
                    "string",
                    "async (HetPipe: Nm in flight, WSP across virtual workers), gpipe, 1f1b, "
                    "zb-h1 or zb-h2 (synchronous: exactly minibatch SGD; zb-* split each "
                    "backward to fill bubbles), interleaved-1f1b or zbv (synchronous, a "
                    "device runs several stages in one device order; needs several_stages "
                    "and the split's placement), or auto (the planner picks).",
                    "async",
                    choices=SCHEDULES,
                    noun="schedule",
                ),
                Key(
                    "weights",
                    "string",
                    "What an async stage's forward and backward run on: the stashed version, "
                    "the latest, or weights predicted along the momentum (SpecTrain).",
                    "stash",
                    choices=WEIGHTS,
                    noun="mode",
                    applies=ASYNC,
                ),
                Key(
                    "predict_variant",
                    "string",
                    'How weights = "predict" extrapolates: paper (forward and backward each '
                    "predict) or consistent (the backward reuses the forward's prediction).",
                    "paper",
                    choices=PREDICT_VARIANTS,
                    noun="variant",
                    applies=when(
                        "train.weights", ("predict",), 'it only tunes weights = "predict"'
                    ),
                ),
                Key(
                    "bn_recalibrate",
                    "integer",
                    "Minibatches re-estimating batch-norm statistics before an evaluation "
                    "or the export.",
                    0,
                    low=0,
                    high=MAX_COUNT,
                ),
                Key(
                    "several_stages",
                    "boolean",
                    "Let a device named several times in one [[vw]]'s devices run each of "
                    "those stages, all in its one worker (docs/gpus.md); unset, a repeated "
                    "device is refused. Under schedule auto without [[vw]]: the planner may "
                    "run interleaved-1f1b or zbv, two stages a device, where predicted "
                    "faster (docs/schedules.md).",
                    False,
                ),
                Key(
                    "on_worker_loss",
                    "string",
                    "When a worker is lost: fail the job, re-plan it on the remaining devices "
                    "from its last checkpoint (replan), or re-form only the lost worker's "
                    "virtual worker on its surviving devices from the shards' weights while "
                    "the others train on (reform; a synchronous job re-plans).",
                    "fail",
                    choices=ON_WORKER_LOSS,
                ),
                Key(
                    "shard_wait_s",
                    "float",
                    "When a parameter-server shard is lost: wait this long for a shard of its "
                    "index to register again (restarted by its supervisor), then resume the "
                    "job from its last checkpoint; 0: fail the job at once.",
                    300.0,
                    low=0.0,
                    high=MAX_SECONDS,
                ),
                Key(
                    "checkpoint_every",
                    "integer",
                    "Waves (or iterations) of the global clock between checkpoints; 0: none.",
                    50,
                    low=0,
                    high=MAX_COUNT,
                ),
                Key(
                    "activations",
                    "string",
                    "What a stage does with the activations of in-flight minibatches: keep, "
                    "recompute in the backward, swap to host memory, or auto (the planner "
                    "picks per layer).",
                    "keep",
                    choices=ACTIVATIONS,
                    noun="policy",
                ),
                Key(
                    "precision",
                    "string",
                    "Compute dtype of forwards and backwards (bf16, fp16: under autocast; "
                    "fp16 with dynamic loss scaling, [loss_scale]); master weights stay "
                    "float32.",
                    "fp32",
                    choices=PRECISIONS,
                    noun="precision",
                ),
                Key(
                    "push_every",
                    "integer",
                    "Waves between the pushes of a virtual worker alone in its job; 0: at "
                    "checkpoints and the end (several virtual workers and the synchronous "
                    "kinds push every wave or iteration).",
                    0,
                    low=0,
                    high=MAX_COUNT,
                ),
                Key(
                    "verify",
                    "boolean",
                    "Fingerprint the weights each forward and backward used (checks stashing).",
                    False,
                ),
                Key(
                    "defer_weight_grad",
                    "boolean",
                    "Async schedule: split each backward, send its input gradient upstream "
                    "at once and run its weight gradient and local step when the stage has "
                    "nothing else ready (fills bubbles of deep pipelines held at a low nm; "
                    "zb-h1, zb-h2 and zbv do this for the synchronous kinds). Needs weights "
                    "= stash and no replicated stage.",
                    False,
                ),
                Key(
                    "max_nm",
                    "integer",
                    "The most minibatches in flight the planner may give a virtual worker "
                    "(a cap on Nm, and so on how stale its weights get). Unset: the planner's "
                    "own limit, with deep pipelines weighed by its staleness rule.",
                    None,
                    low=1,
                    high=MAX_SMALL,
                    applies=ASYNC,
                ),
                Key(
                    "max_replicas",
                    "integer",
                    "The most devices the planner may group into one replicated stage; 1: "
                    "no replicas.",
                    1,
                    low=1,
                    high=MAX_SMALL,
                ),
                Key(
                    "warmup_forwards",
                    'integer or "auto"',
                    "Extra pipeline warm-up forwards of each 1f1b stage before its first "
                    "backward (not a learning-rate warm-up: that is "
                    "lr_schedule.warmup_steps); auto: the planner picks.",
                    0,
                    low=0,
                    high=MAX_SMALL,
                    default_doc='0 ("auto" under schedule "auto")',
                    applies=when("train.schedule", ("1f1b", "auto"), "warm-up forwards are 1f1b's"),
                ),
                Key(
                    "order",
                    "string or array of arrays of strings",
                    "Each stage's order of an iteration's forwards and backwards, in "
                    "`torch.distributed.pipelining`'s CSV action format: the file's path "
                    "(relative to the job file) or its rows inline; checked by a dry run "
                    "before the job starts (docs/schedules.md). Unset: the schedule's own order.",
                    None,
                    applies=when("train.schedule", SYNC_KINDS, "an order is a synchronous one's"),
                ),
                Key(
                    "eval_every",
                    'integer or string "<seconds>s"',
                    "Run the validation set this often while training: every N waves "
                    '(iterations under gpipe and 1f1b) of the global clock, or "30s" every '
                    "30 seconds; 0: only at the end.",
                    0,
                    low=0,
                    high=MAX_COUNT,
                ),
                Key(
                    "metrics",
                    "array of strings",
                    "What each evaluation reports beside the validation loss: accuracy, "
                    'perplexity, or a function of the user\'s "package.module:function" '
                    "taking (outputs, target) and returning a number or a mapping of them.",
                    ["accuracy"],
                ),
                Key(
                    "keep_best",
                    "string",
                    'Export the weights of the best evaluation as model_best.pt: "val_loss", '
                    'a metric of train.metrics, or "-name" / "+name" to say lower / higher is '
                    "better (needed for a function's metric); unset: no best model.",
                    None,
                ),
                Key(
                    "stop_after_no_gain",
                    "integer",
                    "End the job early after this many evaluations in a row that do not "
                    "improve train.keep_best's metric (val_loss where unset); 0: never.",
                    0,
                    low=0,
                    high=MAX_COUNT,
                ),
                Key(
                    "in_flight",
                    "string",
                    "What bounds the minibatches a planned async stage holds: plan (the "
                    "count its predicted timeline held, so its memory peak is the plan's) or "
                    "nm (the schedule's maximum).",
                    "plan",
                    choices=IN_FLIGHT,
                    noun="bound",
                    applies=without_split("the planner's bound applies"),
                ),
                Key(
                    "placement",
                    "string",
                    "Where the parameter-server shards keep each layer's state: local (a "
                    "shard on the host of the stage that runs the layer, so pushes and pulls "
                    "cross no link where a host has a shard) or default (layer j on shard "
                    "j mod S, round-robin wherever its stage runs, as the HetPipe paper's "
                    "default placement). The plan's prediction prices the one chosen.",
                    "local",
                    choices=PLACEMENTS,
                    noun="placement",
                ),
            ),
        ),
        Section(
            "replan",
            "Online re-planning (hetpipe.head.drift, hetpipe.planner.online): the head compares "
            "each stage's measured compute time per minibatch with the plan's prediction, and "
            "where a virtual worker's stage drifts from it, re-splits that virtual worker's "
            "layers over its devices with the drifted device's profile scaled by what it "
            "measured. Each decision, carried out or refused, is logged and recorded "
            "(metrics.jsonl, stages.json, the trace, `hetpipe status`). Watching is safe "
            "everywhere (it reads telemetry and prices plans on the head), so it is on by "
            "default; it watches only jobs whose plan was priced (a split the planner could "
            "not predict has nothing to compare with). A decision is carried out by a live "
            "layer migration at the virtual worker's next free wave (iteration) boundary, "
            "its Nm kept; one the migration cannot carry out is recorded as refused, with "
            "the reason.",
            (
                Key("enabled", "boolean", "Watch for drift and decide re-plans.", True),
                Key(
                    "threshold",
                    "float",
                    "A stage drifts when its measured / predicted time, over the window, is "
                    "this many times what it was once settled (or that many times less).",
                    1.5,
                    above=1.0,
                    high=MAX_SLOW_FACTOR,
                ),
                Key(
                    "window",
                    "integer",
                    "Minibatches each stage's time is measured over; the first window after "
                    "the warm-up (Nm and this window's minibatches) settles each stage's "
                    "ratio, so that warm-up never counts as drift.",
                    16,
                    low=1,
                    high=MAX_SMALL,
                ),
                Key(
                    "window_s",
                    "float",
                    "Seconds a window spans at least: a burst of the host's load shorter "
                    "than two windows is no drift.",
                    2.0,
                    low=0.0,
                    high=MAX_SECONDS,
                ),
                Key(
                    "min_gain",
                    "float",
                    "The least predicted speed-up (re-planned / static throughput) a re-plan "
                    "must promise to be carried out.",
                    1.1,
                    low=1.0,
                    high=MAX_SLOW_FACTOR,
                ),
                Key(
                    "migrate_at",
                    "integer",
                    "A live layer migration before this minibatch of virtual worker "
                    "migrate_vw, to the split migrate_to (a drill of what a re-plan does; a "
                    "multiple of its Nm, M under gpipe and 1f1b); 0: none.",
                    0,
                    low=0,
                    high=MAX_COUNT,
                ),
                Key(
                    "migrate_to",
                    "array of integers",
                    "The split migrate_at carries out: layers per stage, as many stages as the "
                    "virtual worker has, summing to the model's. Unset: none.",
                    None,
                    low=1,
                    high=MAX_SMALL,
                ),
                Key(
                    "migrate_vw",
                    "integer",
                    "The virtual worker migrate_at moves layers in.",
                    0,
                    low=0,
                    high=MAX_SMALL,
                ),
            ),
        ),
        Section(
            "vw",
            "An explicit split: one table per virtual worker (without any, the planner "
            "forms them).",
            (
                Key(
                    "devices",
                    "array of strings or arrays",
                    "The devices in pipeline order, one per stage; an array of names "
                    "replicates that stage on them (its leader first).",
                ),
                Key(
                    "layers",
                    "array of integers",
                    "Layers per stage, summing to the model's. Unset: the planner cuts.",
                    None,
                    low=1,
                    high=MAX_SMALL,
                ),
                Key(
                    "nm",
                    "integer",
                    "This virtual worker's own Nm (M under gpipe and 1f1b). Unset: train.nm.",
                    None,
                    low=1,
                    high=MAX_SMALL,
                ),
            ),
            array=True,
        ),
        Section(
            "fault",
            'Deterministic fault injection for tests and drills. `kind = "stall"` stalls a '
            "stage's compute before the forward of a minibatch (`vw`, `stage`, `minibatch`, "
            '`seconds`); `kind = "slow"` makes a device `factor` times slower from a minibatch '
            "on (`device`, `factor`, `at_minibatch`): an emulated device's padding stretches, a "
            "real one sleeps the extra time after each forward and backward.",
            (
                Key(
                    "kind",
                    "string",
                    "What goes wrong: a stalled stage or a slowed device.",
                    "stall",
                    choices=FAULT_KINDS,
                    noun="fault kind",
                ),
                Key("vw", "integer", "stall: the virtual worker.", None, low=0, high=MAX_SMALL),
                Key("stage", "integer", "stall: the stage in it.", None, low=0, high=MAX_SMALL),
                Key(
                    "minibatch",
                    "integer",
                    "stall: the minibatch to stall before.",
                    None,
                    low=0,
                    high=MAX_COUNT,
                ),
                Key(
                    "seconds",
                    "float",
                    "stall: how long to stall.",
                    None,
                    above=0.0,
                    high=MAX_SECONDS,
                ),
                Key("device", "string", "slow: the device (its name in cluster.toml).", None),
                Key(
                    "factor",
                    "float",
                    "slow: how many times longer each forward and backward takes.",
                    None,
                    above=1.0,
                    high=MAX_SLOW_FACTOR,
                ),
                Key(
                    "at_minibatch",
                    "integer",
                    "slow: the first minibatch (of each virtual worker) it runs slowed.",
                    None,
                    low=0,
                    high=MAX_COUNT,
                ),
            ),
            array=True,
        ),
    ),
)


# -- cluster.toml --------------------------------------------------------------------------


CLUSTER: Final = Schema(
    "Cluster file keys",
    "cluster.toml names the parameter-server shards, the network, the nodes and their "
    "devices (`hetpipe up` starts the daemons of this host). Unknown keys are refused; every "
    "refusal is one line `<file>: <key>: <problem>`. A size is a number of bytes or a text "
    'such as "512MiB" or "2GB".',
    (
        Section("", "The file's tables.", ()),
        Section(
            "ps",
            "The parameter-server shards.",
            (
                Key(
                    "shards",
                    "array of strings",
                    'Shard addresses "host:port" (port 0: any free one); shard 0 is also the head.',
                ),
            ),
        ),
        Section(
            "network",
            "Bandwidths the planner prices boundary transfers with.",
            (
                Key("intra_node_gbps", "float", "Between devices of one node.", 100.0, above=0.0),
                Key("inter_node_gbps", "float", "Between nodes.", 10.0, above=0.0),
            ),
        ),
        Section(
            "network.link",
            "A bandwidth between two devices that overrides the above (either direction).",
            (
                Key("a", "string", "One device."),
                Key("b", "string", "The other device."),
                Key("gbps", "float", "The link's bandwidth.", above=0.0),
            ),
            array=True,
        ),
        Section(
            "node",
            "A host and its devices.",
            (
                Key("name", "string", "The node's name."),
                Key("host", "string", "Its host name or IP address (no port)."),
            ),
            array=True,
        ),
        Section(
            "node.device",
            "A GPU, or a CPU-emulated device; one hetpipe-worker runs each.",
            (
                Key("name", "string", "The device's name, unique in the cluster."),
                Key("device", "string", 'Where it computes: "cpu" (emulated) or "cuda:N".'),
                Key("type", "string", "Its device type: profiles are kept per type."),
                Key(
                    "memory",
                    "size",
                    "The memory cap the planner and the runtime respect.",
                    above=0,
                ),
                Key(
                    "speed",
                    "float",
                    "Relative speed: an emulated device pads its compute to take (measured "
                    "time)/speed; the planner weighs devices by it.",
                    1.0,
                    above=0.0,
                    low=0.001,
                ),
                Key(
                    "port",
                    "integer",
                    "The worker's port; 0: any free one.",
                    0,
                    low=0,
                    high=65535,
                ),
                Key(
                    "host_gbps",
                    "float",
                    "Host <-> device copy bandwidth (swapped activations; charged on an "
                    "emulated device). The default is PCIe 3.0 x16 as pinned copies reach it.",
                    96.0,
                    above=0.0,
                ),
            ),
            array=True,
        ),
        Section(
            "runtime",
            "Daemon timings and limits; the defaults suit one host.",
            (
                Key(
                    "heartbeat_s",
                    "float",
                    "Seconds between a daemon's heartbeats.",
                    1.0,
                    above=0.0,
                    low=MIN_HEARTBEAT_S,
                    high=MAX_DURATION_S,
                ),
                Key(
                    "lost_after_s",
                    "float",
                    "Silence after which a daemon counts as lost; above heartbeat_s.",
                    5.0,
                    above=0.0,
                    high=MAX_DURATION_S,
                ),
                Key(
                    "max_frame_bytes",
                    "size",
                    "The largest message frame a daemon accepts (headers included).",
                    "1GiB",
                    low=MIN_FRAME_BYTES,
                ),
                Key(
                    "hwm",
                    "integer",
                    "Messages ZeroMQ queues per peer (bounded queues give back-pressure).",
                    64,
                    low=1,
                    high=MAX_HWM,
                ),
                Key(
                    "run_dir", "string", "Where the daemons keep their logs and state.", ".hetpipe"
                ),
                Key(
                    "log_max_bytes",
                    "size",
                    "A daemon's log rotates past this size.",
                    "16MiB",
                    low=MIN_LOG_BYTES,
                ),
                Key(
                    "log_keep",
                    "integer",
                    "Rotated logs kept (name.log.1 .. name.log.N).",
                    3,
                    low=0,
                    high=100,
                ),
                Key(
                    "jobs_kept",
                    "integer",
                    "Finished jobs the head keeps in memory; older ones live on disk.",
                    20,
                    low=1,
                    high=100_000,
                ),
                Key(
                    "records_every",
                    "integer",
                    "Per-minibatch records a stage sends the head in one message as it trains.",
                    1024,
                    low=1,
                    high=16384,
                ),
                Key(
                    "records_max_bytes",
                    "size",
                    "A stage's per-minibatch record stream in the job's directory stays under "
                    "this: past it the stream drops every 2nd chunk and keeps every 2nd from "
                    "then on; past it again every 4th, and so on.",
                    "64MiB",
                    low=MIN_LOG_BYTES,
                ),
                Key(
                    "metrics_max_bytes",
                    "size",
                    "A job's metrics.jsonl rotates past this size (metrics.jsonl.1 .. "
                    "metrics.jsonl.N, N = log_keep).",
                    "64MiB",
                    low=MIN_LOG_BYTES,
                ),
                Key(
                    "job_dir_max_bytes",
                    "size",
                    "A job's per-minibatch files (record streams, stages.json, trace.json, "
                    "metrics.jsonl and its rotations) stay under this: past their share, a "
                    "stream's older records and spans fold into summary windows and the "
                    "newest stay whole (checkpoints and models are not counted).",
                    "256MiB",
                    low=MIN_LOG_BYTES,
                ),
                Key(
                    "cuda_ipc",
                    "boolean",
                    "Stages on GPUs of one host pass tensors device to device.",
                    True,
                ),
                Key(
                    "host_shm",
                    "boolean",
                    "Stages of one host pass host tensors through shared memory.",
                    True,
                ),
                Key(
                    "inline_ms",
                    "integer",
                    "A stage's compute expected shorter than this runs on its event loop "
                    "(at most heartbeat_s / 4, which is also the default when smaller).",
                    20,
                    low=0,
                ),
                Key(
                    "retain_freed_mib",
                    "integer",
                    "Freed memory a daemon's C allocator keeps per heap for the next "
                    "minibatch's tensors; 0: the allocator's own behaviour.",
                    256,
                    low=0,
                    high=MAX_RETAIN_MIB,
                ),
            ),
        ),
        Section(
            "security",
            "Trust: CurveZMQ keys and the code a job may import.",
            (
                Key(
                    "curve",
                    "boolean",
                    "Authenticate and encrypt every socket with CurveZMQ (false: every peer "
                    "that can reach a port is trusted).",
                    True,
                ),
                Key(
                    "data_path",
                    "string",
                    "With curve on, how tensors between daemons travel: `curve` encrypted "
                    "like everything else, at a CPU cost per byte (the default: nothing on "
                    "the link is readable, and no other port is used); `mac` on plain TCP "
                    "with a keyed MAC (AES-GMAC, or HMAC-SHA256 where Python's OpenSSL "
                    "lacks AES-GCM) per message under a key agreed over "
                    "Curve: authenticated and replay-proof but readable on the link, for "
                    "clusters on their own network. With mac, a daemon's port P also needs "
                    "P + 1000 open.",
                    "curve",
                    choices=("mac", "curve"),
                    noun="data path",
                ),
                Key(
                    "keys",
                    "string",
                    "The key folder (`hetpipe keys`), relative to the cluster file's folder.",
                    ".hetpipe/keys",
                ),
                Key(
                    "allowed_modules",
                    "array of strings",
                    "Modules a job's model or data may import besides builtins and installed "
                    "entry points.",
                    [],
                ),
                Key(
                    "ship_code",
                    "boolean",
                    "`hetpipe submit` sends the source of each user module a job names with "
                    "the job, and the head and workers run it (checked against its hash), so "
                    "the code need not be installed on every host. Needs `curve = true`: only "
                    "a holder of a client key may submit. Allowed modules still apply; what "
                    "the shipped modules import must be installed.",
                    False,
                ),
            ),
        ),
    ),
)


# -- the reference docs --------------------------------------------------------------------


def _num(x: float) -> str:
    if isinstance(x, float) and x.is_integer() and abs(x) < 1e15:
        return str(int(x))
    if isinstance(x, int) and x >= 1 << 16 and x & (x - 1) == 0:
        return f"2^{x.bit_length() - 1}"
    return f"{x:g}" if isinstance(x, float) else str(x)


def _range(key: Key) -> str:
    if key.choices:
        return ", ".join(f'"{c}"' for c in key.choices)
    parts = []
    if key.above is not None and not (key.low is not None and key.low > key.above):
        parts.append(f"> {_num(key.above)}")
    if key.low is not None:
        parts.append(f">= {key.low}" if isinstance(key.low, str) else f">= {_num(key.low)}")
    if key.below is not None:
        parts.append(f"< {_num(key.below)}")
    if key.high is not None:
        parts.append(f"<= {_num(key.high)}")
    each = "each " if key.type.startswith("array") else ""
    return each + ", ".join(parts) if parts else ""


def _default(key: Key) -> str:
    if key.default_doc:
        return key.default_doc
    if key.required:
        return "required"
    value = key.default
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, dict):
        return "{}"
    if isinstance(value, list):
        return "[" + ", ".join(_num(v) for v in value) + "]"
    return _num(value)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render(schema: Schema) -> str:
    """The Markdown reference of one file: a table of keys per table."""
    out = [
        f"# {schema.title}",
        "",
        "<!-- Generated from hetpipe/core/keys.py by `python -m hetpipe.core.keys --write "
        "docs`; edit the declarations there, not this file. -->",
        "",
        schema.intro,
    ]
    for section in schema.sections:
        if not section.keys:
            continue
        out += ["", f"## {section.title}", "", section.meaning, ""]
        out += [
            "| key | type | default | range | has an effect when | meaning |",
            "| --- " * 6 + "|",
        ]
        for key in section.keys:
            cells = (
                f"`{key.name}`",
                key.type,
                _default(key),
                _range(key),
                key.applies.where if key.applies is not None else "always",
                key.meaning,
            )
            out.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(out) + "\n"


DOCS: Final = {"jobs.md": JOB, "cluster.md": CLUSTER}


def main(argv: list[str] | None = None) -> int:
    """``python -m hetpipe.core.keys --write docs``: (re)write docs/jobs.md and cluster.md;
    ``--check docs``: exit 1 naming each file that differs from the declarations."""
    parser = argparse.ArgumentParser(prog="python -m hetpipe.core.keys", description=main.__doc__)
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--write", metavar="DIR", help="write the references into DIR")
    group.add_argument("--check", metavar="DIR", help="check the references in DIR")
    args = parser.parse_args(argv)
    folder = Path(args.write or args.check)
    stale = []
    for name, schema in DOCS.items():
        path, text = folder / name, render(schema)
        if args.write:
            folder.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        elif not path.is_file() or path.read_text() != text:
            stale.append(str(path))
    for path in stale:
        print(
            f"{path}: differs from hetpipe/core/keys.py; run: python -m hetpipe.core.keys "
            f"--write {folder}",
            file=sys.stderr,
        )
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
