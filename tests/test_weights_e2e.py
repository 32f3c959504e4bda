"""train.weights on real daemons: no staleness means no difference; counted s is observed."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import job
from helpers import stage_records, stages_json

from hetpipe.core.staleness import version_gaps

pytestmark = pytest.mark.slow

SPLIT = [(["gpu0", "gpu1", "gpu2", "gpu3"], [4, 4, 4, 4])]
MODES = [
    {"weights": "stash"},
    {"weights": "latest"},
    {"weights": "predict", "predict_variant": "paper"},
    {"weights": "predict", "predict_variant": "consistent"},
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_modes_are_bit_identical_without_staleness(uniform_cluster, optimizer) -> None:
    """Nm = 1: nothing is stale, so stash, latest and both predict variants compute the
    same weights to the last bit."""
    lr = 0.05 if optimizer == "sgd" else 0.002
    models = []
    for mode in MODES:
        info = uniform_cluster.submit(
            job(
                f"nm1-{mode['weights']}",
                model="cnn",
                split=SPLIT,
                nm=1,
                minibatches=24,
                lr=lr,
                optimizer=optimizer,
                train=mode,
            )
        )
        assert info["state"] == "done", info.get("error")
        models.append(torch.load(info["model_path"]))
    for other in models[1:]:
        assert other.keys() == models[0].keys()
        for name, w in models[0].items():
            assert torch.equal(other[name], w), name


@pytest.mark.timeout(300)
def test_counted_gaps_are_the_updates_a_heterogeneous_run_observes(hetero_cluster) -> None:
    """On the heterogeneous cluster (whimpy device included) the updates between each
    minibatch's forward and backward at each stage are the counted s_fwd - s_bwd, and the
    prediction diagnostic reaches stages.json and the job's final status."""
    nm, total = 4, 40
    info = hetero_cluster.submit(
        job(
            "gaps",
            model="cnn",
            split=SPLIT,
            nm=nm,
            minibatches=total,
            lr=0.03,
            train={"weights": "predict", "bn_recalibrate": 8},
        )
    )
    assert info["state"] == "done", info.get("error")
    gaps = version_gaps(len(SPLIT[0][0]), nm, total)
    for where, rows in stage_records(info).items():
        stage = int(where.rsplit("stage", 1)[1])
        observed = [r["bwd_version"] - r["fwd_version"] for r in rows]
        counted = [gaps[stage][p][0] - gaps[stage][p][1] for p in range(total)]
        assert observed == counted, where
    quality = info["prediction_quality"]
    assert set(quality) == {f"vw0/stage{s}" for s in range(4)}
    assert all(math.isfinite(q) and q > 0 for q in quality.values())
    # following the momentum beats standing still, on the average of the job
    assert sum(quality.values()) / len(quality) < 1.0, quality
    stages = stages_json(info)
    assert stages["vw0/stage0"]["stats"]["prediction_quality"] == quality["vw0/stage0"]
    # batch-norm statistics re-estimated before the export; the trained ones reported too
    assert 0.0 <= info["test_accuracy_trained_bn"] <= 1.0
    print("prediction quality", quality, info["test_accuracy"], info["test_accuracy_trained_bn"])
