"""``scripts/bench_leftout.py``'s pure part: on the benchmark's generated cluster (two helpful
emulated devices and one far slower) the plan the head would make leaves the slow device out
of the one virtual worker, names it and says why; the same device at a helpful speed is kept.
No daemons: the model is measured once on this host's CPU and each type's times divided by
its speed, as an emulated device pads them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import load_script

from hetpipe.config import load_cluster
from hetpipe.job import JobSpec
from hetpipe.localcluster import cluster_toml
from hetpipe.measure import measure
from hetpipe.views import explain_lines

bench = load_script("bench_leftout")


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The benchmark's model measured once on this host's CPU at speed 1."""
    path = tmp_path_factory.mktemp("m") / "cluster.toml"
    path.write_text(cluster_toml(bench.devices(1.0, 1.0)))
    spec = JobSpec.from_dict(bench.job("planned", bench.MINIBATCHES, None))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as a worker computes
    try:
        return measure(spec, load_cluster(path).devices[0])
    finally:
        torch.set_num_threads(threads)


def _plan(tmp_path: Path, slow_ratio: float, measured: dict):
    path = tmp_path / "cluster.toml"
    path.write_text(cluster_toml(bench.devices(bench.SPEED_SCALE, slow_ratio)))
    return bench.plan_alone(path, bench.SPEED_SCALE, slow_ratio, measured)


def test_the_benchmarks_slow_device_is_left_out_and_named(tmp_path: Path, measured) -> None:
    plan = _plan(tmp_path, bench.SLOW_RATIO, measured)
    slow = bench.SLOW
    assert slow in plan.unused
    assert [list(vw.devices) for vw in plan.vws] == [["gpu0", "gpu1"]]
    (e,) = [e for e in plan.details["left_out"] if e["device"] == slow]
    assert e["vw_devices"] == list(bench.ALL)
    assert e["without_samples_per_s"] > e["with_samples_per_s"] > 0
    (w,) = [w for w in plan.warnings if w.startswith(f"{slow} unused: left out of its VW")]
    assert "samples/s with it" in w and "without" in w
    assert any(
        line.startswith(f"left out: {slow} (whimpy, ") for line in explain_lines(plan.details)
    )


def test_the_same_device_at_a_helpful_speed_is_kept(tmp_path: Path, measured) -> None:
    plan = _plan(tmp_path, 1.0, measured)
    assert plan.unused == () and plan.details["left_out"] == []
    assert {d for vw in plan.vws for d in vw.devices} == set(bench.ALL)
