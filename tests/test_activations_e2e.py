"""Activation policies on real daemons: the runtime enforces the planner's memory model.

Two devices of 32 MiB and a batch-norm CNN at minibatch 512 with Nm = 3: keeping every
activation, its first stage needs about 51 MiB, so the runtime refuses the job; with
``train.activations = "auto"`` the planner recomputes a run of that stage's layers (about
29 MiB), the job trains, and each stage's measured peak, counted in the planner's terms,
is the predicted figure within 10%.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from conftest import job, start_cluster

from hetpipe.localcluster import DeviceDef, LocalCluster

pytestmark = pytest.mark.slow

TIGHT = (DeviceDef("gpu0", "fast", "32MiB", 1.0), DeviceDef("gpu1", "fast", "32MiB", 1.0))


@pytest.fixture(scope="module")
def tight_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = start_cluster(tmp_path_factory.mktemp("tight"), TIGHT, shards=1)
    yield c
    c.stop()


def cnn_job(name: str, activations: str) -> dict:
    spec = job(name, model="cnn", model_args={"width": 16}, minibatch=512, nm=3,
               minibatches=12, split=[(["gpu0", "gpu1"], [6, 10])], lr=0.02)
    spec["train"]["activations"] = activations
    return spec


@pytest.mark.timeout(300)
def test_keep_is_refused_and_auto_runs_within_the_predicted_memory(tight_cluster) -> None:
    info = tight_cluster.submit(cnn_job("tight-keep", "keep"), timeout=240)
    assert info["state"] == "failed"
    assert "memory cap 32.0MiB" in info["error"] and "vw0/stage0" in info["error"], info["error"]

    info = tight_cluster.submit(cnn_job("tight-auto", "auto"), timeout=240)
    assert info["state"] == "done", info.get("error")
    pred = info["predicted"]["vws"][0]["stages"]
    assert pred[0]["recompute"] and not pred[1]["recompute"]
    for s in info["stages"]:
        want = pred[s["stage"]]
        got = s["peak_memory"]
        assert got["params"] == want["memory_terms"]["params"]
        assert got["working"] == want["memory_terms"]["working"]
        # the plan bounds what may be in flight; the run reaches it on this pipeline
        assert got["activations"] <= want["memory_terms"]["activations"]
        assert s["peak_bytes"] <= want["memory"] <= want["memory_cap"]
        error = (want["memory"] - s["peak_bytes"]) / want["memory"]
        assert error <= 0.10, (s["stage"], got, want["memory_terms"])
