"""The zero-bubble schedules (zb-h1, zb-h2) with split backwards are exactly minibatch SGD:
transparency against plain PyTorch on the union of each iteration's samples, with one and
with two virtual workers (see hetpipe/core/schedule.py, StageCompute.backward_input)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from conftest import assert_same_weights, job, sync_job, user_code_cluster
from helpers import plain_training, stages_json

from hetpipe.core.schedule import max_in_flight, microbatch_order
from hetpipe.localcluster import LocalCluster

pytestmark = pytest.mark.slow

M = 4
ITERATIONS = 20


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("kind", "split"),
    [
        ("zb-h1", [(["gpu0", "gpu1"], [3, 3])]),
        ("zb-h2", [(["gpu0", "gpu1"], [4, 2])]),
        ("zb-h1", [(["gpu0", "gpu1", "gpu2", "gpu3"], [1, 2, 2, 1])]),
        ("zb-h2", [(["gpu0", "gpu1", "gpu2", "gpu3"], [2, 1, 1, 2])]),
    ],
)
def test_zb_transparency_one_vw(uniform_cluster, kind, split) -> None:
    spec = sync_job(f"{kind}-{len(split[0][0])}", kind, split, iterations=ITERATIONS)
    info = uniform_cluster.submit(spec)
    assert info["state"] == "done", info.get("error")
    assert_same_weights(
        torch.load(info["model_path"]), plain_training(spec, ITERATIONS, m=M, vws=1)
    )
    # each stage ran its first iteration's passes in the order's sequence: a forward span,
    # then one span per input gradient and per weight gradient
    k = len(split[0][0])
    for where, r in stages_json(info).items():
        s = int(where.split("stage")[1])
        ran = sorted(
            (x for x in r["stats"]["spans"] if x[0] in ("forward", "backward") and x[3] < M),
            key=lambda x: x[1],
        )
        want = microbatch_order(kind, k, s, M)
        if s == 0:  # the first stage's input gradient gives nothing, yet is a span
            assert len(ran) == len(want), where
        assert [("F" if x[0] == "forward" else "B", x[3]) for x in ran] == [
            ("F" if op == "F" else "B", j) for op, j in want
        ], where


@pytest.mark.timeout(240)
def test_zb_transparency_two_vws(uniform_cluster) -> None:
    """Two VWs of different depth under zb-h1: SGD on the union of both VWs' samples."""
    split = [(["gpu0", "gpu1"], [3, 3]), (["gpu2", "gpu3"], [2, 4])]
    spec = sync_job("zb2-h1", "zb-h1", split, lr=0.05, iterations=ITERATIONS)
    info = uniform_cluster.submit(spec)
    assert info["state"] == "done", info.get("error")
    assert_same_weights(
        torch.load(info["model_path"]), plain_training(spec, ITERATIONS, m=M, vws=2)
    )


@pytest.fixture(scope="module")
def user_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """Four devices, two shards; the daemons may import ``usermodels``."""
    c = user_code_cluster(tmp_path_factory, "usermodels")
    yield c
    c.stop()


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("kind", "model", "args", "layers"),
    [
        ("zb-h1", "residual_net", {"norm": False}, [3, 5]),  # (a, skip) crosses the cut
        ("zb-h2", "masked_seq", {}, [1, 2, 1, 2]),  # (h, pos, mask): an integer carry too
    ],
)
def test_zb_carries_train_plain_pytorchs_weights(user_cluster, kind, model, args, layers) -> None:
    """Tuples cross the cuts: each floating tensor's input gradient goes back at I, the
    weights' at W."""
    devices = [f"gpu{i}" for i in range(len(layers))]
    spec = job(
        f"zb-carries-{model}-{kind}",
        model=f"usermodels:{model}",
        model_args=args,
        split=[(devices, layers)],
        nm=M,
        minibatches=M * 6,
        train={"schedule": kind},
    )
    info = user_cluster.submit(spec, timeout=200)
    assert info["state"] == "done", info.get("error")
    assert_same_weights(torch.load(info["model_path"]), plain_training(spec, 6, m=M))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", ["zb-h1", "zb-h2"])
def test_zb_memory_predicted_against_counted(uniform_cluster, kind) -> None:
    """Each stage holds the order's count of microbatches until their weight gradients, and
    its peak activations (graphs kept until W, gradients kept between I and W) come within
    10% of the memory model's."""
    k = 4
    spec = job(
        f"zb-mem-{kind}",
        model="cnn",
        model_args={"width": 16},
        minibatch=64,
        nm=8,
        minibatches=16,
        split=[([f"gpu{i}" for i in range(k)], [5, 4, 4, 3])],
        train={"schedule": kind},
    )
    info = uniform_cluster.submit(spec, timeout=200)
    assert info["state"] == "done", info.get("error")
    pred = info["predicted"]["vws"][0]["stages"]
    for s in sorted(info["stages"], key=lambda x: x["stage"]):
        i = s["stage"]
        assert s["peak_in_flight"] == max_in_flight(kind, k, i, 8), i
        want = pred[i]["memory_terms"]["activations"]
        got = s["peak_memory"]["activations"]
        assert abs(got - want) <= 0.10 * want, (i, got, want)
