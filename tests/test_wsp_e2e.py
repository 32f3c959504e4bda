"""Several virtual workers under WSP on real daemons, one of them 4x slower."""

from __future__ import annotations

import pytest
import torch
from conftest import job, start_cluster
from helpers import check_invariants, records_by_index

from hetpipe.data import evaluate, load_dataset
from hetpipe.localcluster import DeviceDef
from hetpipe.models import build_model

pytestmark = pytest.mark.slow

# VW 0 on two unslowed devices, VW 1 on two devices emulated 4x slower.
DEVICES = (
    DeviceDef("fast0", "fast", "64MiB", 1.0),
    DeviceDef("fast1", "fast", "64MiB", 1.0),
    DeviceDef("slow0", "slow", "64MiB", 0.25),
    DeviceDef("slow1", "slow", "64MiB", 0.25),
)


@pytest.fixture(scope="module")
def wsp_cluster(tmp_path_factory):
    c = start_cluster(tmp_path_factory.mktemp("wsp"), DEVICES)
    yield c
    c.stop()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("staleness", [0, 2])
def test_two_vws_one_slow(wsp_cluster, staleness) -> None:
    # two VWs each apply their full update to the global weights: half the usual step
    spec = job(
        f"wsp-d{staleness}",
        model="cnn",
        nm=2,
        epochs=10,
        staleness=staleness,
        lr=0.02,
        split=[(["fast0", "fast1"], [8, 8]), (["slow0", "slow1"], [8, 8])],
    )
    info = wsp_cluster.submit(spec, timeout=280)
    assert info["state"] == "done", info.get("error")
    records = records_by_index(info)
    assert set(records) == {(0, 0), (0, 1), (1, 0), (1, 1)}
    assert all(len(rows) == info["minibatches"] // 2 for rows in records.values())
    assert check_invariants(records, {0: 2, 1: 2}, staleness) > 0
    # the gate really blocked the fast VW: with D = 0 it cannot run far ahead, so it
    # finishes close to the slow one instead of 4x earlier
    end = {vw: max(r["t_bwd"] for r in records[(vw, 0)]) for vw in (0, 1)}
    start = min(r["t_fwd"] for r in records[(0, 0)])
    if staleness == 0:
        assert end[0] - start > 0.7 * (end[1] - start)
    assert info["test_accuracy"] >= 0.95
    # the exported state_dict reproduces the reported accuracy in plain PyTorch
    state = torch.load(info["model_path"])
    # running statistics are averaged over the VWs, never overshoot: variances stay positive
    for name, t in state.items():
        if name.endswith("running_var"):
            assert bool((t > 0).all()), name
    model = build_model("cnn")
    model.load_state_dict(state, strict=True)
    assert evaluate(model, load_dataset("digits")) == pytest.approx(info["test_accuracy"])
    # the job reports where each stage's state lives
    assert {row["shards"][0] for row in info["placement"]} <= {0, 1}
