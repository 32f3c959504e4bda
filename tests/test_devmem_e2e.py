"""Device-level schedules on real daemons: each stage's measured peak memory against the
planner's prediction for it (kept by the head for a split whose devices run several
stages), within 10%, for ``interleaved-1f1b`` and ``zbv``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from conftest import job, start_cluster

from hetpipe.core.schedule import max_in_flight
from hetpipe.localcluster import DeviceDef, LocalCluster

pytestmark = pytest.mark.slow

DEVICES = tuple(DeviceDef(n, "fast", "256MiB", 1.0) for n in "ab")
SPLITS = {
    "interleaved-1f1b": (["a", "b", "a", "b"], [1, 2, 2, 1]),  # round robin, 2 chunks each
    "zbv": (["a", "b", "b", "a"], [1, 2, 2, 1]),  # a V: stages 0 and 3 on a
}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = start_cluster(tmp_path_factory.mktemp("devmem"), DEVICES)
    yield c
    c.stop()


def device_job(kind: str, m: int, iterations: int) -> dict[str, Any]:
    train = {"several_stages": True, "schedule": kind}
    return job(
        kind, model="mlp", split=[SPLITS[kind]], train=train, nm=m, minibatches=m * iterations
    )


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", sorted(SPLITS))
def test_each_stages_peak_memory_is_within_ten_percent_of_its_prediction(
    cluster: LocalCluster, kind: str
) -> None:
    """M = 4, 4 iterations: the head keeps each stage's predicted memory (priced with its
    projected order on the job's 2 devices); each stage's measured peak is at most that and
    within 10% of it, its in-flight count the one predicted."""
    m = 4
    info = cluster.submit(device_job(kind, m, 4), timeout=200)
    assert info["state"] == "done", info.get("error")
    pred = info["predicted"]["vws"][0]["stages"]
    assert [p["device"] for p in pred] == SPLITS[kind][0]
    assert [p["in_flight"] for p in pred] == [
        max_in_flight(kind, 4, s, m, devices=2) for s in range(4)
    ]
    figures = []
    for s in sorted(info["stages"], key=lambda x: x["stage"]):
        want = pred[s["stage"]]
        figures.append((s["stage"], s["peak_bytes"], want["memory"]))
        assert s["peak_in_flight"] == want["in_flight"], (s["stage"], s["peak_in_flight"])
    for stage, got, want in figures:
        assert got <= want, (stage, figures)
        assert (want - got) / want <= 0.10, (stage, figures)
