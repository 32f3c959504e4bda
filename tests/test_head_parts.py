"""The head's pure parts, without a process: hang diagnosis, status views, checkpoint cut
selection and consistency, what a resumed or re-planned job starts from, and registration."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import job

from hetpipe.checkpoint import Checkpoint, stage_file
from hetpipe.config import load_cluster
from hetpipe.core.layout import StageLayout, VWLayout
from hetpipe.head import JobState, JobStatus, diagnose
from hetpipe.head.cuts import cut_positions, cut_problem, expected_stages, ready_cuts
from hetpipe.head.recovery import lost_since, restart_from_global, resume_plan, stage_restores
from hetpipe.head.registry import Registry, hello_problem, shard_problem
from hetpipe.head.views import job_summary, job_view, progress_signature, stage_time
from hetpipe.job import JobSpec
from hetpipe.jobplan import JobPlan, JobPlanError
from hetpipe.localcluster import DeviceDef, cluster_toml

# layers 0..5; the odd ones (activations) hold no state
NAMES = ("0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias")


def make_plan(
    vws: tuple[tuple[tuple[str, int, int], ...], ...] = (
        (("gpu0", 0, 2), ("gpu1", 2, 4), ("gpu2", 4, 6)),
    ),
    *,
    nm: int = 2,
    minibatches: int = 8,
    owed: tuple[int, ...] = (),
    train: dict[str, Any] | None = None,
) -> JobPlan:
    """A job plan as the head holds one: stages as (device, first, last) per VW; layer
    ``2i`` on shard ``i + 1``."""
    return JobPlan(
        job="t-1",
        spec=JobSpec.from_dict(job(nm=nm, minibatches=minibatches, train=train), source="test"),
        vws=tuple(
            VWLayout(tuple(StageLayout((d,), a, b) for d, a, b in stages), nm) for stages in vws
        ),
        minibatches=minibatches,
        placement={n: int(n.split(".")[0]) // 2 + 1 for n in NAMES},
        initial={n: torch.full((2,), float(i)) for i, n in enumerate(NAMES)},
        dataset=None,  # type: ignore[arg-type]
        owed=owed,
    )


# -- hang diagnosis -----------------------------------------------------------------------------


def test_a_hang_is_diagnosed_stage_by_stage() -> None:
    plan = make_plan()
    now = 1000.0
    progress = {
        (0, 0): {"waiting": {"kind": "gradient", "p": 7, "since": now - 31}},
        (0, 1): {"waiting": {"kind": "pull", "wave": 3, "need": 2, "since": now - 40}},
    }
    assert diagnose(plan, progress, now, 1) == [
        "vw0/stage0 (gpu0) waits 31 s for the gradient of minibatch 7 from vw0/stage1 (gpu1)",
        "vw0/stage1 (gpu1) waits 40 s at the WSP gate: the pull of wave 3 needs global "
        "clock >= 2, it is 1",
        "vw0/stage2 (gpu2) reports nothing it waits for",
    ]
    progress = {
        (0, 0): {"waiting": {"kind": "forward", "p": 4, "since": now - 5}},
        (0, 1): {"waiting": {"kind": "activation", "p": 3, "since": now - 6}},
        (0, 2): {"waiting": {"kind": "reduce", "wave": 1, "since": now - 7}},
    }
    assert diagnose(plan, progress, now, 0) == [
        "vw0/stage0 (gpu0) has been running the forward of minibatch 4 for 5 s",
        "vw0/stage1 (gpu1) waits 6 s for the activation of minibatch 3 from vw0/stage0 (gpu0)",
        "vw0/stage2 (gpu2) waits 7 s for the other virtual workers' gradients of iteration 1",
    ]
    odd = {(0, s): {"waiting": {"kind": "the moon", "since": now}} for s in range(3)}
    assert diagnose(plan, odd, now, 0)[0] == "vw0/stage0 (gpu0) waits 0 s for the moon"


def test_only_forwards_and_backwards_count_as_progress() -> None:
    a = {(0, 0): {"done": 3, "forwards": 5, "waiting": {"kind": "pull"}, "loss": 1.0}}
    b = {(0, 0): {"done": 3, "forwards": 5, "waiting": {"kind": "gradient"}, "loss": 0.5}}
    assert progress_signature(a) == progress_signature(b)
    c = {(0, 0): {"done": 3, "forwards": 6}}
    assert progress_signature(a) != progress_signature(c)


# -- views --------------------------------------------------------------------------------------


def test_a_running_jobs_view_sums_its_virtual_workers() -> None:
    plan = make_plan(((("gpu0", 0, 4), ("gpu1", 4, 6)), (("gpu2", 0, 6),)))
    js = JobState(id="t-1", spec=plan.spec, submitted=0.0, plan=plan, started=time.time())
    js.move(JobStatus.PLANNING)
    js.move(JobStatus.RUNNING)
    js.progress = {
        (0, 0): {"done": 4, "forward_s": 1.0, "backward_s": 3.0},
        (0, 1): {"done": 4, "loss": 1.0, "vw_clock": 2, "elapsed_s": 2.0},
        (1, 0): {"done": 2, "loss": 3.0, "vw_clock": 1, "elapsed_s": 2.0},
    }
    view = job_view(js)
    assert view["state"] == "running" and type(view["state"]) is str
    assert view["minibatches"] == 6 and view["positions"] == [4, 2]
    assert view["global_clock"] == 1 and view["loss"] == 2.0
    assert view["samples_per_s"] == (4 + 2) * 32 / 2.0
    assert [v["devices"] for v in view["vws"]] == [["gpu0", "gpu1"], ["gpu2"]]
    first = view["stages"][0]
    assert first["layers"] == [0, 4] and first["time_s"] == 1.0
    assert set(job_summary(js)) == {
        "id",
        "name",
        "state",
        "seconds",
        "total",
        "minibatches",
        "loss",
        "samples_per_s",
    }
    assert stage_time({}) is None and stage_time({"done": 2, "forward_s": 1.0}) == 0.5


# -- checkpoint cuts ----------------------------------------------------------------------------


def state(wave: int, kept: tuple[int, ...] = ()) -> tuple[dict[str, Any], dict[str, Any]]:
    return {"wave": wave, "kept_waves": list(kept)}, {"w": torch.zeros(1)}


def test_a_cut_is_taken_once_every_stage_sent_its_state() -> None:
    plan = make_plan()  # 8 minibatches of nm 2: waves 0..3, cuts at 2 and 4 (every 2)
    assert expected_stages(plan) == [(0, 0), (0, 1), (0, 2)]
    states: dict[tuple[int, int], dict[int, Any]] = {(0, 0): {2: state(2)}, (0, 1): {2: state(2)}}
    cuts, nxt = ready_cuts(plan, states, 2, 2)
    assert cuts == [] and nxt == 2
    states[(0, 2)] = {1: state(1), 2: state(2)}
    cuts, nxt = ready_cuts(plan, states, 2, 2)
    assert [c for c, _ in cuts] == [2] and nxt == 4
    assert set(cuts[0][1]) == {(0, 0), (0, 1), (0, 2)}
    assert states[(0, 2)] == {2: state(2)}  # older states dropped
    for s in range(3):
        states[(0, s)][4] = state(4)
    cuts, nxt = ready_cuts(plan, states, nxt, 2)
    assert [c for c, _ in cuts] == [4] and nxt is None
    assert ready_cuts(plan, states, None, 2) == ([], None)


def test_a_virtual_worker_at_its_end_gives_its_last_state_to_later_cuts() -> None:
    plan = make_plan(((("gpu0", 0, 6),), (("gpu1", 0, 6),)), owed=(8, 4))  # 4 and 2 waves
    states: dict[tuple[int, int], dict[int, Any]] = {(0, 0): {2: state(2)}, (1, 0): {2: state(2)}}
    cuts, nxt = ready_cuts(plan, states, 2, 2)
    assert [c for c, _ in cuts] == [2] and nxt == 4
    states[(0, 0)][4] = state(4)
    cuts, nxt = ready_cuts(plan, states, nxt, 2)
    assert [c for c, _ in cuts] == [4] and nxt is None
    assert cuts[0][1][(1, 0)] == state(2)
    assert cut_positions(plan, 4) == [8, 4] and cut_positions(plan, 1) == [2, 2]


def test_a_cut_whose_shards_and_stages_disagree_is_not_written() -> None:
    plan = make_plan()
    picks = {(0, s): state(2, kept=(0, 1)) for s in range(3)}
    whole = {str(i): {f"0/{i - 1}": [[0, 2]]} for i in (1, 2, 3)}
    assert cut_problem(plan, 2, whole, picks) is None
    behind = {**whole, "2": {"0/1": [[0, 1]]}}
    assert cut_problem(plan, 2, behind, picks) == (
        "shard 2 applied waves [[0, 1]] of vw0/stage1 at cut 2, not [0, 2)"
    )
    late = {**picks, (0, 2): state(3)}
    assert cut_problem(plan, 2, whole, late) == "vw0/stage2 sent its state of wave 3 for cut 2"
    ahead = {**picks, (0, 0): state(2, kept=(2,))}
    assert cut_problem(plan, 2, whole, ahead) == (
        "vw0/stage0 keeps updates of waves [2] outside cut 2"
    )


# -- resuming and re-planning -------------------------------------------------------------------


def checkpoint_of(plan: JobPlan, positions: list[int], totals: list[int]) -> Checkpoint:
    """A checkpoint of ``plan``: each stage's weights and one optimizer tensor per
    parameter (``opt/momentum/<name>``), 3 optimizer steps each."""
    stages, files = {}, {}
    for v, vw in enumerate(plan.vws):
        for s, st in enumerate(vw.stages):
            names = plan.stage_names(v, s)
            tensors = {n: torch.ones(2) for n in names}
            tensors.update({f"opt/momentum/{n}": torch.full((2,), 10.0 * v + s) for n in names})
            meta = {"wave": 2, "optimizer": "sgd", "opt_steps": {n: 3 for n in names}}
            stages[stage_file(v, s)] = tensors
            files[stage_file(v, s)] = {"vw": v, "stage": s, "first": st.first, "last": st.last}
            files[stage_file(v, s)]["meta"] = meta
    meta = {"job": "t-1", "positions": positions, "totals": totals, "stages": files}
    meta["minibatches_done"] = min(positions)
    state = {n: torch.full((2,), -1.0) for n in NAMES}
    return Checkpoint(Path("ck"), 0, state, meta, stages)


def test_a_resume_on_the_same_split_restores_every_stage_whole() -> None:
    old = make_plan()
    ck = checkpoint_of(old, [4], [8])
    plan = make_plan()
    totals, restores, owed = resume_plan(plan, ck, sync=False)
    assert totals == (8,) and owed == [4]
    assert plan.starts == (4,) and plan.owed == (4,) and plan.minibatches_of(0) == 4
    assert all(t.eq(-1).all() for t in plan.initial.values())  # the shards' cut
    assert set(restores) == {(0, 0), (0, 1), (0, 2)}
    meta, tensors = restores[(0, 1)]
    assert meta["weights"] is True and set(tensors) == {
        "2.weight",
        "2.bias",
        "opt/momentum/2.weight",
        "opt/momentum/2.bias",
    }


def test_moved_layers_take_the_optimizer_state_of_each_parameter() -> None:
    ck = checkpoint_of(make_plan(), [4], [8])
    plan = make_plan(((("gpu0", 0, 4), ("gpu1", 4, 6)),))  # stage 0 now holds layers 0..3
    restores = stage_restores(plan, ck, same_vws=True)
    meta, tensors = restores[(0, 0)]
    assert meta == {
        "weights": False,
        "opt_steps": {"0.weight": 3, "0.bias": 3, "2.weight": 3, "2.bias": 3},
        "optimizer": "sgd",
    }
    assert tensors["opt/momentum/0.bias"].eq(0).all()  # from old stage 0
    assert tensors["opt/momentum/2.bias"].eq(1).all()  # from old stage 1
    assert not any(not k.startswith("opt/") for k in tensors)
    # layers 4..5 stayed together (old stage 2, now stage 1): the whole state
    assert restores[(0, 1)][0]["weights"] is True


def test_another_count_of_virtual_workers_starts_all_from_the_slowest() -> None:
    two = make_plan(((("gpu0", 0, 6),), (("gpu1", 0, 6),)))
    ck = checkpoint_of(two, [6, 4], [8, 8])
    one = make_plan(((("gpu0", 0, 6),),))
    totals, restores, owed = resume_plan(one, ck, sync=False)
    assert totals == (8,) and owed == [4] and one.starts == (4,)
    assert restores[(0, 0)][0]["weights"] is False  # data sharded otherwise: from VW 0's


def test_a_finished_or_foreign_checkpoint_is_refused() -> None:
    with pytest.raises(JobPlanError, match="nothing left to train"):
        resume_plan(make_plan(), checkpoint_of(make_plan(), [8], [8]), sync=False)
    foreign = checkpoint_of(make_plan(), [4], [8])
    del foreign.state["4.bias"]
    with pytest.raises(JobPlanError, match=r"has no \['4.bias'\]: another model"):
        resume_plan(make_plan(), foreign, sync=False)


def test_a_replan_without_a_checkpoint_starts_from_the_global_weights() -> None:
    plan = make_plan(((("gpu0", 0, 6),), (("gpu1", 0, 6),)))
    weights = {n: torch.full((2,), 7.0) for n in NAMES}
    assert restart_from_global(plan, weights, [5, 3], 8, sync=False) == (8, 8)
    assert plan.starts == (3, 3) and plan.owed == (5, 5)
    assert all(t.eq(7).all() for t in plan.initial.values())
    sync = make_plan(train={"schedule": "gpipe"})
    restart_from_global(sync, weights, [6], 8, sync=True)
    assert sync.minibatches == 2 and sync.starts == (6,)


def test_the_work_a_resume_does_again() -> None:
    assert lost_since([7, 5], [4, 4]) == [3, 1]
    assert lost_since([4, 3], [4, 4]) == [0, 0]
    assert lost_since(None, [4]) is None and lost_since([4], [4, 4]) is None


# -- registration and liveness ------------------------------------------------------------------


@pytest.fixture
def registry(tmp_path: Path) -> Registry:
    path = tmp_path / "cluster.toml"
    path.write_text(cluster_toml((DeviceDef("gpu0"), DeviceDef("gpu1", "slow")), shards=2))
    return Registry(load_cluster(path), None, "tcp://127.0.0.1:1")  # type: ignore[arg-type]


def hello(device: str, type_: str = "fast", address: str = "tcp://127.0.0.1:9") -> dict[str, Any]:
    return {"device": device, "type": type_, "address": address, "pid": 1, "host": "h"}


def test_only_the_cluster_files_devices_and_shards_register(registry: Registry) -> None:
    cluster = registry.cluster
    assert hello_problem(cluster, hello("gpu0")) is None
    assert "'gpu9' is not a device of" in str(hello_problem(cluster, hello("gpu9")))
    assert "gpu1 is of type 'slow'" in str(hello_problem(cluster, hello("gpu1")))
    assert hello_problem(cluster, hello("gpu0", address="nowhere")) is not None
    assert shard_problem(cluster, {"shard": 1, "address": "tcp://127.0.0.1:9"}) is None
    for index in (0, 2, -1):
        problem = shard_problem(cluster, {"shard": index, "address": "tcp://127.0.0.1:9"})
        assert f"shard {index} is not a shard of" in str(problem)


def test_a_silent_worker_is_lost_once_and_must_say_hello_again(registry: Registry) -> None:
    assert registry.register(b"a", hello("gpu0")) is None
    registry.workers["gpu0"].job = "t-1"
    assert registry.heartbeat(b"a", {"device": "gpu0", "state": "running"})
    assert not registry.heartbeat(b"b", {"device": "gpu0", "state": "idle"})  # another process
    now = time.monotonic()
    assert registry.newly_lost(now) == ([], [])
    lost, _ = registry.newly_lost(now + registry.cluster.runtime.lost_after_s + 1)
    assert [w.device for w, _ in lost] == ["gpu0"] and registry.alive() == {}
    assert registry.newly_lost(now + 100) == ([], [])  # once
    assert not registry.heartbeat(b"a", {"device": "gpu0", "state": "idle"})
    replaced = registry.register(b"b", hello("gpu0"))  # restarted with the job: it is failed
    assert replaced is not None and replaced.job == "t-1"
    assert registry.idle() == {"gpu0"}
