"""Activation policies on real daemons: the runtime enforces the planner's memory model.

Two devices of 32 MiB and a batch-norm CNN at minibatch 512 with Nm = 3: keeping every
activation, its first stage needs about 51 MiB, so the runtime refuses the job; with
``train.activations = "auto"`` the planner recomputes a run of that stage's layers (about
29 MiB; the host links are too slow for swapping to pay), the job trains, and each stage's
measured peak, counted in the planner's terms, is the predicted figure within 10%. With
fast host links the planner swaps instead, and the same holds.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from conftest import job, start_cluster
from helpers import stages_json

from hetpipe.core.schedule import max_in_flight
from hetpipe.localcluster import DeviceDef, LocalCluster

pytestmark = pytest.mark.slow

# 10 Mbit/s to the host: swapping a stage's activations would cost seconds per minibatch
TIGHT = tuple(DeviceDef(f"gpu{i}", "fast", "32MiB", 1.0, host_gbps=0.01) for i in range(2))


@pytest.fixture(scope="module")
def tight_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = start_cluster(tmp_path_factory.mktemp("tight"), TIGHT, shards=1)
    yield c
    c.stop()


def cnn_job(name: str, activations: str) -> dict:
    spec = job(
        name,
        model="cnn",
        model_args={"width": 16},
        minibatch=512,
        nm=3,
        minibatches=12,
        split=[(["gpu0", "gpu1"], [6, 10])],
        lr=0.02,
    )
    spec["train"]["activations"] = activations
    return spec


@pytest.mark.timeout(300)
def test_keep_is_refused_and_auto_runs_within_the_predicted_memory(tight_cluster) -> None:
    info = tight_cluster.submit(cnn_job("tight-keep", "keep"), timeout=240)
    assert info["state"] == "failed"
    assert "memory cap 32.0MiB" in info["error"] and "vw0/stage0" in info["error"], info["error"]

    info = tight_cluster.submit(cnn_job("tight-auto", "auto"), timeout=240)
    assert info["state"] == "done", info.get("error")
    pred = info["predicted"]["vws"][0]["stages"]
    assert pred[0]["recompute"] and not pred[1]["recompute"]
    assert not pred[0]["swap"] and not pred[1]["swap"]
    assert_within_prediction(info)


@pytest.mark.timeout(300)
def test_auto_swaps_over_fast_host_links_within_the_predicted_memory(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """The same devices at the default host bandwidth: the copies hide behind the compute,
    so the planner swaps rather than recomputes, and the runtime holds what it predicted."""
    fast = tuple(DeviceDef(f"gpu{i}", "fast", "32MiB", 1.0) for i in range(2))
    cluster = start_cluster(tmp_path_factory.mktemp("fasthost"), fast, shards=1)
    try:
        info = cluster.submit(cnn_job("tight-swap", "auto"), timeout=240)
    finally:
        cluster.stop()
    assert info["state"] == "done", info.get("error")
    pred = info["predicted"]["vws"][0]["stages"]
    assert pred[0]["swap"] and not pred[0]["recompute"] and not pred[1]["swap"]
    assert_within_prediction(info)


@pytest.mark.timeout(300)
def test_a_stage_before_a_lagging_one_peaks_at_the_memory_models_figure(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """A first stage that keeps everything before a last stage 20x slower: its successor
    lags, so it holds Nm minibatches in flight, the count the memory model charges
    (:func:`hetpipe.core.schedule.max_in_flight`), and its measured peak is the model's figure
    term by term. The accumulators are the exception, bounded only: a virtual worker alone
    in its job carries one wave's update at a time, the model keeps room for two (the wave
    being pushed under WSP with several). The last stage holds one.

    With ``weights = "latest"`` the stages run the lock-step order whatever the timing, so
    the same lagging successor leaves the first stage at that order's count, 3 of Nm = 4,
    and the model charges exactly that."""
    devices = (DeviceDef("gpu0", "fast", "256MiB", 1.0), DeviceDef("gpu1", "slow", "256MiB", 0.05))
    cluster = start_cluster(tmp_path_factory.mktemp("lagging"), devices, shards=1)
    try:
        spec = job(
            "lagging-keep",
            model="cnn",
            model_args={"width": 16},
            minibatch=128,
            nm=3,
            minibatches=9,
            split=[(["gpu0", "gpu1"], [6, 10])],
            lr=0.02,
        )
        info = cluster.submit(spec, timeout=240)
        latest = job(
            "lagging-latest",
            model="cnn",
            model_args={"width": 16},
            minibatch=128,
            nm=4,
            minibatches=12,
            split=[(["gpu0", "gpu1"], [6, 10])],
            lr=0.02,
            train={"weights": "latest"},
        )
        fixed = cluster.submit(latest, timeout=240)
    finally:
        cluster.stop()
    assert fixed["state"] == "done", fixed.get("error")
    first = min(fixed["stages"], key=lambda s: s["stage"])
    pred = fixed["predicted"]["vws"][0]["stages"][0]
    assert first["peak_in_flight"] == max_in_flight("async", 2, 0, 4, fixed=True) == 3
    assert first["peak_memory"]["activations"] == pred["memory_terms"]["activations"]
    assert first["peak_bytes"] <= pred["memory"]
    assert info["state"] == "done", info.get("error")
    pred = info["predicted"]["vws"][0]["stages"]
    first, last = sorted(info["stages"], key=lambda s: s["stage"])
    assert first["peak_in_flight"] == max_in_flight("async", 2, 0, 3) == 3
    assert last["peak_in_flight"] == max_in_flight("async", 2, 1, 3) == 1
    # the predicted timeline lags the same way: its expected peak is the bound here
    assert [p["expected_in_flight"] for p in pred] == [3, 1]
    assert [p["expected_memory_terms"] for p in pred] == [p["memory_terms"] for p in pred]
    want, got = pred[0]["memory_terms"], first["peak_memory"]
    for term in ("params", "optimizer", "stash", "activations", "working"):
        assert got[term] == want[term], (term, got, want)
    assert got["accumulators"] <= want["accumulators"]
    for s in (first, last):
        assert s["peak_bytes"] <= pred[s["stage"]]["memory"]


@pytest.mark.timeout(300)
def test_a_planned_stage_holds_at_most_its_expected_count(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """``train.in_flight = "plan"`` (the default): the planner limits a stage whose count
    depends on timing to what its predicted timeline held, and that becomes its bound. With
    Nm = 12 and two waves the first stage of two is predicted to hold fewer than 12 whatever
    the cut (a slower successor lets it run ahead by a fraction of a minibatch per
    minibatch).

    Under ``"plan"`` the first stage stalls at its second forward, so the first gradient is
    back before it could run more: the stage still runs its expected count of forwards
    before its first backward (the fill). The last stage then stalls for a second in the
    second wave, as a slow day would: the first stage, limited, waits with its expected
    count in flight. Under ``"nm"`` the last stage stalls for a second at its first forward:
    the same plan's first stage forwards all 12 of the first wave meanwhile, the count the
    schedule permits."""
    devices = tuple(DeviceDef(f"gpu{i}", "fast", "256MiB", 1.0) for i in range(2))
    # every task handed to the compute thread (``inline_ms = 0``), as the planner then
    # prices it: a stage with injected stalls never runs inline, and a first stage priced
    # inline would be predicted to run far enough ahead to hold all 12
    cluster = start_cluster(tmp_path_factory.mktemp("limit"), devices, shards=1, inline_ms=0)
    infos = {}
    try:
        for bound in ("plan", "nm"):
            spec = job(
                f"limit-{bound}",
                minibatch=64,
                nm=12,
                minibatches=24,
                lr=0.02,
                train={"in_flight": bound, "policy": "np", "vws": 1},
            )
            spec["fault"] = (
                [
                    {"vw": 0, "stage": 0, "minibatch": 1, "seconds": 0.5},
                    {"vw": 0, "stage": 1, "minibatch": 13, "seconds": 1.0},
                ]
                if bound == "plan"
                else [{"vw": 0, "stage": 1, "minibatch": 0, "seconds": 1.0}]
            )
            infos[bound] = cluster.submit(spec, timeout=240)
    finally:
        cluster.stop()
    for bound, info in infos.items():
        assert info["state"] == "done", (bound, info.get("error"))
        assert len(info["predicted"]["vws"][0]["stages"]) == 2, info["predicted"]
    limited, free = (sorted(infos[b]["stages"], key=lambda s: s["stage"]) for b in ("plan", "nm"))
    pred = infos["plan"]["predicted"]["vws"][0]["stages"]
    expected = pred[0]["expected_in_flight"]
    assert 1 <= expected < 12 and pred[0]["limit"] == pred[0]["in_flight"] == expected, pred
    assert pred[0]["memory"] == pred[0]["expected_memory"]
    assert limited[0]["peak_in_flight"] == expected
    assert limited[0]["peak_bytes"] <= pred[0]["memory"]
    loose = infos["nm"]["predicted"]["vws"][0]["stages"]
    assert loose[0]["limit"] == 0 and loose[0]["in_flight"] == 12
    assert free[0]["peak_in_flight"] == 12
    assert limited[1]["peak_in_flight"] == free[1]["peak_in_flight"] == 1
    # filled: the limited stage ran its count of forwards before its first backward, so it
    # reached that count whatever the timing (hetpipe.core.schedule.fill_counts)
    stages = stages_json(infos["plan"])
    spans = sorted(
        (x for x in stages["vw0/stage0"]["stats"]["spans"] if x[0] in ("forward", "backward")),
        key=lambda x: x[1],
    )
    ops = [x[0] for x in spans]
    assert ops[: ops.index("backward")] == ["forward"] * expected, ops[: expected + 2]


def assert_within_prediction(info: dict) -> None:
    """Each stage's measured peak, in the planner's terms, within the bound and 10% of it."""
    pred = info["predicted"]["vws"][0]["stages"]
    for s in info["stages"]:
        want = pred[s["stage"]]
        got = s["peak_memory"]
        assert got["params"] == want["memory_terms"]["params"]
        assert got["working"] == want["memory_terms"]["working"]
        # the plan bounds what may be in flight; the run reaches it on this pipeline
        assert got["activations"] <= want["memory_terms"]["activations"]
        assert s["peak_bytes"] <= want["memory"] <= want["memory_cap"]
        error = (want["memory"] - s["peak_bytes"]) / want["memory"]
        assert error <= 0.10, (s["stage"], got, want["memory_terms"])
