"""Per-layer profiles: what one layer costs on one device type, as the planner reads it.

The planner never runs the model; it reasons from these numbers, and the runtime counts its
own tensors in the same terms. Measuring them needs torch and lives apart
(:mod:`hetpipe.planner.profile`); the types are pure.

A profile is kept per *device type* because that is the unit the cluster file groups devices
by: two devices of one type are assumed to behave the same. Times are stored *as measured for
the type*: on an emulated device with ``speed = 0.25`` the profile holds the padded (4x
longer) times, so the planner uses its forwards and backwards as they are and never applies a
device's speed a second time. The one exception is ``update_s``: the runtime pads an emulated
device's forwards and backwards but not its optimizer step, so the planner charges the update
at the device's speed of its profiled time (:func:`update_scale`).

Byte counts are per minibatch at the profile's minibatch size:

====================  =========================================================
``param_bytes``       trainable parameters of the layer
``buffer_bytes``      non-trainable buffers (batch-norm statistics)
``out_bytes``         the layer's output: what crosses a cut after this layer
``saved_bytes``       what autograd keeps for the backward (not counting parameters)
``work_bytes``        transient peak beyond the saved tensors (output + input gradient)
``saved_input_bytes`` of ``saved_bytes``, the layer's input (a Linear's, a convolution's)
``saved_output_bytes`` of ``saved_bytes``, the layer's output (a ReLU's); ``out_bytes``
                      where the output is a view of the input (a Flatten's: no new bytes)
====================  =========================================================

The last two say which saved tensors a stage already holds otherwise, since each layer is
profiled alone: a layer's saved input is the previous layer's output (the same tensor, where
that layer saves its output too) or, on a stage's first layer, the stage input, which the
stage keeps anyway; and a stage keeps its output until the backward, which a last layer that
does not save it leaves uncounted (:func:`hetpipe.core.memory.activation_bytes`). A profile saved
before they were measured loads with ``saved_input_bytes = 0`` and ``saved_output_bytes =
out_bytes`` (None in the constructor): the count the memory model made before them.

``update_s`` is the per-minibatch cost of what the runtime does with the layer's state besides
its forward and backward: the out-of-place optimizer step, the update accumulated for the
parameter server, the weight fingerprints, and the batch-norm statistics deltas. It is small
for a layer of few large tensors and dominant for a stage of many tiny ones.

**The call term.** A layer timed alone pays, every pass, for its own call: its own backward
call (the autograd engine started for one node, a gradient of ones), its own timing and
bookkeeping. A stage runs all its layers in *one* forward task and *one* backward call, so a
sum of alone-timed layers charges that call once per layer, and a stage of many layers runs
faster than the sum of its layers. The profiler therefore also times the whole model as one
such call and keeps, per device type, a :class:`CallProfile`: the forward, backward and update
call's own cost, with every layer's time net of it. A stage of layers ``[a, b)`` costs the sum
of its layers plus the call term once (:meth:`ModelProfile.stage_times` for one stage; the
partitioners' prefix sums add the same term to every ``[a, b)``). A profile without the term
has none (0): its layers keep their gross times.

**Ties.** A tensor several layers share (GPT's input embedding and output head) is in each of
those layers' ``param_bytes``: each layer was measured alone. :attr:`ModelProfile.ties` says
which layers share which tensor and its bytes (:class:`TieProfile`), so that the planner counts
it once on a stage holding several of its layers (:meth:`ModelProfile.duplicate_bytes`), once
more on every other stage holding a copy, and prices the copies' exchange
(:meth:`ModelProfile.tie_link_bytes`: the bytes each link carries per exchange, as the runtime's
:class:`hetpipe.pipeline.TieRoute` routes them).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

__all__ = [
    "CallProfile",
    "LayerProfile",
    "ModelProfile",
    "StageTimes",
    "TieProfile",
    "at_speed",
    "padded_speed",
    "scale_layers",
    "update_scale",
]


def padded_speed(speed: float) -> float:
    """The speed a device of config ``speed`` computes at once the emulation has padded it
    (:func:`hetpipe.emulate.pad`): ``speed`` where it is slowed, 1 otherwise (padding never
    speeds a device up). The one home of that rule for every path that prices an emulated
    device."""
    return min(1.0, speed)


@dataclass(frozen=True)
class LayerProfile:
    """Cost of one layer on one device type at the profile's minibatch size."""

    fwd_s: float
    bwd_s: float
    param_bytes: int
    buffer_bytes: int
    out_bytes: int
    saved_bytes: int
    work_bytes: int
    update_s: float = 0.0  # optimizer step and bookkeeping of the layer's state (see above)
    saved_input_bytes: int = 0  # of saved_bytes, the layer's input (see above)
    saved_output_bytes: int | None = None  # of saved_bytes, its output; None: out_bytes

    def __post_init__(self) -> None:
        if self.saved_output_bytes is None:
            object.__setattr__(self, "saved_output_bytes", self.out_bytes)

    @property
    def output_saved(self) -> int:
        """:attr:`saved_output_bytes` as an int (never None once constructed)."""
        return int(self.saved_output_bytes or 0)

    @property
    def time_s(self) -> float:
        """Everything the layer costs a stage per minibatch: forward, backward, update."""
        return self.fwd_s + self.bwd_s + self.update_s

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LayerProfile:
        return cls(
            float(d["fwd_s"]),
            float(d["bwd_s"]),
            int(d["param_bytes"]),
            int(d["buffer_bytes"]),
            int(d["out_bytes"]),
            int(d["saved_bytes"]),
            int(d["work_bytes"]),
            float(d.get("update_s", 0.0)),
            int(d.get("saved_input_bytes", 0)),
            None if d.get("saved_output_bytes") is None else int(d["saved_output_bytes"]),
        )


@dataclass(frozen=True)
class CallProfile:
    """What one forward call, one backward call and one update of a stage cost beyond its
    layers' own (net) times, on one device type, stored like the layers' (see the module
    docs).

    Charged once per stage and minibatch whatever the stage's layer count: a stage runs its
    layers as one forward task, differentiates them with one backward call and steps all
    its weights in one optimizer call. 0 for a profile that never measured it.
    """

    fwd_s: float = 0.0
    bwd_s: float = 0.0
    update_s: float = 0.0

    @property
    def time_s(self) -> float:
        return self.fwd_s + self.bwd_s + self.update_s

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> CallProfile:
        d = d or {}
        return cls(
            float(d.get("fwd_s", 0.0)), float(d.get("bwd_s", 0.0)), float(d.get("update_s", 0.0))
        )


@dataclass(frozen=True)
class TieProfile:
    """One tensor several layers share: its canonical name (the name the shards keep), the
    layers using it (ascending, distinct) and its bytes.

    A stage holding any of ``layers`` holds the whole tensor (a copy where other stages hold
    some of them too: :mod:`hetpipe.modelstate`), and each of those layers counts it in its
    ``param_bytes``."""

    name: str
    layers: tuple[int, ...]
    nbytes: int

    def __post_init__(self) -> None:
        if len(self.layers) < 2 or list(self.layers) != sorted(set(self.layers)):
            raise ValueError(
                f"tie {self.name!r}: layers must be two or more distinct ones, ascending, "
                f"got {list(self.layers)}"
            )
        if self.nbytes < 0 or self.layers[0] < 0:
            raise ValueError(f"tie {self.name!r}: negative bytes or layer")

    def holders(self, bounds: Sequence[tuple[int, int]]) -> list[int]:
        """The stages (ascending) of the split ``bounds`` (each stage's ``[a, b)``) that hold
        a layer of this tie."""
        return [i for i, (a, b) in enumerate(bounds) if any(a <= j < b for j in self.layers)]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "layers": list(self.layers), "nbytes": self.nbytes}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TieProfile:
        return cls(str(d["name"]), tuple(int(j) for j in d["layers"]), int(d["nbytes"]))


@dataclass(frozen=True)
class StageTimes:
    """A stage's compute per minibatch on one device type, from its layers and its call."""

    fwd_s: float
    bwd_s: float
    update_s: float

    @property
    def time_s(self) -> float:
        return self.fwd_s + self.bwd_s + self.update_s


@dataclass(frozen=True)
class ModelProfile:
    """A model's layers profiled on each device type (same layer count for every type).

    ``input_bytes`` is the size of one minibatch of model input (what stage 0 receives).
    ``calls``: per device type, the stage call term (:class:`CallProfile`); a type without
    one has none (a profile measured before the term existed). ``ties``: the tensors several
    layers share (the module docs), none for a model without ties or a profile measured
    before they were kept.
    """

    model: str
    minibatch: int
    input_bytes: int
    layers: dict[str, tuple[LayerProfile, ...]]
    calls: dict[str, CallProfile] = field(default_factory=dict)
    ties: tuple[TieProfile, ...] = ()

    def __post_init__(self) -> None:
        counts = {t: len(v) for t, v in self.layers.items()}
        if len(set(counts.values())) > 1:
            raise ValueError(f"profile {self.model!r}: layer counts differ by type: {counts}")
        extra = sorted(set(self.calls) - set(self.layers))
        if extra:
            raise ValueError(f"profile {self.model!r}: call term of unprofiled type {extra[0]!r}")
        n = self.n_layers()
        for tie in self.ties:
            if self.layers and tie.layers[-1] >= n:
                raise ValueError(
                    f"profile {self.model!r}: tie {tie.name!r} uses layer {tie.layers[-1]} of {n}"
                )

    def duplicate_bytes(self, a: int, b: int) -> int:
        """Bytes the layers ``[a, b)`` count more than once in their ``param_bytes``: a tie
        two or more of them use is one tensor on the stage, counted once."""
        out = 0
        for tie in self.ties:
            n = sum(1 for j in tie.layers if a <= j < b)
            if n > 1:
                out += (n - 1) * tie.nbytes
        return out

    def spanning(self, bounds: Sequence[tuple[int, int]]) -> dict[str, list[int]]:
        """Canonical name -> the stages holding a copy (ascending), for every tie whose layers
        fall in more than one stage of the split ``bounds`` (:meth:`StateLayout.spanning`'s
        answer, from the profile)."""
        out = {}
        for tie in self.ties:
            holders = tie.holders(bounds)
            if len(holders) > 1:
                out[tie.name] = holders
        return out

    def tie_link_bytes(self, bounds: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
        """Per link of the split ``bounds`` (link ``s`` joins stages ``s`` and ``s + 1``): the
        bytes of the ties' gradient sums it carries up (towards the last stage) and down,
        per exchange. The runtime's route (:class:`hetpipe.pipeline.TieRoute`): each copy's
        sum goes to every other copy, along the pipeline, so the link after stage ``s``
        carries up the sum of every holder at or before ``s`` and down that of every
        holder after it, for a tie with holders on both sides."""
        out = [[0, 0] for _ in range(max(0, len(bounds) - 1))]
        for tie in self.ties:
            holders = tie.holders(bounds)
            if len(holders) < 2:
                continue
            for s in range(holders[0], holders[-1]):
                out[s][0] += tie.nbytes * sum(1 for h in holders if h <= s)
                out[s][1] += tie.nbytes * sum(1 for h in holders if h > s)
        return [(u, d) for u, d in out]

    def call(self, dtype: str) -> CallProfile:
        """The stage call term of ``dtype`` (zero where none was measured)."""
        return self.calls.get(dtype) or CallProfile()

    def stage_times(self, dtype: str, a: int, b: int) -> StageTimes:
        """Forward, backward and update of a stage of layers ``[a, b)`` on ``dtype``: the
        layers' sums plus the call term once. The partitioners, which need every ``[a, b)``
        at once, add the same term to their prefix-sum differences
        (:class:`hetpipe.planner.costs.CostTables`, :mod:`hetpipe.planner.syncmodel`)."""
        lps = self.layers[dtype][a:b]
        c = self.call(dtype)
        return StageTimes(
            sum(lp.fwd_s for lp in lps) + c.fwd_s,
            sum(lp.bwd_s for lp in lps) + c.bwd_s,
            sum(lp.update_s for lp in lps) + c.update_s,
        )

    def n_layers(self) -> int:
        return len(next(iter(self.layers.values()))) if self.layers else 0

    @property
    def types(self) -> tuple[str, ...]:
        return tuple(self.layers)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "minibatch": self.minibatch,
            "input_bytes": self.input_bytes,
            "layers": {t: [lp.to_dict() for lp in v] for t, v in self.layers.items()},
            "calls": {t: c.to_dict() for t, c in self.calls.items()},
            "ties": [tie.to_dict() for tie in self.ties],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ModelProfile:
        layers = {
            t: tuple(LayerProfile.from_dict(x) for x in v) for t, v in dict(d["layers"]).items()
        }
        calls = {t: CallProfile.from_dict(c) for t, c in dict(d.get("calls") or {}).items()}
        ties = tuple(TieProfile.from_dict(x) for x in d.get("ties") or ())
        return cls(str(d["model"]), int(d["minibatch"]), int(d["input_bytes"]), layers, calls, ties)

    def scaled(self, minibatch: int) -> ModelProfile:
        """The profile at another minibatch size, assuming time and activations scale linearly.

        A first-order estimate (small minibatches under-use a GPU, so real times grow less than
        linearly); re-profiling at the job's minibatch is better, and the plan says so. The call
        term stays: a call's own cost does not grow with the rows.
        """
        if minibatch == self.minibatch:
            return self
        f = minibatch / self.minibatch
        layers = {t: scale_layers(v, f) for t, v in self.layers.items()}
        return ModelProfile(
            self.model,
            minibatch,
            math.ceil(self.input_bytes * f),
            layers,
            dict(self.calls),
            self.ties,
        )


def update_scale(speed: float) -> float:
    """The share of a profiled ``update_s`` a device of emulation ``speed`` spends on it.

    The runtime pads an emulated device's forwards and backwards, never its optimizer step
    (:mod:`hetpipe.emulate`), while a profile holds every time padded (``/ speed``, above):
    so the update runs at ``speed`` of its profiled time (1 on an unslowed device). Every
    planner path that charges an update takes it from here."""
    return padded_speed(speed)


def at_speed(
    layers: Sequence[LayerProfile], call: CallProfile | None, measured: float, speed: float
) -> tuple[tuple[LayerProfile, ...], CallProfile | None]:
    """What a device of emulation ``speed`` measures, from what one of ``measured`` speed
    measured on the same hardware (the emulated devices of one node share its cores).

    A profile holds every time ``/ speed`` of the same compute
    (:func:`hetpipe.measure.measure_model`), so
    this is exact, where two types measured one after the other on a busy host differ by
    its load at each moment (here up to a fifth, enough to swap the planner's formations).
    Byte counts are the hardware's and stay."""
    f = padded_speed(measured) / padded_speed(speed)
    out = tuple(
        replace(lp, fwd_s=lp.fwd_s * f, bwd_s=lp.bwd_s * f, update_s=lp.update_s * f)
        for lp in layers
    )
    if call is None:
        return out, None
    return out, CallProfile(call.fwd_s * f, call.bwd_s * f, call.update_s * f)


def scale_layers(layers: Sequence[LayerProfile], factor: float) -> tuple[LayerProfile, ...]:
    """Scale times and per-minibatch activation bytes by ``factor``; parameters stay, and so
    does the update cost (it depends on the parameters, not on the minibatch)."""
    return tuple(
        LayerProfile(
            lp.fwd_s * factor,
            lp.bwd_s * factor,
            lp.param_bytes,
            lp.buffer_bytes,
            math.ceil(lp.out_bytes * factor),
            math.ceil(lp.saved_bytes * factor),
            math.ceil(lp.work_bytes * factor),
            lp.update_s,
            math.ceil(lp.saved_input_bytes * factor),
            math.ceil(lp.output_saved * factor),
        )
        for lp in layers
    )
