"""Measuring a job's per-layer profile on one device: the worker's side of profiling.

A worker answers the head's ``measure`` message with :func:`measure`: each layer's forward,
backward and update time on its own device (an emulated device padded to its speed, a real
GPU as it is), the bytes each layer saves for its backward, and the stage call term, netted
out of the layers (:func:`measure_model`). The head keeps the answers
(:mod:`hetpipe.profiling`); the types are the core's (:mod:`hetpipe.core.profile`). It lives
apart from the planner so that a worker never imports the planner.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hetpipe import carry
from hetpipe.config import DeviceSpec
from hetpipe.core.profile import CallProfile, LayerProfile, TieProfile, padded_speed
from hetpipe.data import first_batch, load_data, to_device
from hetpipe.job import JobSpec
from hetpipe.models import build_model, model_loss
from hetpipe.modelstate import StateLayout, layer_of
from hetpipe.stagememory import saved_ends

__all__ = ["Measured", "measure", "measure_layers", "measure_model", "ties_of"]


def measure(spec: JobSpec, device: DeviceSpec) -> dict[str, Any]:
    """Profile the job's model on ``device`` (runs on a worker's compute thread)."""
    torch.manual_seed(spec.seed)
    model = build_model(spec.model)
    source = load_data(spec.data.name, spec.data.args, spec.data.collate)
    # the first samples as a minibatch of its own, as the runtime's stream gathers one
    # (data.MinibatchStream): a slice would be a view of the whole training set, and a layer
    # that saves its input (the first Linear or conv) would count that set's storage as its
    # saved bytes; only these samples are read
    x, y = first_batch(source, spec.minibatch)
    x = carry.mapped(x, torch.Tensor.clone)
    y = to_device(y, device.device)
    loss = model_loss(spec.model)
    got = measure_model(
        model,
        x,
        device.device,
        speed=device.speed,
        loss_fn=lambda out: loss(out, y),
        precision=spec.precision,
    )
    return {
        "layers": [dataclasses.asdict(lp) for lp in got.layers],
        "call": got.call.to_dict(),
        "input_bytes": carry.nbytes(x),
        "ties": [t.to_dict() for t in ties_of(model)],
    }


def ties_of(model: Any) -> tuple[TieProfile, ...]:
    """The parameters several layers of ``model`` (a flat ``nn.Sequential``) share, each
    counted in every such layer's ``param_bytes``: what the planner needs to count it once
    per stage (:class:`hetpipe.core.profile.TieProfile`)."""
    params = dict(model.named_parameters())
    out = []
    for name, names in StateLayout.of(model).ties().items():
        layers = tuple(sorted({layer_of(n) for n in names}))
        if name in params and len(layers) > 1:
            t = params[name]
            out.append(TieProfile(name, layers, t.numel() * t.element_size()))
    return tuple(out)


Step = Callable[[Mapping[str, Any], Mapping[str, Any]], Mapping[str, Any]]


@dataclass(frozen=True)
class Measured:
    """What :func:`measure_model` found: the layers (net of the call) and the call term."""

    layers: tuple[LayerProfile, ...]
    call: CallProfile


def measure_model(
    model: Any,
    example: Any,
    device: str = "cpu",
    *,
    speed: float = 1.0,
    warmup: int = 2,
    repeats: int = 15,
    loss_fn: Callable[[Any], Any] | None = None,
    step: Step | None = None,
    budget_s: float = 2.0,
    precision: str = "fp32",
) -> Measured:
    """:func:`measure_layers`, plus the stage call term (the module docs say why).

    Each pass also runs the whole model as a stage runs its layers: one forward over them
    all, one backward call from its output. With the layers' times ``f_i`` (their backward
    ``b_i`` over the ``m`` layers whose backward ran) and the whole model's ``F`` and ``B``,
    a call costs ``c_f = (sum f_i - F) / (n - 1)`` and ``c_b = (sum b_i - B) / (m - 1)``
    beyond its layers (each from its fastest pass, where load from other processes spoiled
    least; at least 0: a whole model slower than its layers is noise, not a call that saves
    time). Every layer's (median) time is then net of one call, so a stage of layers
    ``[a, b)`` costs ``sum f_i - (b - a - 1) c_f`` as measured. The
    update likewise: the state of every layer that has some, updated as one, against the
    layers' updates one by one.
    """
    return _measure(
        model,
        example,
        device,
        speed=speed,
        warmup=warmup,
        repeats=repeats,
        loss_fn=loss_fn,
        step=step,
        budget_s=budget_s,
        precision=precision,
        whole=True,
    )


def measure_layers(
    model: Any,
    example: Any,
    device: str = "cpu",
    *,
    speed: float = 1.0,
    warmup: int = 2,
    repeats: int = 15,
    loss_fn: Callable[[Any], Any] | None = None,
    step: Step | None = None,
    budget_s: float = 2.0,
    precision: str = "fp32",
) -> tuple[LayerProfile, ...]:
    """Profile each element of an ``nn.Sequential`` on ``device`` with a real minibatch.

    Each layer's times are *gross*: they include its own call, which a stage of several
    layers pays once (:func:`measure_model` measures that call and nets it out).

    Each layer runs alone on the previous layer's (detached) output, so its forward and
    backward are timed without the rest of the model. The layers are timed in interleaved
    passes (layer 0, 1, ..., then again), so a burst of load from another process spoils one
    sample of every layer rather than every sample of one; each time is the median over
    ``repeats`` passes after ``warmup`` passes (fewer, but at least 3, once the timed passes
    took ``budget_s``, so that a large model is profiled in bounded time), divided by
    ``speed`` (an emulated device with speed 0.25 is profiled 4x slower, which is what the
    planner must see for that type; a speed above 1 is not divided by, since the runtime pads
    but never speeds up).

    The first layer gets an input that needs no gradient, as stage 0 of a pipeline does; the
    others compute their input's gradient. The last layer's backward starts from
    ``loss_fn(output)`` when given (bind labels with a closure), else from a gradient of ones.
    ``update_s`` times what the runtime does with the layer's state after each backward:
    ``step(params, grads) -> new params`` (out of place; default: SGD with momentum and weight
    decay), the delta and its accumulation, and the batch-norm statistics' delta (weight
    fingerprints are taken only under ``train.verify``, so they are not counted). Saved
    bytes come from ``saved_tensors_hooks``: every tensor autograd keeps, deduplicated by
    storage, minus the layer's own parameters and buffers (those are counted once as
    parameters).

    ``precision = "bf16"`` profiles what ``train.precision = "bf16"`` runs: each forward
    (and the loss) under bfloat16 autocast, every layer after the first fed a bfloat16
    input as a stage receives it, and a floating output counted in bfloat16 bytes (what
    travels to the next stage and what it keeps as its input); the parameters stay float32.

    A layer's input and output may be carries (:mod:`hetpipe.carry`: a tuple of tensors, and
    the model's input a dict too): its ``out_bytes`` count every tensor of its output, which
    is what the runtime sends at a cut after it (so a cut inside a residual block is priced
    for the branch and the skip), its input gradient every floating tensor of its input, and
    its backward starts from a gradient of ones for each output tensor that takes one.

    The layers are moved to ``device`` in place and run in training mode, so batch-norm
    running statistics change: profile a fresh model, not one being trained.
    """
    return _measure(
        model,
        example,
        device,
        speed=speed,
        warmup=warmup,
        repeats=repeats,
        loss_fn=loss_fn,
        step=step,
        budget_s=budget_s,
        precision=precision,
        whole=False,
    ).layers


def _measure(
    model: Any,
    example: Any,
    device: str,
    *,
    speed: float,
    warmup: int,
    repeats: int,
    loss_fn: Callable[[Any], Any] | None,
    step: Step | None,
    budget_s: float,
    precision: str,
    whole: bool,
) -> Measured:
    """The measurement of :func:`measure_layers` and, with ``whole``, :func:`measure_model`."""
    import torch

    if speed <= 0:
        raise ValueError(f"speed must be > 0, got {speed}")
    speed = padded_speed(speed)
    if precision not in ("fp32", "bf16", "fp16"):
        raise ValueError(f"precision must be fp32, bf16 or fp16, got {precision!r}")
    bf16 = precision != "fp32"  # a half precision: its dtype below
    half = torch.float16 if precision == "fp16" else torch.bfloat16

    def autocast() -> Any:
        return torch.autocast(torch.device(device).type, dtype=half, enabled=bf16)

    layers = [layer.to(device) for layer in model]
    n = len(layers)
    # inputs of every layer, from one untimed pass; a layer's input and output may be carries
    # (hetpipe.carry: a tuple of tensors; the model's input also a dict)
    inputs = []
    x = carry.mapped(example, lambda t: t.to(device))
    for layer in layers:
        inputs.append(x)
        with torch.no_grad(), autocast():
            x = layer(x)
        if bf16:
            x = carry.to_half(x, half)
    fwd: list[list[float]] = [[] for _ in range(n)]
    bwd: list[list[float]] = [[] for _ in range(n)]
    upd: list[list[float]] = [[] for _ in range(n)]
    saved = [0] * n
    # of those, the layer's input and its output (hetpipe.core.profile: a stage holds them
    # otherwise), by storage; a view of the input as output counts as a saved output
    saved_in = [0] * n
    saved_out = [0] * n
    backs = [False] * n  # whether the layer's backward ran (it computes some gradient)
    whole_fwd: list[float] = []
    whole_bwd: list[float] = []
    outs: list[Any] = [None] * n
    owns = [
        {t.untyped_storage().data_ptr() for t in (*layer.parameters(), *layer.buffers())}
        for layer in layers
    ]
    states = [_UpdateState(layer, step) for layer in layers]
    whole_state = _UpdateState(model, step) if whole else None
    whole_upd: list[float] = []
    started = 0.0
    for rep in range(warmup + repeats):
        if rep == warmup:
            started = time.perf_counter()
        elif rep - warmup >= min(3, repeats) and time.perf_counter() - started > budget_s:
            break
        for i, layer in enumerate(layers):
            inp = _input(inputs[i], i > 0)
            seen: dict[int, int] = {}

            def pack(t: Any, seen: dict[int, int] = seen, own: set[int] = owns[i]) -> Any:
                st = t.untyped_storage()
                if st.data_ptr() not in own:
                    seen[st.data_ptr()] = st.nbytes()
                return t

            _sync(device)
            t0 = time.perf_counter()
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast():
                y = layer(inp)
                target = loss_fn(y) if (i == n - 1 and loss_fn is not None) else y
            _sync(device)
            t1 = time.perf_counter()
            _backward(target)
            _sync(device)
            t2 = time.perf_counter()
            states[i].run()
            _sync(device)
            t3 = time.perf_counter()
            layer.zero_grad(set_to_none=True)
            outs[i] = y
            if rep >= warmup:
                fwd[i].append(t1 - t0)
                bwd[i].append(t2 - t1)
                upd[i].append(t3 - t2)
                saved[i] = sum(seen.values())
                saved_in[i], saved_out[i] = saved_ends(seen, inp, y)
                backs[i] = any(t.requires_grad for t in carry.tensors(target))
        if whole and n > 1:
            f_all, b_all = _time_whole(layers, inputs[0], loss_fn, autocast, device)
            assert whole_state is not None
            _sync(device)
            t0 = time.perf_counter()
            whole_state.run()
            _sync(device)
            if rep >= warmup:
                whole_fwd.append(f_all)
                whole_bwd.append(b_all)
                whole_upd.append(time.perf_counter() - t0)
    call_f = call_b = call_u = 0.0
    stateful = [s.has_state for s in states]
    if whole and n > 1 and whole_fwd:
        # fastest samples: another process's burst only ever adds time, and it lands far
        # more often in the whole model's one long interval than in a layer's short one (a
        # median of the whole model taken under load can exceed the layers' sum)
        f_min = [min(v) for v in fwd]
        b_min = [min(v) for i, v in enumerate(bwd) if backs[i]]
        call_f = max(0.0, (sum(f_min) - min(whole_fwd)) / (n - 1))
        if len(b_min) > 1:
            call_b = max(0.0, (sum(b_min) - min(whole_bwd)) / (len(b_min) - 1))
        u_min = [min(v) for i, v in enumerate(upd) if stateful[i]]
        if len(u_min) > 1:
            call_u = max(0.0, (sum(u_min) - min(whole_upd)) / (len(u_min) - 1))
    out: list[LayerProfile] = []
    for i, layer in enumerate(layers):
        y, x = outs[i], inputs[i]
        params = sum(p.numel() * p.element_size() for p in layer.parameters())
        buffers = sum(b.numel() * b.element_size() for b in layer.buffers())
        # every tensor of the carry crosses a cut after this layer (and travels in bfloat16
        # where it is floating under bf16); its floating ones take gradients
        out_bytes = sum(
            t.numel() * (2 if bf16 and t.is_floating_point() else t.element_size())
            for t in carry.tensors(y)
        )
        in_grad = carry.float_bytes(x) if i > 0 else 0
        out.append(
            LayerProfile(
                max(0.0, statistics.median(fwd[i]) - call_f) / speed,
                max(0.0, statistics.median(bwd[i]) - (call_b if backs[i] else 0.0)) / speed,
                params,
                buffers,
                out_bytes,
                saved[i],
                out_bytes + in_grad,
                max(0.0, statistics.median(upd[i]) - (call_u if stateful[i] else 0.0)) / speed,
                saved_in[i],
                saved_out[i],
            )
        )
    return Measured(tuple(out), CallProfile(call_f / speed, call_b / speed, call_u / speed))


def _time_whole(
    layers: Sequence[Any],
    x: Any,
    loss_fn: Callable[[Any], Any] | None,
    autocast: Callable[[], Any],
    device: str,
) -> tuple[float, float]:
    """Forward and backward time of every layer run as one stage: one forward over them
    all (what the first stage receives: an input without gradient), one backward call."""

    inp = _input(x, False)
    _sync(device)
    t0 = time.perf_counter()
    with autocast():
        y = inp
        for layer in layers:
            y = layer(y)
        target = loss_fn(y) if loss_fn is not None else y
    _sync(device)
    t1 = time.perf_counter()
    _backward(target)
    _sync(device)
    t2 = time.perf_counter()
    for layer in layers:
        layer.zero_grad(set_to_none=True)
    return t1 - t0, t2 - t1


def _input(x: Any, grad: bool) -> Any:
    """A layer's input as a stage gets it: detached, and with ``grad`` (any layer but the
    model's first) each floating tensor a leaf that takes a gradient."""
    if isinstance(x, torch.Tensor):
        inp = x.detach()
        if grad and inp.is_floating_point():
            inp.requires_grad_(True)
        return inp
    return carry.requiring_grad(x) if grad else carry.mapped(x, torch.Tensor.detach)


def _backward(target: Any) -> None:
    """The backward a layer, or the whole model, is timed with: from the loss where
    ``target`` is one, else from a gradient of ones (for each tensor of a carry that takes
    one); none for an output without gradient."""
    import torch

    if isinstance(target, torch.Tensor):
        if target.requires_grad:
            if target.dim() == 0:
                target.backward()
            else:
                target.backward(torch.ones_like(target))
        return
    outs = [t for t in carry.tensors(target) if t.requires_grad]
    if outs:
        torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])


class _UpdateState:
    """The runtime's per-minibatch work on one layer's state, on copies of its tensors.

    Mirrors a stage's backward epilogue and forward bookkeeping: the optimizer builds new
    weights out of place, the delta is added to the wave's accumulator, and buffers are
    cloned before the forward and their change accumulated.
    """

    def __init__(self, layer: Any, step: Step | None) -> None:
        import torch

        with torch.no_grad():
            self.params = {n: p.detach().clone() for n, p in layer.named_parameters()}
            self.grads = {n: torch.full_like(p, 1e-3) for n, p in self.params.items()}
            self.acc = {n: torch.zeros_like(p) for n, p in self.params.items()}
            self.buffers = [b.detach().clone() for b in layer.buffers() if b.is_floating_point()]
            self.buf_acc = [torch.zeros_like(b) for b in self.buffers]
        self.momentum: dict[str, Any] = {}
        self.step = step or self._sgd

    @property
    def has_state(self) -> bool:
        """Whether there is anything to update (a layer without state costs nothing)."""
        return bool(self.params or self.buffers)

    def _sgd(self, params: Mapping[str, Any], grads: Mapping[str, Any]) -> dict[str, Any]:
        import torch

        new = {}
        for n, g in grads.items():
            g = g.add(params[n], alpha=1e-4)
            buf = self.momentum.get(n)
            if buf is None:
                buf = self.momentum[n] = g.clone()
            else:
                buf.mul_(0.9).add_(g)
            new[n] = torch.add(params[n], buf, alpha=-1e-3)
        return new

    def run(self) -> None:
        import torch

        if not self.has_state:
            return
        with torch.no_grad():
            for b, acc in zip(self.buffers, self.buf_acc, strict=True):
                before = b.clone()
                acc.add_(b - before)
            new = self.step(self.params, self.grads)
            for n, w in new.items():
                self.acc[n].add_(w - self.params[n])
            # keep the weights as they were, so repeated runs time the same work


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize(device)
