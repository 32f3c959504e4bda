"""``train.placement``: the job chooses where the shards keep each layer's state (the HetPipe
paper's ED against ED-local), the runtime places its real tensors by it and the plan prices
the choice (:mod:`hetpipe.planner.placement`)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import UNIFORM, job
from helpers import GPUS, paper_cluster

from hetpipe.config import load_cluster
from hetpipe.core.keys import PLACEMENTS
from hetpipe.job import JobError, JobSpec
from hetpipe.jobplan import plan_job
from hetpipe.localcluster import cluster_toml
from hetpipe.planner import make_plan, synthetic_profile
from hetpipe.planner.placement import default_placement, place_plan

SHARDS = {0: "tcp://127.0.0.1:7100", 1: "tcp://127.0.0.1:7101"}


def _spec(**train: str) -> JobSpec:
    return JobSpec.from_dict(job("placed", split=[(["gpu0", "gpu1"], [3, 3])], train=train))


def test_local_is_the_default_and_default_is_taken_and_kept() -> None:
    assert _spec().placement == "local"
    spec = _spec(placement="default")
    assert spec.placement == "default"
    assert JobSpec.from_dict(spec.to_dict()) == spec


def test_a_placement_outside_the_choices_is_refused_in_one_line() -> None:
    with pytest.raises(JobError) as e:
        _spec(placement="nearby")
    text = str(e.value)
    assert "\n" not in text and "train.placement" in text and "nearby" in text, text
    assert all(p in text for p in PLACEMENTS), text


def _plan(tmp_path: Path, placement: str):
    path = tmp_path / "c.toml"
    path.write_text(cluster_toml(UNIFORM[:2], shards=2))
    spec = _spec(placement=placement)
    workers = {d: SimpleNamespace(job=None) for d in ("gpu0", "gpu1")}
    return plan_job(spec, "placed-1", load_cluster(path), workers, SHARDS)


def test_default_puts_layer_j_on_shard_j_mod_s_wherever_its_stage_runs(tmp_path: Path) -> None:
    plan = _plan(tmp_path, "default")
    assert plan.placement, plan.placement
    for name, shard in plan.placement.items():
        assert shard == int(name.split(".")[0]) % 2, (name, plan.placement)


def test_local_balances_a_stage_per_shard_of_its_host(tmp_path: Path) -> None:
    # both shards on the one host: each stage's state on one shard, the two stages apart
    plan = _plan(tmp_path, "local")
    stage_shards = [
        {plan.placement[n] for n in plan.stage_names(0, s)} for s in range(len(plan.vws[0].stages))
    ]
    assert all(len(s) == 1 for s in stage_shards), stage_shards
    assert stage_shards[0] != stage_shards[1], stage_shards


@pytest.fixture(scope="module")
def paper_plans():
    """The paper's testbed planned as ED under each placement."""
    cluster = paper_cluster()
    prof = synthetic_profile(16, {t: s for t, (_, s) in GPUS.items()}, 0)
    kw = {"minibatch": 32, "staleness": 0, "optimizer_state_factor": 1, "policy": "ed"}
    return cluster, prof, {pl: make_plan(cluster, prof, placement=pl, **kw) for pl in PLACEMENTS}


def test_the_plan_prices_and_reports_the_jobs_placement(paper_plans) -> None:
    cluster, prof, plans = paper_plans
    local, default = plans["local"], plans["default"]
    for pl, plan in plans.items():
        chosen = [p["name"] for p in plan.details["placements"] if p["chosen"]]
        assert chosen == [pl], plan.details["placements"]
        scores = {p["name"]: p["score"] for p in plan.details["placements"]}
        # the prediction is the chosen placement's: ED-local pushes cross no link
        assert plan.samples_per_s == pytest.approx(scores[pl], rel=1e-9), (pl, scores)
    assert local.samples_per_s > default.samples_per_s
    # the plan's per-layer shards follow the rule it priced
    assert default.layer_shards == default_placement(cluster.ps, len(default.layer_shards))
    devices = {d.name: d for d in cluster.devices}
    stages = [[(devices[st.device], tuple(st.layers)) for st in v.stages] for v in local.vws]
    assert local.layer_shards == place_plan(cluster, prof, stages)[0]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_job_placed_round_robin_trains_and_reports_its_shards(uniform_cluster) -> None:
    """Two VWs on two shards under ``default``: every layer's state on shard j mod 2, each
    VW's pushes and pulls reach both, and the job trains as it does placed locally."""
    split = [(["gpu0", "gpu1"], [3, 3]), (["gpu2", "gpu3"], [3, 3])]
    spec = job(
        "round-robin", split=split, minibatches=200, nm=2, lr=0.02, train={"placement": "default"}
    )
    info = uniform_cluster.submit(spec, timeout=240)
    assert info["state"] == "done", info.get("error")
    # the mlp's parameters are in its odd layers (Linear), its ReLUs hold none: shard 1
    # holds every stage's state; local placement would give each stage its own shard
    assert {tuple(r["shards"]) for r in info["placement"]} == {(1,)}, info["placement"]
    assert info["test_accuracy"] > 0.8, info["test_accuracy"]
