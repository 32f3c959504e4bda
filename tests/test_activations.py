"""Per-layer activation policies (keep / recompute) and the one memory model they share.

A recomputed layer must be invisible in the results (same dropout masks, batch-norm
statistics moved once per minibatch) and visible in the memory a stage keeps, counted in
the planner's own terms.
"""

from __future__ import annotations

import pytest
import torch
from conftest import job

from hetpipe.config import DeviceSpec
from hetpipe.data import MinibatchStream, load_dataset
from hetpipe.job import JobSpec
from hetpipe.models import build_model
from hetpipe.planner.memory import MemoryCapError, stage_memory_of
from hetpipe.planner.profile import ModelProfile, measure_layers
from hetpipe.stage import StageCompute
from hetpipe.task import StageTask


def device(memory: int = 1 << 30) -> DeviceSpec:
    return DeviceSpec("gpu0", "cpu", "fast", memory, 1.0, 0, "node0", "127.0.0.1")


def whole_stage(model: str, recompute: list[int], *, nm: int = 3, memory: int = 1 << 30,
                seed: int = 3) -> StageCompute:
    """One stage holding the whole model (so also the loss), initial weights loaded."""
    spec = JobSpec.from_dict(job("unit", model=model, minibatches=12, nm=nm, seed=seed))
    n = len(build_model(spec.model.name, spec.model.args))
    task = StageTask(job="unit", spec=spec.to_dict(), vw=0, stage=0, k=1, first=0, last=n,
                     nm=nm, staleness=0, minibatches=12, num_vws=1, prev=None, next=None,
                     recompute=recompute)
    compute = StageCompute(task, device(memory))
    torch.manual_seed(seed)
    state = build_model(spec.model.name, spec.model.args).state_dict()
    names = compute.state_names()
    compute.load({k: state[k] for k in names}, {k: [] for k in names})
    return compute


def train(compute: StageCompute, steps: int, nm: int = 3) -> None:
    """Async order with ``nm`` in flight: forwards run ahead of backwards, so a recompute
    happens after other minibatches' forwards reseeded the generators."""
    stream = MinibatchStream(load_dataset("digits"), 32, 0, 0, 1)
    for p in range(steps + nm - 1):
        if p < steps:
            compute.forward(p, *stream.batch(p))
        q = p - nm + 1
        if q >= 0:
            compute.backward(q, None)
            compute.step(q)


def n_layers(model: str) -> int:
    return len(build_model(model))


@pytest.mark.parametrize("model", ["usermodels:dropout_mlp", "cnn"])
def test_recompute_is_transparent(model: str) -> None:
    """Every layer recomputed: the same weights and batch-norm statistics as keeping them,
    dropout included, with several minibatches in flight."""
    keep = whole_stage(model, [])
    again = whole_stage(model, list(range(n_layers(model))))
    train(keep, 8)
    train(again, 8)
    want, got = keep.state_dict(), again.state_dict()
    assert set(want) == set(got)
    for name, w in want.items():
        diff = (got[name].double() - w.double()).abs().max().item()
        assert diff <= 1e-6, f"{name}: max abs diff {diff:.3g}"
    assert keep.stats.losses == pytest.approx(again.stats.losses, abs=1e-6)


def test_recompute_keeps_less_and_the_cap_counts_what_is_kept() -> None:
    """The activations term counts only what a recomputed layer keeps (its input), so a cap
    that refuses the kept job admits the recomputed one."""
    model = "usermodels:dropout_mlp"
    keep = whole_stage(model, [])
    again = whole_stage(model, list(range(n_layers(model))))
    stream = MinibatchStream(load_dataset("digits"), 32, 0, 0, 1)
    for p in range(3):
        keep.forward(p, *stream.batch(p))
        again.forward(p, *stream.batch(p))
    k, r = keep.memory(), again.memory()
    assert r.activations < k.activations
    assert (k.params, k.stash) == (r.params, r.stash)
    cap = (k.total + r.total) // 2
    tight = whole_stage(model, [], memory=cap)
    with pytest.raises(MemoryCapError, match="memory cap"):
        for p in range(3):
            tight.forward(p, *stream.batch(p))
    fits = whole_stage(model, list(range(n_layers(model))), memory=cap)
    for p in range(3):
        fits.forward(p, *stream.batch(p))
    assert fits.memory().total <= cap


@pytest.mark.parametrize("recompute", [[], [1, 3, 4]])
def test_runtime_memory_equals_the_planner_formula(recompute: list[int]) -> None:
    """With Nm minibatches in flight a stage's counted activations and working memory are
    the planner's figures for the same layers measured by the profiler."""
    model, nm = "usermodels:dropout_mlp", 3
    compute = whole_stage(model, recompute, nm=nm)
    stream = MinibatchStream(load_dataset("digits"), 32, 0, 0, 1)
    x, _ = stream.batch(0)
    torch.manual_seed(3)
    layers = measure_layers(build_model(model), x, repeats=3, warmup=1)
    profile = ModelProfile(model, 32, x.numel() * x.element_size(), {"fast": layers})
    # a stage at position 0 of 2 holds Nm in flight (the last stage of one holds one)
    want = stage_memory_of(profile, "fast", (0, len(layers)), 0, 2, nm, 1, recompute=recompute)
    for p in range(nm):
        compute.forward(p, *stream.batch(p))
    got = compute.memory()
    assert got.activations == want.activations
    assert got.working == want.working
    assert got.params == want.params
