"""Learning-rate schedules and the loss scale's rule (hetpipe.core.lr) against torch's own
(``torch.optim.lr_scheduler``, ``torch.amp.GradScaler``); the job keys of the training loop
and each of their refusals, in one line; a stage's step applying them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import job, one_line_error

from hetpipe.core.lr import LossScale, LrSchedule, step_index
from hetpipe.job import JobError, JobSpec, load_job
from hetpipe.optim import grad_stats
from hetpipe.security import CodeError, check_code
from hetpipe.usercode import named_code


def _torch_factors(make, steps: int, lr: float = 0.1) -> list[float]:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    sched = make(opt)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"] / lr)
        opt.step()
        sched.step()
    return out


def test_warmup_then_cosine_is_torchs_sequential_linear_and_cosine() -> None:
    lrs = torch.optim.lr_scheduler
    ours = LrSchedule("cosine", warmup_steps=4, warmup_start=0.1, total_steps=20, min_factor=0.2)
    want = _torch_factors(
        lambda o: lrs.SequentialLR(
            o,
            [
                lrs.LinearLR(o, start_factor=0.1, total_iters=4),
                lrs.CosineAnnealingLR(o, T_max=16, eta_min=0.1 * 0.2),
            ],
            milestones=[4],
        ),
        20,
    )
    assert [ours.factor(i) for i in range(20)] == pytest.approx(want, abs=1e-9)
    assert ours.factor(25) == pytest.approx(0.2)  # past the end: the floor


def test_step_and_constant_are_torchs() -> None:
    lrs = torch.optim.lr_scheduler
    want = _torch_factors(lambda o: lrs.StepLR(o, step_size=3, gamma=0.5), 12)
    assert [LrSchedule("step", step_every=3, gamma=0.5).factor(i) for i in range(12)] == (
        pytest.approx(want)
    )
    warm = LrSchedule("step", warmup_steps=2, step_every=3, gamma=0.5)
    assert [warm.factor(i) for i in range(6)] == pytest.approx([0, 0.5, 1, 1, 1, 0.5])
    assert LrSchedule().constant and LrSchedule().factor(7) == 1.0
    assert not LrSchedule(warmup_steps=1).constant


def test_a_function_gives_the_factor_after_the_warm_up() -> None:
    sched = LrSchedule(
        "pkg.mod:f", warmup_steps=2, args={"k": 3}, function=lambda t, k: 1.0 / (k + t)
    )
    assert [sched.factor(i) for i in range(4)] == pytest.approx([0, 0.5, 1 / 3, 1 / 4])
    with pytest.raises(ValueError, match="not resolved"):
        LrSchedule("pkg.mod:f").factor(0)
    with pytest.raises(ValueError, match=r"pkg.mod:f returned nan for step 0, not a finite"):
        LrSchedule("pkg.mod:f", function=lambda t: float("nan")).factor(0)


def test_a_schedule_function_is_user_code_the_cluster_must_allow() -> None:
    d = job(train={"schedule": "1f1b"})
    d["lr_schedule"] = {"kind": "mysched:warm", "args": {"a": 1}}
    spec = JobSpec.from_dict(d)
    assert spec.lr_schedule.args == {"a": 1}
    assert [(n.key, n.module, n.function) for n in named_code(spec)] == [
        ("lr_schedule.kind", "mysched", "warm")
    ]
    check_code(spec, ["mysched"])
    with pytest.raises(CodeError) as info:
        check_code(spec, [])
    assert str(info.value).startswith(
        "job: lr_schedule.kind: module 'mysched' is not allowed: list it in cluster.toml"
    )


def test_step_index_is_the_iteration_or_the_vws_minibatch_across_a_resume() -> None:
    assert step_index(True, 3, 4, 0) == 3
    assert step_index(True, 3, 4, 8) == 5  # resumed after 2 iterations of M = 4
    assert step_index(False, 3, 4, 8) == 11


def test_loss_scale_follows_gradscaler_on_any_verdicts() -> None:
    verdicts = [True, False, True, True, True, False, False] + [True] * 7
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=3)
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    ours = LossScale(1024.0, 2.0, 0.5, 3)
    for finite in verdicts:
        opt.zero_grad()
        scaler.scale((p * (1.0 if finite else float("inf"))).sum()).backward()
        scaler.step(opt)
        scaler.update()
        ours.update(finite)
        assert ours.scale == scaler.get_scale()
    assert ours.skipped == verdicts.count(False)


def test_grad_stats_sums_every_tensors_square_and_sees_a_nan() -> None:
    grads = {"a": torch.tensor([3.0, 0.0]), "b": torch.tensor([[4.0]])}
    assert grad_stats(grads) == (25.0, True)
    assert grad_stats({}) == (0.0, True)
    assert not grad_stats({**grads, "c": torch.tensor([float("nan")])})[1]


def test_keys_parse_and_round_trip() -> None:
    d = job(train={"schedule": "1f1b", "precision": "fp16"})
    d["optimizer"]["clip_norm"] = 1.0
    d["lr_schedule"] = {"kind": "cosine", "warmup_steps": 5, "total_steps": 50}
    d["loss_scale"] = {"init": 1024.0, "growth_interval": 10}
    spec = JobSpec.from_dict(d)
    assert spec.optimizer.clip_norm == 1.0 and spec.optimizer.merge == "sum"
    assert spec.lr_schedule == LrSchedule("cosine", warmup_steps=5, total_steps=50)
    assert (spec.loss_scale.init, spec.loss_scale.growth_interval) == (1024.0, 10)
    assert JobSpec.from_dict(spec.to_dict(), strict=True) == spec
    plain = JobSpec.from_dict(job())
    assert "lr_schedule" not in plain.to_dict() and "loss_scale" not in plain.to_dict()
    a = job()
    a["optimizer"]["merge"] = "mean"
    assert JobSpec.from_dict(a).optimizer.merge == "mean"


SYNC = '[train]\nminibatch = 8\nminibatches = 8\nschedule = "1f1b"\n'
ASYNC = "[train]\nminibatch = 8\nminibatches = 8\n"


@pytest.mark.parametrize(
    ("train", "more", "key", "problem"),
    [
        (SYNC + "warmup = 2\n", "", "train.warmup", "renamed train.warmup_forwards"),
        (SYNC, '[lr_schedule]\nkind = "linear"\n', "lr_schedule.kind", "unknown schedule kind"),
        (SYNC, "[lr_schedule]\nwarmup_steps = -1\n", "lr_schedule.warmup_steps", ">= 0"),
        (
            SYNC,
            "[lr_schedule]\nwarmup_steps = 2\nwarmup_start = 1.5\n",
            "lr_schedule.warmup_start",
            "<= 1",
        ),
        (SYNC, "[lr_schedule]\nwarmup_start = 0.5\n", "lr_schedule.warmup_start", "no effect"),
        (
            SYNC,
            '[lr_schedule]\nkind = "cosine"\nwarmup_steps = 9\ntotal_steps = 9\n',
            "lr_schedule.total_steps",
            "not more than warmup_steps 9",
        ),
        (SYNC, "[lr_schedule]\ntotal_steps = 9\n", "lr_schedule.total_steps", "no effect"),
        (
            SYNC,
            '[lr_schedule]\nkind = "cosine"\nmin_factor = 2.0\n',
            "lr_schedule.min_factor",
            "<= 1",
        ),
        (SYNC, '[lr_schedule]\nkind = "step"\n', "lr_schedule.step_every", "missing"),
        (
            SYNC,
            '[lr_schedule]\nkind = "step"\nstep_every = 0\n',
            "lr_schedule.step_every",
            ">= 1",
        ),
        (
            SYNC,
            '[lr_schedule]\nkind = "step"\nstep_every = 2\ngamma = 0.0\n',
            "lr_schedule.gamma",
            "> 0",
        ),
        (SYNC, "[lr_schedule]\ngamma = 0.5\n", "lr_schedule.gamma", "no effect"),
        (SYNC, "[lr_schedule]\nsteps = 5\n", "lr_schedule.steps", "unknown key"),
        (SYNC, '[lr_schedule]\nkind = "mod:"\n', "lr_schedule.kind", "unknown schedule kind"),
        (SYNC, "[lr_schedule]\nargs = { a = 1 }\n", "lr_schedule.args", "no effect"),
        (
            SYNC,
            '[lr_schedule]\nkind = "m:f"\nargs = 3\n',
            "lr_schedule.args",
            "expected a table",
        ),
        (SYNC, "[optimizer]\nclip_norm = 0.0\n", "optimizer.clip_norm", "> 0"),
        (SYNC, '[optimizer]\nclip_norm = "big"\n', "optimizer.clip_norm", "expected"),
        (ASYNC, '[optimizer]\nmerge = "avg"\n', "optimizer.merge", "unknown merge 'avg'"),
        (SYNC, '[optimizer]\nmerge = "mean"\n', "optimizer.merge", "no effect"),
        (ASYNC + 'precision = "fp16"\n', "", "train.precision", "fp16 needs schedule gpipe"),
        (SYNC, "[loss_scale]\ninit = 1024.0\n", "loss_scale.init", "no effect"),
        (SYNC + 'precision = "fp16"\n', "[loss_scale]\ninit = 0.0\n", "loss_scale.init", "> 0"),
        (
            SYNC + 'precision = "fp16"\n',
            "[loss_scale]\ngrowth_factor = 1.0\n",
            "loss_scale.growth_factor",
            "> 1",
        ),
        (
            SYNC + 'precision = "fp16"\n',
            "[loss_scale]\nbackoff_factor = 1.0\n",
            "loss_scale.backoff_factor",
            "must be in [0.01, 1)",
        ),
        (
            SYNC + 'precision = "fp16"\n',
            "[loss_scale]\ngrowth_interval = 0\n",
            "loss_scale.growth_interval",
            ">= 1",
        ),
    ],
)
def test_each_bad_value_is_refused_in_one_line(
    tmp_path: Path, train: str, more: str, key: str, problem: str
) -> None:
    path = tmp_path / "job.toml"
    path.write_text(f'name = "j"\n[model]\nname = "mlp"\n{train}{more}')
    one_line_error(load_job, JobError, path, key, problem)
