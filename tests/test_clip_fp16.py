"""The training loop as people write it, through the pipeline: a learning-rate schedule with
warm-up, gradient clipping on the global norm and fp16 with dynamic loss scaling in a
synchronous job equal plain PyTorch's loop (``torch.optim.lr_scheduler``,
``clip_grad_norm_``, ``torch.amp.GradScaler``); ``optimizer.merge`` makes the shards add the
mean of the virtual workers' updates instead of their sum."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch
from conftest import UNIFORM, assert_same_weights, job, user_code_cluster
from helpers import plain_training, stages_json

from hetpipe.localcluster import LocalCluster

pytestmark = pytest.mark.slow

M = 4
ITERATIONS = 12
WARMUP = 3


def _warmup_cosine(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    """torch's warm-up then cosine, as ``[lr_schedule]`` below says it."""
    lr = torch.optim.lr_scheduler
    return lr.SequentialLR(
        opt,
        [
            lr.LinearLR(opt, start_factor=0.25, end_factor=1.0, total_iters=WARMUP),
            lr.CosineAnnealingLR(opt, T_max=ITERATIONS - WARMUP, eta_min=0.05 * 0.1),
        ],
        milestones=[WARMUP],
    )


@pytest.mark.timeout(240)
@pytest.mark.parametrize("vws", [1, 2])
def test_schedule_and_clipping_equal_torchs_loop(uniform_cluster, vws) -> None:
    """k = 2, 1f1b, M = 4: the warm-up-then-cosine rate on the iteration clock and the
    global norm of the iteration's gradient over both stages, clipped below about half of
    the iterations' norms; with 2 VWs the norm of their merged mean gradient (plain
    PyTorch on the union of their samples, whose norms are smaller)."""
    clip = 0.3 if vws == 1 else 0.15
    split = [(["gpu0", "gpu1"], [3, 3]), (["gpu2", "gpu3"], [2, 4])][:vws]
    spec = job(
        f"loop-clip-{vws}",
        model="mlp",
        split=split,
        nm=M,
        minibatches=M * ITERATIONS,
        lr=0.05,
        train={"schedule": "1f1b"},
    )
    spec["optimizer"]["clip_norm"] = clip
    spec["lr_schedule"] = {
        "kind": "cosine",
        "warmup_steps": WARMUP,
        "warmup_start": 0.25,
        "min_factor": 0.1,
    }
    info = uniform_cluster.submit(spec)
    assert info["state"] == "done", info.get("error")
    want = plain_training(spec, ITERATIONS, m=M, vws=vws, scheduler=_warmup_cosine, clip_norm=clip)
    assert_same_weights(torch.load(info["model_path"]), want)
    # without clipping the weights differ: the clip did something
    unclipped = plain_training(spec, ITERATIONS, m=M, vws=vws, scheduler=_warmup_cosine)
    assert max((unclipped[n] - want[n]).abs().max().item() for n in want) > 1e-3


@pytest.mark.timeout(240)
def test_async_schedule_follows_the_minibatch_and_clips_per_stage(uniform_cluster) -> None:
    """One async VW, k = 2, Nm = 1 (nothing stale: plain SGD a minibatch per step): the
    step schedule with warm-up on the VW's minibatch number, each stage clipping its own
    gradient by its own norm, equal torch's loop clipping each stage's parameters apart."""
    steps = 16
    spec = job(
        "loop-async",
        model="mlp",
        split=[(["gpu0", "gpu1"], [3, 3])],
        nm=1,
        minibatches=steps,
    )
    spec["optimizer"]["clip_norm"] = 0.3
    spec["lr_schedule"] = {"kind": "step", "warmup_steps": 2, "step_every": 5, "gamma": 0.5}
    info = uniform_cluster.submit(spec)
    assert info["state"] == "done", info.get("error")
    lrs = torch.optim.lr_scheduler

    def warm_step(opt: torch.optim.Optimizer) -> lrs.LRScheduler:
        return lrs.SequentialLR(
            opt,
            [
                lrs.LinearLR(opt, start_factor=1e-12, total_iters=2),
                lrs.StepLR(opt, step_size=5, gamma=0.5),
            ],
            milestones=[2],
        )

    want = plain_training(spec, steps, scheduler=warm_step, clip_norm=0.3, clip_stages=[3, 3])
    assert_same_weights(torch.load(info["model_path"]), want)


@pytest.mark.timeout(240)
def test_fp16_skips_exactly_gradscalers_steps(uniform_cluster) -> None:
    """A huge initial scale overflows the fp16 gradients between the stages (the last
    stage's own gradients stay finite: only the agreement makes it skip too); GradScaler
    skips the same iterations, the scale grows back every 3 steps and overflows again; the
    weights end finite and equal torch's autocast loop."""
    steps = 14
    spec = job(
        "loop-fp16",
        model="mlp",
        split=[(["gpu0", "gpu1"], [3, 3])],
        nm=1,
        minibatches=steps,
        train={"schedule": "1f1b", "precision": "fp16"},
    )
    spec["loss_scale"] = {"init": 2.0**24, "growth_interval": 3}
    info = uniform_cluster.submit(spec)
    assert info["state"] == "done", info.get("error")
    skipped: list[int] = []
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24, growth_interval=3)
    want = plain_training(spec, steps, m=1, scaler=scaler, skipped=skipped)
    assert skipped and len(skipped) < steps, skipped
    for where, r in stages_json(info).items():
        assert r["stats"]["skipped_steps"] == skipped, where
        assert r["stats"]["loss_scale"] == scaler.get_scale(), where
    got = torch.load(info["model_path"])
    assert all(torch.isfinite(t).all() for t in got.values())
    assert_same_weights(got, want, tol=1e-4)


@pytest.mark.timeout(240)
def test_merge_mean_adds_half_of_what_sum_adds_with_two_vws(uniform_cluster) -> None:
    """Two async virtual workers, one wave each: the shards end at w0 + U0 + U1 under sum
    and at w0 + (U0 + U1) / 2 under mean. A VW whose stages start late may pull the other's
    update before its own wave, which changes its update by a term of second order in the
    learning rate: a small rate keeps that far below the tolerance."""
    final = {}
    for merge in ("sum", "mean"):
        spec = job(
            f"loop-merge-{merge}",
            model="mlp",
            split=[(["gpu0", "gpu1"], [3, 3]), (["gpu2", "gpu3"], [3, 3])],
            nm=2,
            minibatches=2,
            lr=1e-3,
            momentum=0.0,
            weight_decay=0.0,
        )
        spec["optimizer"]["merge"] = merge
        info = uniform_cluster.submit(spec)
        assert info["state"] == "done", info.get("error")
        final[merge] = torch.load(info["model_path"])
    initial = plain_training(job("init", model="mlp"), 0)
    for name, w0 in initial.items():
        summed = final["sum"][name] - w0
        mean = final["mean"][name] - w0
        assert summed.abs().max() > 0, name
        assert torch.allclose(mean, summed / 2, atol=1e-6), name
    assert not math.isclose(
        float(final["sum"]["1.weight"].sum()), float(final["mean"]["1.weight"].sum())
    )


@pytest.fixture(scope="module")
def allowing_schedules(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """Two devices whose daemons may import the schedule functions of ``userschedules``."""
    c = user_code_cluster(tmp_path_factory, "userschedules", devices=UNIFORM[:2], shards=1)
    yield c
    c.stop()


@pytest.mark.timeout(240)
def test_a_schedule_function_of_the_users_own(allowing_schedules) -> None:
    """``lr_schedule.kind = "userschedules:halving"`` with its args after a warm-up, in a
    synchronous job: equal torch's loop with the same factors (a LambdaLR); a function
    returning no number fails the job naming it."""
    steps = 6
    spec = job(
        "loop-fn", model="mlp", split=[(["gpu0", "gpu1"], [3, 3])], nm=2, minibatches=2 * steps
    )
    spec["train"]["schedule"] = "1f1b"
    spec["train"].pop("staleness", None)
    spec["lr_schedule"] = {
        "kind": "userschedules:halving",
        "warmup_steps": 2,
        "args": {"every": 2},
    }
    info = allowing_schedules.submit(spec)
    assert info["state"] == "done", info.get("error")

    def factor(i: int) -> float:
        return i / 2 if i < 2 else 0.5 ** ((i - 2) // 2)

    want = plain_training(
        spec,
        steps,
        m=2,
        scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, factor),
    )
    assert_same_weights(torch.load(info["model_path"]), want)
    spec["name"] = "loop-fn-broken"
    spec["lr_schedule"] = {"kind": "userschedules:broken"}
    info = allowing_schedules.submit(spec)
    assert info["state"] == "failed"
    assert "userschedules:broken returned 'fast'" in info["error"], info["error"]
