"""Jobs without a split, planned by the head on the default cluster's shape, end to end."""

from __future__ import annotations

import pytest
from conftest import job

from hetpipe.job import JobSpec
from hetpipe.planner import ProfileStore
from hetpipe.profiling import model_key

pytestmark = pytest.mark.slow


def planned_job(name: str, **kw) -> dict:
    """A job dict with no [[vw]] split and no Nm: the head's planner decides both."""
    out = job(name, **kw)
    out["train"].pop("nm")
    return out


@pytest.mark.timeout(400)
def test_the_head_plans_two_vws_that_use_the_whimpy_device(hetero_cluster) -> None:
    spec = planned_job("planned", model="cnn", epochs=12, minibatches=None, lr=0.025)
    # HD: each virtual worker gets a mix of device types, so the whimpy device has a place.
    # Under "auto" the planner also weighs ED, which here is the two medium devices alone:
    # a near tie on this cluster, decided by the moment's profile (under "auto" this test
    # failed 2 of 9 runs of the code before 2026-11-26's data-path change and 4 of 12
    # after, on that day), so it cannot be asserted
    spec["train"].update({"vws": 2, "policy": "hd"})
    info = hetero_cluster.submit(spec, timeout=380)
    assert info["state"] == "done", info.get("error")
    devices = [d for vw in info["vws"] for d in vw["devices"]]
    assert len(info["vws"]) == 2
    assert "gpu3" in devices, info["vws"]  # the whimpy device holds a stage of some VW
    assert len(devices) == len(set(devices))
    # the planner's figures come with the job, for the split it ran
    pred = info["predicted"]
    assert pred["samples_per_s"] > 0
    assert [v["devices"] for v in info["vws"]] == [
        [s["device"] for s in v["stages"]] for v in pred["vws"]
    ]
    for s in info["stages"]:
        ps = pred["vws"][s["vw"]]["stages"][s["stage"]]
        assert list(s["layers"]) == list(ps["layers"])
        assert ps["time_s"] > 0 and ps["memory"] <= ps["memory_cap"]
        assert s["peak_bytes"] <= ps["memory_cap"]
    # the emulated types of the one node were measured once: their profiles are that
    # measurement over each type's speed, exactly (fast 1, medium 0.5, whimpy 0.25). Types
    # measured one after the other each carried the host's load of their moment, and once
    # made "auto" prefer ED's two medium devices alone (a predicted margin of 1.2 flipped)
    store = ProfileStore(hetero_cluster.run_dir / "profiles.json")
    prof = store.model_profile(model_key(JobSpec.from_dict(spec)), 32)
    assert prof is not None and sorted(prof.layers) == ["fast", "medium", "whimpy"]
    for t, f in (("medium", 2.0), ("whimpy", 4.0)):
        for a, b in zip(prof.layers["fast"], prof.layers[t], strict=True):
            assert (b.fwd_s, b.bwd_s, b.update_s) == pytest.approx(
                (f * a.fwd_s, f * a.bwd_s, f * a.update_s), rel=1e-9
            )
    # two VWs each apply their whole update to the global weights: asynchronous, but it
    # learns. Not to a fixed accuracy at its last wave: which update lands last depends on
    # the host's timing, and a class on the edge can flip there. Measured once in CI on a
    # busy host (2026-11-26): 0.856, every zero taken for an eight at the end (logits 2.62
    # against 2.83) where the checkpoint 32 waves earlier held 0.914 with every zero right.
    # 18 reruns of the same plan gave 0.978-0.994, and 20 000 tensors through shared memory
    # between two processes all arrived intact. Chance is 0.1.
    assert info["test_accuracy"] >= 0.8, (info["test_accuracy"], info["vws"])


@pytest.mark.timeout(300)
def test_a_model_that_fits_nowhere_cannot_be_planned(hetero_cluster) -> None:
    # 4096-wide hidden layers: 16M parameters (64 MiB), four times that with optimizer
    # state and update accumulators, against 131 MiB of device memory in all
    spec = planned_job("huge", model="mlp", model_args={"hidden": [4096, 4096]}, minibatches=4)
    info = hetero_cluster.submit(spec, timeout=280)
    assert info["state"] == "failed"
    error = info["error"]
    assert error.startswith("cannot plan: "), error
    assert "fits on no virtual worker" in error and "MiB" in error, error
    assert "\n" not in error


@pytest.mark.timeout(400)
def test_a_synchronous_job_is_planned_and_runs_its_plan(hetero_cluster) -> None:
    spec = job(
        "sync-planned",
        model="cnn",
        nm=4,
        minibatches=48,
        lr=0.05,
        train={"schedule": "1f1b", "vws": 1},
    )
    info = hetero_cluster.submit(spec, timeout=380)
    assert info["state"] == "done", info.get("error")
    pred = info["predicted"]
    assert pred["schedule"] == "1f1b" and pred["iteration_s"] > 0
    assert len(info["vws"]) == 1 and info["vws"][0]["devices"] == [
        s["device"] for s in pred["vws"][0]["stages"]
    ]
    for s in info["stages"]:  # every stage within its cap, as the synchronous model said
        ps = pred["vws"][0]["stages"][s["stage"]]
        assert ps["memory"] <= ps["memory_cap"] and s["peak_bytes"] <= ps["memory_cap"]


@pytest.mark.timeout(400)
def test_schedule_auto_says_what_it_chose_and_runs_it(hetero_cluster) -> None:
    spec = planned_job("auto", model="mlp", minibatches=40)
    spec["train"].update({"schedule": "auto", "vws": 1})
    info = hetero_cluster.submit(spec, timeout=380)
    assert info["state"] == "done", info.get("error")
    pred = info["predicted"]
    why = [w for w in pred["warnings"] if w.startswith("schedule auto chose ")]
    assert why and why[0].startswith(f"schedule auto chose {pred['schedule']}:"), pred
    assert "async" in why[0] and ("1f1b" in why[0] or "gpipe" in why[0])
