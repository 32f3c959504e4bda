"""End-to-end pipelines on real daemons: transparency, stashing, accuracy, memory caps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import assert_same_weights, job

from hetpipe.data import MinibatchStream, load_dataset
from hetpipe.job import JobSpec
from hetpipe.models import build_model, model_loss

pytestmark = pytest.mark.slow


def plain_training(spec_dict: dict, steps: int) -> dict[str, torch.Tensor]:
    """The same nn.Sequential trained by plain PyTorch from the same weights and data order.

    One intra-op thread, as the workers use: a different thread count changes the order of
    float reductions, and max-pooling after ReLU amplifies such rounding differences.
    """
    spec = JobSpec.from_dict(spec_dict)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(spec.seed)
    model = build_model(spec.model.name, spec.model.args)
    stream = MinibatchStream(load_dataset(spec.data.name), spec.minibatch, spec.seed, 0, 1)
    opt = torch.optim.SGD(
        model.parameters(),
        lr=spec.optimizer.lr,
        momentum=spec.optimizer.momentum,
        weight_decay=spec.optimizer.weight_decay,
    )
    loss_fn = model_loss(spec.model.name)
    model.train()
    for p in range(steps):
        x, y = stream.batch(p)
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    torch.set_num_threads(threads)
    return model.state_dict()


def stage_records(info: dict) -> dict[str, list[dict]]:
    data = json.loads(Path(info["stages_path"]).read_text())
    out = {}
    for where, r in data.items():
        fields = r["stats"]["record_fields"]
        out[where] = [dict(zip(fields, row, strict=True)) for row in r["records"]]
    return out


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
    records = stage_records(info)
    assert len(records) == 4
    stashed = 0
    for where, rows in records.items():
        assert [r["p"] for r in rows] == list(range(info["minibatches"])), where
        for r in rows:
            assert r["fwd_fingerprint"] != 0.0, (where, r["p"])  # train.verify took them
            assert r["bwd_fingerprint"] == r["fwd_fingerprint"], (where, r["p"])
            assert r["bwd_version"] >= r["fwd_version"]
            stashed += r["bwd_version"] > r["fwd_version"]
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
