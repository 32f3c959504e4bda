"""Synchronous pipelines (gpipe, 1f1b) are exactly minibatch SGD: transparency against plain
PyTorch on the union of each iteration's samples, with one and with two virtual workers."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_same_weights, job, sync_job
from helpers import plain_training, stage_records, stages_json

from hetpipe.core.schedule import microbatch_order

pytestmark = pytest.mark.slow

M = 4
ITERATIONS = 30


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("kind", "split", "warmup"),
    [
        ("gpipe", [(["gpu0", "gpu1"], [3, 3])], 0),
        ("1f1b", [(["gpu0", "gpu1", "gpu2", "gpu3"], [1, 2, 2, 1])], 0),
        ("gpipe", [(["gpu0", "gpu1", "gpu2", "gpu3"], [2, 1, 1, 2])], 0),
        ("1f1b", [(["gpu0", "gpu1"], [4, 2])], 0),
        ("1f1b", [(["gpu0", "gpu1", "gpu2", "gpu3"], [2, 1, 1, 2])], 2),
    ],
)
def test_sync_transparency_one_vw(uniform_cluster, kind, split, warmup) -> None:
    spec = sync_job(f"sync-{kind}-{len(split[0][0])}-{warmup}", kind, split)
    if kind == "1f1b":  # warm-up forwards are 1f1b's: the key is refused under gpipe
        spec["train"]["warmup_forwards"] = warmup
    info = uniform_cluster.submit(spec)
    assert info["state"] == "done", info.get("error")
    assert_same_weights(
        torch.load(info["model_path"]), plain_training(spec, ITERATIONS, m=M, vws=1)
    )
    # one optimizer step per iteration: the weight version moves once every M microbatches
    for where, rows in stage_records(info).items():
        v0 = rows[0]["fwd_version"]
        steps = [r["fwd_version"] - v0 for r in rows]
        stateless = steps[-1] == 0  # a stage of parameter-free layers never steps
        assert steps == [0 if stateless else r["p"] // M for r in rows], where
        assert all(r["bwd_version"] == r["fwd_version"] for r in rows), where
        assert [r["clock"] for r in rows] == [r["p"] // M for r in rows], where
    # the timeline shows each iteration's flush: one step span per iteration, after the
    # iteration's last backward and before the next iteration's first forward
    stages = stages_json(info)
    for where, r in stages.items():
        spans = r["stats"]["spans"]
        steps = [x for x in spans if x[0] == "step"]
        assert [x[4] for x in steps] == list(range(ITERATIONS)), where
        for i, step in enumerate(steps[:-1]):
            last_b = max(x[2] for x in spans if x[0] == "backward" and x[3] // M == i)
            next_f = min(x[1] for x in spans if x[0] == "forward" and x[3] // M == i + 1)
            assert last_b <= step[1] and step[2] <= next_f, (where, i)
    # every stage ran its iteration in the schedule's order (warm-up included)
    k = len(split[0][0])
    for where, r in stages.items():
        ran = sorted(
            (x for x in r["stats"]["spans"] if x[0] in ("forward", "backward") and x[3] < M),
            key=lambda x: x[1],
        )
        want = microbatch_order(kind, k, int(where.split("stage")[1]), M, warmup)
        assert [("F" if x[0] == "forward" else "B", x[3]) for x in ran] == list(want), where


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", ["1f1b", "gpipe"])
def test_sync_transparency_two_vws(uniform_cluster, kind) -> None:
    """Two VWs of different depth: SGD on the union of both VWs' samples of each iteration."""
    split = [(["gpu0", "gpu1"], [3, 3]), (["gpu2", "gpu3"], [2, 4])]
    spec = sync_job(f"sync2-{kind}", kind, split, lr=0.05)
    info = uniform_cluster.submit(spec)
    assert info["state"] == "done", info.get("error")
    assert_same_weights(
        torch.load(info["model_path"]), plain_training(spec, ITERATIONS, m=M, vws=2)
    )


@pytest.mark.timeout(240)
def test_sync_vws_of_different_m_weight_gradients_by_samples(uniform_cluster) -> None:
    """A VW of M = 2 beside one of M = 4: every iteration is SGD on all 6 microbatches."""
    split = [(["gpu0", "gpu1"], [3, 3]), (["gpu2", "gpu3"], [2, 4])]
    spec = sync_job("sync-uneven", "1f1b", split, lr=0.05)
    spec["train"]["minibatches"] = 2 * ITERATIONS
    spec["vw"][0]["nm"], spec["vw"][1]["nm"] = 2, 4
    info = uniform_cluster.submit(spec)
    assert info["state"] == "done", info.get("error")
    assert info["minibatches"] == 6 * ITERATIONS
    assert_same_weights(
        torch.load(info["model_path"]), plain_training(spec, ITERATIONS, m=[2, 4], vws=2)
    )


@pytest.mark.timeout(300)
def test_planned_sync_vws_share_m_unevenly_and_stay_transparent(uniform_cluster) -> None:
    """No split, two VWs asked, M = 3: the planner forms them and shares the iteration's
    microbatches (2 + 1), the runtime runs that plan, and the job is still SGD on the union
    of both VWs' samples of each iteration."""
    m = 3
    spec = job(
        "sync-planned-2vw",
        model="mlp",
        nm=m,
        minibatches=m * ITERATIONS,
        lr=0.05,
        train={"schedule": "1f1b", "vws": 2, "warmup_forwards": "auto"},
    )
    info = uniform_cluster.submit(spec, timeout=280)
    assert info["state"] == "done", info.get("error")
    pred = info["predicted"]
    ms = [v["nm"] for v in pred["vws"]]
    assert len(ms) == 2 and sorted(ms) == [1, 2], pred
    assert pred["policy"] in ("np", "ed", "hd")
    assert [v["devices"] for v in info["vws"]] == [
        [s["device"] for s in v["stages"]] for v in pred["vws"]
    ]
    # train.minibatches counts the job's microbatches: ITERATIONS iterations of M in all
    assert info["minibatches"] == m * ITERATIONS
    assert_same_weights(
        torch.load(info["model_path"]), plain_training(spec, ITERATIONS, m=ms, vws=2)
    )
    # the order the planner picked (train.warmup_forwards = "auto") is the order every stage ran
    warmup = pred["warmup"]
    stages = stages_json(info)
    for where, r in stages.items():
        v, s = (int(x) for x in where.replace("vw", "").split("/stage"))
        ran = sorted(
            (x for x in r["stats"]["spans"] if x[0] in ("forward", "backward") and x[3] < ms[v]),
            key=lambda x: x[1],
        )
        want = microbatch_order("1f1b", len(pred["vws"][v]["stages"]), s, ms[v], warmup)
        assert [("F" if x[0] == "forward" else "B", x[3]) for x in ran] == list(want), where
