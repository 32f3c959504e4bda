"""The synchronous planner chooses a device-level schedule (``interleaved-1f1b`` or ``zbv``,
two stages a device) where the job leaves the schedule to it (``train.schedule = "auto"``
with ``train.several_stages = true``, no ``[[vw]]``) and that kind is predicted faster than
the best one-stage-a-device pipeline by more than the margin; the job then runs it.

Planner tests run no processes; the last test plans and runs a job on real daemons from a
stored profile (so the plan does not hang on the moment's measurement)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import assert_same_weights, job, start_cluster
from helpers import check_device_level, gpu_cluster, plain_training, stages_json

from hetpipe.config import load_cluster
from hetpipe.core.devschedule import check_placement
from hetpipe.core.layout import validate
from hetpipe.core.schedule import DEVICE_KINDS
from hetpipe.job import JobSpec
from hetpipe.localcluster import DeviceDef, LocalCluster, cluster_toml
from hetpipe.models import build_model
from hetpipe.planner.chunksearch import MARGIN, choose_chunks, chunk_placement
from hetpipe.planner.profile import ProfileStore, synthetic_profile
from hetpipe.planner.syncmodel import SyncModel
from hetpipe.planner.syncplan import sync_plan
from hetpipe.profiling import model_key, plan_for
from hetpipe.views import explain_lines

DEVICES = tuple(DeviceDef(n, "fast", "256MiB", 1.0) for n in "ab")
M = 2  # microbatches per iteration


def auto_job(name: str, minibatches: int = 4 * M) -> dict:
    """A job of the builtin mlp that leaves the synchronous schedule and split to the planner
    and lets a device run several stages."""
    train = {"schedule": "auto", "several_stages": True, "vws": 1}
    return job(name, model="mlp", nm=M, minibatches=minibatches, train=train)


def mlp_profile():
    """A profile of the builtin mlp's layers whose compute dwarfs the hand-offs: on two equal
    devices with two microbatches the fill and drain dominate, which a V halves."""
    n = len(build_model(JobSpec.from_dict(auto_job("p")).model))
    return synthetic_profile(
        n,
        {"fast": 1.0},
        0,
        time_s=(1e-2, 4e-2),
        param_bytes=(4 << 10, 8 << 10),
        out_bytes=(1 << 10, 2 << 10),
    )


def local_config(tmp_path: Path):
    path = tmp_path / "cluster.toml"
    path.write_text(cluster_toml(DEVICES, shards=1))
    return load_cluster(path)


def test_the_planner_chooses_a_faster_device_level_kind(tmp_path: Path) -> None:
    spec = JobSpec.from_dict(auto_job("chosen"))
    plan = plan_for(spec, local_config(tmp_path), mlp_profile())
    kind = plan.schedule
    assert kind in DEVICE_KINDS, plan.warnings
    rows = plan.details["chunk_candidates"]
    one, picked = rows[0], next(r for r in rows if r["kind"] == kind)
    assert picked["chosen"] and not one["chosen"]
    assert picked["iteration_s"] < one["iteration_s"] * (1 - MARGIN)
    assert plan.details["searched_iteration_s"] == pytest.approx(picked["iteration_s"])
    assert plan.iteration_s >= picked["iteration_s"]  # the hosts' sharing on top
    # the layout: two stages on each device, in the kind's placement, the searched layers
    (vw,) = plan.vws
    devices = [st.device for st in vw.stages]
    assert devices == picked["devices"]
    assert devices == list(chunk_placement(kind, ("a", "b")))
    assert check_placement(kind, devices) == 2
    assert [st.layers[1] - st.layers[0] for st in vw.stages] == picked["layers"]
    assert vw.nm == M and plan.warmup == 0
    for d in ("a", "b"):  # a device's stages fit its cap together
        held = [st for st in vw.stages if st.device == d]
        assert len(held) == 2 and sum(st.memory.total for st in held) <= held[0].memory_cap
    assert all(st.in_flight >= 1 and st.time_s > 0 for st in vw.stages)
    validate(plan.run_layouts("keep"), {"a", "b"}, sum(picked["layers"]), several=True)
    # it says what it chose and why, in the plan and in --explain
    assert any(w.startswith(f"schedule chosen: {kind}, two stages") for w in plan.warnings)
    assert plan.details["chunk_choice"].startswith(kind)
    assert any("chosen: " in line and kind in line for line in explain_lines(plan.details))
    assert f"schedule auto chose {kind}" in plan.details["schedule_choice"]


def test_a_job_running_the_chosen_kind_is_planned_again_with_it(tmp_path: Path) -> None:
    """A resumed attempt plans the job again from its spec, which now names the kind the
    planner chose but no split: the same kind, two stages a device, whatever the margin."""
    first = plan_for(JobSpec.from_dict(auto_job("again")), local_config(tmp_path), mlp_profile())
    kind = first.schedule
    # the spec as the head keeps it once the planner chose (hetpipe.head.jobs)
    spec = dataclasses.replace(
        JobSpec.from_dict(auto_job("again")), schedule=kind, nm=M, warmup_forwards=0
    )
    again = plan_for(spec, local_config(tmp_path), mlp_profile())
    assert again.schedule == kind
    assert [st.device for st in again.vws[0].stages] == [st.device for st in first.vws[0].stages]
    assert again.details["chunk_choice"].endswith("the kind the job runs, planned again")


@pytest.mark.parametrize(
    "extra",
    [{"several_stages": False}, {"on_worker_loss": "replan"}, {"activations": "auto"}],
    ids=["not-asked", "replan", "auto-activations"],
)
def test_without_several_stages_the_plan_keeps_one_stage_a_device(
    tmp_path: Path, extra: dict
) -> None:
    """The same job without ``train.several_stages``, or with what a several-stage job may not
    have (a re-plan on a lost worker, activations the planner picks): the kinds are priced
    and suggested only, as before."""
    d = auto_job("kept")
    d["train"].update(extra)
    plan = plan_for(JobSpec.from_dict(d), local_config(tmp_path), mlp_profile())
    assert plan.schedule not in DEVICE_KINDS
    assert len({st.device for st in plan.vws[0].stages}) == len(plan.vws[0].stages)
    assert "chunk_choice" not in plan.details


def test_a_device_level_kind_not_faster_keeps_1f1b() -> None:
    """Large activations under a tight cap: two stages a device do not fit together, so the
    plan stays one stage a device (1F1B, the kind that fits)."""
    prof = synthetic_profile(
        16, {"fast": 1.0}, 0, param_bytes=(64 << 10, 128 << 10), out_bytes=(1 << 20, 2 << 20)
    )
    cluster = gpu_cluster([[("fast", 1.0), ("fast", 1.0)]], memory=48 << 20)
    plan = sync_plan(
        cluster, prof, minibatch=32, m=M, optimizer_state_factor=1, budget_s=1, several_stages=True
    )
    assert plan.schedule == "1f1b"
    assert [st.device for st in plan.vws[0].stages] == ["g0", "g1"]
    rows = plan.details["chunk_candidates"]
    assert rows[0]["chosen"] and not any(r["chosen"] for r in rows[1:])
    assert all(r["iteration_s"] is None for r in rows[1:])
    assert "no device-level schedule" in plan.details["chunk_choice"]


def test_the_margin_and_the_last_iteration_are_kept() -> None:
    """A kind faster by less than the margin, or whose last short iteration cannot run, is
    not chosen; the rows say why."""
    prof = synthetic_profile(8, {"fast": 1.0}, 0, time_s=(1e-2, 4e-2))
    cluster = gpu_cluster([[("fast", 1.0), ("fast", 1.0)]])
    model = SyncModel(prof, list(cluster.devices), cluster.network.bytes_per_s, 4, 1)
    best = model.choice((0, 1), "1f1b")
    assert best is not None
    rows, picked, _ = choose_chunks(model, best, margin=0.0)
    assert picked is not None and picked.iteration_s < best.iteration_s
    rows, none, why = choose_chunks(model, best, margin=0.99)
    assert none is None and rows[0]["chosen"] and "99%" in why
    assert all(r["why"].startswith("not chosen") for r in rows[1:] if r["iteration_s"])
    # 10 microbatches in iterations of 4 leave a last one of 2: interleaved on 2 devices
    # runs it; 9 leave 1, which it cannot
    rows, c, _ = choose_chunks(model, best, margin=0.0, total=9)
    inter = next(r for r in rows if r["kind"] == "interleaved-1f1b")
    assert c is None or c.kind != "interleaved-1f1b"
    if inter["iteration_s"] is not None:
        assert "last iteration" in inter["why"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    root = tmp_path_factory.mktemp("autochunks")
    # the profile the planner reads, stored before the head starts: no measurement
    (root / "run").mkdir(parents=True)
    store = ProfileStore(root / "run" / "profiles.json")
    prof = mlp_profile()
    store.put(
        model_key(JobSpec.from_dict(auto_job("p"))),
        32,
        "fast",
        prof.layers["fast"],
        input_bytes=prof.input_bytes,
    )
    store.save()
    c = start_cluster(root, DEVICES, shards=1)
    yield c
    c.stop()


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_planned_device_level_job_runs_its_device_schedule(cluster: LocalCluster) -> None:
    iterations = 4
    spec = auto_job("auto-chunks", minibatches=M * iterations)
    info = cluster.submit(spec, timeout=150)
    assert info["state"] == "done", info.get("error")
    kind = info["predicted"]["schedule"]
    assert kind in DEVICE_KINDS, info["predicted"]["warnings"]
    # exactly minibatch SGD on each iteration's microbatches, as plain PyTorch trains
    assert_same_weights(torch.load(info["model_path"]), plain_training(spec, iterations, m=M))
    stages = stages_json(info)
    assert sorted(stages) == [f"vw0/stage{s}" for s in range(4)]
    devices = [st["device"] for st in info["predicted"]["vws"][0]["stages"]]
    assert check_placement(kind, devices) == 2
    # each stage held what its projected order charges; each device ran its forwards in order
    check_device_level(info, kind, M, iterations)
