"""Device-level schedules on real daemons: ``interleaved-1f1b`` and ``zbv`` (a device runs
several stages of one virtual worker in its device's order, :mod:`hetpipe.devturn`) train as
plain PyTorch does, and each stage holds at once what the memory model charges it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from conftest import assert_same_weights, job, start_cluster
from helpers import check_device_level, plain_training, stages_json

from hetpipe.localcluster import DeviceDef, LocalCluster

pytestmark = pytest.mark.slow

DEVICES = tuple(DeviceDef(n, "fast", "256MiB", 1.0) for n in "abcd")
ABAB = [(["a", "b", "a", "b"], [1, 2, 2, 1])]  # round robin: 2 devices x 2 chunks
ABBA = [(["a", "b", "b", "a"], [1, 2, 2, 1])]  # a V: stages 0 and 3 on a, 1 and 2 on b
CDCD = (["c", "d", "c", "d"], [1, 2, 2, 1])
DCCD = (["d", "c", "c", "d"], [1, 2, 2, 1])


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = start_cluster(tmp_path_factory.mktemp("devsched"), DEVICES)
    yield c
    c.stop()


def device_job(name: str, kind: str, split: list, m: int, iterations: int) -> dict[str, Any]:
    """A synchronous job of the builtin mlp under ``kind`` on ``split``."""
    train = {"several_stages": True, "schedule": kind}
    return job(name, model="mlp", split=split, train=train, nm=m, minibatches=m * iterations)


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "kind, split",
    [
        ("interleaved-1f1b", ABAB),
        ("zbv", ABBA),
        ("interleaved-1f1b", [*ABAB, CDCD]),
        ("zbv", [*ABBA, DCCD]),
    ],
    ids=["interleaved", "zbv", "interleaved-two-vws", "zbv-two-vws"],
)
def test_device_schedules_are_transparent(cluster: LocalCluster, kind: str, split: list) -> None:
    """M = 4, 8 iterations: minibatch SGD on each iteration's union (of every virtual
    worker's microbatches), within 1e-5; every stage holds at most the microbatches the
    memory model charges its projected order (max_in_flight), and at its peak exactly that;
    each device of the first virtual worker started its forwards in its device order."""
    m, iterations = 4, 8
    spec = device_job(f"{kind}-{len(split)}", kind, split, m, iterations)
    info = cluster.submit(spec, timeout=200)
    assert info["state"] == "done", info.get("error")
    assert_same_weights(
        torch.load(info["model_path"]), plain_training(spec, iterations, m=m, vws=len(split))
    )
    stages = stages_json(info)
    assert len(stages) == 4 * len(split)
    check_device_level(info, kind, m, iterations)
