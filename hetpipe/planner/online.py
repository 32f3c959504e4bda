"""Online re-plan: a new split for a virtual worker whose device drifted from its profile.

The head's drift detection (:mod:`hetpipe.head.drift`) measures that a stage's device runs
``ratio`` times the time its plan predicted. This module prices what to do about it, with the
planner's own pieces and nothing else:

1. **The drifted world.** The device gets a type of its own (``<type>@<device>``) whose
   forwards and backwards are its type's times ``x ratio`` (its bytes, and its update,
   which the slowdown does not stretch, stay): every other device of its type keeps the
   profile as it was.
2. **Static**: the job's current split, priced in that world
   (:func:`~hetpipe.planner.explicit.explicit_plan`): what it runs at if nothing is done.
3. **Re-split**: the drifted virtual worker's layers cut anew over the same devices in the
   same order (:meth:`~hetpipe.planner.partition.CostModel.partition`, the exact
   min-bottleneck split under each device's memory cap), with the activation policy the
   planner picks under ``train.activations``, and Nm too where the job leaves Nm to it; the
   other virtual workers keep theirs. Its gain is its predicted job throughput / static's.
4. **Device moves** (a plan of several virtual workers): the drifted device swapped with
   each device of another virtual worker, both re-split, priced the same way. A move
   re-forms two virtual workers, which live migration does not do: the best one is
   reported beside the decision, never carried out by it.

A re-split is carried out only where its gain reaches ``min_gain`` and it fits every
device's cap; otherwise the :class:`Decision` says why not. Pure: no torch, asyncio or zmq;
fast enough to run on the head between two telemetry ticks.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from hetpipe.core.layout import VWLayout
from hetpipe.core.profile import CallProfile, ModelProfile
from hetpipe.core.units import format_size
from hetpipe.planner.partition import CostModel, Partition
from hetpipe.planner.plan import _at_minibatch, _cost_model
from hetpipe.planner.plans import PlanError, PlanInputs

__all__ = ["Decision", "LayerMove", "drifted", "layer_moves", "replan"]

MAX_DEVICE_MOVES = 8  # device swaps priced at most (each re-splits two virtual workers)


@dataclass(frozen=True)
class LayerMove:
    """Layers ``first``..``last``-1 leave stage ``src`` for stage ``dst`` (of one VW)."""

    first: int
    last: int
    src: int
    dst: int

    def to_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Decision:
    """One re-plan decision for virtual worker ``vw``, carried out (``take``) or refused.

    What live migration takes: ``vw``, ``layout`` (the new stages: each one's devices,
    layers ``[first, last)``, recomputed and swapped layers; and Nm), ``bounds`` (each
    stage's ``(first, last)``, the same layers), ``moves`` (which layers leave which stage
    for which), ``gain`` (predicted re-planned / static job throughput) and ``reason``.
    ``device``, ``stage`` and ``ratio`` say what drifted and by how much (measured /
    predicted compute); ``static_samples_per_s`` and ``samples_per_s`` are the predicted
    job throughputs without and with the re-split; ``alternative`` is the best device move
    between virtual workers, priced (None where the plan has one VW or none could run).
    """

    vw: int
    device: str
    stage: int
    ratio: float
    take: bool
    reason: str
    gain: float = 1.0
    old_bounds: tuple[tuple[int, int], ...] = ()
    bounds: tuple[tuple[int, int], ...] = ()
    old_nm: int = 0
    nm: int = 0
    moves: tuple[LayerMove, ...] = ()
    layout: VWLayout | None = None
    static_samples_per_s: float = 0.0
    samples_per_s: float = 0.0
    alternative: dict[str, Any] | None = None
    plan_s: float = 0.0  # time the pricing took
    at: float = 0.0  # wall-clock time of the decision (set by the head)
    minibatch: int = 0  # the drifted stage's minibatches done then (set by the head)
    # after / before its migration, as measured (set by the head: hetpipe.head.gain)
    measured_gain: float | None = None
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def changes(self) -> bool:
        """Whether it moves any layer or changes Nm."""
        return bool(self.moves) or self.nm != self.old_nm

    def to_dict(self) -> dict[str, Any]:
        """Plain data for metrics.jsonl, stages.json, the trace and ``status``."""
        return {
            "at": self.at,
            "minibatch": self.minibatch,
            "vw": self.vw,
            "device": self.device,
            "stage": self.stage,
            "ratio": round(self.ratio, 4),
            "taken": self.take,
            "reason": self.reason,
            "gain": round(self.gain, 4),
            "measured_gain": self.measured_gain,
            "old_bounds": [list(b) for b in self.old_bounds],
            "bounds": [list(b) for b in self.bounds],
            "old_nm": self.old_nm,
            "nm": self.nm,
            "moves": [m.to_dict() for m in self.moves],
            "recompute": [list(s.recompute) for s in self.layout.stages] if self.layout else [],
            "swap": [list(s.swap) for s in self.layout.stages] if self.layout else [],
            "static_samples_per_s": self.static_samples_per_s,
            "samples_per_s": self.samples_per_s,
            "alternative": self.alternative,
            "plan_s": self.plan_s,
        }

    def line(self) -> str:
        """One line for the log and ``hetpipe status``."""
        what = "re-plan" if self.take else "no re-plan"
        moved = ", ".join(
            f"layers {m.first}-{m.last - 1} stage {m.src}->{m.dst}" for m in self.moves
        )
        return (
            f"vw {self.vw}: {self.device} (stage {self.stage}) at {self.ratio:.2f}x its "
            f"prediction: {what}"
            + (f" ({moved})" if moved and self.take else "")
            + f": {self.reason}"
        )


def drifted(
    cluster: Any, profile: ModelProfile, device: str, ratio: float
) -> tuple[Any, ModelProfile]:
    """The cluster and profile where ``device`` computes ``ratio`` times its type's time:
    it gets a type of its own, ``<type>@<device>``, its forward and backward times (and its
    call term's) scaled by ``ratio``."""
    dev = next((d for d in cluster.devices if d.name == device), None)
    if dev is None:
        raise PlanError(f"no device {device!r} in the plan's cluster")
    own = f"{dev.type}@{device}"
    layers = tuple(
        dataclasses.replace(lp, fwd_s=lp.fwd_s * ratio, bwd_s=lp.bwd_s * ratio)
        for lp in profile.layers[dev.type]
    )
    calls = dict(profile.calls)
    if dev.type in calls:
        c = calls[dev.type]
        calls[own] = CallProfile(c.fwd_s * ratio, c.bwd_s * ratio, c.update_s)
    new_profile = dataclasses.replace(profile, layers={**profile.layers, own: layers}, calls=calls)
    nodes = tuple(
        dataclasses.replace(
            node,
            devices=tuple(
                dataclasses.replace(d, type=own) if d.name == device else d for d in node.devices
            ),
        )
        for node in cluster.nodes
    )
    return dataclasses.replace(cluster, nodes=nodes), new_profile


def layer_moves(
    old: Sequence[tuple[int, int]], new: Sequence[tuple[int, int]]
) -> tuple[LayerMove, ...]:
    """Which contiguous layer ranges change stage between two splits of one VW's layers
    over the same stages (each a ``(first, last)`` per stage)."""
    owner_old = [s for s, (a, b) in enumerate(old) for _ in range(a, b)]
    owner_new = [s for s, (a, b) in enumerate(new) for _ in range(a, b)]
    moves: list[LayerMove] = []
    for j, (src, dst) in enumerate(zip(owner_old, owner_new, strict=True)):
        if src == dst:
            continue
        last = moves[-1] if moves else None
        if last is not None and last.last == j and (last.src, last.dst) == (src, dst):
            moves[-1] = dataclasses.replace(last, last=j + 1)
        else:
            moves.append(LayerMove(j, j + 1, src, dst))
    return tuple(moves)


def _job_rate(parts: Sequence[Partition], minibatch: int) -> float:
    """Predicted samples/s of a job whose virtual workers run these partitions: in the
    steady state WSP lets no virtual worker get more than D waves ahead, so every one runs
    as many waves as the slowest, each wave its Nm minibatches."""
    if len(parts) == 1:
        return minibatch * parts[0].minibatches_per_s
    waves = min(p.minibatches_per_s / p.nm for p in parts)
    return minibatch * waves * sum(p.nm for p in parts)


def _over_cap(p: Partition) -> str | None:
    """The first stage of ``p`` whose memory is over its device's cap."""
    for s, (name, mem, cap) in enumerate(zip(p.devices, p.memory, p.caps, strict=True)):
        if mem.total > cap:
            return (
                f"stage {s} on {name} would need {format_size(mem.total)}, over its cap of "
                f"{format_size(cap)}"
            )
    return None


def _split(model: CostModel, devs: Sequence[Any], nm: int, pick_nm: bool) -> Partition:
    """The best split of the model over ``devs`` (and its Nm with ``pick_nm``)."""
    p = model.best_nm(devs) if pick_nm else model.partition(devs, nm)
    if not isinstance(p, Partition):
        raise PlanError(p.reason)
    return p


def replan(
    cluster: Any,
    profile: ModelProfile,
    vws: Sequence[VWLayout],
    inputs: PlanInputs,
    vw: int,
    device: str,
    ratio: float,
    *,
    min_gain: float,
    pick_nm: bool = False,
    schedule: str = "async",
    device_moves: bool = True,
) -> Decision:
    """Price re-splitting virtual worker ``vw`` of the running ``vws`` (their layouts as they
    run) now that ``device`` computes ``ratio`` times its profiled time, and decide.

    ``cluster``, ``profile`` and ``inputs`` are what the job was planned with; ``pick_nm``:
    the job leaves Nm to the planner (its new Nm is chosen too); ``schedule``: the job's
    (a synchronous job keeps its own activations, pinned, as the planner leaves them).
    Throughputs are the partitions' steady-state estimates (the bottleneck's rate, or Nm
    over the round trip where Nm does not fill the pipeline), combined over virtual
    workers as WSP paces them: the planner's event simulation
    (:mod:`hetpipe.planner.predict`) would cost more than the head can spend between two
    telemetry ticks at 16 stages x 200 layers. Never raises for a candidate that cannot
    run: the decision is then refused with the reason."""
    started = time.perf_counter()
    lay = vws[vw]
    stage = next((s for s, st in enumerate(lay.stages) if device in st.devices), -1)
    old_bounds = tuple((s.first, s.last) for s in lay.stages)
    base = Decision(
        vw, device, stage, ratio, False, "", old_bounds=old_bounds, old_nm=lay.nm, nm=lay.nm
    )

    def refused(reason: str, **extra: Any) -> Decision:
        return dataclasses.replace(
            base, reason=reason, plan_s=time.perf_counter() - started, **extra
        )

    if stage < 0:
        return refused(f"{device} runs no stage of vw {vw}")
    if any(len(st.devices) > 1 for st in lay.stages):
        return refused("a replicated stage's split is not re-planned online")
    try:
        world, drift_profile = drifted(cluster, profile, device, ratio)
        model = _cost_model(world, _at_minibatch(drift_profile, inputs.minibatch, []), inputs)
        by_name = {d.name: d for d in world.devices}
        devs = [tuple(by_name[s.device] for s in v.stages) for v in vws]
        static = [
            model.describe(d, [(s.first, s.last) for s in v.stages], v.nm)
            for d, v in zip(devs, vws, strict=True)
        ]
    except (PlanError, KeyError) as exc:
        return refused(f"cannot price the current split: {exc}")
    static_rate = _job_rate(static, inputs.minibatch)
    base = dataclasses.replace(base, static_samples_per_s=static_rate)
    alternative = (
        _best_move(model, devs, static, inputs, vw, device, static_rate, pick_nm)
        if device_moves and len(vws) > 1
        else None
    )
    try:
        cand = _split(model, devs[vw], lay.nm, pick_nm)
    except PlanError as exc:
        return refused(f"no split of vw {vw} fits: {exc}", alternative=alternative)
    layout = VWLayout.from_counts(
        [(d,) for d in cand.devices],
        cand.sizes,
        cand.nm,
        recompute=cand.recompute or None,  # empty: described without a policy
        swap=cand.swap or None,
    )
    if schedule != "async":
        layout = layout.pinned(inputs.activations)
    parts = [cand if v == vw else p for v, p in enumerate(static)]
    rate = _job_rate(parts, inputs.minibatch)
    gain = rate / static_rate if static_rate > 0 else 1.0
    bounds = tuple((s.first, s.last) for s in layout.stages)
    decided = dataclasses.replace(
        base,
        gain=gain,
        bounds=bounds,
        nm=layout.nm,
        moves=layer_moves(old_bounds, bounds),
        layout=layout,
        samples_per_s=rate,
        alternative=alternative,
        details={
            "stage_times": cand.stage_times,
            "static_stage_times": static[vw].stage_times,
            "types": cand.types,
        },
    )
    over = _over_cap(cand)
    if over is not None:
        reason = f"does not fit: {over}"
    elif not decided.changes:
        reason = "the current split is already the best for the drifted device"
    elif gain < min_gain:
        reason = f"predicted gain {gain:.2f}x is below min_gain {min_gain:g}"
    else:
        reason = f"predicted gain {gain:.2f}x"
        decided = dataclasses.replace(decided, take=True)
    if alternative is not None and alternative["gain"] > max(gain, min_gain):
        reason += (
            f"; moving {device} to vw {alternative['to_vw']} would gain "
            f"{alternative['gain']:.2f}x (a re-formation, not done live)"
        )
    return dataclasses.replace(decided, reason=reason, plan_s=time.perf_counter() - started)


def _best_move(
    model: CostModel,
    devs: Sequence[tuple[Any, ...]],
    static: Sequence[Partition],
    inputs: PlanInputs,
    vw: int,
    device: str,
    static_rate: float,
    pick_nm: bool,
) -> dict[str, Any] | None:
    """The best swap of ``device`` with a device of another virtual worker (both then
    re-split), as ``{"to_vw", "with", "gain", "samples_per_s"}``; None where none runs."""
    best: dict[str, Any] | None = None
    tried = 0
    mine = devs[vw]
    at = next(i for i, d in enumerate(mine) if d.name == device)
    for u, theirs in enumerate(devs):
        if u == vw:
            continue
        for j, other in enumerate(theirs):
            if tried >= MAX_DEVICE_MOVES:
                return best
            tried += 1
            a = (*mine[:at], other, *mine[at + 1 :])
            b = (*theirs[:j], mine[at], *theirs[j + 1 :])
            try:
                pa = _split(model, a, static[vw].nm, pick_nm)
                pb = _split(model, b, static[u].nm, pick_nm)
            except PlanError:
                continue
            parts = [pa if v == vw else pb if v == u else p for v, p in enumerate(static)]
            rate = _job_rate(parts, inputs.minibatch)
            gain = rate / static_rate if static_rate > 0 else 1.0
            if best is None or gain > best["gain"]:
                best = {
                    "to_vw": u,
                    "with": other.name,
                    "gain": round(gain, 4),
                    "samples_per_s": rate,
                }
    return best


def _swap(lay: VWLayout, a: str, b: str) -> VWLayout:
    """``lay`` with devices ``a`` and ``b`` exchanged wherever they lead a stage."""
    swap = {a: b, b: a}
    return VWLayout(
        tuple(
            dataclasses.replace(s, devices=(swap.get(s.device, s.device), *s.devices[1:]))
            for s in lay.stages
        ),
        lay.nm,
    )
