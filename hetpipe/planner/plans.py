"""The plan the runtime executes and a person reads: :class:`Plan`, its virtual workers
(:class:`VWPlan`) and their stages (:class:`StagePlan`), their (de)serialisation, and the
table ``hetpipe plan`` prints (:meth:`Plan.table`). A planned stage is its layout
(:class:`hetpipe.core.layout.StageLayout`, the one type of a split) plus the planner's
predictions, so the plan's result is the layouts the runtime runs (:meth:`Plan.run_layouts`).
Made by :mod:`hetpipe.planner.plan` (the search), :mod:`hetpipe.planner.explicit` (a split
the user wrote) and :mod:`hetpipe.planner.syncplan` (synchronous jobs).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from hetpipe.core.layout import OnStage, SplitError, StageLayout, VWLayout, VWSpec, validate
from hetpipe.core.memory import StageMemory
from hetpipe.core.profile import ModelProfile
from hetpipe.core.schedule import fill_counts
from hetpipe.core.units import format_size
from hetpipe.planner.runtime import RuntimeCosts

__all__ = [
    "Plan",
    "PlanError",
    "PlanInputs",
    "StagePlan",
    "VWPlan",
    "check_split",
    "model_title",
]


def model_title(key: str) -> str:
    """A profile's model key (JSON of the model, its arguments, the data and theirs, as
    :func:`hetpipe.profiling.model_key` writes it) as a person reads it: ``cnn (width=8) on
    digits``; anything else as given."""
    try:
        d = json.loads(key)
    except ValueError:
        d = None
    if not isinstance(d, dict) or "model" not in d:
        return key or "model"

    def args(a: Any) -> str:
        return (
            f" ({', '.join(f'{k}={v}' for k, v in sorted(a.items()))})"
            if isinstance(a, dict) and a
            else ""
        )

    text = f"{d['model']}{args(d.get('args'))}"
    if d.get("data"):
        text += f" on {d['data']}{args(d.get('data_args'))}"
    if d.get("precision"):
        text += f", {d['precision']}"
    return text


class PlanError(ValueError):
    """No plan is possible (the model fits nowhere, a bad explicit split); one clear line."""


@dataclass(frozen=True)
class PlanInputs:
    """What a job asks of the planner, said once: the figures every plan is priced with and
    the search's options. :func:`hetpipe.planner.make_plan` takes it (or its fields as
    keywords); :func:`hetpipe.planner.explicit_plan` and
    :func:`hetpipe.planner.replica_proposals` take it too and read what pricing a given
    split needs (the search's ``policy``, ``num_vws`` and ``in_flight`` are not theirs).

    ``minibatch`` rows per minibatch, WSP's ``staleness`` D and the optimizer's
    ``optimizer_state_factor`` (state tensors per parameter) price every stage. ``nm``
    fixes Nm for every VW (None: chosen per VW). ``shard_of_stage(vw, stage, device) ->
    shard`` overrides parameter placement. ``costs`` are the runtime's own costs (None:
    :class:`hetpipe.planner.runtime.RuntimeCosts` as measured for this project) and
    ``cores`` the cores of each node, shared by its emulated devices and daemons (one
    number, or by node name; None: this machine's). ``minibatches`` (per VW) is how long
    the job runs, so that the prediction includes filling and draining the pipelines (None:
    long enough for a steady state). ``weights`` is the job's mode as
    :func:`hetpipe.core.memory.weights_mode` names it, ``activations`` its
    ``train.activations``, ``max_replicas`` its ``train.max_replicas``, ``row_profiles``
    the model profiled at a replica's fewer rows (by rows), and ``in_flight`` its
    ``train.in_flight``. ``policy`` and ``num_vws`` choose the formations searched.
    ``max_nm`` (``train.max_nm``) caps the Nm the search gives any VW (None: no cap but
    the search's own; the staleness rule of :mod:`hetpipe.planner.staleness` still
    weighs deep pipelines). ``placement`` (``train.placement``) is where the shards keep
    each layer's state, priced on the links (:mod:`hetpipe.planner.placement`).
    """

    minibatch: int
    staleness: int
    optimizer_state_factor: int
    policy: str = "auto"
    num_vws: int | None = None
    nm: int | None = None
    shard_of_stage: Callable[[int, int, Any], int] | None = None
    costs: RuntimeCosts | None = None
    cores: int | Mapping[str, int] | None = None
    minibatches: int | None = None
    weights: str = "stash"
    activations: str = "keep"
    max_replicas: int = 1
    row_profiles: Mapping[int, ModelProfile] | None = None
    in_flight: str = "nm"
    max_nm: int | None = None
    placement: str = "local"

    @classmethod
    def of(cls, inputs: PlanInputs | None, options: Mapping[str, Any]) -> PlanInputs:
        """``inputs`` with ``options`` (field names) replacing its fields; without
        ``inputs``, the options alone (a keyword call of the planner's functions)."""
        if inputs is None:
            return cls(**options)
        return replace(inputs, **options) if options else inputs


# validate's problems that explicit plans have always named in these words (callers match
# them): the words lead, validate's own text follows
_SPLIT_WORDS = (
    ("is not a device of", "unknown device"),
    ("is already in", "device used twice"),
    ("sums to", "layers must sum to {n_layers}"),
)


def check_split(vws: Sequence[VWSpec], devices: Collection[str], n_layers: int) -> None:
    """Refuse a split a user gave (``vws``: its ``[[vw]]`` tables, layers and Nm where
    given) as :func:`hetpipe.core.layout.validate` does, the one check of a split, raising
    :class:`PlanError` with validate's text (the job-file key, then the problem), led by
    the words these plans always used for the same problem ("unknown device", "device used
    twice", "layers must sum to 16")."""
    try:
        validate(vws, devices, n_layers)
    except SplitError as exc:
        for problem, words in _SPLIT_WORDS:
            if problem in exc.problem:
                lead = words.format(n_layers=n_layers)
                raise PlanError(f"{exc.key}: {lead}: {exc.problem}") from None
        raise PlanError(str(exc)) from None


@dataclass(frozen=True)
class StagePlan(OnStage):
    """One planned stage: its layout (what runs where, :class:`hetpipe.core.layout.StageLayout`)
    and the planner's predictions for it. The layout's fields read as before (``device``,
    ``layers``, ``replicas``, ``rows``, ``recompute``, ``swap``, ``limit``) so that the
    search, the table and the tests need not know where they live."""

    layout: StageLayout
    type: str
    time_s: float  # predicted compute per minibatch: forward + backward + update, as run
    # the peak under every timing the schedule permits (hetpipe.core.schedule.max_in_flight):
    # what the stage is fitted with and what a user relies on to stay under the cap
    memory: StageMemory
    memory_cap: int
    shard: int  # PS shard holding (most of) this stage's parameters
    busy_s: float = 0.0  # time_s plus hand-offs, sends, and push/merge per minibatch
    slowdown: float = 1.0  # how much sharing its host's cores stretches this stage's work
    keep_memory: StageMemory | None = None  # what ``memory`` would be keeping every layer
    # the gradient exchange between a replicated stage's devices per minibatch; 0 for a
    # stage on one device
    exchange_s: float = 0.0
    # the peak of the predicted timeline: the same model at the most minibatches the
    # simulated stage held at once (``expected_in_flight``, of the ``in_flight`` that
    # ``memory`` charges); never above ``memory``, equal to it where the order fixes the
    # count. None / 0 in a plan made before it was predicted
    expected_memory: StageMemory | None = None
    expected_in_flight: int = 0
    in_flight: int = 0

    @property
    def limit(self) -> int:
        """The most minibatches the runtime lets this stage hold, filled to that first
        (set by make_plan under ``train.in_flight = "plan"``); 0: the schedule's own
        maximum."""
        return self.layout.in_flight_limit

    def to_dict(self) -> dict[str, Any]:
        return {
            "limit": self.limit,
            "expected_memory": self.expected_memory.to_dict() if self.expected_memory else None,
            "expected_in_flight": self.expected_in_flight,
            "in_flight": self.in_flight,
            "replicas": list(self.replicas),
            "rows": list(self.rows),
            "exchange_s": self.exchange_s,
            "recompute": list(self.recompute),
            "swap": list(self.swap),
            "keep_memory": self.keep_memory.to_dict() if self.keep_memory else None,
            "device": self.device,
            "type": self.type,
            "layers": list(self.layers),
            "time_s": self.time_s,
            "memory": self.memory.to_dict(),
            "memory_cap": self.memory_cap,
            "shard": self.shard,
            "busy_s": self.busy_s,
            "slowdown": self.slowdown,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any], fill: int = 0) -> StagePlan:
        """The stage :meth:`to_dict` wrote; ``fill``: its in-flight fill, which the JSON
        does not hold (its virtual worker derives it from the limits and Nm)."""
        a, b = d["layers"]
        layout = StageLayout(
            devices=(str(d["device"]), *(str(x) for x in d.get("replicas", ()))),
            first=int(a),
            last=int(b),
            recompute=tuple(int(j) for j in d.get("recompute", ())),
            swap=tuple(int(j) for j in d.get("swap", ())),
            rows=tuple(int(x) for x in d.get("rows", ())),
            in_flight_limit=int(d.get("limit", 0)),
            in_flight_fill=fill,
        )
        return cls(
            layout,
            str(d["type"]),
            float(d["time_s"]),
            StageMemory.from_dict(d["memory"]),
            int(d["memory_cap"]),
            int(d["shard"]),
            float(d.get("busy_s", 0.0)),
            float(d.get("slowdown", 1.0)),
            StageMemory.from_dict(d["keep_memory"]) if d.get("keep_memory") else None,
            float(d.get("exchange_s", 0.0)),
            StageMemory.from_dict(d["expected_memory"]) if d.get("expected_memory") else None,
            int(d.get("expected_in_flight", 0)),
            int(d.get("in_flight", 0)),
        )


@dataclass(frozen=True)
class VWPlan:
    """One planned virtual worker: its stages (layouts plus predictions) in pipeline order,
    its Nm and its predicted rate; its layout is :attr:`layout`."""

    stages: tuple[StagePlan, ...]
    nm: int
    samples_per_s: float  # predicted rate of this VW over its run (its samples / its time)

    @property
    def layout(self) -> VWLayout:
        """What this virtual worker runs: its stages' layouts and its Nm."""
        return VWLayout(tuple(s.layout for s in self.stages), self.nm)

    @property
    def devices(self) -> tuple[str, ...]:
        """Each stage's leader, in pipeline order."""
        return tuple(s.device for s in self.stages)

    @property
    def layers(self) -> tuple[int, ...]:
        """Layers per stage (the job file's ``layers = [...]``)."""
        return tuple(b - a for a, b in (s.layers for s in self.stages))

    def run_layout(self, schedule: str, activations: str) -> VWLayout:
        """The layout the runtime runs for this virtual worker of a plan of ``schedule``.

        An async plan's stages recompute and swap what the planner chose; the synchronous
        planner keeps every activation and chooses nothing, so there the job's
        ``train.activations`` (``activations``: "recompute" or "swap" pins every layer of
        every stage, anything else keeps them all) applies as pinned."""
        return self.layout if schedule == "async" else self.layout.pinned(activations)

    def to_dict(self) -> dict[str, Any]:
        return {
            "devices": list(self.devices),
            "stages": [s.to_dict() for s in self.stages],
            "nm": self.nm,
            "samples_per_s": self.samples_per_s,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> VWPlan:
        nm = int(d["nm"])
        fills = fill_counts([int(s.get("limit", 0)) for s in d["stages"]], nm)
        return cls(
            tuple(StagePlan.from_dict(s, f) for s, f in zip(d["stages"], fills, strict=True)),
            nm,
            float(d["samples_per_s"]),
        )


@dataclass(frozen=True)
class Plan:
    vws: tuple[VWPlan, ...]
    samples_per_s: float  # predicted rate of the job: every sample / the time to the last
    policy: str  # "np" | "ed" | "hd" | "explicit" (what auto chose, or what was asked)
    unused: tuple[str, ...]  # device names no VW uses (reasons in ``warnings``)
    warnings: tuple[str, ...]
    layer_shards: tuple[int, ...] = ()  # PS shard of each layer's parameters
    minibatch: int = 0
    staleness: int = 0
    model: str = ""
    details: dict[str, Any] = field(default_factory=dict, compare=False)  # search statistics
    schedule: str = "async"  # hetpipe.core.schedule.KINDS; Nm is M for gpipe/1f1b
    iteration_s: float = 0.0  # gpipe/1f1b: predicted time of one iteration
    warmup: int = 0  # 1f1b: extra warm-up forwards of its order (hetpipe.core.schedule)

    def run_layouts(self, activations: str) -> tuple[VWLayout, ...]:
        """The layouts the runtime runs, one per virtual worker (:meth:`VWPlan.run_layout`;
        ``activations``: the job's ``train.activations``, pinned for a synchronous plan)."""
        return tuple(v.run_layout(self.schedule, activations) for v in self.vws)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON/msgpack-able)."""
        return {
            "vws": [v.to_dict() for v in self.vws],
            "samples_per_s": self.samples_per_s,
            "policy": self.policy,
            "unused": list(self.unused),
            "warnings": list(self.warnings),
            "layer_shards": list(self.layer_shards),
            "minibatch": self.minibatch,
            "staleness": self.staleness,
            "model": self.model,
            "details": dict(self.details),
            "schedule": self.schedule,
            "iteration_s": self.iteration_s,
            "warmup": self.warmup,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        return cls(
            tuple(VWPlan.from_dict(v) for v in d["vws"]),
            float(d["samples_per_s"]),
            str(d["policy"]),
            tuple(str(x) for x in d.get("unused", ())),
            tuple(str(x) for x in d.get("warnings", ())),
            tuple(int(x) for x in d.get("layer_shards", ())),
            int(d.get("minibatch", 0)),
            int(d.get("staleness", 0)),
            str(d.get("model", "")),
            dict(d.get("details", {})),
            str(d.get("schedule", "async")),
            float(d.get("iteration_s", 0.0)),
            int(d.get("warmup", 0)),
        )

    def table(self) -> str:
        """A readable table: per VW its devices in order, stages, times, memory, Nm, rates.

        ``compute`` is a stage's predicted forward + backward + update per minibatch (what the
        job status measures as ``time_s``), ``busy`` adds the runtime's hand-offs, sends and
        per-wave push and merge, and ``host`` is how much sharing its host stretches it.
        ``expected`` is the memory peak of the predicted timeline (``in flight`` held of the
        most the schedule permits), ``bound`` the peak under any timing, what ``use`` of the
        cap counts; a stage limited to its expected count (``train.in_flight = "plan"``) shows
        ``in flight`` with a ``!``."""
        lines = [
            f"plan for {model_title(self.model)}: policy {self.policy}, {len(self.vws)} virtual "
            f"worker(s), minibatch {self.minibatch}, "
            + (
                f"staleness D={self.staleness}"
                if self.schedule == "async"
                else f"schedule {self.schedule}"
                + (f" with {self.warmup} extra warm-up forward(s)" if self.warmup else "")
                + f": {'+'.join(str(v.nm) for v in self.vws) or 0} "
                f"microbatches per iteration, predicted iteration {_ms(self.iteration_s)}"
            )
        ]
        head = (
            f"  {'stage':<6}{'device':<10}{'type':<10}{'layers':<12}{'compute':>10}{'busy':>10}"
            f"{'host':>7}{'in flight':>11}{'expected':>11}{'bound / cap':>24}{'use':>6}"
            f"{'shard':>7}"
        )
        for v, vw in enumerate(self.vws):
            order = (
                s.device if not s.replicas else f"[{', '.join((s.device, *s.replicas))}]"
                for s in vw.stages
            )
            lines.append(
                f"VW {v}: {' > '.join(order)}   Nm={vw.nm}   "
                f"predicted {vw.samples_per_s:.1f} samples/s"
            )
            lines.append(head)
            for i, s in enumerate(vw.stages):
                a, b = s.layers
                rng = f"{a}-{b - 1} ({b - a})"
                mem = f"{format_size(s.memory.total)} / {format_size(s.memory_cap)}"
                use = s.memory.total / s.memory_cap if s.memory_cap else math.inf
                held = (
                    f"{s.expected_in_flight}/{s.in_flight}{'!' if s.limit else ''}"
                    if s.expected_memory
                    else "-"
                )
                expected = format_size(s.expected_memory.total) if s.expected_memory else "-"
                lines.append(
                    f"  {i:<6}{s.device:<10}{s.type:<10}{rng:<12}{_ms(s.time_s):>10}"
                    f"{_ms(s.busy_s):>10}{f'x{s.slowdown:.2f}':>7}{held:>11}{expected:>11}"
                    f"{mem:>24}{use:>6.0%}{s.shard:>7}"
                )
                if s.replicas:
                    spans = ", ".join(
                        f"{dev} rows {lo}-{hi - 1}"
                        for dev, lo, hi in zip(
                            (s.device, *s.replicas), s.rows, s.rows[1:], strict=False
                        )
                    )
                    lines.append(
                        f"  {'':<6}replicated: {spans}; gradient exchange "
                        f"{_ms(s.exchange_s)} per minibatch (memory: the leader's)"
                    )
                if s.recompute or s.swap:
                    before = s.keep_memory.total if s.keep_memory else s.memory.total
                    kept = _ranges(
                        [j for j in range(a, b) if j not in set(s.recompute) | set(s.swap)]
                    )
                    lines.append(
                        f"  {'':<6}activations: keep {kept}, recompute "
                        f"{_ranges(list(s.recompute))}, swap {_ranges(list(s.swap))}; memory "
                        f"{format_size(before)} keeping all -> {format_size(s.memory.total)}"
                    )
        if any(s.limit for vw in self.vws for s in vw.stages):
            lines.append(
                "!: the stage runs its expected count of forwards (fewer where a stage "
                "before it holds fewer) before its first backward and never holds "
                "more, so that is its bound under any timing "
                '(train.in_flight = "plan")'
            )
        lines.append(f"total predicted: {self.samples_per_s:.1f} samples/s")
        lines += _replica_choice_lines(self.details.get("replica_choice", ()))
        for r in self.details.get("replicas", ()):
            lines.append(
                f"replicas, VW {r['vw']} ({r['what']}): devices [{_groups(r['groups'])}] layers "
                f"{r['layers']}: bottleneck {_ms(r['bottleneck'])} (gradient exchange "
                f"{_ms(max(r['exchange_s']))}) vs {_ms(r['unreplicated'])} without replicas"
            )
        if self.unused:
            lines.append(f"unused devices: {', '.join(self.unused)}")
        for w in self.warnings:
            lines.append(f"warning: {w}")
        return "\n".join(lines)


def _ranges(layers: list[int]) -> str:
    """Sorted layers as ranges ("0-2, 7", or "none")."""
    if not layers:
        return "none"
    parts: list[str] = []
    start = prev = layers[0]
    for j in [*layers[1:], None]:
        if j is not None and j == prev + 1:
            prev = j
            continue
        parts.append(f"{start}" if start == prev else f"{start}-{prev}")
        if j is not None:
            start = prev = j
    return ", ".join(parts)


def _ms(t: float) -> str:
    return f"{t * 1e3:.2f}ms" if t < 10 else f"{t:.2f}s"


def _groups(groups: Sequence[Sequence[str]]) -> str:
    """Devices by stage, a replicated stage's in brackets ("gpu0, [gpu1, gpu2]")."""
    return ", ".join(g[0] if len(g) == 1 else "[" + ", ".join(g) + "]" for g in groups)


def _replica_choice_lines(notes: Sequence[Mapping[str, Any]]) -> list[str]:
    """What the planner weighed per VW with ``train.max_replicas`` (see
    :func:`hetpipe.planner.replicas.replicate`), in words."""
    lines = []
    for n in notes:
        if "groups" not in n:
            lines.append(f"replicas, VW {n['vw']}: none ({n['why']})")
            continue
        lines.append(
            f"replicas, VW {n['vw']}: {'chosen' if n['chosen'] else 'not chosen'}: devices "
            f"[{_groups(n['groups'])}] layers {n['layers']} predicts "
            f"{_ms(n['minibatch_s'])} per minibatch "
            f"(gradient exchange {_ms(max(n['exchange_s']))}) and "
            f"{n['samples_per_s']:.1f} samples/s, against "
            f"{_ms(n['unreplicated_minibatch_s'])} and {n['unreplicated_samples_per_s']:.1f} "
            f"samples/s without replicas"
        )
    return lines
