"""The memory model of one pipeline stage: the ONE formula the planner and the runtime share.

A stage of a virtual worker with ``k`` stages and ``Nm`` minibatches in flight keeps alive
(async schedule; the synchronous ones differ where said):

============  ==========================================================================
params        its layers' parameters and buffers
optimizer     optimizer state: ``optimizer_state_factor`` x parameter bytes (SGD with
              momentum 1, Adam 2, plain SGD 0)
stash         extra weight copies, by ``train.weights`` (:func:`stashed`): ``stash`` keeps
              the older versions in-flight backwards need (out-of-place updates),
              ``in_flight - 1``; ``latest`` none; ``predict`` (paper variant) one, the
              predicted weights a forward or a backward runs on (the forward's graph saves
              its weights as names, bound to the backward's prediction at the backward:
              :mod:`hetpipe.lateweights`), plus the recomputed layers' parameters once per
              in-flight minibatch (:func:`held_predictions`: a recomputed run recomputes
              its activations on its forward's prediction); ``predict`` consistent
              ``in_flight``, each in-flight minibatch's own prediction. None in gpipe/1f1b
              (the weights change only between iterations)
accumulators  two update accumulators: the wave being built and the wave being pushed and
              merged under WSP (2 x parameter bytes); in the synchronous kinds the
              iteration's gradient sum beside the passes with the previous step's update,
              held until its wave is pushed (2 x), or at the step the mean gradient, new
              weight version and update beside the held one where that is more (4 x, no
              activation left: :func:`accumulators`)
activations   for every in-flight minibatch, what its layers keep for the backward under
              their policy (see below), its stage output (the root its backward
              differentiates from) where the last layer does not save it, plus the received
              stage input (``in_flight`` x (kept bytes + input bytes)); a tensor two layers
              save (one's output, the next one's input, or the first layer's input: the
              stage input) counted once (:func:`activation_bytes`); where the backward reruns the
              forward (``latest``: it differentiates the newest weights, not the ones the
              forward ran on) only the inputs stay, plus one minibatch's kept tensors
              (``in_flight`` x input bytes + kept bytes). ``predict`` paper keeps the
              forward's graph like ``stash``: no second forward. A split backward
              (zb-h1, zb-h2) keeps a minibatch's graph until its weight gradient (the
              in-flight count runs to the ``W``: :func:`hetpipe.core.schedule.held_peak`)
              and, between its input and weight gradients, the gradients the weight pass
              starts from: its output's and one output of each other layer with weights
              (the first stage: its output's alone; :func:`split_grad_bytes`, for the
              order's most such minibatches at once; none without weights)
working       the transient peak of a backward (:func:`working_bytes`): async, the largest
              layer's; a whole synchronous backward, walked layer by layer with the weight
              gradients it returns and the saved tensors it has freed
              (:func:`backward_walk`); a split one, its input pass's or its weight pass's
              gradients, the larger; plus the largest run of recomputed layers' saved
              tensors (they live again while its backward runs), plus the largest swapped
              layer's saved tensors
              (the one layer in transit between the device and the host)
============  ==========================================================================

Each layer's activations follow a policy (``train.activations``; "auto" lets the planner
choose per layer):

- ``keep``: the layer keeps what autograd saves (``saved_bytes``);
- ``recompute``: the forward drops what the layer saves; the backward runs it again (same
  dropout masks: the seed is a function of the minibatch) and differentiates that. A run of
  consecutive recomputed layers is one segment (Chen et al.'s checkpointing): it keeps only
  its first layer's input, and its saved tensors live again, all at once, while its
  backward runs (the ``working`` term). The stage input is counted once, with the stage.

``in_flight`` is how many minibatches a stage holds between a forward and its backward:
the most the schedule permits under ANY timing (:func:`hetpipe.core.schedule.max_in_flight`, the
one home of that rule). In the async kind the last stage holds one and any other stage Nm:
a slow successor lets forwards queue, and admission (minibatch p enters only after p - Nm
finished) bounds them by Nm. A cap must hold whatever the relative speeds, so the model
charges that count, never what one simulated timing happens to reach: a plan that fits here
fits at run time, and a run whose stages keep pace holds less. Where the order is fixed the
count is that order's own, under any timing: an async stage that does not stash weights runs
the lock-step order (:func:`fixed_order`) and holds ``min(Nm, 2 (k - position) - 1)``;
gpipe holds all M microbatches of an iteration at every stage, 1f1b at most
``k - position`` (its warm-up plus one).

Beside that bound the planner predicts what a stage is EXPECTED to hold: the peak count of the
pipeline's simulated timeline (:func:`expected_in_flight`), priced by the same functions
(``flight`` of :func:`stage_memory`). It is the peak a run of that timing reaches, to compare
a run's measured peak with; a cap is never checked against it. Where the order is fixed the
two are equal.

Precision (``train.precision``): the weight terms (params, optimizer, stash,
accumulators) are float32 in both precisions, since the weights, their updates and the
optimizer state are kept in float32 (autocast casts per operation). In ``bf16`` the
activation and working terms shrink: they come from a profile measured under bfloat16
autocast (:func:`hetpipe.measure.measure_layers`, keyed by precision), whose layers
save bf16 tensors where autocast computes in bf16 and whose stage inputs arrive as bf16;
the runtime counts its real tensors the same way.

Buffers are not stashed or accumulated with the parameters here because they carry no
gradient; batch-norm running statistics are small and accounted once in ``params``.

A tied tensor (:class:`hetpipe.core.profile.TieProfile`) is in the parameters of every stage
that holds one of its layers, with all four weight terms: a stage holding a copy steps it,
keeps its optimizer state, its versions and its updates like its own weights. On one stage it
is one tensor however many of the stage's layers use it, while each of those layers' profiled
``param_bytes`` counts it: the bytes counted twice (``shared``,
:meth:`ModelProfile.duplicate_bytes`) leave the stage's parameters before any term is made.

One composition, two sources. :func:`compose` turns a stage's quantities into the six
terms: the planner's predicted ones (:func:`stage_terms`: ``factor`` x parameters of optimizer
state, :func:`stashed` copies, two accumulators, :func:`activations` of ``flight``
minibatches) and the runtime's counted ones (:meth:`hetpipe.stage.StageCompute.memory`: its
optimizer's state, the weight versions in-flight backwards hold, its accumulators, what each
in-flight minibatch keeps, per layer through :func:`activation_bytes` and
:func:`working_bytes`). The runtime enforces the cap with :meth:`StageMemory.check`: a plan
that fits here fits there, and a run reports its peak in the terms the plan predicted.

**Scalar and vectorised forms.** :func:`stage_terms` is plain arithmetic, so the partitioners
pass numpy arrays over every layer range ``[a, b)`` at once and get each term (and
``total``) elementwise: the very expression of the scalar form, never a second copy of it.
This module imports no numpy itself (the core stays pure).
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

from hetpipe.core.profile import LayerProfile, ModelProfile
from hetpipe.core.schedule import SYNCHRONOUS, ZB_KINDS, max_deferred, max_in_flight
from hetpipe.core.units import format_size

ACTIVATION_POLICIES = ("keep", "recompute", "swap", "auto")


class MemoryCapError(RuntimeError):
    """A stage needs more memory than its device's cap."""


__all__ = [
    "ACTIVATION_POLICIES",
    "WEIGHT_MODES",
    "MemoryCapError",
    "StageMemory",
    "accumulators",
    "activation_bytes",
    "activations",
    "backward_kind",
    "backward_walk",
    "compose",
    "copy_seconds",
    "expected_in_flight",
    "fixed_order",
    "held_predictions",
    "in_flight",
    "kept_copies",
    "param_copies",
    "recompute_runs",
    "stage_input_bytes",
    "stage_memory",
    "stage_memory_of",
    "stage_terms",
    "stashed",
    "swap_seconds",
    "unhidden_copy_s",
    "unhidden_swap_s",
    "untied_params",
    "weights_mode",
    "working_bytes",
]

# train.weights as the memory model tells them apart (predict's variants differ)
WEIGHT_MODES = ("stash", "latest", "predict", "predict-consistent")


def weights_mode(weights: str, variant: str = "paper") -> str:
    """The memory model's name for ``train.weights`` and ``train.predict_variant``."""
    mode = "predict-consistent" if weights == "predict" and variant == "consistent" else weights
    if mode not in WEIGHT_MODES:
        raise ValueError(f"weights: unknown mode {weights!r}")
    return mode


def reruns(schedule: str = "async", weights: str = "stash") -> bool:
    """Whether the backward reruns the forward (it differentiates the newest weights)."""
    return schedule == "async" and weights == "latest"


@dataclass(frozen=True)
class StageMemory:
    """Bytes one stage keeps alive, by kind (see the module docs for each term)."""

    params: int
    optimizer: int
    stash: int
    accumulators: int
    activations: int
    working: int

    @property
    def total(self) -> int:
        return (
            self.params
            + self.optimizer
            + self.stash
            + self.accumulators
            + self.activations
            + self.working
        )

    def check(self, cap: int, where: str, in_flight: int) -> None:
        """Raise :class:`MemoryCapError` with the breakdown when ``total`` exceeds ``cap``."""
        if self.total > cap:
            parts = ", ".join(f"{k} {format_size(v)}" for k, v in self.to_dict().items())
            raise MemoryCapError(
                f"{where} needs {format_size(self.total)} > memory cap {format_size(cap)} "
                f"({parts}; {in_flight} minibatch(es) in flight)"
            )

    def to_dict(self) -> dict[str, int]:
        return {
            "params": self.params,
            "optimizer": self.optimizer,
            "stash": self.stash,
            "accumulators": self.accumulators,
            "activations": self.activations,
            "working": self.working,
        }

    @classmethod
    def from_dict(cls, d: dict[str, int]) -> StageMemory:
        return cls(
            int(d["params"]),
            int(d["optimizer"]),
            int(d["stash"]),
            int(d["accumulators"]),
            int(d["activations"]),
            int(d["working"]),
        )


def fixed_order(schedule: str = "async", weights: str = "stash") -> bool:
    """Whether a stage runs the lock-step order as a fixed sequence (async, weights not
    stashed: its s is counted on that order, see :mod:`hetpipe.core.staleness`)."""
    return schedule == "async" and weights != "stash"


def in_flight(
    position: int, k: int, nm: int, schedule: str = "async", weights: str = "stash", warmup: int = 0
) -> int:
    """The count the model charges: :func:`hetpipe.core.schedule.max_in_flight` for this stage
    (``warmup``: 1f1b's extra warm-up forwards)."""
    return max_in_flight(schedule, k, position, nm, fixed_order(schedule, weights), warmup)


def expected_in_flight(
    simulated: int,
    position: int,
    k: int,
    nm: int,
    schedule: str = "async",
    weights: str = "stash",
    warmup: int = 0,
) -> int:
    """The count a stage is expected to hold at its peak under the predicted timing:
    ``simulated``, the most the planner's simulated timeline held at once
    (:attr:`hetpipe.planner.simulate.SimResult.peak_in_flight`), where the count depends on
    timing (async, weights stashed: a successor that keeps pace returns gradients before
    all Nm are forwarded); the bound :func:`in_flight` where the order is fixed (gpipe,
    1f1b, an async stage on the lock-step order), since a fixed order holds its own count
    under every timing. Never more than the bound: a higher ``simulated`` is a simulator
    that broke the schedule's rules, refused here."""
    bound = in_flight(position, k, nm, schedule, weights, warmup)
    if schedule != "async" or fixed_order(schedule, weights):
        return bound
    if not 1 <= simulated <= bound:
        raise ValueError(
            f"stage {position} of {k}: simulated {simulated} in flight, outside "
            f"1..{bound} (the schedule's maximum at Nm={nm})"
        )
    return simulated


def stashed(flight: int, schedule: str = "async", weights: str = "stash") -> int:
    """Extra weight copies beside the current weights (async only; see the module docs)."""
    if schedule != "async":
        return 0
    return {"stash": flight - 1, "latest": 0, "predict": 1, "predict-consistent": flight}[weights]


def held_predictions(
    flight: int, recomputed_params: int, schedule: str = "async", weights: str = "stash"
) -> int:
    """Bytes of forward predictions kept for recomputed layers (``predict`` paper): every
    in-flight minibatch keeps its recomputed layers' predicted weights (``recomputed_params``
    bytes), on which its backward recomputes their activations, the forward's own."""
    if schedule != "async" or weights != "predict":
        return 0
    return flight * recomputed_params


ACCUMULATORS = 2  # parameter-sized update accumulators (see the module docs)
STEP_COPIES = 3  # a synchronous step's parameter-sized tensors beside the weights and state
HELD_UPDATES = 1  # a synchronous stage's previous update, held until its wave is pushed
SPLIT_KINDS = (*ZB_KINDS, "zbv")  # the synchronous kinds whose backwards are split
BACKWARDS = ("layer", "whole", "split")  # how the working term walks a backward


def backward_kind(schedule: str = "async") -> str:
    """How :func:`working_bytes` prices a stage's backward under ``schedule``: ``whole``
    (gpipe, 1f1b, interleaved-1f1b: one backward returns the input's and the weights'
    gradients, walked per layer), ``split`` (zb-h1, zb-h2, zbv: an input pass, then a weight
    pass returning the weights' gradients) or ``layer`` (async: the largest layer's working
    peak, its weight gradients charged with the accumulators)."""
    if schedule not in SYNCHRONOUS:
        return "layer"
    return "split" if schedule in SPLIT_KINDS else "whole"


def accumulators(param_bytes: Any, rest: Any, schedule: str = "async") -> Any:
    """The ``accumulators`` term (numbers or arrays, elementwise). Async: the two update
    accumulators. A synchronous kind holds its gradient sum (1 x parameters) beside the
    activations through the passes, and beside it the previous step's update, which a
    virtual worker alone in its job carries into the next iteration's until its wave is
    pushed (:meth:`hetpipe.versions.WeightVersions.carry`; :data:`HELD_UPDATES`): 2 x. The
    gradients a backward returns are the working term's (:func:`working_bytes`: a whole
    backward's per layer, a weight pass's at once). At the step, when no activation is
    left, the mean gradient, the new weight version (made out of place, beside the old) and
    the update (:data:`STEP_COPIES` x parameters) beside the held update: the term is what
    the passes hold plus what the step needs beyond ``rest`` (the activations and working
    bytes it no longer holds), so the total is the larger of the two moments. Measured
    (``scripts/bench_stage_memory.py``: a stage of one Linear peaks at its step, weights,
    momentum and these four to the byte)."""
    if schedule not in SYNCHRONOUS:
        return ACCUMULATORS * param_bytes
    passes = 1 + HELD_UPDATES  # the gradient sum and the held update
    beyond = (STEP_COPIES + HELD_UPDATES - passes) * param_bytes - rest
    return passes * param_bytes + beyond * (beyond > 0)


def param_copies(factor: int, flight: int, schedule: str = "async", weights: str = "stash") -> int:
    """Parameter-sized copies a stage keeps: the weights, ``factor`` of optimizer state, two
    accumulators, and the extra copies of its ``weights`` mode (:func:`stage_terms`' weight
    terms, counted in parameter sizes)."""
    return 1 + factor + ACCUMULATORS + stashed(flight, schedule, weights)


def kept_copies(flight: int, schedule: str = "async", weights: str = "stash") -> int:
    """How many minibatches' saved tensors a stage keeps at once: every in-flight one's, or
    one where the backward reruns the forward (the rerun's room). So a byte a layer saves
    costs this many bytes of the ``activations`` term (:func:`activations`)."""
    return 1 if reruns(schedule, weights) else flight


def activations(
    flight: Any, saved: Any, input_bytes: Any, schedule: str = "async", weights: str = "stash"
) -> Any:
    """Bytes of in-flight minibatches: every one's input, and the saved tensors of
    :func:`kept_copies` of them (numbers or arrays, elementwise)."""
    return flight * input_bytes + kept_copies(flight, schedule, weights) * saved


def compose(
    param_bytes: Any,
    buffer_bytes: Any,
    *,
    optimizer: Any,
    copies: Any,
    held: Any,
    accumulators: Any,
    activations: Any,
    working: Any,
) -> StageMemory:
    """The six terms of a stage from its quantities, predicted (:func:`stage_terms`) or
    counted (:meth:`hetpipe.stage.StageCompute.memory`): the weights with their buffers,
    ``copies`` further weight versions plus ``held`` bytes of kept predictions, and the
    other terms as given. Numbers or arrays (elementwise)."""
    return StageMemory(
        params=param_bytes + buffer_bytes,
        optimizer=optimizer,
        stash=copies * param_bytes + held,
        accumulators=accumulators,
        activations=activations,
        working=working,
    )


def deferred_grads(deferred: int, out_bytes: Any) -> Any:
    """Bytes of the gradients ``deferred`` minibatches keep between their input and weight
    gradients, each ``out_bytes`` (:func:`split_grad_bytes`; numbers or arrays)."""
    return deferred * out_bytes


def split_grad_bytes(out_bytes: Sequence[int], param_bytes: Sequence[int], position: int) -> int:
    """Bytes of gradients one minibatch keeps between the halves of a split backward, for
    a stage whose layers output ``out_bytes`` and hold ``param_bytes``: its output's
    gradient, and the gradient of each other layer's output where that layer has weights
    (where their branch joins the input's path, :mod:`hetpipe.splitbackward`); on the
    first stage, whose input takes no gradient, the output's alone (its weight half
    differentiates from the output). None for a stage without weights: its weight half has
    nothing to differentiate, so its input half keeps no gradient for it
    (:meth:`hetpipe.stage.StageCompute.backward_input`)."""
    if not out_bytes or not any(param_bytes):
        return 0
    if position == 0:
        return out_bytes[-1]
    return out_bytes[-1] + sum(o for o, p in zip(out_bytes[:-1], param_bytes, strict=False) if p)


def stage_terms(
    param_bytes: Any,
    buffer_bytes: Any,
    kept: Any,
    input_bytes: Any,
    working: Any,
    *,
    factor: int,
    flight: int,
    schedule: str = "async",
    weights: str = "stash",
    held: Any = 0,
    deferred: Any = 0,
) -> StageMemory:
    """What the planner predicts a stage keeps: :func:`compose` of ``factor`` x parameters
    of optimizer state, :func:`stashed` weight copies, the two accumulators, and the
    :func:`activations` of ``flight`` minibatches that each keep ``kept`` bytes in the
    stage's layers (:func:`activation_bytes`) besides their ``input_bytes``, plus the
    ``deferred`` bytes of a split backward's gradients (:func:`deferred_grads`).

    The scalar form (:func:`stage_memory`) and the vectorised ones (the partitioners, with
    numpy arrays over every ``[a, b)``: the fields, and ``total``, come back as arrays) are
    this one expression."""
    acts = activations(flight, kept, input_bytes, schedule, weights) + deferred
    return compose(
        param_bytes,
        buffer_bytes,
        optimizer=factor * param_bytes,
        copies=stashed(flight, schedule, weights),
        held=held,
        accumulators=accumulators(param_bytes, acts + working, schedule),
        activations=acts,
        working=working,
    )


def recompute_runs(recompute: Collection[int]) -> list[tuple[int, int]]:
    """The maximal runs ``[c, d)`` of consecutive recomputed layers: each is recomputed as
    one segment (one checkpoint), so it keeps only the input of its first layer."""
    out: list[tuple[int, int]] = []
    for j in sorted(recompute):
        if out and out[-1][1] == j:
            out[-1] = (out[-1][0], j + 1)
        else:
            out.append((j, j + 1))
    return out


def activation_bytes(
    saved: Sequence[int],
    inputs: Sequence[int],
    recompute: Collection[int] = (),
    swap: Collection[int] = (),
    saved_in: Sequence[int] = (),
    saved_out: Sequence[int] = (),
    output: int = 0,
) -> int:
    """Bytes one in-flight minibatch keeps ON THE DEVICE in a stage's layers and its output
    (not counting its input).

    ``saved[j]`` is what layer ``j`` of the stage saves for its backward when kept,
    ``inputs[j]`` the size of its input; ``recompute`` the stage-relative indices of the
    recomputed layers, ``swap`` those of the swapped ones (their saved tensors wait in host
    memory). A run of recomputed layers keeps its first layer's input only (none when that
    is the stage input, which is counted once with the stage).

    Each layer's ``saved`` is what it saves alone, so a tensor two of them save is in both:
    ``saved_in[j]`` and ``saved_out[j]`` say how much of ``saved[j]`` is its input and its
    output (:class:`hetpipe.core.profile.LayerProfile`). The first layer's saved input is
    the stage input, counted with the stage; between two kept layers the tensor one saves as
    output and the next as input is counted once; and the stage's ``output``, which every
    in-flight minibatch keeps until its backward (the root the backward differentiates
    from), is counted where its last layer does not keep it (nor where that layer is
    recomputed or swapped). Left empty (and ``output`` 0)
    they correct nothing: the count of a profile that did not measure them.
    """
    skipped = set(recompute) | set(swap)
    kept = sum(s for j, s in enumerate(saved) if j not in skipped)
    kept += sum(inputs[c] for c, _ in recompute_runs(recompute) if c > 0)
    if saved_in and 0 not in skipped:
        kept -= saved_in[0]
    if saved_in and saved_out:
        kept -= sum(
            min(saved_in[j], saved_out[j - 1])
            for j in range(1, len(saved))
            if j not in skipped and j - 1 not in skipped
        )
    # a recomputed or swapped last layer keeps none of its saved output on the device,
    # while the output itself stays (the backward's root): then it is counted whole
    last = saved_out[-1] if saved_out and len(saved) - 1 not in skipped else 0
    return kept + max(0, output - last)


def backward_walk(
    work: Sequence[int],
    out: Sequence[int],
    params: Sequence[int],
    saved: Sequence[int] = (),
    saved_in: Sequence[int] = (),
    saved_out: Sequence[int] = (),
) -> int:
    """The transient peak of one whole backward of a stage's layers, beyond what its
    minibatch keeps (:func:`activation_bytes`), walked layer by layer from the last: at
    layer ``i``'s backward the stage output's gradient (received, held to the end), the
    gradient of layer ``i``'s output where that is another layer's (``i`` not the last) and
    of its input (together ``work[i]``: :class:`hetpipe.core.profile.LayerProfile`), and the
    weight gradients of layers ``i`` on (returned together at the end: ``params``), less
    the tensors the layers after ``i`` saved, freed once their backward ran (each layer's
    share of :func:`activation_bytes`, a tensor two layers save counted with the first; the
    stage output, which the minibatch holds to the end, never freed). ``saved`` left empty:
    nothing counted freed (a recomputed or swapped layer's saved tensors are not where the
    kept count has them; the walk is then the conservative one). The max over ``i``.

    The vectorised form over every ``[a, b)`` is :func:`hetpipe.planner.costs.working_matrix`,
    the same integers."""
    n = len(work)
    if not n:
        return 0
    grads = list(itertools.accumulate(reversed(params)))[::-1]  # layers i on
    peak = work[-1] + params[-1]  # the last layer: its output's gradient is the received one
    freed = 0
    for i in range(n - 2, -1, -1):
        if saved:
            j = i + 1  # its saved tensors, less the one layer j - 1 saves too
            share = saved[j] - (min(saved_in[j], saved_out[j - 1]) if saved_in else 0)
            if j == n - 1 and saved_out:  # the stage output stays with the minibatch
                share -= min(saved_out[j], share)
            freed += share
        peak = max(peak, out[-1] + work[i] + grads[i] - freed)
    return peak


def untied_params(params: Sequence[int], ties: Sequence[tuple[Collection[int], int]]) -> list[int]:
    """Each layer's parameter bytes without the tied tensors it uses (``ties``: each one's
    layers and bytes), whose gradient :func:`working_bytes` charges once (``tied``)."""
    out = list(params)
    for users, nbytes in ties:
        for j in users:
            out[j] -= nbytes
    return out


def working_bytes(
    work: Sequence[int],
    saved: Sequence[int],
    recompute: Collection[int] = (),
    swap: Collection[int] = (),
    *,
    backward: str = "layer",
    out: Sequence[int] = (),
    params: Sequence[int] = (),
    saved_in: Sequence[int] = (),
    saved_out: Sequence[int] = (),
    tied: int = 0,
) -> int:
    """The transient peak of a stage: its backward's (``backward``, :func:`backward_kind`)
    plus the largest run of recomputed layers' saved tensors (a run lives again while its
    backward runs) plus the largest swapped layer's (one layer is on its way out or back in
    while the others compute; the two can coincide, so both are counted).

    A backward's: ``layer``, the largest layer's working memory; ``whole``,
    :func:`backward_walk` (the weight gradients it returns included; the freed tensors only
    where every layer keeps its own); ``split``, the larger of the input pass's (the largest
    layer's working memory) and the weight pass's, which returns every weight's gradient at
    once (``params``' sum) beside the gradients the input pass kept (counted with the
    activations). A tied tensor's gradient is one tensor however many of the stage's layers
    use it: ``params`` then leave it out, and ``tied`` (its bytes, for every tie the stage
    holds) is charged through the whole backward, beside every layer's (conservative by
    what the walk reaches before its gradient appears)."""
    if backward not in BACKWARDS:
        raise ValueError(f"backward: unknown kind {backward!r}")
    rerun = max((sum(saved[c:d]) for c, d in recompute_runs(recompute)), default=0)
    transit = max((saved[j] for j in swap), default=0)
    if backward == "whole":
        kept_all = not recompute and not swap
        peak = tied + backward_walk(
            work,
            out,
            params,
            saved if kept_all else (),
            saved_in if kept_all else (),
            saved_out if kept_all else (),
        )
    elif backward == "split":
        peak = max(max(work, default=0), sum(params) + tied)
    else:
        peak = max(work, default=0)
    return peak + rerun + transit


def copy_seconds(nbytes: int, host_gbps: float) -> float:
    """Seconds to copy ``nbytes`` one way between a device and its host at ``host_gbps``."""
    return nbytes * 8 / (host_gbps * 1e9)


def swap_seconds(saved: Sequence[int], swap: Collection[int], host_gbps: float) -> float:
    """Seconds to copy the swapped layers' saved tensors one way at ``host_gbps``."""
    return copy_seconds(sum(saved[j] for j in swap), host_gbps)


def unhidden_copy_s(copy_s: float, compute_s: float) -> float:
    """What a copy of ``copy_s`` seconds adds to the ``compute_s`` it runs beside."""
    return max(0.0, copy_s - compute_s)


def unhidden_swap_s(copy_s: float, fwd_s: float, bwd_s: float) -> float:
    """The part of a stage's swap time that its compute does not hide, per minibatch.

    The copies out run beside the forward (the layers after a swapped one keep computing
    while it leaves), the copies in beside the backward (prefetched while the later layers
    differentiate): one copy engine per direction, so each direction shows only what
    exceeds the compute it overlaps with: ``max(0, copy - fwd) + max(0, copy - bwd)``.
    The bound is optimistic for a swapped last layer (nothing after it to hide behind) and
    pessimistic where other minibatches' compute also overlaps; it is the planner's and the
    emulation's one charge.
    """
    return unhidden_copy_s(copy_s, fwd_s) + unhidden_copy_s(copy_s, bwd_s)


def stage_memory(
    layers: Sequence[LayerProfile],
    position: int,
    k: int,
    nm: int,
    optimizer_state_factor: int,
    input_bytes: int,
    schedule: str = "async",
    weights: str = "stash",
    recompute: Collection[int] = (),
    swap: Collection[int] = (),
    warmup: int = 0,
    flight: int | None = None,
    shared: int = 0,
    defer: bool = False,
    ties: Sequence[tuple[Collection[int], int]] = (),
) -> StageMemory:
    """Memory of a stage holding ``layers`` at ``position`` of ``k``, with ``Nm`` = ``nm``.

    ``input_bytes`` is the size of the stage's input per minibatch: the model input for the
    first stage, else the previous layer's ``out_bytes`` (see :func:`stage_input_bytes`).
    ``recompute``/``swap``: stage-relative indices of the layers whose activations are
    recomputed/swapped to host memory. ``flight``: the minibatches in flight to charge
    (default :func:`in_flight`, the bound a cap is checked against; the expected peak
    passes :func:`expected_in_flight`). ``shared``: bytes of tied tensors the layers'
    ``param_bytes`` count more than once (:meth:`ModelProfile.duplicate_bytes`).
    ``defer``: the async kind defers weight gradients (``train.defer_weight_grad``), so each
    minibatch it holds may keep its output gradient until its weight gradient
    (:func:`hetpipe.core.schedule.max_deferred`). ``ties``: each tied tensor the stage
    holds, as (its stage-relative layers, its bytes), whose gradient the backward holds once
    (:func:`working_bytes`).
    """
    n = in_flight(position, k, nm, schedule, weights, warmup) if flight is None else flight
    saved = [lp.saved_bytes for lp in layers]
    inputs = [input_bytes] + [lp.out_bytes for lp in layers[:-1]]
    recomputed = sum(layers[j].param_bytes for j in recompute)
    kept = activation_bytes(
        saved,
        inputs,
        recompute,
        swap,
        [lp.saved_input_bytes for lp in layers],
        [lp.output_saved for lp in layers],
        layers[-1].out_bytes if layers else 0,
    )
    return stage_terms(
        sum(lp.param_bytes for lp in layers) - shared,
        sum(lp.buffer_bytes for lp in layers),
        kept,
        input_bytes,
        working_bytes(
            [lp.work_bytes for lp in layers],
            saved,
            recompute,
            swap,
            backward=backward_kind(schedule),
            out=[lp.out_bytes for lp in layers],
            params=untied_params([lp.param_bytes for lp in layers], ties),
            saved_in=[lp.saved_input_bytes for lp in layers],
            saved_out=[lp.output_saved for lp in layers],
            tied=sum(nbytes for users, nbytes in ties if users),
        ),
        factor=optimizer_state_factor,
        flight=n,
        schedule=schedule,
        weights=weights,
        held=held_predictions(n, recomputed, schedule, weights),
        deferred=deferred_grads(
            max_deferred(schedule, k, position, nm, defer=defer),
            split_grad_bytes(
                [lp.out_bytes for lp in layers], [lp.param_bytes for lp in layers], position
            ),
        ),
    )


def stage_input_bytes(profile: ModelProfile, dtype: str, first: int) -> int:
    """Bytes a stage whose first layer is ``first`` receives per minibatch."""
    return profile.input_bytes if first == 0 else profile.layers[dtype][first - 1].out_bytes


def stage_memory_of(
    profile: ModelProfile,
    dtype: str,
    layers: tuple[int, int],
    position: int,
    k: int,
    nm: int,
    optimizer_state_factor: int,
    schedule: str = "async",
    weights: str = "stash",
    recompute: Collection[int] = (),
    swap: Collection[int] = (),
    warmup: int = 0,
    flight: int | None = None,
) -> StageMemory:
    """:func:`stage_memory` for layers ``[a, b)`` of ``profile`` on device type ``dtype``
    (``recompute``/``swap``: GLOBAL indices of the recomputed/swapped layers), a tensor tied
    between its layers counted once."""
    a, b = layers
    return stage_memory(
        profile.layers[dtype][a:b],
        position,
        k,
        nm,
        optimizer_state_factor,
        stage_input_bytes(profile, dtype, a),
        schedule,
        weights,
        {j - a for j in recompute},
        {j - a for j in swap},
        warmup,
        flight,
        profile.duplicate_bytes(a, b),
        ties=[
            ([j - a for j in t.layers if a <= j < b], t.nbytes)
            for t in profile.ties
            if any(a <= j < b for j in t.layers)
        ],
    )
