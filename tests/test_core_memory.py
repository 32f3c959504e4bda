"""The one memory model (:mod:`hetpipe.core.memory`): its scalar and vectorised forms are one
expression, and the runtime's accounting of a real stage equals the planner's figure for the
same stage, term by term."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import numpy as np
import pytest
import torch
from conftest import job
from helpers import with_saved_ends

from hetpipe.config import DeviceSpec
from hetpipe.core.layout import StageLayout
from hetpipe.core.memory import (
    StageMemory,
    accumulators,
    activation_bytes,
    backward_kind,
    backward_walk,
    compose,
    in_flight,
    stage_memory,
    stage_memory_of,
    stage_terms,
    working_bytes,
)
from hetpipe.core.profile import ModelProfile, TieProfile
from hetpipe.data import MinibatchStream, load_dataset
from hetpipe.job import JobSpec
from hetpipe.measure import measure_layers
from hetpipe.models import build_model
from hetpipe.optim import StageOptimizer
from hetpipe.planner.costs import working_matrix
from hetpipe.planner.partition import CostModel
from hetpipe.planner.profile import synthetic_profile
from hetpipe.planner.syncmodel import SyncModel
from hetpipe.stage import StageCompute
from hetpipe.task import StageTask

MODES = [
    ("async", "stash"),
    ("async", "latest"),
    ("async", "predict"),
    ("async", "predict-consistent"),
    ("gpipe", "stash"),
    ("1f1b", "stash"),
]


def test_compose_is_the_six_terms() -> None:
    m = compose(
        100, 7, optimizer=100, copies=2, held=5, accumulators=200, activations=30, working=4
    )
    assert m == StageMemory(107, 100, 205, 200, 30, 4)
    assert m.total == 107 + 100 + 205 + 200 + 30 + 4


@pytest.mark.parametrize(("schedule", "weights"), MODES)
def test_vectorised_terms_are_the_scalar_terms(schedule: str, weights: str) -> None:
    """:func:`stage_terms` on arrays over every ``[a, b)`` gives, term by term, what the
    scalar :func:`stage_memory` gives for each ``[a, b)`` alone."""
    prof = synthetic_profile(7, {"t": 1.0}, 3)
    lps = prof.layers["t"]
    L = len(lps)

    def prefix(vals: list[int]) -> np.ndarray:
        return np.array([0, *itertools.accumulate(vals)], dtype=np.int64)

    P = prefix([lp.param_bytes for lp in lps])
    B = prefix([lp.buffer_bytes for lp in lps])
    S = prefix([lp.saved_bytes for lp in lps])
    inb = np.array([prof.input_bytes] + [lp.out_bytes for lp in lps], dtype=np.int64)
    # the backward's working term, walked per layer for the kind (prefix sums, running maxima)
    W = working_matrix(lps, backward_kind(schedule))
    for flight in (1, 3):
        terms = stage_terms(
            P[None, :] - P[:, None],
            B[None, :] - B[:, None],
            S[None, :] - S[:, None],
            inb[:, None],
            W,
            factor=2,
            flight=flight,
            schedule=schedule,
            weights=weights,
        )
        for a, b in itertools.combinations(range(L + 1), 2):
            want = stage_memory(lps[a:b], 0, 4, 3, 2, int(inb[a]), schedule, weights, flight=flight)
            got = {k: int(v[a, b]) for k, v in terms.to_dict().items()}
            assert got == want.to_dict(), (a, b)
            assert int(terms.total[a, b]) == want.total


@pytest.mark.parametrize("ends", [False, True])
@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_the_partitioners_price_every_range_by_the_one_model(kind: str, ends: bool) -> None:
    """The asynchronous partitioner's and the synchronous planner's memory matrices are the
    scalar model's totals (same integers), on a profile with measured saved ends too."""
    prof = synthetic_profile(6, {"t": 1.0}, 5)
    if ends:
        prof = with_saved_ends(prof, 3)
    dev = DeviceSpec("d0", "cpu", "t", 1 << 30, 1.0, 0, "n0", "127.0.0.1")
    cm = CostModel(prof, lambda _a, _b: 1e9, 1)
    sync = SyncModel(prof, [dev, dev], lambda _a, _b: 1e9, 4, 1)
    L = prof.n_layers()
    for position, k in ((0, 2), (1, 2)):
        flight = in_flight(position, k, 3)
        async_totals = cm.memory_total("t", flight)
        sync_totals = sync._memory_matrix(0, position, k, kind)
        for a, b in itertools.combinations(range(L + 1), 2):
            want = stage_memory_of(prof, "t", (a, b), position, k, 3, 1)
            assert int(async_totals[a, b]) == want.total
            assert cm.stage_memory("t", a, b, position, k, 3) == want
            want = stage_memory_of(prof, "t", (a, b), position, k, 4, 1, kind)
            assert sync_totals[a, b] == want.total


@pytest.mark.parametrize("kind", ["1f1b", "zb-h1"])
def test_a_tied_tensors_gradient_is_charged_once_by_every_form(kind: str) -> None:
    """A tensor two layers share has one gradient: the walk charges it once on a stage
    holding either layer, and the synchronous planner's matrix is the scalar model's, to
    the byte, on every ``[a, b)``."""
    prof = synthetic_profile(6, {"t": 1.0}, 5)
    nbytes = min(prof.layers["t"][j].param_bytes for j in (1, 4))
    prof = dataclasses.replace(prof, ties=(TieProfile("w", (1, 4), nbytes),))
    dev = DeviceSpec("d0", "cpu", "t", 1 << 30, 1.0, 0, "n0", "127.0.0.1")
    sync = SyncModel(prof, [dev, dev], lambda _a, _b: 1e9, 4, 1)
    L = prof.n_layers()
    for position in (0, 1):
        totals = sync._memory_matrix(0, position, 2, kind)
        for a, b in itertools.combinations(range(L + 1), 2):
            want = stage_memory_of(prof, "t", (a, b), position, 2, 4, 1, kind)
            assert totals[a, b] == want.total, (a, b)
    lps = prof.layers["t"]
    once = stage_memory_of(prof, "t", (0, L), 0, 2, 4, 1, kind).working
    twice = stage_memory(lps, 0, 2, 4, 1, prof.input_bytes, kind).working  # ties unknown
    assert 0 < twice - once <= nbytes  # counted twice without the tie, once with it


def whole_model_stage(
    model: str, nm: int, minibatches: int, train: dict[str, Any] | None = None
) -> tuple[StageCompute, int]:
    """A real stage holding the whole ``model`` on a fast CPU device, its weights loaded
    from seed 3; and the model's number of layers."""
    extra = {"train": train} if train else {}
    spec = JobSpec.from_dict(
        job("unit", model=model, minibatches=minibatches, nm=nm, seed=3, **extra)
    )
    n = len(build_model(spec.model.name, spec.model.args))
    task = StageTask.standalone(
        "unit", spec.to_dict(), StageLayout(("gpu0",), 0, n), nm=nm, minibatches=minibatches
    )
    dev = DeviceSpec("gpu0", "cpu", "fast", 1 << 30, 1.0, 0, "node0", "127.0.0.1")
    compute = StageCompute(task, dev)
    torch.manual_seed(3)
    state = build_model(spec.model.name, spec.model.args).state_dict()
    names = compute.state_names()
    compute.load({k: state[k] for k in names}, {k: [] for k in names})
    return compute, n


def test_runtime_accounting_equals_the_planner_on_every_term() -> None:
    """A real stage (the whole model, async, weights stashed, SGD with momentum) holding Nm
    minibatches of Nm weight versions, with two waves' updates accumulated, counts exactly
    the planner's six terms for the same layers measured by the profiler."""
    model, nm = "usermodels:dropout_mlp", 3
    compute, n = whole_model_stage(model, nm, 24)
    stream = MinibatchStream(load_dataset("digits"), 32, 0, 0, 1)
    # the async order: Nm forwards ahead, then a backward and a step before each forward
    for p in range(nm):
        compute.forward(p, *stream.batch(p))
    for p in range(nm, 2 * nm + 1):
        q = p - nm
        compute.backward(q, None)
        compute.step(q)
        compute.forward(p, *stream.batch(p))
    assert len(compute.in_flight) == nm
    assert sorted(compute.acc) == [0, 1]  # the wave being built and the one before
    got = compute.memory()

    x, _ = stream.batch(0)
    torch.manual_seed(3)
    layers = measure_layers(build_model(model), x, repeats=3, warmup=1)
    profile = ModelProfile(model, 32, x.numel() * x.element_size(), {"fast": layers})
    factor = StageOptimizer.state_factor(compute.spec.optimizer)
    assert factor == 1  # SGD with momentum: one parameter-sized buffer
    # position 0 of 2 holds Nm in flight (a pipeline's last stage holds one)
    want = stage_memory_of(profile, "fast", (0, n), 0, 2, nm, factor)
    assert got.to_dict() == want.to_dict()


@pytest.mark.parametrize("kind", ["1f1b", "zb-h1"])
def test_runtime_walks_the_backward_as_the_planner_does(kind: str) -> None:
    """A real synchronous stage's working term, counted from the bytes its first forward
    measured, is the model's walk of its backward for the same layers measured by the
    profiler, to the byte: a whole backward layer by layer with the weight gradients it
    returns, a split one's larger pass."""
    model = "usermodels:dropout_mlp"
    compute, n = whole_model_stage(model, 4, 8, {"schedule": kind})
    stream = MinibatchStream(load_dataset("digits"), 32, 0, 0, 1)
    compute.forward(0, *stream.batch(0))
    x, _ = stream.batch(0)
    torch.manual_seed(3)
    layers = measure_layers(build_model(model), x, repeats=1, warmup=0)
    profile = ModelProfile(model, 32, x.numel() * x.element_size(), {"fast": layers})
    want = stage_memory_of(profile, "fast", (0, n), 0, 1, 4, 1, kind)
    assert compute.memory().working == want.working
    # not the async kind's largest layer: walked (1f1b) or the weight pass's (zb-h1)
    assert want.working != max(lp.work_bytes for lp in layers)


def test_a_tensor_two_layers_save_and_the_stage_output_are_counted_once() -> None:
    """Layers Linear, ReLU, Linear (each saved alone: its input, its output, its input) on a
    stage input of 8 bytes: the first Linear's saved input is the stage input (counted with
    the stage), the ReLU's output is the second Linear's input (once), and the stage output
    (4 bytes, which the last Linear does not save) is kept until the backward."""
    saved, inputs = [8, 16, 16], [8, 16, 16]
    saved_in, saved_out = [8, 0, 16], [0, 16, 0]
    assert activation_bytes(saved, inputs) == 40  # without the ends: nothing corrected
    assert activation_bytes(saved, inputs, (), (), saved_in, saved_out, 4) == 16 + 4
    # a swapped ReLU parks its output on the host: the second Linear's saved input stays
    assert activation_bytes(saved, inputs, (), (1,), saved_in, saved_out, 4) == 16 + 4
    # a last layer that saves its output (a ReLU) holds the stage output already
    assert activation_bytes([8, 16], [8, 16], (), (), [8, 0], [0, 16], 16) == 16


def test_a_synchronous_stage_peaks_at_its_passes_or_at_its_step() -> None:
    """The passes hold the gradient sum and the previous step's update, held until its wave
    is pushed (the gradients a backward returns are the working term's), the step three
    parameter-sized tensors beside the held update with no activation left: the larger
    moment counts."""
    assert accumulators(100, 500, "async") == 200
    assert accumulators(100, 500, "1f1b") == 200  # the sum + the update still held
    assert accumulators(100, 500, "zb-h1") == 200
    assert accumulators(100, 50, "1f1b") == 200 + 150  # the step: 4 x beside 50 bytes gone
    assert accumulators(100, 50, "zbv") == 200 + 150
    np.testing.assert_array_equal(
        accumulators(np.array([100, 100]), np.array([500, 50]), "zb-h2"), [200, 350]
    )
    for kind, kept in itertools.product(("1f1b", "zb-h1"), (10, 100)):
        terms = stage_terms(100, 0, kept, 10, 20, factor=1, flight=2, schedule=kind)
        passes = 400 + 2 * (10 + kept) + 20
        assert terms.total == max(passes, 600)  # weights, momentum, 4 x at the step


def test_a_whole_backward_is_walked_layer_by_layer() -> None:
    """At each layer's backward: the received gradient, the layer's output and input
    gradients, the weight gradients of it and the layers after it, less what those layers
    saved (freed by then; the stage output stays): the peak of the walk, not the largest
    layer beside every weight gradient."""
    work, out, params = [30, 60, 15], [20, 10, 5], [7, 0, 3]
    saved, s_in, s_out = [20, 10, 40], [20, 0, 10], [0, 10, 5]
    # last: 15 + 3; layer 1: 5 + 60 + 3 - (40 - 10 - 5); layer 0: 5 + 30 + 10 - (25 + 10)
    assert backward_walk(work, out, params, saved, s_in, s_out) == max(18, 43, 10)
    assert backward_walk(work, out, params) == max(18, 68, 45)  # nothing counted freed
    # the whole kind walks; a split one takes its input pass or its weight pass; async the
    # largest layer
    kw = {"out": out, "params": params, "saved_in": s_in, "saved_out": s_out}
    assert working_bytes(work, saved, backward="whole", **kw) == 43
    assert working_bytes(work, saved, backward="split", **kw) == 60
    assert working_bytes([1, 2], [0, 0], backward="split", params=[50, 0]) == 50
    assert working_bytes(work, saved, **kw) == 60
    # a recomputed run: the conservative walk, plus the run's saved tensors
    assert working_bytes(work, saved, [1, 2], backward="whole", **kw) == 68 + 50
