"""End-to-end pipelines on real daemons: transparency, stashing, accuracy, memory caps."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_same_weights, job
from helpers import checked_stash, plain_training

from hetpipe.data import load_dataset
from hetpipe.models import build_model

pytestmark = pytest.mark.slow


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("model", "split"),
    [
        ("mlp", [(["gpu0", "gpu1"], [3, 3])]),
        ("mlp", [(["gpu0", "gpu1", "gpu2", "gpu3"], [1, 2, 2, 1])]),
        ("cnn", [(["gpu0", "gpu1", "gpu2", "gpu3"], [4, 4, 4, 4])]),
    ],
)
def test_transparency(uniform_cluster, model, split) -> None:
    """Nm = 1: the pipelined weights equal plain PyTorch training's after 50 minibatches."""
    spec = job(f"transparency-{model}", model=model, split=split, nm=1, minibatches=50)
    info = uniform_cluster.submit(spec)
    assert info["state"] == "done", info.get("error")
    assert info["minibatches"] == 50
    got = torch.load(info["model_path"])
    want = plain_training(spec, 50)
    assert_same_weights(got, want)


@pytest.mark.timeout(180)
def test_weight_stashing(uniform_cluster) -> None:
    """Nm = k = 4: each backward differentiates the weights its forward used."""
    split = [(["gpu0", "gpu1", "gpu2", "gpu3"], [4, 4, 4, 4])]
    info = uniform_cluster.submit(
        job("stash", model="cnn", split=split, nm=4, epochs=6, train={"verify": True})
    )
    assert info["state"] == "done", info.get("error")
    records, stashed = checked_stash(info)
    assert len(records) == 4
    # the stash was really needed: newer weights existed when older backwards ran
    first = records["vw0/stage0"]
    assert sum(r["bwd_version"] > r["fwd_version"] for r in first) > len(first) // 2
    assert stashed > 0
    assert info["test_accuracy"] >= 0.9


@pytest.mark.timeout(240)
def test_heterogeneous_cnn_accuracy(hetero_cluster) -> None:
    """The default cluster's shape (whimpy device included) trains the CNN to >= 95%."""
    split = [(["gpu0", "gpu1", "gpu2", "gpu3"], [4, 4, 4, 4])]
    info = hetero_cluster.submit(job("hetero", model="cnn", split=split, nm=4, epochs=10, lr=0.03))
    assert info["state"] == "done", info.get("error")
    assert info["test_accuracy"] >= 0.95
    # the exported state_dict loads strictly into the plain model and gives that accuracy
    from hetpipe.data import evaluate

    model = build_model("cnn")
    model.load_state_dict(torch.load(info["model_path"]), strict=True)
    assert evaluate(model, load_dataset("digits")) == pytest.approx(info["test_accuracy"])


@pytest.mark.timeout(120)
def test_whimpy_device_cannot_hold_the_model(hetero_cluster) -> None:
    """The whole CNN on the 3 MiB device fails with the cap and the breakdown, by name."""
    info = hetero_cluster.submit(
        job("too-big", model="cnn", split=[(["gpu3"], [16])], nm=4, minibatches=20)
    )
    assert info["state"] == "failed"
    assert "gpu3" in info["error"] and "memory cap 3.0MiB" in info["error"]
    # and the cluster goes on to the next job
    ok = hetero_cluster.submit(job("after", model="mlp", split=[(["gpu0"], [6])], minibatches=20))
    assert ok["state"] == "done", ok.get("error")
