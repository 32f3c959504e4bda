"""A live layer migration on real daemons: a virtual worker of three workers moves layers
between them while it trains (replan.migrate_at), ends with the weights of the same job that
does not migrate, and records the migration in stages.json, metrics.jsonl and its status."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import assert_same_weights, job, start_cluster
from helpers import check_invariants, records_by_index, stages_json

from hetpipe.localcluster import DeviceDef

pytestmark = pytest.mark.slow

DEVICES = (
    DeviceDef("m0", "fast", "256MiB", 1.0),
    DeviceDef("m1", "fast", "256MiB", 1.0),
    DeviceDef("m2", "fast", "256MiB", 1.0),
)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = start_cluster(tmp_path_factory.mktemp("migrate"), DEVICES)
    yield c
    c.stop()


def spec(name: str, at: int = 0, to: list[int] | None = None) -> dict:
    split = [(["m0", "m1", "m2"], [6, 6, 4])]
    d = job(name, model="cnn", nm=1, minibatches=12, split=split)
    if at:
        d["replan"] = {"migrate_at": at, "migrate_to": to}
    return d


@pytest.mark.timeout(300)
def test_a_live_migration_is_lossless_and_recorded(cluster) -> None:
    plain = cluster.submit(spec("plain"), timeout=140)
    assert plain["state"] == "done", plain.get("error")
    moved = cluster.submit(spec("moved", 4, [3, 9, 4]), timeout=140)
    assert moved["state"] == "done", moved.get("error")
    assert_same_weights(torch.load(moved["model_path"]), torch.load(plain["model_path"]), 1e-6)
    assert [m["event"] for m in moved["migrations"]] == ["migration"]
    stages = stages_json(moved)
    first = stages["vw0/stage0"]["stats"]["migrations"]
    assert [m["at"] for m in first] == [4]
    assert first[0]["moves"] == [{"first": 3, "last": 6, "src": 0, "dst": 1}]
    assert all(m["migration_stall_s"] >= 0 for m in first)
    lines = [json.loads(x) for x in Path(moved["metrics_path"]).read_text().splitlines()]
    assert [x["at"] for x in lines if x.get("event") == "migration"] == [4]
    # the moved layers trained on their new stages: the last stage's records go on
    assert stages["vw0/stage1"]["stats"]["migrations"][0]["range"] == [3, 12]


@pytest.mark.timeout(200)
def test_a_migration_a_stage_cannot_carry_out_fails_the_job_with_its_reason(cluster) -> None:
    info = cluster.submit(spec("bad", 4, [8, 8]), timeout=140)
    assert info["state"] == "failed"
    assert "the new split has 2 stages, the virtual worker 3" in info["error"]


@pytest.mark.timeout(300)
def test_wsp_invariant_holds_on_daemons_with_a_migration_in_one_virtual_worker(
    tmp_path_factory,
) -> None:
    devices = tuple(DeviceDef(f"w{i}", "fast", "256MiB", 1.0) for i in range(4))
    c = start_cluster(tmp_path_factory.mktemp("migrate-wsp"), devices)
    try:
        spec = job(
            "wsp-mig",
            model="cnn",
            nm=2,
            minibatches=16,
            staleness=0,
            split=[(["w0", "w1"], [8, 8]), (["w2", "w3"], [8, 8])],
        )
        spec["replan"] = {"migrate_at": 6, "migrate_to": [5, 11], "migrate_vw": 1}
        info = c.submit(spec, timeout=250)
    finally:
        c.stop()
    assert info["state"] == "done", info.get("error")
    records = records_by_index(info)
    assert all(len(rows) == 16 for rows in records.values())
    assert check_invariants(records, {0: 2, 1: 2}, 0) > 0
    assert [m["event"] for m in info["migrations"]] == ["migration"]
    moved = stages_json(info)["vw1/stage0"]["stats"]["migrations"][0]
    assert moved["range"] == [0, 5] and moved["moves"] == [
        {"first": 5, "last": 8, "src": 0, "dst": 1}
    ]


@pytest.mark.timeout(400)
def test_a_slowed_device_is_re_planned_by_a_live_migration_the_head_orders(
    tmp_path_factory,
) -> None:
    """The online re-plan's whole path on real daemons: a device slows down mid-job, the
    head's drift watch decides a re-split, and the head orders it while the virtual worker
    trains (stage 0 picks the boundary): it is carried out at a boundary past the decision,
    and the slowed device keeps fewer layers. Slow devices, so that an emulated device's
    padding, not a loaded host's waits, makes its speed."""
    devices = tuple(DeviceDef(f"s{i}", "mid", "256MiB", 0.25) for i in range(2))
    c = start_cluster(tmp_path_factory.mktemp("migrate-replan"), devices)
    try:
        spec = {
            "name": "replanned",
            "model": {"name": "cnn"},
            "data": {"name": "digits"},
            "optimizer": {"name": "sgd", "lr": 0.03, "momentum": 0.9},
            "train": {"minibatch": 32, "minibatches": 240, "staleness": 1, "seed": 0},
            "vw": [{"devices": ["s0", "s1"]}],
            "fault": [{"kind": "slow", "device": "s0", "factor": 4.0, "at_minibatch": 60}],
            "replan": {"window": 8, "window_s": 1.0},
        }
        info = c.submit(spec, timeout=350)
    finally:
        c.stop()
    assert info["state"] == "done", info.get("error")
    taken = [d for d in info["replan_decisions"] if d["taken"]]
    assert taken and taken[0]["device"] == "s0", [d["line"] for d in info["replan_decisions"]]
    (m,) = info["migrations"]
    assert m["event"] == "migration", m
    nm = info["final_plan"][0]["nm"]
    assert m["at"] % nm == 0 and m["at"] > taken[0]["minibatch"]
    old = taken[0]["old_bounds"][0]
    (first, last) = info["final_plan"][0]["layers"][0]
    assert first == 0 and last < old[1]  # s0 gave layers away
    stages = stages_json(info)
    (moved,) = stages["vw0/stage0"]["stats"]["migrations"]
    assert moved["at"] == m["at"] and moved["migration_stall_s"] < 30
    # what the re-plan promised, and what the migration gave: measured beside it
    lines = [json.loads(x) for x in Path(info["metrics_path"]).read_text().splitlines()]
    (gain,) = [x for x in lines if x.get("event") == "migration_gain"]
    assert gain["at"] == m["at"] and gain["predicted_gain"] == taken[0]["gain"]
    assert gain["measured_gain"] is not None and gain["measured_gain"] > 0
    assert m["measured_gain"] == gain["measured_gain"]
    (decided,) = [d for d in stages["vw0/stage0"]["replans"] if d["taken"]]
    assert decided["measured_gain"] == gain["measured_gain"]
    print("measured gain", gain)
