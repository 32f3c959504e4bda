"""Staleness in the planner's objective: the stated penalty, the ``train.max_nm`` cap, schedule
"auto" weighing async staleness, and the warning on a deep asynchronous pipeline."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import KW, gpu_cluster

from hetpipe.config import (
    ClusterConfig,
)
from hetpipe.job import JobError, JobSpec, load_job
from hetpipe.planner import Plan, PlanError, make_plan, synthetic_profile
from hetpipe.planner.staleness import (
    EXPONENT,
    SHALLOW_NM,
    choose_schedule,
    deep_warnings,
    effective_rate,
    factor,
)
from hetpipe.profiling import plan_for
from hetpipe.views import explain_lines


def one_node(n: int, speed: float = 1.0) -> ClusterConfig:
    """``n`` alike GPUs on one node."""
    return gpu_cluster([[("a", speed)] * n])


PROF = synthetic_profile(32, {"a": 1.0}, 0)


def job(**train) -> JobSpec:
    return JobSpec.from_dict(
        {
            "name": "t",
            "model": {"name": "cnn", "args": {"width": 8}},
            "data": {"name": "digits"},
            "optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.9},
            "train": {"minibatch": 32, "minibatches": 200, **train},
        }
    )


def test_the_rule_spares_shallow_pipelines_and_orders_the_modes():
    for mode in EXPONENT:
        assert all(factor(n, mode) == 1.0 for n in range(1, SHALLOW_NM + 1))
        fs = [factor(n, mode) for n in range(SHALLOW_NM, 33)]
        assert fs == sorted(fs, reverse=True)  # deeper is never worth more
    assert factor(8, "stash") == pytest.approx(0.25)
    assert factor(8, "latest") == pytest.approx(0.25)
    assert factor(8, "predict") == pytest.approx(0.5)
    assert factor(8, "predict-consistent") == 1.0
    assert effective_rate([100.0, 50.0], [8, 2], "stash") == pytest.approx(75.0)
    assert deep_warnings([4, 2], "stash") == []
    (w,) = deep_warnings([2, 8], "stash")
    assert w.startswith("vw 1: deep asynchronous pipeline (Nm=8 > 4)") and "x0.25" in w


def test_the_penalty_picks_a_shallower_pipeline_for_stale_weights():
    cluster = one_node(8)
    fresh = make_plan(cluster, PROF, num_vws=1, weights="predict-consistent", **KW)
    stale = make_plan(cluster, PROF, num_vws=1, weights="stash", **KW)
    # the consistent prediction is not penalised: the deepest pipeline, the highest rate
    assert fresh.vws[0].nm == 8
    # stash: raw throughput alone would buy Nm 8 too; the rule's effective rate does not
    assert stale.vws[0].nm <= SHALLOW_NM
    assert stale.samples_per_s < fresh.samples_per_s
    st = stale.details["staleness"]
    assert st["weights"] == "stash" and st["factors"] == [1.0]
    assert st["effective_samples_per_s"] == pytest.approx(stale.samples_per_s)
    deep = fresh.details["staleness"]
    assert deep["effective_samples_per_s"] == pytest.approx(fresh.samples_per_s)
    # the same order at Nm 8 under stash would be credited a quarter: below what it chose
    assert stale.samples_per_s > 0.25 * fresh.samples_per_s


def test_max_nm_caps_every_virtual_worker():
    cluster = one_node(8)
    for cap in (1, 2, 3):
        p = make_plan(cluster, PROF, num_vws=1, weights="predict-consistent", max_nm=cap, **KW)
        assert [v.nm for v in p.vws] == [cap]
        assert p.details["staleness"]["max_nm"] == cap
    # balancing waves across VWs of different speed raises Nm: never above the cap
    mixed = gpu_cluster([[("a", 1.0)] * 3 + [("b", 0.3)] * 3])
    prof = synthetic_profile(16, {"a": 1.0, "b": 0.3}, 1)
    free = make_plan(mixed, prof, policy="np", weights="predict-consistent", **KW)
    capped = make_plan(mixed, prof, policy="np", weights="predict-consistent", max_nm=2, **KW)
    assert max(v.nm for v in free.vws) > 2  # the cap has something to cap
    assert all(v.nm <= 2 for v in capped.vws)
    with pytest.raises(PlanError, match="nm 3 is above max_nm 2"):
        make_plan(cluster, PROF, nm=3, max_nm=2, **KW)
    with pytest.raises(PlanError, match="max_nm must be >= 1"):
        make_plan(cluster, PROF, max_nm=0, **KW)


def test_a_deep_asynchronous_pipeline_carries_a_warning():
    cluster = one_node(8)
    deep = make_plan(cluster, PROF, num_vws=1, nm=8, weights="stash", **KW)
    (w,) = [w for w in deep.warnings if "deep asynchronous pipeline" in w]
    assert "Nm=8 > 4" in w and "x0.25" in w and "predict_variant" in w
    assert f"warning: {w}" in deep.table()  # what `hetpipe plan` prints
    shallow = make_plan(cluster, PROF, num_vws=1, nm=4, weights="stash", **KW)
    assert not any("deep asynchronous" in w for w in shallow.warnings)
    text = "\n".join(explain_lines(deep.details))
    assert "staleness x0.25" in text and "staleness rule:" in text


def test_schedule_auto_weighs_stale_async_against_synchronous():
    cluster = one_node(8)
    # stash: the deep async pipeline's throughput is discounted, a synchronous kind wins
    stale = plan_for(job(schedule="auto", vws=1), cluster, PROF, n_train=10_000)
    assert stale.schedule != "async"
    assert "exact minibatch SGD" in stale.details["schedule_choice"]
    # the consistent prediction keeps the deep pipeline's worth: async wins, deep, warned
    fresh = plan_for(
        job(schedule="auto", vws=1, weights="predict", predict_variant="consistent"),
        cluster,
        PROF,
        n_train=10_000,
    )
    assert fresh.schedule == "async" and fresh.vws[0].nm > SHALLOW_NM
    assert "staleness rule" in fresh.details["schedule_choice"]
    assert any("deep asynchronous pipeline" in w for w in fresh.warnings)
    assert fresh.samples_per_s > stale.samples_per_s  # raw speed alone would pick async


def _plan(schedule: str, rate: float, nm: int = 8, weights: str = "stash") -> Plan:
    st = {"effective_samples_per_s": rate * factor(nm, weights), "rule": "r"}
    details = {"staleness": st} if schedule == "async" else {}
    return Plan((), rate, "np", (), (), schedule=schedule, details=details)


def test_choose_schedule_compares_effective_rates():
    best, why = choose_schedule([_plan("async", 100.0), _plan("1f1b", 60.0)])
    assert best.schedule == "1f1b" and "staleness-weighted 25.0" in why
    best, why = choose_schedule(
        [_plan("async", 100.0, weights="predict-consistent"), _plan("1f1b", 60.0)]
    )
    assert best.schedule == "async" and why.startswith("schedule auto chose async")
    best, _ = choose_schedule([_plan("async", 100.0, nm=4), _plan("1f1b", 60.0)])
    assert best.schedule == "async"


def test_the_job_key_max_nm(tmp_path: Path):
    spec = job(max_nm=3)
    assert spec.max_nm == 3 and job().max_nm is None
    assert JobSpec.from_dict(spec.to_dict(), strict=True).max_nm == 3
    with pytest.raises(JobError, match=r"max_nm.*is 2 but the job gives nm = 4"):
        job(max_nm=2, nm=4)
    with pytest.raises(JobError, match=r"max_nm.*>= 1"):
        job(max_nm=0)
    path = tmp_path / "job.toml"
    path.write_text(
        'name = "t"\n[model]\nname = "cnn"\n[data]\nname = "digits"\n[optimizer]\n'
        'name = "sgd"\nlr = 0.1\n[train]\nminibatch = 8\nminibatches = 4\n'
        'schedule = "gpipe"\nmax_nm = 2\n'
    )
    with pytest.raises(JobError, match=r"max_nm.*has no effect with schedule 'gpipe'"):
        load_job(path)
