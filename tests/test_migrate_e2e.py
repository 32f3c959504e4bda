"""A live layer migration on real daemons: a virtual worker of three workers moves layers
between them while it trains (train.migrate_at), ends with the weights of the same job that
does not migrate, and records the migration in stages.json, metrics.jsonl and its status."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import assert_same_weights, job, start_cluster
from helpers import stages_json

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
    train = {"migrate_at": at, "migrate_to": to} if at else {}
    split = [(["m0", "m1", "m2"], [6, 6, 4])]
    return job(name, model="cnn", nm=1, minibatches=12, split=split, train=train)


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
