"""Schedules as data: what one stage of one virtual worker does next.

Pure (no torch, asyncio or sockets). The runtime (:mod:`hetpipe.pipeline`) executes the
actions a :class:`StageSchedule` gives it, and the planner's simulator
(:mod:`hetpipe.planner.simulate`) asks the same object what each simulated stage does next,
so a prediction never follows other rules than a run. Clock rules (waves, the pull's need)
stay in :mod:`hetpipe.core.wsp`.

Index letters used below:

====  =====================================================================================
k     stages in the virtual worker; ``stage`` is this stage's index, 0 .. k - 1
p     minibatch (async) or microbatch (sync) number inside the virtual worker, 0, 1, ...
nm    async: minibatches in flight and per wave (Nm); sync: microbatches per iteration (M)
c     wave (async) or iteration (sync); both are ``p // nm``
D     WSP staleness bound (async only)
====  =====================================================================================

Kinds:

- ``async`` (HetPipe): stage 0 admits p only after the backward of p - nm finished there; a
  ready backward goes before a ready forward (1F1B); the last stage runs the backward of p
  right after its forward; an optimizer step follows every backward (weight stashing keeps
  forward and backward on one version); after the backward of a wave's last minibatch the
  stage pushes the wave's update; before the first forward of wave c >= 1 it pulls with
  ``need = c - 1 - D`` (sent as soon as that forward is admitted, so it overlaps the
  backwards still running) and merges the answer. A replicated stage
  (:mod:`hetpipe.replicas`) waits before each step for its replicas' gradients of that
  minibatch (``Wait("replicas")``). A stage given a ``limit`` forwards only while it holds
  fewer minibatches than that between a forward and its backward (the plan's count,
  ``train.in_flight = "plan"``), and given a ``fill`` runs that many forwards before its
  first backward (:func:`fill_counts`), so it reaches that count whatever the timing:
  what it holds at its peak no longer depends on timing. Given ``defer``
  (``train.defer_weight_grad``), each backward is split as in ``zb-h1``: the input gradient
  (:class:`BackwardInput`, sent upstream at once) where the backward would run, and the
  weights' gradient (:class:`BackwardWeight`, then its optimizer step) deferred until the
  stage has nothing else ready (no input gradient to take, no forward to run, no wave to
  merge), so it fills what would be a bubble. Version semantics are weight stashing's: a
  minibatch's ``W`` differentiates the weights its forward used (its graph holds them), the
  ``W``s and their steps run one per minibatch in minibatch order, and a forward runs on
  the weights of the steps taken so far (a deferred step reaches a later forward as a
  late one would: one more unit of the local staleness the async kind already has). What
  a stage holds does not grow: admission and the limit still count a minibatch until its
  ``W``, and the last stage runs its ``W`` before its next forward (it holds one).
- ``gpipe`` and ``1f1b`` (synchronous, with a flush): an iteration is nm microbatches run in
  a fixed per-stage order (:func:`microbatch_order`; 1f1b with ``warmup`` extra warm-up
  forwards spans the orders between the two); gradients accumulate; after the
  iteration's last backward the stage exchanges gradients with the other virtual workers
  through its shards (``Pull``/``Merge`` with ``grads=True``, only with several), steps its
  optimizer once on the mean gradient and pushes the update to the global weights.
- ``zb-h1`` and ``zb-h2`` (synchronous, zero bubble, Qi et al. ICLR'24): as ``1f1b``, but each
  backward is split in two actions, :class:`BackwardInput` (the gradient of the stage's
  input, which the previous stage waits for, sent at once) and :class:`BackwardWeight` (the
  weights' gradient, deferred to fill what would be a bubble). Their orders hold ``("I", j)``
  and ``("W", j)`` entries instead of ``("B", j)``; a microbatch's activations stay until its
  weight step.
- ``interleaved-1f1b`` and ``zbv`` (synchronous, device-level: a device runs several stages of
  the virtual worker): each device runs its stages' actions in one order
  (:mod:`hetpipe.core.devschedule`: Megatron-LM's interleaved 1F1B, and the V-shaped zero
  bubble ZB-V with split backwards); a stage's order is its device's, that stage's entries
  only, given ``devices`` (the virtual worker's device count). Otherwise as ``1f1b``.

Every stage starts with ``Pull(0)`` and ``Merge(0)``: the initial weights.

A schedule is driven by two calls: :meth:`StageSchedule.next` says what to do now, given
which inputs have arrived (an :class:`Inputs`), without changing anything; the caller
executes it and reports it with :meth:`StageSchedule.done`. ``Wait`` and ``Done`` are never
reported.

One file on purpose: every kind shares the admission, hand-off and wave rules of one
:class:`StageSchedule`, and the runtime, the simulator and the memory model must read them
from one place (a copy per kind would drift).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from hetpipe.core.wsp import pull_need

__all__ = [
    "DEVICE_KINDS",
    "INPUT_GRAD_SHARE",
    "KINDS",
    "SYNCHRONOUS",
    "SYNC_KINDS",
    "ZB_KINDS",
    "Action",
    "Backward",
    "BackwardInput",
    "BackwardWeight",
    "Done",
    "Forward",
    "Inputs",
    "Merge",
    "OptimizerStep",
    "Pull",
    "Push",
    "ScheduleError",
    "StageSchedule",
    "Wait",
    "check_order",
    "clock_cycles",
    "deferred_peak",
    "fill_counts",
    "held_peak",
    "iteration_trips",
    "max_deferred",
    "max_in_flight",
    "microbatch_order",
    "stage_tables",
]

# the synchronous kinds whose order is set per stage (the planner searches them, one stage a
# device)
SYNC_KINDS = ("gpipe", "1f1b", "zb-h1", "zb-h2")
# the synchronous kinds whose order is set per device, for a device holding several stages
# (hetpipe.core.devschedule); each stage runs its projection of its device's order
DEVICE_KINDS = ("interleaved-1f1b", "zbv")
SYNCHRONOUS = (*SYNC_KINDS, *DEVICE_KINDS)  # every synchronous kind
KINDS = ("async", *SYNCHRONOUS)
ZB_KINDS = ("zb-h1", "zb-h2")  # the per-stage synchronous kinds whose backwards are split


class ScheduleError(ValueError):
    """A schedule that cannot exist (bad k, stage, nm, order); ``str(e)`` is one line."""


# -- actions ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Forward:
    """Run the forward of minibatch ``p`` (on the last stage: and its loss)."""

    p: int


@dataclass(frozen=True, slots=True)
class Backward:
    """Run the backward of minibatch ``p``."""

    p: int


@dataclass(frozen=True, slots=True)
class BackwardInput:
    """Run the first half of the backward of microbatch ``p``: the gradient of the stage's
    input only (what the previous stage waits for); the graph is kept for
    :class:`BackwardWeight`."""

    p: int


@dataclass(frozen=True, slots=True)
class BackwardWeight:
    """Run the second half of the backward of microbatch ``p``: the weights' gradient from
    the graph :class:`BackwardInput` kept, accumulated for the step; frees the graph."""

    p: int


@dataclass(frozen=True, slots=True)
class OptimizerStep:
    """Step the optimizer: after backward ``i`` (async) or at the end of iteration ``i``."""

    i: int


@dataclass(frozen=True, slots=True)
class Push:
    """Send this stage's update of wave/iteration ``c`` to its shards."""

    c: int


@dataclass(frozen=True, slots=True)
class Pull:
    """Ask the shards: the weights for wave ``c``, or (``grads``) iteration c's mean gradient.

    Sending it never blocks; :class:`Merge` takes the answer.
    """

    c: int
    grads: bool = False


@dataclass(frozen=True, slots=True)
class Merge:
    """Take the answer of ``Pull(c, grads)``: load the weights, or adopt the mean gradient."""

    c: int
    grads: bool = False


@dataclass(frozen=True, slots=True)
class Wait:
    """Nothing can run until an input arrives: ``what`` is ``pull``, ``gradient``,
    ``activation``, ``reduce`` or ``replicas``, for minibatch ``p`` / wave ``c`` (WSP ``need``)."""

    what: str
    p: int | None = None
    c: int | None = None
    need: int | None = None


@dataclass(frozen=True, slots=True)
class Done:
    """Every action of this stage has been given (push acknowledgements may be outstanding)."""


Action = (
    Forward
    | Backward
    | BackwardInput
    | BackwardWeight
    | OptimizerStep
    | Push
    | Pull
    | Merge
    | Wait
    | Done
)
COMPUTE = (Forward, Backward, BackwardInput, BackwardWeight, OptimizerStep)
# the actions that run on the compute thread and take time, one tick each in clock_cycles
PASSES = (Forward, Backward, BackwardInput, BackwardWeight)
# what each order entry's letter runs
ORDER_ACTIONS: dict[str, type] = {
    "F": Forward,
    "B": Backward,
    "I": BackwardInput,
    "W": BackwardWeight,
}


class Inputs(Protocol):
    """What has arrived at a stage; the runtime and the simulator each implement it."""

    def has_activation(self, p: int) -> bool: ...

    def has_gradient(self, p: int) -> bool: ...

    def pulled(self, c: int, grads: bool) -> bool: ...

    def combined(self, p: int) -> bool:
        """Whether every other replica's gradients of ``p`` have arrived (asked only of a
        replicated stage)."""
        ...


# -- microbatch order of the synchronous kinds -------------------------------------------------


def microbatch_order(
    kind: str, k: int, stage: int, m: int, warmup: int = 0, devices: int | None = None
) -> tuple[tuple[str, int], ...]:
    """The order of one iteration's forwards ``("F", j)`` and backwards ``("B", j)`` at a stage.

    ``gpipe``: all m forwards, then all m backwards, both in microbatch order. ``1f1b`` (with a
    flush): ``k - stage - 1 + warmup`` warm-up forwards (at most m), then one forward and one
    backward in turn, then the remaining backwards; with ``warmup`` 0 (1F1B as published) the
    last stage alternates from the start.

    ``warmup`` spans the orders between the two: each extra warm-up forward lets a stage run
    ahead of a slower successor by one more microbatch (fewer bubbles where stage times
    differ) at the memory of one more microbatch in flight; from ``m - 1`` on, every stage
    runs gpipe's order. Every stage gets the same extra, so a stage always warms up one more
    than its successor (or runs all m forwards): its first backward needs the successor's
    first backward, which needs no forward this stage has not yet scheduled, so the stages'
    orders never deadlock.

    A device-level kind (:data:`DEVICE_KINDS`): the stage's projection of its device's order
    on ``devices`` devices (:func:`hetpipe.core.devschedule.stage_order`; None: two stages a
    device, :func:`hetpipe.core.devschedule.default_devices`).
    """
    _check_position(k, stage)
    if kind in DEVICE_KINDS:
        from hetpipe.core import devschedule  # it builds on this module

        if warmup:
            raise ScheduleError(f"warmup: extra warm-up forwards are for 1f1b, not {kind}")
        if devices is None:
            devices = devschedule.default_devices(kind, k)
        return devschedule.stage_order(kind, k, devices, stage, m)
    if m < 1:
        raise ScheduleError(f"microbatches per iteration: must be >= 1, got {m}")
    if warmup < 0:
        raise ScheduleError(f"warmup: must be >= 0, got {warmup}")
    if kind == "gpipe":
        return tuple([("F", j) for j in range(m)] + [("B", j) for j in range(m)])
    if kind in ZB_KINDS:
        if warmup:
            raise ScheduleError(f"warmup: extra warm-up forwards are for 1f1b, not {kind}")
        return zb_order(k, stage, m, *ZB_SHAPES[kind](k, stage))
    if kind != "1f1b":
        raise ScheduleError(f"no microbatch order for schedule {kind!r}")
    warm = min(k - stage - 1 + warmup, m)
    order = [("F", j) for j in range(warm)]
    f, b = warm, 0
    while f < m:
        order += [("F", f), ("B", b)]
        f, b = f + 1, b + 1
    order += [("B", j) for j in range(b, m)]
    return tuple(order)


def zb_order(k: int, stage: int, m: int, warm: int, defer: int) -> tuple[tuple[str, int], ...]:
    """A zero-bubble order with split backwards: ``warm`` warm-up forwards (at most m), then
    one forward and one input gradient in turn, then the remaining input gradients; the
    weight gradients run in microbatch order, one after each forward/input-gradient step
    from the ``defer``-th step of that steady part on (one per step after the last
    forward), and the rest at the end.

    A deferred weight gradient fills the time the stage would otherwise wait for a gradient
    from the next stage; each one deferred holds one more microbatch's activations. The
    orders are deadlock-free when each stage warms up at least one more than its successor
    (as 1f1b): the input gradient of j at a stage needs the successor's, which comes after
    forwards the stage has already run, and a weight gradient waits for nothing.
    """
    _check_position(k, stage)
    if m < 1:
        raise ScheduleError(f"microbatches per iteration: must be >= 1, got {m}")
    w = min(warm, m)
    order = [("F", j) for j in range(w)]
    f, i, done, step = w, 0, 0, 0  # next forward, input gradient, weight gradient; steps
    while i < m:
        if f < m:
            order.append(("F", f))
            f += 1
        order.append(("I", i))
        i += 1
        if step >= defer and done < i:
            order.append(("W", done))
            done += 1
        step += 1
    order += [("W", j) for j in range(done, m)]
    return tuple(order)


def _zb_h1(k: int, stage: int) -> tuple[int, int]:
    # 1f1b's warm-up; stage s defers s weight gradients (torch's ZB1P, Qi et al.'s ZB-H1):
    # every stage then holds at most k microbatches, the first stage's count in 1f1b
    return k - stage - 1, stage


def _zb_h2(k: int, stage: int) -> tuple[int, int]:
    # twice 1f1b's warm-up, 2 (k - s - 1) forwards: a stage runs ahead of a slower
    # successor by that many more microbatches (Qi et al.'s ZB-H2 memory, 2k - 1 on the
    # first stage); the weight gradients deferred as in zb-h1
    return 2 * (k - stage - 1), stage


# The share of a backward's time its input gradient takes (the weight gradient the rest),
# by which the planner prices a split backward: a linear or convolution layer's input and
# weight gradients are each one product the size of its forward, so 1:1. (The first stage
# has no input gradient to give and runs its whole backward at W; it is priced alike, which
# moves time between its two halves, not its total.)
INPUT_GRAD_SHARE = 0.5

# per zero-bubble kind: (warm-up forwards, weight gradients deferred) of a stage
ZB_SHAPES: dict[str, Callable[[int, int], tuple[int, int]]] = {"zb-h1": _zb_h1, "zb-h2": _zb_h2}


def held_peak(order: Sequence[tuple[str, int]]) -> int:
    """The most microbatches an order holds at once between a forward and the end of its
    backward (``B``, or ``W`` where the backward is split): what the memory model charges."""
    held = peak = 0
    for op, _j in order:
        if op == "F":
            held += 1
            peak = max(peak, held)
        elif op in ("B", "W"):
            held -= 1
    return peak


def deferred_peak(order: Sequence[tuple[str, int]]) -> int:
    """The most microbatches an order holds at once between an input gradient (``I``) and
    its weight gradient (``W``): each keeps the gradients the weight gradient starts from."""
    held = peak = 0
    for op, _j in order:
        if op == "I":
            held += 1
            peak = max(peak, held)
        elif op == "W":
            held -= 1
    return peak


def max_deferred(
    kind: str,
    k: int,
    stage: int,
    nm: int,
    devices: int | None = None,
    defer: bool = False,
    limit: int | None = None,
) -> int:
    """What :func:`deferred_peak` charges a stage of ``kind``: 0 where backwards are whole
    (``devices``: a device-level kind's device count, as :func:`microbatch_order`). The
    async kind with ``defer`` (:class:`StageSchedule`): every minibatch the stage holds may
    wait for its weight gradient, so what it holds (:func:`max_in_flight`, ``limit`` as
    there)."""
    if kind == "async":
        return max_in_flight(kind, k, stage, nm, limit=limit) if defer else 0
    if kind not in (*ZB_KINDS, *DEVICE_KINDS):
        return 0
    return deferred_peak(microbatch_order(kind, k, stage, nm, devices=devices))


@functools.lru_cache(maxsize=4096)
def iteration_trips(
    k: int, stage: int, order: tuple[tuple[str, int], ...]
) -> tuple[tuple[Action, ...], ...]:
    """One synchronous iteration of a stage of a virtual worker alone in its job (``order``:
    its forwards and backwards), in its hand-offs to the compute thread (:meth:`StageSchedule.
    trip`), the step and push included; the initial pull and merge are left out. What joins
    a hand-off never waits for an input (a first stage's forward reads data, a last stage's
    backward its loss, the step and push follow the last backward), so the grouping does not
    depend on when inputs arrive: the planner's search prices an iteration from it without
    simulating (:func:`hetpipe.planner.simulate.iteration_time`)."""
    m = sum(op == "F" for op, _ in order)
    # the sync kinds differ only in their default order, given here
    sched = StageSchedule(SYNC_KINDS[0], k=k, stage=stage, nm=m, total=m, order=order)
    out: list[tuple[Action, ...]] = []
    while not isinstance(a := sched.next(_EVERYTHING), Done):
        sched.done(a)
        if isinstance(a, (*COMPUTE, Push)):
            out.append(tuple(sched.trip(a, _EVERYTHING)))
    return tuple(out)


def check_order(order: Sequence[tuple[str, int]], m: int) -> None:
    """Refuse an order that is not a valid iteration: each microbatch forward once and
    backward once, either whole (``B``) or split (``I`` then ``W``); forwards, backwards (or
    input gradients) and weight gradients each in microbatch order; a backward after its
    forward, a weight gradient after its input gradient."""
    bad = [op for op, _j in order if op not in ORDER_ACTIONS]
    if bad:
        raise ScheduleError(f"order entry {bad[0]!r}: must be one of F, B, I, W")
    fwd = [j for op, j in order if op == "F"]
    bwd = [j for op, j in order if op in ("B", "I")]
    if fwd != list(range(m)) or bwd != list(range(m)):
        raise ScheduleError(f"order must run forwards and backwards of 0..{m - 1} in order")
    split = {j for op, j in order if op == "I"}
    weights = [j for op, j in order if op == "W"]
    if weights != sorted(split):
        raise ScheduleError(
            "order must run one weight gradient (W) per input gradient (I), in order"
        )
    seen: set[int] = set()
    inputs: set[int] = set()
    for op, j in order:
        if op == "F":
            seen.add(j)
        elif op == "W":
            if j not in inputs:
                raise ScheduleError(f"order runs the weight gradient of {j} before its input's")
        elif j not in seen:
            raise ScheduleError(f"order runs the backward of {j} before its forward")
        else:
            inputs.add(j)


def max_in_flight(
    kind: str,
    k: int,
    stage: int,
    nm: int,
    fixed: bool = False,
    warmup: int = 0,
    limit: int | None = None,
    devices: int | None = None,
) -> int:
    """The most minibatches ``stage`` of ``k`` can hold between a forward and its backward,
    over EVERY timing the schedule permits (``nm``: Nm, or M in the synchronous kinds;
    ``fixed``: async, the stage runs the lock-step order as its ``sequence``).

    This is the count the memory model charges (:mod:`hetpipe.core.memory`): a device cap
    must hold whatever the relative speeds and arrival times, so the count is the schedule's
    maximum, never what one simulated timing happens to reach.

    - ``async``: the last stage runs a backward right after its forward: 1. Any other stage:
      Nm. Admission bounds it (stage 0 admits p after the backward of p - Nm there, and a
      later stage forwards only what stage 0 admitted and differentiates p before stage 0
      does), and a timing reaches it: when each stage's successors lag (a slower device
      after it, a late gradient), stage 0 admits Nm at once and each stage forwards all of
      them before the first gradient returns. Stages whose successors keep pace hold fewer,
      by timing only. A stage that runs the lock-step order as a fixed ``sequence``
      (weights not stashed, :class:`hetpipe.core.staleness.StageTable`) holds what that order
      holds, whatever the timing: ``min(Nm, 2 (k - stage) - 1)``, its forwards until the
      first gradient returns after the round trip through the later stages. A greedy stage
      given a ``limit`` (:class:`StageSchedule`) holds at most that.
    - ``gpipe``: all M microbatches of an iteration, at every stage.
    - ``1f1b``: its fixed order's warm-up plus one, ``min(M, k - stage + warmup)``, under
      any timing (``warmup``: :func:`microbatch_order`'s extra warm-up forwards).
    - ``zb-h1``, ``zb-h2``: what the fixed order holds until each weight gradient
      (:func:`held_peak`): a microbatch's graph stays until its ``W``.
    - ``interleaved-1f1b``, ``zbv``: what the stage's projection of its device's order holds
      (:func:`held_peak`; ``devices`` as :func:`microbatch_order`).
    """
    _check_position(k, stage)
    if nm < 1:
        raise ScheduleError(f"nm: must be >= 1, got {nm}")
    if kind == "gpipe":
        return nm
    if kind == "1f1b":
        return min(nm, k - stage + warmup)
    if kind in ZB_KINDS:
        return held_peak(microbatch_order(kind, k, stage, nm))
    if kind in DEVICE_KINDS:
        return held_peak(microbatch_order(kind, k, stage, nm, devices=devices))
    if kind != "async":
        raise ScheduleError(f"schedule: unknown kind {kind!r} (one of: {', '.join(KINDS)})")
    if fixed:
        return min(nm, 2 * (k - stage) - 1)
    most = 1 if stage == k - 1 else nm
    return most if limit is None else min(most, limit)


def fill_counts(limits: Sequence[int], nm: int) -> tuple[int, ...]:
    """Per stage of an async virtual worker whose stages are limited (``limits``, 0: none),
    the forwards each limited stage runs before its first backward: the smallest limit of
    that stage and every stage before it (0 where the stage has no limit, and on the last
    stage, whose backward follows its forward at once).

    Filled so, a limited stage holds exactly its fill at the end of its warm-up, whatever
    the timing, instead of whatever count the first gradient's return happens to find; with
    the limits non-increasing (the planner's usual case) that is its limit, the peak the
    plan charges. Not more: before a stage's first backward no stage before it has run a
    backward either (a gradient comes from the stage after), so stage j has forwarded at
    most its limit, and a larger fill would wait for an activation that never comes."""
    fills = []
    low = nm
    for i, limit in enumerate(limits):
        low = min(low, limit or nm)
        fills.append(low if limit and i < len(limits) - 1 else 0)
    return tuple(fills)


def _check_position(k: int, stage: int) -> None:
    if k < 1:
        raise ScheduleError(f"k: must be >= 1, got {k}")
    if not 0 <= stage < k:
        raise ScheduleError(f"stage: must be in 0..{k - 1}, got {stage}")


# -- the schedule of one stage ---------------------------------------------------------------


class StageSchedule:
    """The action sequence of one stage (see the module docstring for the rules).

    ``pulls``: the stage exchanges with its shards during the run (several virtual workers
    and state on the shards); a virtual worker alone in its job needs no pull after the
    first (its global weights hold nothing but its own updates). ``pushes``: the stage has
    state on the shards. ``order``: a sync iteration's microbatch order for this stage
    (default: the kind's own, from :func:`microbatch_order` with ``warmup``). ``sequence``
    (async only): the n-th forward or backward this stage must run, ``("F", p)`` or
    ``("B", p)``, instead of greedy 1F1B (a ready backward first); a stage that predicts
    weights runs the lock-step order its s was counted on
    (:class:`hetpipe.core.staleness.StageTable`), whatever the timing. ``limit`` (async, greedy
    order only): the most minibatches the stage holds between a forward and its backward; a
    forward waits for a backward beyond it. None: the schedule's own maximum
    (:func:`max_in_flight`). Any limit >= 1 is deadlock-free: the oldest minibatch a stage
    holds is also the oldest its successor holds or the next it admits, so its gradient
    always comes back. ``fill`` (with a limit, at most it): the forwards the stage runs
    before its first backward (of this run's minibatches; at most ``total``), deadlock-free
    at the counts :func:`fill_counts` gives. ``devices`` (a device-level kind only): the
    virtual worker's device count, which its stage orders are projected from (None: two
    stages a device).
    """

    def __init__(
        self,
        kind: str,
        *,
        k: int,
        stage: int,
        nm: int,
        total: int,
        staleness: int = 0,
        pulls: bool = False,
        pushes: bool = True,
        order: Sequence[tuple[str, int]] | None = None,
        sequence: Callable[[int], tuple[str, int]] | None = None,
        replicated: bool = False,
        warmup: int = 0,
        limit: int | None = None,
        fill: int = 0,
        devices: int | None = None,
        defer: bool = False,
    ) -> None:
        if kind not in KINDS:
            raise ScheduleError(f"schedule: unknown kind {kind!r} (one of: {', '.join(KINDS)})")
        _check_position(k, stage)
        if nm < 1:
            raise ScheduleError(f"nm: must be >= 1, got {nm}")
        if total < 1:
            raise ScheduleError(f"total: must be >= 1, got {total}")
        if staleness < 0:
            raise ScheduleError(f"staleness: must be >= 0, got {staleness}")
        self.kind, self.k, self.stage, self.nm, self.total = kind, k, stage, nm, total
        self.staleness = staleness
        self.pulls, self.pushes = pulls, pushes
        self.first, self.last = stage == 0, stage == k - 1
        self.sync = kind in SYNCHRONOUS
        self.waves = -(-total // nm)
        self.nf = 0  # next forward
        self.nb = 0  # next backward (with split backwards: next weight gradient)
        self.ni = 0  # next input gradient (split backwards)
        self.steps = 0  # optimizer steps taken
        self.pushed = 0  # waves/iterations pushed
        self.merged = -1  # the wave whose weights are loaded (async), 0 once started (sync)
        self.sent: set[tuple[int, bool]] = set()  # pulls sent
        self.reduced = -1  # the iteration whose mean gradient is merged (sync)
        self.pos = 0  # position in the current iteration's order (sync)
        self._orders: dict[int, tuple[tuple[str, int], ...]] = {}
        if sequence is not None and self.sync:
            raise ScheduleError("a fixed compute sequence is for the async kind only")
        self.sequence = sequence
        if replicated and self.sync:
            raise ScheduleError("replicated stages are for the async kind only")
        self.replicated = replicated
        if warmup and kind != "1f1b":
            raise ScheduleError(f"warmup: extra warm-up forwards are for 1f1b, not {kind}")
        if warmup < 0:
            raise ScheduleError(f"warmup: must be >= 0, got {warmup}")
        self.warmup = warmup
        if limit is not None and (kind != "async" or sequence is not None):
            raise ScheduleError(
                "an in-flight limit is for the async kind's greedy order only "
                "(a fixed order holds its own count)"
            )
        if limit is not None and limit < 1:
            raise ScheduleError(f"in-flight limit: must be >= 1, got {limit}")
        # nm bounds every async stage already (stage 0 admits so, and no later stage holds
        # more than stage 0), so no limit is nm
        self.limit = nm if limit is None else min(limit, nm)
        if fill and (limit is None or not 1 <= fill <= self.limit):
            raise ScheduleError(
                f"fill: forwards before the first backward need a limit and "
                f"1..limit ({self.limit}), got {fill}"
            )
        self.fill = min(fill, total)
        if devices is not None and kind not in DEVICE_KINDS:
            raise ScheduleError(f"devices: a device count is for {DEVICE_KINDS}, not {kind}")
        self.devices = devices
        if defer and (kind != "async" or sequence is not None or replicated):
            raise ScheduleError(
                "defer: deferred weight gradients are for the async kind's greedy order of "
                "an unreplicated stage (zb-h1, zb-h2 and zbv split the synchronous kinds')"
            )
        self.defer = defer
        # a device-level kind: the device runs its stages' passes in its own order, so no
        # pass joins another in one hand-off (the device's next may be another stage's)
        self.alone = kind in DEVICE_KINDS
        if order is not None:
            check_order(order, nm)
            self._orders[nm] = tuple(order)

    # -- queries ---------------------------------------------------------------------------

    def in_iteration(self, c: int) -> int:
        """Microbatches of iteration ``c`` (the last one may be short)."""
        return min(self.nm, self.total - c * self.nm)

    def order(self, c: int) -> tuple[tuple[str, int], ...]:
        m = self.in_iteration(c)
        if m not in self._orders:
            self._orders[m] = microbatch_order(
                self.kind, self.k, self.stage, m, self.warmup, self.devices
            )
        return self._orders[m]

    def deferred(self) -> BackwardWeight | None:
        """The oldest deferred weight gradient (``defer``), if one waits: what a stage held
        at a boundary (a layer migration's) runs before it stops there, so it drains."""
        return BackwardWeight(self.nb) if self.defer and self.nb < self.ni else None

    @property
    def finished(self) -> bool:
        return isinstance(self.next(_NOTHING), Done)

    # -- next / done -----------------------------------------------------------------------

    def next(self, inputs: Inputs) -> Action:
        """The action to run now; it changes nothing until reported with :meth:`done`."""
        if self.merged < 0:
            if (0, False) not in self.sent:
                return Pull(0)
            if inputs.pulled(0, False):
                return Merge(0)
            return Wait("pull", p=0, c=0, need=pull_need(0, self.staleness))
        if self.sync:
            return self._next_sync(inputs)
        return self._next_deferred(inputs) if self.defer else self._next_async(inputs)

    def _next_async(self, inputs: Inputs) -> Action:
        # the hottest function of the planner's simulator: plain locals, no helper calls
        nb, nf, nm, total = self.nb, self.nf, self.nm, self.total
        if self.steps < nb:
            if self.replicated and not inputs.combined(nb - 1):
                return Wait("replicas", p=nb - 1)
            return OptimizerStep(nb - 1)
        if self.pushes:
            closed = self.waves if nb >= total else nb // nm  # waves fully stepped here
            if self.pushed < closed:
                return Push(self.pushed)
        if self.last and nb < nf:
            return Backward(nb)  # the loss is here: its backward follows at once
        q = nf
        c = q // nm
        # the pull of a wave goes out, and its answer is merged, once stage 0 may admit the
        # wave's first minibatch (a later stage: at once), so it overlaps the backwards still
        # to run; the forward itself also waits for the stage's limit
        prefetch = not self.first or q - nm < nb
        admitted = q - nb < self.limit
        opens_wave = self.pulls and q < total and q % nm == 0 and c > self.merged
        if opens_wave and prefetch and (c, False) not in self.sent:
            return Pull(c)  # prefetch: overlaps the backwards still to run
        n = nf + nb
        turn = self.sequence(n)[0] if self.sequence and n < 2 * total else None
        filling = nf < self.fill  # no backward before the warm-up's forwards
        if nb < nf and inputs.has_gradient(nb) and turn != "F" and not filling:
            return Backward(nb)
        blocked: Wait | None = None
        if q < total and turn != "B":
            blocked = self._merge_or_forward(q, c, opens_wave, prefetch, admitted, inputs)
            if not isinstance(blocked, Wait | None):
                return blocked
        if nb >= total and self.pushed >= (self.waves if self.pushes else 0):
            return Done()
        if blocked is not None:
            return blocked
        if nb < nf and turn != "F" and not filling:
            return Wait("gradient", p=nb)
        return Wait("activation", p=q)

    def _merge_or_forward(
        self, q: int, c: int, opens_wave: bool, prefetch: bool, admitted: bool, inputs: Inputs
    ) -> Action | None:
        """An async stage's next minibatch ``q`` (of wave ``c``): the merge that opens its
        wave, or the wait for that wave's pull, or its forward; None where it must wait for
        admission or its activation."""
        if opens_wave:
            if not prefetch:
                return None
            if inputs.pulled(c, False):
                return Merge(c)
            return Wait("pull", p=q, c=c, need=pull_need(c, self.staleness))
        if admitted and (self.first or inputs.has_activation(q)):
            return Forward(q)
        return None

    def _next_deferred(self, inputs: Inputs) -> Action:
        """:meth:`_next_async` with split backwards: an input gradient where the backward
        would run, its weight gradient once nothing else is ready (``defer``)."""
        nb, ni, nf, nm, total = self.nb, self.ni, self.nf, self.nm, self.total
        if self.steps < nb:
            return OptimizerStep(nb - 1)
        if self.pushes:
            closed = self.waves if nb >= total else nb // nm  # waves fully stepped here
            if self.pushed < closed:
                return Push(self.pushed)
        if self.last and ni < nf:
            return BackwardInput(ni)  # the loss is here: its input gradient follows at once
        q = nf
        c = q // nm
        prefetch = not self.first or q - nm < nb
        # a minibatch counts until its weight gradient; the last stage holds one
        admitted = q - nb < (1 if self.last else self.limit)
        opens_wave = self.pulls and q < total and q % nm == 0 and c > self.merged
        if opens_wave and prefetch and (c, False) not in self.sent:
            return Pull(c)
        filling = nf < self.fill
        if ni < nf and inputs.has_gradient(ni) and not filling:
            return BackwardInput(ni)
        blocked: Wait | None = None
        if q < total:
            blocked = self._merge_or_forward(q, c, opens_wave, prefetch, admitted, inputs)
            if not isinstance(blocked, Wait | None):
                return blocked
        if nb < ni:
            return BackwardWeight(nb)  # nothing else is ready: the deferred W fills the gap
        if nb >= total and self.pushed >= (self.waves if self.pushes else 0):
            return Done()
        if blocked is not None:
            return blocked
        if ni < nf and not filling:
            return Wait("gradient", p=ni)
        return Wait("activation", p=q)

    def _next_sync(self, inputs: Inputs) -> Action:
        c = self.steps  # the iteration in progress
        if c >= self.waves:
            if self.pushes and self.pushed < self.waves:
                return Push(self.pushed)
            return Done()
        if self.pushes and self.pushed < c:
            return Push(self.pushed)
        order = self.order(c)
        if self.pos < len(order):
            op, j = order[self.pos]
            p = c * self.nm + j
            if op == "F":
                if self.first or inputs.has_activation(p):
                    return Forward(p)
                return Wait("activation", p=p)
            if op == "W":
                return BackwardWeight(p)  # its input gradient ran: it waits for nothing
            if self.last or inputs.has_gradient(p):
                return Backward(p) if op == "B" else BackwardInput(p)
            return Wait("gradient", p=p)
        if self.pulls and self.reduced < c:
            if (c, True) not in self.sent:
                return Pull(c, grads=True)
            if inputs.pulled(c, True):
                return Merge(c, grads=True)
            return Wait("reduce", c=c)
        return OptimizerStep(c)

    def joins(self, run: Sequence[Action], nxt: Action) -> bool:
        """Whether ``nxt`` (what :meth:`next` gives after ``run`` was reported) goes to the
        compute thread in the same hand-off as ``run``, the compute actions begun by one of
        them: the optimizer step after a backward, the push of the wave that step closed, on
        the last stage the backward after its forward, and on the first stage the next
        forward (its input is the data; a first stage's backward sends nothing, so nothing
        waits for the end of the run but that forward's own activation). A push that other
        virtual workers may wait for is not held back behind a forward. Under a
        device-level kind no pass joins another (its device's next pass may be another
        stage's). The runtime runs a hand-off this way (:meth:`trip`) and the simulator times
        it so: one trip to the compute thread and back per hand-off."""
        prev = run[-1]
        kind = type(nxt)
        return (
            kind is OptimizerStep
            or (kind is Push and type(prev) is OptimizerStep)
            or (
                not self.alone
                and self.last
                and kind in (Backward, BackwardInput)
                and type(prev) is Forward
                and nxt.p == prev.p  # type: ignore[union-attr]
            )
            or (
                not self.alone
                and self.first
                and kind is Forward
                and not any(type(a) is Forward for a in run)
                and not (self.pulls and any(type(a) is Push for a in run))
            )
        )

    def trip(self, action: Action, inputs: Inputs) -> list[Action]:
        """``action`` (just reported) and what :meth:`joins` it, each reported in turn: one
        hand-off to the compute thread. The runtime runs it as one; the simulator and the
        synchronous search (:func:`iteration_trips`) charge it one hop."""
        run = [action]
        while self.joins(run, nxt := self.next(inputs)):
            self.done(nxt)
            run.append(nxt)
        return run

    def done(self, action: Action) -> None:
        """Record that ``action`` (the one :meth:`next` gave) has been run."""
        kind = type(action)
        if kind is Forward:
            self.nf = action.p + 1  # type: ignore[union-attr]
            self.pos += self.sync
        elif kind is Backward or kind is BackwardWeight:
            self.nb = action.p + 1  # type: ignore[union-attr]
            self.pos += self.sync
        elif kind is BackwardInput:
            self.ni = action.p + 1  # type: ignore[union-attr]
            self.pos += self.sync
        elif kind is OptimizerStep:
            self.steps += 1
            if self.sync:
                self.pos = 0
        elif kind is Push:
            self.pushed = action.c + 1  # type: ignore[union-attr]
        elif kind is Pull:
            self.sent.add((action.c, action.grads))  # type: ignore[union-attr]
        elif kind is Merge:
            if action.grads:  # type: ignore[union-attr]
                self.reduced = action.c  # type: ignore[union-attr]
            else:
                self.merged = action.c  # type: ignore[union-attr]
            self.sent.discard((action.c, action.grads))  # type: ignore[union-attr]
        else:
            raise ScheduleError(f"{action!r} is not an action to report")


class _Arrived:
    """Inputs where nothing (``False``: to ask whether a schedule has anything left) or
    everything (``True``: to list a stage's actions without timing) has arrived."""

    def __init__(self, arrived: bool) -> None:
        self.arrived = arrived

    def has_activation(self, p: int) -> bool:
        return self.arrived

    def has_gradient(self, p: int) -> bool:
        return self.arrived

    def pulled(self, c: int, grads: bool) -> bool:
        return self.arrived

    def combined(self, p: int) -> bool:
        return self.arrived


_NOTHING = _Arrived(False)
_EVERYTHING = _Arrived(True)


# -- whole tables ------------------------------------------------------------------------------


def clock_cycles(
    schedules: Sequence[StageSchedule], *, limit: int = 100_000
) -> Iterator[tuple[int, int, Action]]:
    """Run one virtual worker's stages in lock step and yield ``(tick, stage, action)``.

    Each tick every stage runs at most one forward or backward (or one half of a split
    backward); the actions around them (optimizer step, push, pull, merge) take no time.
    What a stage sends in tick t arrives at its neighbour for tick t + 1, and pulls are
    answered at once (no other virtual worker holds the clock back). This is the timing the
    exact action tables in the tests are written for; the planner's simulator times the same
    schedules with measured costs.
    """
    k = len(schedules)
    acts: list[set[int]] = [set() for _ in range(k)]
    grads: list[set[int]] = [set() for _ in range(k)]
    sent: list[set[tuple[int, bool]]] = [set() for _ in range(k)]
    inputs = [_Ticked(acts[s], grads[s], sent[s]) for s in range(k)]
    for tick in range(limit):
        arriving: list[tuple[set[int], int]] = []
        for s, sch in enumerate(schedules):
            computed = False
            while True:
                a = sch.next(inputs[s])
                if isinstance(a, Wait | Done) or (computed and isinstance(a, PASSES)):
                    break
                sch.done(a)
                yield tick, s, a
                if isinstance(a, Pull):
                    sent[s].add((a.c, a.grads))
                elif isinstance(a, PASSES):
                    computed = True
                    if isinstance(a, Forward) and s + 1 < k:
                        arriving.append((acts[s + 1], a.p))
                    elif isinstance(a, Backward | BackwardInput) and s > 0:
                        arriving.append((grads[s - 1], a.p))
        for box, p in arriving:
            box.add(p)
        if all(sch.finished for sch in schedules):
            return
        if not arriving and not any(
            isinstance(sch.next(inputs[s]), (*COMPUTE, Push, Pull, Merge))
            for s, sch in enumerate(schedules)
        ):
            waits = {s: sch.next(inputs[s]) for s, sch in enumerate(schedules)}
            raise ScheduleError(f"schedule deadlocks at tick {tick}: {waits}")
    raise ScheduleError(f"schedule did not finish in {limit} ticks")


def stage_tables(schedules: Sequence[StageSchedule]) -> list[list[Action]]:
    """Each stage's actions, in order, under :func:`clock_cycles`."""
    out: list[list[Action]] = [[] for _ in schedules]
    for _tick, s, a in clock_cycles(schedules):
        out[s].append(a)
    return out


class _Ticked:
    """Inputs of one stage under :func:`clock_cycles`."""

    def __init__(self, acts: set[int], grads: set[int], sent: set[tuple[int, bool]]) -> None:
        self.acts, self.grads, self.sent = acts, grads, sent

    def has_activation(self, p: int) -> bool:
        return p in self.acts

    def has_gradient(self, p: int) -> bool:
        return p in self.grads

    def pulled(self, c: int, grads: bool) -> bool:
        return (c, grads) in self.sent

    def combined(self, p: int) -> bool:
        return True  # the replicas of a stage run in lock step with it
