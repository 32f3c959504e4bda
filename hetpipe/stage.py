"""The compute of one pipeline stage: forward, backward and loss, over the objects it owns.

Every method here runs on the worker's single compute thread, never on the event loop, so
sends and receives keep flowing while a stage computes. The scheduling (which minibatch, when)
lives in :mod:`hetpipe.pipeline`; this module only does what it is told, in order.
:class:`StageCompute` holds one object per job besides the compute, and delegates to it:

- :mod:`hetpipe.stagelayers`: the layers, run one by one under their activation policies;
- :mod:`hetpipe.versions`: the weight versions (weight stashing by out-of-place updates, the
  merge with pulled global weights) and each wave's accumulated update for the push;
- :mod:`hetpipe.gradients`: the weight gradients between backward and optimizer step;
- :mod:`hetpipe.probes`: the prediction probes of ``train.weights = "predict"``;
- :mod:`hetpipe.stagememory`: the memory it keeps, counted in the planner's terms, which is
  what the device's cap is checked against (:meth:`StageCompute.memory`);
- :mod:`hetpipe.stagestate`: what it saves at a checkpoint's cut and restores.

Weight stashing: a forward runs the layers on the current version and keeps a reference to
that dict with the minibatch; the optimizer step builds a new dict of new tensors. So the
backward of p differentiates exactly the weights its forward used. The stale-weight modes
differ only in which weights a pass takes (:meth:`StageCompute._forward_weights`);
``predict`` paper binds other weights to the forward's graph at the backward
(:mod:`hetpipe.lateweights`). A forward that the backward reruns (``latest``) keeps only its
input. On an emulated device the copy time of swapped layers that the compute does not hide
is charged at the device's ``host_gbps`` (:meth:`StageCompute._charge_swap`).

Names: a slice of an ``nn.Sequential`` keeps the keys of the whole model, so a stage's state
names (``"7.weight"``) are the global ones that travel to the shards and end up in the
exported state_dict. Which names train, stay frozen, stay local or are tied is decided in
:mod:`hetpipe.modelstate`; how dropout is seeded in :mod:`hetpipe.seeding`.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import deque
from collections.abc import Hashable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import torch

from hetpipe import carry, emulate, stagestate
from hetpipe.carry import Carry, Inputs, Target
from hetpipe.config import DeviceSpec
from hetpipe.core.lr import LossScale, is_function, step_index
from hetpipe.core.memory import (
    MemoryCapError,
    StageMemory,
    copy_seconds,
    fixed_order,
    unhidden_copy_s,
)
from hetpipe.core.staleness import StageTable
from hetpipe.core.units import format_size
from hetpipe.core.wsp import wave_of
from hetpipe.cudaipc import Shared
from hetpipe.gradients import Gradients
from hetpipe.hostcopy import HostCopier, HostCopy
from hetpipe.job import JobSpec
from hetpipe.models import build_model, model_loss
from hetpipe.modelstate import StateLayout
from hetpipe.optim import StageOptimizer, grad_stats
from hetpipe.probes import PROBE_EVERY, Probe, Probes
from hetpipe.readback import Readback
from hetpipe.replicas import combine
from hetpipe.seeding import LayerSeeds
from hetpipe.splitbackward import Kept, input_gradients, weight_gradients
from hetpipe.stagelayers import StageLayers, build_stage_module
from hetpipe.stagememory import LayerBytes, MemoryCount, nbytes
from hetpipe.task import StageTask
from hetpipe.usercode import load_function
from hetpipe.versions import WeightVersions, fingerprint, to_device

__all__ = ["PROBE_EVERY", "DeviceMemory", "StageCompute", "build_stage_module"]


class DeviceMemory:
    """The memory the stages of one device keep, counted together: a device that runs
    several stages (of one virtual worker) has one cap for all of them, so what each keeps
    now is summed and checked against it (each stage is also checked alone, as ever).

    Updated from the device's one compute thread (where every stage's compute runs)."""

    def __init__(self, device: str, cap: int) -> None:
        self.device = device
        self.cap = cap
        self.now: dict[str, int] = {}  # stage (its ``where``) -> bytes it keeps now
        self.peak = 0  # the most the stages kept together

    def check(self, where: str, total: int) -> None:
        """Note that stage ``where`` keeps ``total`` bytes now; raise
        :class:`MemoryCapError` (one line, naming the device and every stage's share) when
        the stages together exceed the cap."""
        self.now[where] = total
        together = sum(self.now.values())
        self.peak = max(self.peak, together)
        if together > self.cap and len(self.now) > 1:
            parts = ", ".join(f"{w} {format_size(n)}" for w, n in sorted(self.now.items()))
            raise MemoryCapError(
                f"device {self.device}: its {len(self.now)} stages need "
                f"{format_size(together)} together > memory cap {format_size(self.cap)} "
                f"({parts})"
            )

    def leave(self, where: str) -> None:
        """Stage ``where`` has ended: it keeps nothing now."""
        self.now.pop(where, None)


T = TypeVar("T")

# train.precision -> the dtype of autocast and of what travels between stages
_HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class _InFlight:
    """What the backward of one minibatch needs: its input, output and weight version."""

    x: Inputs  # a carry (hetpipe.carry), or the first stage's batch input
    out: Carry
    params: dict[str, torch.Tensor]
    version: int
    fingerprint: float  # of the weights the forward used, taken at forward time
    kept_bytes: int  # activations kept for the backward, stage input and output included
    samples: int = 1  # of the minibatch (sync schedules weight gradients by it)
    loss: torch.Tensor | None = None  # last stage: its backward starts here
    # weights "latest": the forward kept no graph; the backward reruns it from the kept
    # input on the weights of that moment
    recompute: bool = False
    # weights "predict" paper, an update in between: the graph's weights are bound at the
    # backward to the weights predicted ``late`` updates ahead then (hetpipe.lateweights)
    late: int | None = None
    swapped: int = 0  # bytes its swapped layers parked in host memory
    # a split backward (zero-bubble kinds): the gradient of the output its input gradient
    # was taken from, on the device, kept for the weight gradient
    grad: Carry | None = None
    kept: Kept | None = None  # what its input gradient left for the weights' (splitbackward)


RECENT_LOSSES = 20  # how many of the last losses the live mean takes


@dataclass
class StageStats:
    """Counters a stage reports to the head."""

    forwards: int = 0
    backwards: int = 0
    forward_s: float = 0.0
    backward_s: float = 0.0
    merges: int = 0
    last_loss: float | None = None
    # the last losses read back, for the live mean; bounded, as a job may run for weeks
    losses: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT_LOSSES))
    peak_bytes: int = 0
    peak_memory: dict[str, int] = field(default_factory=dict)  # peak of each StageMemory term
    # the most minibatches held between a forward and its backward: the count the memory
    # model charges is the schedule's maximum (hetpipe.core.schedule.max_in_flight); this is
    # what this run's timing reached
    peak_in_flight: int = 0
    # weights = "predict": ||W_hat - W_target|| / ||W_stale - W_target|| of each probe (at
    # most one per PROBE_EVERY minibatches: StageCompute._judge), as read back so far
    # (StageCompute.read_quality)
    prediction_quality: list[float] = field(default_factory=list)
    # fp16: the steps skipped for a gradient with an inf or NaN on some stage
    skipped: list[int] = field(default_factory=list)


class _Through(Generic[T]):
    """A name of :class:`StageCompute` that reads (and sets) the attribute of an object it
    owns: ``_Through("wv")`` as ``params`` is ``self.wv.params``."""

    def __init__(self, owner: str, name: str = "") -> None:
        self.owner = owner
        self.name = name

    def __set_name__(self, cls: type, name: str) -> None:
        self.name = self.name or name

    def __get__(self, obj: Any, cls: type | None = None) -> T:
        if obj is None:  # on the class: the descriptor itself
            return self  # type: ignore[return-value]
        return getattr(getattr(obj, self.owner), self.name)

    def __set__(self, obj: Any, value: T) -> None:
        setattr(getattr(obj, self.owner), self.name, value)


class StageCompute:
    """One stage's compute (forward, backward, loss, local step) over the objects it owns:
    its weight versions, gradients, prediction probes and memory count."""

    def __init__(
        self, task: StageTask, device: DeviceSpec, local: Mapping[str, torch.Tensor] | None = None
    ) -> None:
        """``local``: initial values of the stage's non-persistent buffers (from the head)."""
        self.task = task
        self.dev = device.device
        self.speed = device.speed
        self.where = f"{task.where} on {device.name} ({device.type})"
        self.spec = JobSpec.from_dict(task.spec)
        self.module = build_stage_module(self.spec, task.first, task.last, self.dev)
        self.module.train()
        self.seeds = LayerSeeds(
            self.module, seed=self.spec.seed, vw=task.vw, first=task.first, device=self.dev
        )
        self.seeds.start = task.start
        # started from a checkpoint's local weights that had merged the pull of the cut's
        # wave already (load_state): the attempt's first pull and merge are done
        self.restored = False
        layout = StateLayout.of(self.module)
        if task.ties:
            # a tie spanning stages: the stage's part of the whole model's layout, where a
            # copy of a tie whose canonical name lies in an earlier stage is held under that
            # name (hetpipe.modelstate)
            with torch.device("meta"):
                full = StateLayout.of(build_model(self.spec.model))
            layout = full.on_stage(task.first, task.last)
        local = local or {}
        missing = [n for n in layout.local if n not in local]
        if missing:
            raise ValueError(
                f"{task.where}: no initial value for non-persistent buffer {missing[0]!r}"
            )
        self.copier = HostCopier(self.dev)  # what goes out reaches the host off the compute
        # the weight versions, the optimizer and each wave's update (hetpipe.versions)
        self.wv = WeightVersions(
            layout,
            StageOptimizer(self.spec.optimizer),
            {n: local[n].to(self.dev, copy=True) for n in layout.local},
            self.dev,
            self.copier,
            num_vws=task.num_vws,
            sync=self.spec.sync,
            copies=task.copies,
        )
        self.in_flight: dict[int, _InFlight] = {}
        self.grads = Gradients(self.dev, self.copier)  # awaiting the step (hetpipe.gradients)
        self.loss_fn = model_loss(self.spec.model) if task.is_last else None
        # a replica of the last stage: its rows' share of the whole minibatch's mean loss, so
        # that the replicas' gradients sum to the unsplit one (hetpipe.replicas)
        lo, hi = task.my_rows(self.spec.minibatch)
        self.loss_scale = (hi - lo) / self.spec.minibatch if task.replicated else 1.0
        self.stats = StageStats()
        self._losses = Readback(self.dev)  # read back in batches: no wait per minibatch
        self.verify = self.spec.verify  # fingerprint the weights each pass used (costs reads)
        # train.precision = "bf16" or "fp16": forwards (and so backwards) under autocast in
        # that dtype; the weights, their updates and the optimizer state stay float32,
        # activations and gradients between stages travel in it
        self.half = _HALF.get(self.spec.precision)
        # fp16: the loss is scaled by GradScaler's dynamic scale, which every stage of the
        # virtual worker steps on the same agreed verdicts (hetpipe.core.lr.LossScale)
        ls = self.spec.loss_scale
        self.scaler = (
            LossScale(ls.init, ls.growth_factor, ls.backoff_factor, ls.growth_interval)
            if self.spec.precision == "fp16"
            else None
        )
        # the learning rate's schedule on the virtual worker's clock (hetpipe.core.lr); its
        # length defaults to the job's: steps of this attempt after the ones before it
        steps = -(-task.minibatches // task.nm) if self.spec.sync else task.minibatches
        sched = self.spec.lr_schedule
        if is_function(sched.kind):  # checked current on this host (hetpipe.usercode)
            sched = dataclasses.replace(sched, function=load_function(sched.kind, "lr_schedule"))
        self.lr_schedule = (
            dataclasses.replace(
                sched, total_steps=step_index(self.spec.sync, steps, task.nm, task.start)
            )
            if sched.total_steps is None
            else sched
        )
        self.base_lr = self.spec.optimizer.lr
        # sync steps with an agreement: each iteration's gradient, taken by step_stats
        # before the stages agree on its norm and verdict (set in agreed by the runner)
        self.ready: dict[int, dict[str, torch.Tensor]] = {}
        self.agreed: dict[int, tuple[float, bool]] = {}
        recompute = frozenset(j - task.first for j in task.recompute)
        # a layer both recomputed and swapped is recomputed: it keeps nothing to swap
        swap = frozenset(j - task.first for j in task.swap) - recompute
        # the layers under their activation policies (hetpipe.stagelayers)
        self.layers = StageLayers(
            self.module,
            layout,
            self.seeds,
            first=task.first,
            recompute=recompute,
            swap=swap,
            dev=self.dev,
        )
        self.host_gbps = device.host_gbps
        self.stalls: dict[int, list[float]] = {}
        # [[fault]] kind = "slow" on this device: (at_minibatch, factor), see emulate.speed_at
        self.slowdowns = tuple(
            (f.at_minibatch, f.factor) for f in self.spec.slowdowns if f.device == device.name
        )
        for f in self.spec.faults:
            if (f.vw, f.stage) == (task.vw, task.stage):
                self.stalls.setdefault(f.minibatch, []).append(f.seconds)
        self.versions: dict[int, tuple[int, float, int, float]] = {}
        # how stale weights are handled (async only): see hetpipe.core.staleness, docs/jobs-guide.md
        self.weights = "stash" if self.spec.sync else self.spec.weights
        self.table = (
            StageTable(task.k, task.stage, task.nm, task.minibatches)
            if fixed_order(self.spec.schedule, self.weights)
            else None
        )
        self.probes = Probes(self.dev)  # weights = "predict" (hetpipe.probes)
        # each kind of pass's least CPU time, what an emulated device pads (hetpipe.emulate)
        self.pace = emulate.Pace()
        # the memory it keeps, counted in the planner's terms (hetpipe.stagememory)
        self.mem = MemoryCount(
            self.module, recompute, swap, device.memory, self.where, self.spec.schedule
        )
        # the device's count of all its stages, where its worker runs several (the worker
        # sets it; None: this stage alone is checked)
        self.device_memory: DeviceMemory | None = None

    # -- what it owns, read through by the names the runtime and tests use -----------------

    params: _Through[dict[str, torch.Tensor]] = _Through("wv")  # the current weight version
    buffers: _Through[dict[str, torch.Tensor]] = _Through("wv")
    local: _Through[dict[str, torch.Tensor]] = _Through("wv")  # non-persistent buffers
    layout: _Through[StateLayout] = _Through("wv")
    steps_taken: _Through[int] = _Through("wv")
    optimizer: _Through[StageOptimizer] = _Through("wv")
    acc: _Through[dict[int, dict[str, torch.Tensor]]] = _Through("wv")  # wave -> its update
    pending: _Through[dict[int, dict[str, torch.Tensor]]] = _Through("grads")
    param_bytes: _Through[int] = _Through("mem")
    _layer_bytes: _Through[dict[Hashable, LayerBytes]] = _Through("mem", "layer_bytes")
    probe: _Through[Probe | None] = _Through("probes")  # the outstanding prediction probe
    probe_every: _Through[int] = _Through("probes", "every")
    _quality: _Through[Readback] = _Through("probes", "quality")  # the probes' scores

    def _speed(self, p: int) -> float:
        """The speed minibatch ``p`` computes at (slowed by a ``[[fault]] kind = "slow"``)."""
        return emulate.speed_at(self.speed, self.slowdowns, p) if self.slowdowns else self.speed

    # -- state names ------------------------------------------------------------------------

    @property
    def has_state(self) -> bool:
        """Whether this stage holds weights or buffers kept on the parameter server."""
        return bool(self.wv.param_names or self.wv.buffer_names)

    def state_names(self) -> list[str]:
        """Global names of everything this stage keeps on the parameter server."""
        return self.wv.param_names + self.wv.buffer_names

    # -- forward / backward -----------------------------------------------------------------

    def forward(self, p: int, x: Inputs, y: Target) -> Carry | None:
        """Run the forward of minibatch ``p``: the carry for the next stage (a tensor or a
        tuple of tensors, :mod:`hetpipe.carry`), or, on the last stage, None after the loss
        (kept for :meth:`backward`, which the schedule runs right after in the async kind).

        ``x``: the carry from the previous stage, or on the first stage the batch's input (a
        tensor, a tuple or a dict of tensors, which the first element takes as it is); ``y``:
        the target the last stage's loss takes (a tensor, a dict of tensors, or None)."""
        for fault in self.stalls.get(p, ()):
            time.sleep(fault)  # injected: a stuck kernel or device, for hang diagnosis
        started = emulate.mark()
        if isinstance(x, (torch.Tensor, Shared)):  # one tensor: the plain case, nothing walked
            x = to_device(x, self.dev)
            if not self.task.is_first and x.is_floating_point():
                x = x.detach().requires_grad_()
            shape: Hashable = tuple(x.shape)
        else:
            x = carry.mapped(x, lambda t: to_device(t, self.dev))
            if not self.task.is_first:
                x = carry.requiring_grad(x)
            shape = carry.shape_of(x)
        params, recompute, late = self._forward_weights(p)
        state = {**params, **self.wv.buffers, **self.wv.local}
        self.seeds.p = p
        before = {n: b.clone() for n, b in self.wv.buffers.items()}
        known = self.mem.layer_bytes.get(shape)
        self.layers.swapper.start()
        if recompute and known is not None:
            # the backward reruns this forward (weights latest): keep the input only
            with torch.no_grad(), self._autocast():
                out, _ = self.layers.run(p, x, state, measure=False)
        else:
            with self._autocast(), self.layers.late.forward(late is not None):
                out, measured = self.layers.run(p, x, state, measure=known is None)
            if late is not None:
                self._release(params)
        if known is None:
            known = measured
            self.mem.measured(shape, known)
        if recompute:
            out = carry.mapped(out, torch.Tensor.detach)  # a measuring forward's graph too
            kept = nbytes(x)
        else:
            kept = self.mem.kept(known) + nbytes(x)
        if before:
            self.wv.accumulate(wave_of(p, self.task.nm), self.wv.buffer_deltas(before))
        self.stats.forwards += 1
        flight = _InFlight(
            x=x,
            out=out,
            params={} if recompute else params,
            version=self.wv.version,
            fingerprint=fingerprint(params) if self.verify else 0.0,
            kept_bytes=kept,
            samples=(int(y.shape[0]) if y.dim() else 1)
            if isinstance(y, torch.Tensor)
            else carry.samples(y, x),
            recompute=recompute,
            late=late,
            swapped=self.layers.swapper.bytes,
        )
        self.in_flight[p] = flight
        self._check_memory()
        if self.loss_fn is None:
            if isinstance(out, torch.Tensor):
                sent = out.detach()
                if self.half is not None and sent.is_floating_point():
                    sent = sent.to(self.half)  # activations travel in the compute precision
            else:
                sent = carry.mapped(out, torch.Tensor.detach)
                if self.half is not None:
                    sent = carry.to_half(sent, self.half)
            self.stats.forward_s += self._charge_swap(
                self._pad(started, self._speed(p), "forward", flight), flight.swapped
            )
            return sent
        with self._autocast():
            target = (
                to_device(y, self.dev)
                if isinstance(y, torch.Tensor)
                else carry.mapped(y, lambda t: to_device(t, self.dev))
            )
            flight.loss = self.loss_fn(out, target)
        self._losses.add(p, flight.loss)
        self.stats.forward_s += self._charge_swap(
            self._pad(started, self._speed(p), "forward", flight), flight.swapped
        )
        return None

    def eval_state(self) -> dict[str, torch.Tensor]:
        """A copy of this stage's weights and buffers as they are now (at a wave boundary):
        what a validation pass of ``train.eval_every`` runs on while training goes on."""
        return {
            n: t.detach().clone()
            for n, t in {**self.wv.params, **self.wv.buffers, **self.wv.local}.items()
        }

    def best_weights(self) -> dict[str, torch.Tensor]:
        """A host copy of this stage's weights and buffers kept on the shards, by their global
        names, as they are now: its part of ``model_best.pt`` where a validation pass while
        training improved ``train.keep_best`` (:mod:`hetpipe.evalpass`)."""
        return {
            n: t.detach().to("cpu", copy=True)
            for n, t in {**self.wv.params, **self.wv.buffers}.items()
        }

    def eval_forward(self, x: Inputs, state: Mapping[str, torch.Tensor] | None = None) -> Any:
        """A validation forward: this stage's layers on ``x`` in eval mode under
        ``no_grad``, with ``state`` (:meth:`eval_state`) or the current weights. Nothing
        trains and nothing is kept: no running statistic moves (eval mode), no weight
        version, optimizer state, memory count or loss changes. Returns the stage's output
        as the model makes it (the last stage's goes to the loss and the metrics; another
        stage's is what the next one takes, :mod:`hetpipe.carry`)."""
        x = carry.mapped(x, lambda t: to_device(t, self.dev))
        if state is None:
            state = {**self.wv.params, **self.wv.buffers, **self.wv.local}
        p = self.seeds.p
        self.module.eval()
        try:
            with torch.no_grad(), self._autocast():
                out, _ = self.layers.run(p, x, state, measure=False)
        finally:
            self.module.train()
            self.seeds.p = p
        return out

    def _charge_swap(self, compute_s: float, moved: int) -> float:
        """The pass's time with the swap copies of ``moved`` bytes that ran beside it: on an
        emulated device (the tensors never left host memory) it sleeps the part of the copy
        at ``host_gbps`` that ``compute_s`` does not hide
        (:func:`hetpipe.core.memory.unhidden_copy_s`, the planner's own charge); on a GPU
        the copies are real and already in the measured time."""
        if not moved or self.layers.swapper.cuda:
            return compute_s
        extra = unhidden_copy_s(copy_seconds(moved, self.host_gbps), compute_s)
        time.sleep(extra)
        return compute_s + extra

    def _autocast(self) -> AbstractContextManager[Any]:
        """The compute precision's autocast context (none in float32)."""
        if self.half is None:
            return nullcontext()
        return torch.autocast(torch.device(self.dev).type, dtype=self.half)

    def backward(self, p: int, grad: Carry | None) -> Carry | None:
        """Run the backward of minibatch ``p`` from the gradient of its output (None on the
        last stage: from its loss); return the gradient of its input for the previous stage.

        A carry's gradient (:mod:`hetpipe.carry`): for a bare tensor, one tensor; for a
        tuple, a tuple of one gradient per floating tensor, in order (integer and boolean
        tensors take none). Where there is no gradient to give (an input without a floating
        tensor), an empty tensor says so: the previous stage still waits for the end of this
        backward.

        The weights' gradients wait for :meth:`step`: kept per minibatch (async) or summed
        over the iteration, weighted by samples (sync).
        """
        started = emulate.mark()
        flight = self.in_flight.pop(p)
        if flight.recompute:
            self._rerun(p, flight)
        # predict paper: the graph's saved weights are the ones predicted now
        late = self._predicted(flight.late) if flight.late is not None else None
        with self.layers.late.backward(late) if late is not None else nullcontext():
            if isinstance(flight.x, torch.Tensor) and isinstance(flight.out, torch.Tensor):
                grad_in, pgrads = self._differentiate(flight, grad)
            else:
                grad_in, pgrads = self._differentiate_carry(flight, grad)
        # observable weight stashing: (forward's version, its weights' fingerprint then,
        # version current at this backward, fingerprint of the weights differentiated now)
        self.versions[p] = (
            flight.version,
            flight.fingerprint,
            self.wv.version,
            fingerprint(late if late is not None else flight.params) if self.verify else 0.0,
        )
        if self.spec.sync:
            self.grads.add(pgrads, flight.samples)
        else:
            self.grads.pending[p] = pgrads
        self.stats.backwards += 1
        self.stats.backward_s += self._charge_swap(
            self._pad(started, self._speed(p), "backward", flight), flight.swapped
        )
        return grad_in

    def _pad(self, started: emulate.Mark, speed: float, kind: str, flight: _InFlight) -> float:
        """Pad a pass of ``kind`` on ``flight`` to its device's speed (:func:`emulate.pad`),
        from the least CPU time such a pass took: same input shape, recomputing or not."""
        key = (kind, carry.shape_of(flight.x), flight.recompute)
        return emulate.pad(started, speed, self.dev, self.pace, key)

    def backward_input(self, p: int, grad: Carry | None) -> Carry | None:
        """The first half of a split backward (:class:`hetpipe.core.schedule.BackwardInput`):
        the gradient of minibatch ``p``'s input only, returned as :meth:`backward` returns
        it, at once, for the previous stage. Its graph and ``grad`` stay with the minibatch
        (counted in its kept activations) for :meth:`backward_weight`. The first stage has
        no input gradient to give: it only keeps ``grad``. In the async kind
        (``train.defer_weight_grad``) it runs on the weights the forward stashed, as
        :meth:`backward` does."""
        started = emulate.mark()
        flight = self.in_flight[p]
        if grad is not None:
            grad = (
                to_device(grad, self.dev)
                if isinstance(grad, (torch.Tensor, Shared))
                else carry.mapped(grad, lambda t: to_device(t, self.dev))
            )
        # a stage without weights has nothing for its weight half to differentiate: the
        # gradient is not kept for it (memory.split_grad_bytes)
        flight.grad = grad if self.mem.param_bytes else None
        grad_in = None if self.task.is_first else self._gradients(flight, grad, "input")[0]
        # what it keeps until its weight gradient is the most a split backward holds
        self._check_memory()
        speed = self.speed if self.spec.sync else self._speed(p)
        self.stats.backward_s += self._pad(started, speed, "input", flight)
        return grad_in

    def backward_weight(self, p: int) -> None:
        """The second half of a split backward (:class:`hetpipe.core.schedule.
        BackwardWeight`): the weights' gradient of minibatch ``p`` from the graph and output
        gradient :meth:`backward_input` kept, summed into the iteration's as :meth:`backward`
        does (async: kept for the minibatch's own step, as :meth:`backward` keeps it); the
        minibatch's graph is freed. Together the two give what :meth:`backward` gives: the
        graph holds the forward's weights, so a deferred weight gradient still
        differentiates the version its forward used."""
        started = emulate.mark()
        flight = self.in_flight.pop(p)
        # a stage without weights kept nothing for this half (backward_input): none to take
        pgrads = self._gradients(flight, flight.grad, "weight")[1] if self.mem.param_bytes else {}
        flight.grad = None
        self.versions[p] = (
            flight.version,
            flight.fingerprint,
            self.wv.version,
            fingerprint(flight.params) if self.verify else 0.0,
        )
        if self.spec.sync:
            self.grads.add(pgrads, flight.samples)
        else:
            self.grads.pending[p] = pgrads
        self.stats.backwards += 1
        speed = self.speed if self.spec.sync else self._speed(p)
        self.stats.backward_s += self._charge_swap(
            self._pad(started, speed, "weight", flight), flight.swapped
        )

    def _gradients(
        self, flight: _InFlight, grad: Carry | None, part: str
    ) -> tuple[Carry | None, dict[str, torch.Tensor]]:
        if isinstance(flight.x, torch.Tensor) and isinstance(flight.out, torch.Tensor):
            return self._differentiate(flight, grad, part)  # type: ignore[arg-type]
        return self._differentiate_carry(flight, grad, part)

    @property
    def _splits(self) -> bool:
        """Whether a split backward's halves go through :mod:`hetpipe.splitbackward` (its
        weight half walks only the weights' branches). Not under recomputed layers, whose
        checkpoints rerun at each pass: there the weight half differentiates the kept graph
        from the outputs again."""
        return not self.task.recompute

    def _split(
        self,
        flight: _InFlight,
        outs: list[torch.Tensor],
        grad_outs: list[torch.Tensor],
        inputs: list[torch.Tensor],
        weights: list[str],
        part: str,
    ) -> tuple[torch.Tensor | None, ...]:
        """One half of a split backward (``part``: ``input`` or ``weight``), the gradients
        of ``inputs`` as :meth:`_differentiate` takes them (``weights``: the names of the
        weights that take a gradient; the input half keeps what the weight half needs)."""
        if part == "input":
            params = [flight.params[n] for n in weights]
            grads, kept = input_gradients(outs, grad_outs, inputs, params)
            # without weights the weight half has nothing to differentiate: nothing is kept
            # for it (the output gradient included: memory.split_grad_bytes)
            flight.kept = kept if params else None
            return grads
        kept, flight.kept = flight.kept, None
        if not inputs:  # no weight takes a gradient
            return ()
        if kept is None:  # the first stage: no input half ran before
            return torch.autograd.grad(outs, inputs, grad_outs, allow_unused=True)
        return weight_gradients(kept, inputs)

    def _scaled(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss the backward starts from: times the fixed ``loss_scale`` and, under fp16,
        the dynamic loss scale (undone on the gradients before the step)."""
        scale = self.loss_scale * (self.scaler.scale if self.scaler is not None else 1.0)
        return loss * scale if scale != 1.0 else loss

    def _differentiate(
        self, flight: _InFlight, grad: torch.Tensor | None, part: str = "all"
    ) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
        """The gradients of a minibatch's input (as the previous stage takes it) and of its
        weights, from its graph and the gradient of its output: one tensor in, one out.
        ``part``: ``all``, or of a split backward ``input`` (the graph kept for the rest) or
        ``weight`` (no input gradient: None)."""
        assert isinstance(flight.x, torch.Tensor) and isinstance(flight.out, torch.Tensor)
        wants_input = flight.x.requires_grad and part != "weight"
        weights = [n for n in self.wv.param_names if flight.params[n].requires_grad]
        names = [] if part == "input" else weights
        retain = part == "input"
        inputs = ([flight.x] if wants_input else []) + [flight.params[n] for n in names]
        loss = flight.loss
        target = loss if loss is not None else flight.out
        if not inputs or not target.requires_grad:
            # nothing to differentiate: a parameter-free first stage, or an output that
            # depends on no trainable tensor (integer tokens, a wholly frozen stage)
            grads: tuple[torch.Tensor | None, ...] = (None,) * len(inputs)
        elif part != "all" and self._splits:
            grads = self._split(
                flight,
                [self._scaled(loss)] if loss is not None else [flight.out],
                [torch.ones_like(loss)]
                if loss is not None
                else [to_device(grad, self.dev).to(flight.out.dtype)],  # type: ignore[arg-type]
                inputs,
                weights,
                part,
            )
        elif loss is not None:
            grads = torch.autograd.grad(
                self._scaled(loss), inputs, allow_unused=True, retain_graph=retain
            )
        else:
            assert grad is not None, f"{self.where}: backward without a gradient"
            grads = torch.autograd.grad(
                flight.out,
                inputs,
                to_device(grad, self.dev).to(flight.out.dtype),
                allow_unused=True,
                retain_graph=retain,
            )
        if part == "weight":
            return None, {n: g for n, g in zip(names, grads, strict=True) if g is not None}
        grad_in = grads[0] if wants_input else None
        if grad_in is not None and self.half is not None:
            grad_in = grad_in.to(self.half)  # gradients travel in the compute precision
        if grad_in is None and wants_input:
            grad_in = torch.zeros_like(flight.x)
        elif not self.task.is_first and not wants_input:
            # an integer input has no gradient, but the previous stage still waits for the
            # end of this minibatch's backward: an empty tensor says "none"
            grad_in = torch.zeros(0, device=self.dev)
        pgrads = {
            n: g for n, g in zip(names, grads[int(wants_input) :], strict=True) if g is not None
        }
        return grad_in, pgrads

    def _differentiate_carry(
        self, flight: _InFlight, grad: Carry | None, part: str = "all"
    ) -> tuple[Carry | None, dict[str, torch.Tensor]]:
        """:meth:`_differentiate` where a tuple (or the first stage's dict) goes in or out.

        The outputs differentiated are the floating output tensors that require a gradient,
        each from its own incoming gradient (``grad`` holds one per floating output, in
        order; a single empty tensor: the next stage had none to give); the inputs, every
        floating input tensor (all of them require one on a stage past the first). The
        gradient returned: one per floating input in a tuple (a bare tensor's for a bare
        input), an input that took none getting zeros; an empty tensor where no input is
        floating."""
        floats_in = [t for t in carry.tensors(flight.x) if t.is_floating_point()]
        ins = [t for t in floats_in if t.requires_grad] if part != "weight" else []
        weights = [n for n in self.wv.param_names if flight.params[n].requires_grad]
        names = [] if part == "input" else weights
        inputs = ins + [flight.params[n] for n in names]
        loss = flight.loss
        outs: list[torch.Tensor] = []
        grad_outs: list[torch.Tensor] = []
        if loss is not None:
            if loss.requires_grad:
                outs = [self._scaled(loss)]
                grad_outs = [torch.ones_like(loss)]
        else:
            assert grad is not None, f"{self.where}: backward without a gradient"
            floats_out = [t for t in carry.tensors(flight.out) if t.is_floating_point()]
            given = carry.tensors(grad)
            if len(given) == len(floats_out):  # else an empty "none" from the next stage
                for t, g in zip(floats_out, given, strict=True):
                    if t.requires_grad:
                        outs.append(t)
                        grad_outs.append(to_device(g, self.dev).to(t.dtype))
        if part != "all" and self._splits and outs:
            grads: tuple[torch.Tensor | None, ...] = self._split(
                flight, outs, grad_outs, inputs, weights, part
            )
        elif inputs and outs:
            grads = torch.autograd.grad(
                outs, inputs, grad_outs, allow_unused=True, retain_graph=part == "input"
            )
        else:  # nothing to differentiate (see _differentiate)
            grads = (None,) * len(inputs)
        pgrads = {n: g for n, g in zip(names, grads[len(ins) :], strict=True) if g is not None}
        if self.task.is_first or part == "weight":
            return None, pgrads
        if not floats_in:
            return torch.zeros(0, device=self.dev), pgrads
        taken = dict(zip(map(id, ins), grads, strict=False))
        back = []
        for t in floats_in:
            g = taken.get(id(t))
            g = torch.zeros_like(t) if g is None else g
            back.append(g.to(self.half) if self.half is not None else g)
        if isinstance(flight.x, torch.Tensor):
            return back[0], pgrads
        return tuple(back), pgrads

    def _forward_weights(self, p: int) -> tuple[dict[str, torch.Tensor], bool, int | None]:
        """The weights the forward of ``p`` runs on, whether its backward will rerun it, and,
        where its backward binds other weights to the forward's graph, their ``s``.

        ``stash``: the current weights, differentiated by the backward (kept in the graph).
        ``latest``: the same forward, but where the schedule puts updates between this forward
        and its backward, none is kept: the backward reruns it on the newest weights.
        ``predict``: the weights ``s_fwd`` updates ahead (:meth:`StageOptimizer.predict`);
        variant ``consistent`` differentiates the forward's own prediction; variant ``paper``
        keeps the forward's graph (no second forward) and its backward runs on the weights
        predicted ``s_bwd`` ahead of the weights of that moment: the graph saves its weights
        as names that the backward binds then (:mod:`hetpipe.lateweights`), so input
        gradients go through W_hat(s_bwd) and weight gradients come from the forward's
        activations, as in the SpecTrain paper. Where the schedule puts no update in between
        (the last stage, Nm = 1) every mode keeps the forward's graph on its own weights, so
        with nothing stale the three modes are the same computation.
        """
        if self.table is None:
            return self.wv.params, False, None
        s_fwd, s_bwd = self.table.s(p)
        between = s_fwd > s_bwd and not self.task.is_last
        if self.weights == "latest":
            return self.wv.params, between, None
        params = self._predicted(s_fwd)
        late = between and self.spec.predict_variant == "paper"
        if late:
            # tensors of its own (a name without optimizer state yet is not predicted), so
            # that the forward can release them (:meth:`_release`)
            params = {
                n: w.detach().clone().requires_grad_()
                if w is self.wv.params[n] and w.requires_grad
                else w
                for n, w in params.items()
            }
        if s_fwd > 0:  # a probe of this prediction, if it is its turn (hetpipe.probes)
            self.probes.offer(p, self.wv.steps_taken + s_fwd, params, self.wv.params, late)
        return params, False, s_bwd if late else None

    def _predicted(self, s: int) -> dict[str, torch.Tensor]:
        """The current weights ``s`` updates ahead, as leaves that take gradients."""
        if s <= 0:
            return self.wv.params
        ahead = self.wv.optimizer.predict(self.wv.params, s)
        return {n: w if w is self.wv.params[n] else w.requires_grad_() for n, w in ahead.items()}

    def _rerun(self, p: int, flight: _InFlight) -> None:
        """Rerun the forward of ``p`` from its kept input on the newest weights (``latest``),
        with the same dropout masks and without moving the batch-norm statistics a second
        time."""
        params = self.wv.params
        buffers = {n: b.clone() for n, b in self.wv.buffers.items()}
        self.seeds.p = p
        self.layers.swapper.start()
        # layer by layer under the activation policy: recomputed runs stay checkpoints
        with self._autocast():
            flight.out, _ = self.layers.run(
                p, flight.x, {**params, **buffers, **self.wv.local}, measure=False
            )
        flight.params = params
        flight.swapped = self.layers.swapper.bytes

    def _release(self, params: Mapping[str, torch.Tensor]) -> None:
        """Free the storage of a late-bound forward's predicted weights: its graph saved
        them as names (:mod:`hetpipe.lateweights`) and keeps the tensors only as the leaves
        its weight gradients are taken for, which needs their shapes, not their values.
        Kept: the weights of recomputed layers (their rerun needs the forward's values),
        the stage's own current weights, and the prediction a probe still judges. (A
        storage resize is no autograd op and bumps no version: no ``no_grad`` needed.)"""
        probe = self.probes.probe
        if probe is not None and probe.predicted is params:
            return
        current, recomputed = self.wv.params, self.layers.recomputed_names
        for n, w in params.items():
            if w is not current[n] and n not in recomputed:
                w.untyped_storage().resize_(0)

    def _judge(self) -> None:
        """Score the outstanding prediction once this stage took the ``s_fwd`` updates it
        extrapolated (:meth:`hetpipe.probes.Probes.judge`), and release a late-bound
        forward's prediction once scored."""
        predicted = self.probes.judge(self.wv.params, self.wv.steps_taken)
        if predicted is not None:
            self._release(predicted)

    @property
    def agrees(self) -> bool:
        """Whether each step waits for the stages of the virtual worker to agree on the
        iteration's gradient norm and verdict (finite or not): a synchronous schedule with
        ``optimizer.clip_norm`` or fp16 (:meth:`step_stats`, then :meth:`step`)."""
        return self.spec.sync and (
            self.spec.optimizer.clip_norm is not None or self.scaler is not None
        )

    def step_stats(self, i: int) -> tuple[float, bool]:
        """Before an agreed step (:attr:`agrees`): take iteration ``i``'s mean gradient
        (unscaled under fp16) for :meth:`step`; return its squared L2 norm and whether
        every value is finite, what this stage contributes to the agreement."""
        grads = self._unscaled(self.grads.take_mean())
        self.ready[i] = grads
        # a tie's copies hold one gradient: the owner counts it in the norm, once
        copies = self.task.copies
        return grad_stats({n: g for n, g in grads.items() if n not in copies} if copies else grads)

    def step(
        self, i: int, replicas: Mapping[int, Mapping[str, torch.Tensor]] | None = None
    ) -> None:
        """The local optimizer step: after backward ``i`` (async), or at the end of iteration
        ``i`` on the mean gradient (sync: the virtual workers' mean once merged, else this
        stage's own). ``replicas``: the other replicas' gradients of ``i`` by replica, summed
        with this one's in replica order first (hetpipe.replicas).

        The rate is ``optimizer.lr`` times the schedule's factor at the virtual worker's
        step (:func:`hetpipe.core.lr.step_index`). With ``clip_norm`` the gradients are
        scaled by ``min(1, clip_norm / (norm + 1e-6))`` as ``clip_grad_norm_`` does: ``norm``
        the iteration's over every stage (sync: as agreed in :attr:`agreed`), or this
        stage's own of the minibatch (async). Under fp16 a step whose gradients hold an inf
        or NaN on any stage is skipped (no update, optimizer state untouched) and the loss
        scale follows GradScaler's rule."""
        if not self.spec.sync:
            grads = self.grads.pending.pop(i)
            if replicas is not None:
                every = {**replicas, self.task.replica: grads}
                grads = combine([every[r] for r in sorted(every)], self.dev)
            if self.spec.optimizer.clip_norm is not None:
                grads = self._clipped(grads, grad_stats(grads)[0])
            self._set_lr(i)
            self._step(wave_of(i, self.task.nm), grads)
            return
        if not self.agrees:
            self._set_lr(i)
            self._step(i, self.grads.take_mean())
            return
        if i not in self.ready:  # no runner asked for the stats: this stage's own
            self.agreed.setdefault(i, self.step_stats(i))
        grads = self.ready.pop(i)
        sq, finite = self.agreed.pop(i) if i in self.agreed else grad_stats(grads)
        if self.scaler is not None:
            self.scaler.update(finite)
            if not finite:
                self.stats.skipped.append(i)
                return
        if self.spec.optimizer.clip_norm is not None:
            grads = self._clipped(grads, sq)
        self._set_lr(i)
        self._step(i, grads)

    def _set_lr(self, i: int) -> None:
        """The optimizer's rate for its step ``i`` (an iteration, or a minibatch in async)."""
        if self.lr_schedule.constant:
            return
        step = step_index(self.spec.sync, i, self.task.nm, self.task.start)
        self.wv.optimizer.lr = self.base_lr * self.lr_schedule.factor(step)

    def _unscaled(self, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """fp16: the gradients divided by the loss scale they were taken at (GradScaler's
        unscale: times the float32 reciprocal); as they are otherwise."""
        if self.scaler is None or not grads:
            return grads
        inv = float(torch.tensor(self.scaler.scale, dtype=torch.float64).reciprocal().float())
        names = list(grads)
        with torch.no_grad():
            out = torch._foreach_mul([grads[n] for n in names], inv)
        return dict(zip(names, out, strict=True))

    def _clipped(self, grads: dict[str, torch.Tensor], sq: float) -> dict[str, torch.Tensor]:
        """The gradients scaled by ``clip_grad_norm_``'s clamped coefficient for the norm
        ``sqrt(sq)``."""
        assert self.spec.optimizer.clip_norm is not None
        coef = min(self.spec.optimizer.clip_norm / (math.sqrt(sq) + 1e-6), 1.0)
        if not grads:
            return grads
        names = list(grads)
        with torch.no_grad():
            out = torch._foreach_mul([grads[n] for n in names], coef)
        return dict(zip(names, out, strict=True))

    def _step(self, wave: int, grads: Mapping[str, torch.Tensor]) -> None:
        """Local update out of place (:meth:`hetpipe.versions.WeightVersions.update`); a
        probe is judged on the new weights, and the update joins what ``wave`` pushes."""
        deltas = self.wv.update(grads)
        if deltas is None:
            return
        if self.probes.probe is not None:
            self._judge()
        self.wv.accumulate(wave, deltas)

    def gradient_sum(self) -> tuple[HostCopy, int]:
        """This iteration's sample-weighted gradient sum, on its way to the host for the
        shards (a side-stream copy: the compute thread does not wait for it), and its
        samples."""
        return self.grads.to_host()

    def tie_gradients(self) -> HostCopy:
        """Sync: this stage's part of the iteration's sample-weighted gradient sum for each
        tie spanning stages it holds a copy of, on its way to the host (for the other
        copies: :meth:`hetpipe.pipeline.StageRunner._exchange`)."""
        return self.copier.to_host(self.grads.tied(self.task.tied, self.wv.params))

    def sum_tied(self, sums: Mapping[tuple[int, str], torch.Tensor]) -> None:
        """Sync: take the sum over every copy of each tie this stage holds, added in stage
        order (the same bits on every copy), as its part of the iteration's gradient sum.
        ``sums``: ``(stage, tie)`` -> that copy's sum."""
        out = {}
        with torch.no_grad():
            for tie in self.task.tied:
                if tie in self.wv.layout.frozen:  # its zeros travelled; it takes no step
                    continue
                total = None
                for stage in self.task.ties[tie]:
                    g = to_device(sums[(stage, tie)], self.dev)
                    total = g.clone() if total is None else total.add_(g)
                out[tie] = total
        self.grads.set_tied(out)

    def merge_gradients(self, mean: Mapping[str, torch.Tensor]) -> None:
        """Adopt the mean gradient of every virtual worker's samples of the iteration."""
        self.grads.merge(mean)

    # -- parameter server -------------------------------------------------------------------

    def push_deltas(self, wave: int, keep: bool = True) -> HostCopy:
        """The stage's update of ``wave``, on its way to host memory
        (:meth:`hetpipe.versions.WeightVersions.push_deltas`).

        ``optimizer.merge = "mean"`` (async, several virtual workers): the weights' part
        is divided by the number of virtual workers, so the shards add the mean of the
        virtual workers' updates instead of their sum (buffers' updates are averaged
        already). The stage's own weights keep its whole update until the next pull."""
        n = self.task.num_vws
        if self.spec.sync or self.spec.optimizer.merge != "mean" or n == 1:
            return self.wv.push_deltas(wave, keep)
        acc = self.wv.acc.get(wave, {}) if keep else self.wv.acc.pop(wave, {})
        params = set(self.wv.param_names)
        with torch.no_grad():
            share = {name: t / n if name in params else t for name, t in acc.items()}
        return self.copier.to_host(share)

    def carry(self, wave: int) -> None:
        """Move the update of ``wave`` into the next wave's, unpushed (a virtual worker alone
        in its job, between the pushes that carry its updates)."""
        self.wv.carry(wave)

    def load(
        self, pulled: Mapping[str, torch.Tensor], applied: Mapping[str, list[list[int]]]
    ) -> None:
        """Set local state to pulled global state plus own updates the shard had not applied
        (:meth:`hetpipe.versions.WeightVersions.load`)."""
        self.wv.load(pulled, applied)
        self.stats.merges += 1

    def read_losses(self, block: bool = False) -> list[tuple[int, float]]:
        """The last stage's losses read back since the previous call, as ``(p, loss)``; they
        come in batches (:class:`hetpipe.readback.Readback`), all of them with ``block``."""
        got = self._losses.ready(block)
        if got:
            self.stats.losses.extend(v for _, v in got)
            self.stats.last_loss = got[-1][1]
        return got

    def read_quality(self, block: bool = False) -> None:
        """Move the prediction probes' scores read back since the previous call into
        ``stats.prediction_quality`` (all of them with ``block``), as :meth:`read_losses`."""
        self.stats.prediction_quality.extend(self.probes.read(block))

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Current local state (for tests and debugging)."""
        return self.wv.state_dict()

    # -- checkpoints ------------------------------------------------------------------------

    def state(self, wave: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """This stage's state at the cut ``wave``, called right after its push of
        ``wave - 1`` (:func:`hetpipe.stagestate.save`), with fp16's loss scale (a resumed
        job goes on with the scale the uninterrupted one had)."""
        meta, tensors = stagestate.save(self.wv, wave)
        if self.scaler is not None:
            meta["loss_scale"] = [self.scaler.scale, self.scaler.tracker, self.scaler.skipped]
        return meta, tensors

    def load_state(
        self, meta: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], *, weights: bool
    ) -> None:
        """Start from a checkpointed state (:func:`hetpipe.stagestate.restore`): optimizer
        state always, and with ``weights`` the local weights and buffers too."""
        stagestate.restore(self.wv, meta, tensors, weights=weights, where=self.where)
        scale = meta.get("loss_scale")
        if self.scaler is not None and scale is not None:
            self.scaler.scale, self.scaler.tracker, self.scaler.skipped = scale
        if weights:
            # not merged at the cut: the first pull merges the cut's global weights, as the
            # uninterrupted stage's pull of that wave would have (a merge replaces the weights)
            self.restored = bool(meta.get("merged", True))

    # -- memory -----------------------------------------------------------------------------

    def memory(self) -> StageMemory:
        """What this stage keeps alive now, counted from its real tensors and composed as
        the planner composes its prediction (:meth:`hetpipe.stagememory.MemoryCount.count`)."""
        return self.mem.count(
            self.in_flight,
            self.wv.params,
            acc=self.wv.acc,
            grad_sum=self.grads.sum,
            optimizer=self.wv.optimizer.state_bytes(),
            paper=self.weights == "predict" and self.spec.predict_variant == "paper",
            probe=self.probes.probe,
        )

    def _check_memory(self) -> None:
        mem = self.memory()
        self.stats.peak_bytes = max(self.stats.peak_bytes, mem.total)
        self.stats.peak_in_flight = max(self.stats.peak_in_flight, len(self.in_flight))
        for name, value in mem.to_dict().items():
            self.stats.peak_memory[name] = max(self.stats.peak_memory.get(name, 0), value)
        mem.check(self.mem.cap, self.where, len(self.in_flight))
        if self.device_memory is not None:
            self.device_memory.check(self.where, mem.total)
