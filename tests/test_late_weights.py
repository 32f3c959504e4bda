"""SpecTrain's ``paper`` variant without a second forward (hetpipe.lateweights).

A middle stage of a three-stage virtual worker runs its lock-step order in process, fed the
same inputs and output gradients whatever its settings: its backward must go through the
weights predicted ``s_bwd`` ahead at the backward, take the weight gradients from the
forward's activations, run each layer's forward once, and give the same job under every
activation policy.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import assert_same_weights, job

from hetpipe.config import DeviceSpec
from hetpipe.core.layout import StageLayout
from hetpipe.core.memory import stage_memory_of
from hetpipe.job import JobSpec
from hetpipe.measure import measure_layers
from hetpipe.models import build_model
from hetpipe.planner.profile import ModelProfile
from hetpipe.stage import StageCompute
from hetpipe.task import StageTask

MINIBATCHES = 12


def middle_stage(
    model: str,
    args: dict,
    first: int,
    last: int,
    *,
    recompute: list[int] = (),
    swap: list[int] = (),
    precision: str = "fp32",
) -> StageCompute:
    """Stage 1 of 3 holding layers ``first``..``last``-1, weights predict (paper), Nm = 3."""
    train = {"weights": "predict", "predict_variant": "paper", "precision": precision}
    spec = JobSpec.from_dict(
        job(
            "late", model=model, model_args=args, nm=3, minibatches=MINIBATCHES, seed=4, train=train
        )
    )
    task = StageTask.standalone(
        "late",
        spec.to_dict(),
        StageLayout(
            ("gpu0",), first, last, recompute=tuple(list(recompute)), swap=tuple(list(swap))
        ),
        stage=1,
        k=3,
        nm=3,
        minibatches=MINIBATCHES,
    )
    device = DeviceSpec("gpu0", "cpu", "fast", 1 << 30, 1.0, 0, "node0", "127.0.0.1", 96.0)
    compute = StageCompute(task, device)
    torch.manual_seed(4)
    state = build_model(spec.model.name, spec.model.args).state_dict()
    names = compute.state_names()
    compute.load({k: state[k] for k in names}, {k: [] for k in names})
    return compute


def feeds(width_in: int, width_out: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each minibatch's input and output gradient (the neighbours' part), seeded."""
    g = torch.Generator().manual_seed(11)
    xs = [torch.randn(32, width_in, generator=g) for _ in range(MINIBATCHES)]
    gs = [torch.randn(32, width_out, generator=g) for _ in range(MINIBATCHES)]
    return xs, gs


def run_order(
    compute: StageCompute,
    xs: list[torch.Tensor],
    gs: list[torch.Tensor],
    before_backward=None,
    after_backward=None,
) -> dict[int, torch.Tensor]:
    """The stage's lock-step order (forwards, backwards, a step after each backward); the
    input gradient of each minibatch. The callbacks see the stage around each backward."""
    y = torch.zeros(32, dtype=torch.long)
    grads = {}
    assert compute.table is not None
    for n in range(2 * MINIBATCHES):
        kind, p = compute.table.op(n)
        if kind == "F":
            compute.forward(p, xs[p], y)
        else:
            if before_backward is not None:
                before_backward(p)
            grads[p] = compute.backward(p, gs[p])
            if after_backward is not None:
                after_backward(p)
            compute.step(p)
    return grads


def test_paper_runs_each_forward_once_and_backpropagates_through_the_backward_prediction():
    """One linear layer: the input gradient of a minibatch with updates between its forward
    and backward is g W_hat(s_bwd), the prediction made at the backward (not the forward's,
    which differs), its weight gradient g^T x from the forward, and the layer runs once per
    minibatch. The graph does not keep the forward's prediction: one predicted copy."""
    compute = middle_stage("mlp", {"hidden": [16, 16]}, 1, 2)
    calls = []
    compute.module[0].register_forward_pre_hook(lambda _m, _x: calls.append(1))
    xs, gs = feeds(64, 16)
    fwd_weights = {}
    real_forward = compute.forward

    def forward(p, x, y):
        s_fwd, _ = compute.table.s(p)
        fwd_weights[p] = compute.optimizer.predict(compute.params, s_fwd)["1.weight"].clone()
        out = real_forward(p, x, y)
        assert len(calls) == p + 1  # once, in the forward
        return out

    compute.forward = forward
    checked, released, weighed = [], [], []

    def before_backward(p):
        flight = compute.in_flight[p]
        if flight.late is None:
            return
        # the graph kept no copy of the forward's prediction (but the one a probe may
        # still judge, released once judged): one predicted copy
        released.append(flight.params["1.weight"].untyped_storage().nbytes() == 0)
        assert compute.memory().stash == compute.param_bytes
        want = compute.optimizer.predict(compute.params, flight.late)["1.weight"]
        checked.append((p, want.clone()))

    def after_backward(p):
        if checked and checked[-1][0] == p:  # the weight gradient: the forward's input
            torch.testing.assert_close(
                compute.pending[p]["1.weight"], gs[p].T @ xs[p], rtol=1e-5, atol=1e-5
            )
            weighed.append(p)

    grads = run_order(compute, xs, gs, before_backward, after_backward)
    assert len(calls) == MINIBATCHES  # no layer ran again in a backward
    assert len(checked) >= 3, checked  # minibatches with updates in between were tested
    assert sum(released) >= 2, released
    assert weighed == [p for p, _ in checked]
    for p, w_bwd in checked:
        got = grads[p]
        torch.testing.assert_close(got, gs[p] @ w_bwd, rtol=1e-5, atol=1e-6)
        away = (gs[p] @ fwd_weights[p] - got).abs().max()
        assert away > 1e-3, (p, away)  # the forward's prediction would give another gradient


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_paper_is_the_same_job_under_every_activation_policy(precision: str) -> None:
    """Dropout MLP layers 1-6 (two linear layers, dropout): recomputing every layer, a run
    of them, or swapping them trains the weights and sends the input gradients of keeping
    them (<= 1e-6): a recomputed run recomputes its activations on the forward's prediction
    and differentiates on the backward's, as a kept layer does."""
    xs, gs = feeds(64, 64)
    arms = {
        "keep": {},
        "recompute": {"recompute": list(range(1, 7))},
        "mixed": {"recompute": [1, 2, 3], "swap": [4, 5]},
        "swap": {"swap": list(range(1, 7))},
    }
    results = {}
    for name, policy in arms.items():
        compute = middle_stage("usermodels:dropout_mlp", {}, 1, 7, precision=precision, **policy)
        lates = []
        grads = run_order(
            compute, xs, gs, lambda p, c=compute, acc=lates: acc.append(c.in_flight[p].late)
        )
        assert sum(s is not None for s in lates) >= 3, lates
        results[name] = (compute.state_dict(), grads)
    want_state, want_grads = results["keep"]
    for name in ("recompute", "mixed", "swap"):
        state, grads = results[name]
        assert_same_weights(state, want_state, tol=1e-6)
        for p in range(MINIBATCHES):
            torch.testing.assert_close(
                grads[p].float(), want_grads[p].float(), rtol=0, atol=1e-6, msg=f"{name} p={p}"
            )


def test_paper_memory_is_the_planner_formula() -> None:
    """A middle stage with a recomputed run, Nm = 3: its peak activations are the planner's
    (each in-flight minibatch keeps its graph, no rerun room), and its weight copies stay
    within the planner's stash term (one predicted copy plus the run's prediction per
    in-flight minibatch), which they exceed the one copy by. (No pushes here: the update
    accumulators grow unlike a pipeline's, so the total is the end-to-end tests'.)"""
    model, recompute = "usermodels:dropout_mlp", [1, 2, 3]
    compute = middle_stage(model, {}, 1, 7, recompute=recompute)
    xs, gs = feeds(64, 64)
    run_order(compute, xs, gs)
    torch.manual_seed(3)
    full = build_model(model)
    x = torch.randn(32, 1, 8, 8)
    layers = measure_layers(full, x, repeats=1, warmup=0)
    profile = ModelProfile(model, 32, x.numel() * x.element_size(), {"fast": layers})
    want = stage_memory_of(
        profile, "fast", (1, 7), 1, 3, 3, 1, weights="predict", recompute=recompute
    )
    peak = compute.stats.peak_memory
    assert compute.stats.peak_in_flight == 3
    assert peak["activations"] == want.activations
    recomputed = sum(layers[j].param_bytes for j in recompute)
    assert want.stash == compute.param_bytes + 3 * recomputed
    assert compute.param_bytes + recomputed <= peak["stash"] <= want.stash
    assert (peak["params"], peak["working"]) == (want.params, want.working)


@pytest.mark.parametrize("every", [1, 4])
def test_probes_are_spaced_and_each_is_scored_in_full(every: int) -> None:
    """A prediction probe starts at most every ``probe_every`` minibatches (judging costs
    passes over the weights), and each is scored exactly as separate differences, norms and
    reads score it: ||W_hat - W_target|| / ||W_stale - W_target||, read back in batches
    (no wait for the device per probe)."""
    compute = middle_stage("mlp", {"hidden": [16, 16]}, 1, 2)
    compute.probe_every = every
    xs, gs = feeds(64, 16)
    starts, want = [], []
    real_forward, real_judge = compute.forward, compute._judge

    def forward(p, x, y):
        before = compute.probe
        out = real_forward(p, x, y)
        if compute.probe is not None and compute.probe is not before:
            starts.append(p)
        return out

    def judge():
        probe = compute.probe
        if probe is not None and compute.steps_taken >= probe.target:
            names = [n for n in probe.predicted if probe.predicted[n] is not probe.stale[n]]
            with torch.no_grad():
                now = [compute.params[n] for n in names]
                hat = torch._foreach_sub([probe.predicted[n] for n in names], now)
                old = torch._foreach_sub([probe.stale[n] for n in names], now)
                num = float(torch.stack(torch._foreach_norm(hat)).norm())
                den = float(torch.stack(torch._foreach_norm(old)).norm())
            want.append(num / den)
        real_judge()

    compute.forward, compute._judge = forward, judge
    run_order(compute, xs, gs)
    assert len(starts) >= 2, starts
    assert all(b - a >= every for a, b in itertools.pairwise(starts)), starts
    # the scores wait on the device until read back in batches, in the order judged
    compute.read_quality()
    read = len(compute.stats.prediction_quality)
    assert read % compute._quality.every == 0, read  # whole batches only, none yet waited for
    assert compute.stats.prediction_quality == want[:read]
    compute.read_quality(block=True)
    assert compute.stats.prediction_quality == want
    assert len(want) >= len(starts) - 1
    if every == 1:  # a probe at every forward that finds none outstanding
        assert len(starts) > MINIBATCHES // 4, starts


def test_a_probe_with_nothing_to_score_adds_no_score() -> None:
    """Where the weights did not move (lr 0), the stale weights are the target and the ratio
    has no denominator: such probes are judged on the device and dropped when read back."""
    compute = middle_stage("mlp", {"hidden": [16, 16]}, 1, 2)
    compute.probe_every = 1
    compute.optimizer.lr = 0.0
    xs, gs = feeds(64, 16)
    run_order(compute, xs, gs)
    assert len(compute._quality) > 0  # probes were judged (their scores wait on the device)
    compute.read_quality(block=True)
    assert compute.stats.prediction_quality == []
