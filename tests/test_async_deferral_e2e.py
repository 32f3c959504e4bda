"""Deferred weight gradients (``train.defer_weight_grad``) on real daemons: Nm = 1 is still
plain training, and at Nm = 4 every weight gradient differentiates its forward's weights."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_same_weights, job
from helpers import checked_stash, plain_training

pytestmark = pytest.mark.slow

FOUR = [(["gpu0", "gpu1", "gpu2", "gpu3"], [1, 2, 2, 1])]


@pytest.mark.timeout(240)
def test_nm_one_with_deferral_is_plain_training(uniform_cluster) -> None:
    """Nm = 1: each W runs right after its I, so the weights equal plain PyTorch's."""
    spec = job(
        "defer-transparency", split=FOUR, nm=1, minibatches=40, train={"defer_weight_grad": True}
    )
    info = uniform_cluster.submit(spec)
    assert info["state"] == "done", info.get("error")
    assert info["minibatches"] == 40
    assert_same_weights(torch.load(info["model_path"]), plain_training(spec, 40))


@pytest.mark.timeout(240)
def test_deferred_w_differentiates_the_forwards_weights(uniform_cluster) -> None:
    """Nm = 4 with train.verify: every (deferred) weight gradient ran on the weights its
    forward used, though newer weights existed by then."""
    split = [(["gpu0", "gpu1", "gpu2", "gpu3"], [4, 4, 4, 4])]
    info = uniform_cluster.submit(
        job(
            "defer-stash",
            model="cnn",
            split=split,
            nm=4,
            minibatches=60,
            train={"verify": True, "defer_weight_grad": True},
        )
    )
    assert info["state"] == "done", info.get("error")
    records, stashed = checked_stash(info)
    assert len(records) == 4
    assert stashed > 0


@pytest.mark.timeout(240)
def test_a_live_migration_drains_the_deferred_weight_gradients(uniform_cluster) -> None:
    """A stage stopped at a migration's boundary runs its deferred W's first (it drains as
    with whole backwards), so the migration is carried out and the job ends."""
    spec = job(
        "defer-migrate",
        model="cnn",
        split=[(["gpu0", "gpu1", "gpu2"], [6, 6, 4])],
        nm=2,
        minibatches=16,
        train={"defer_weight_grad": True},
    )
    spec["replan"] = {"migrate_at": 8, "migrate_to": [3, 9, 4]}
    info = uniform_cluster.submit(spec, timeout=180)
    assert info["state"] == "done", info.get("error")
    assert [m["event"] for m in info["migrations"]] == ["migration"]
