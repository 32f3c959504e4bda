"""Which devices: the search leaves out a device (or a whole VW) that costs more than it adds,
names it and says why with the predicted samples/s with and without it; a helpful device is
kept; and each VW's share of the samples is stated."""

from __future__ import annotations

import random

import pytest
from helpers import KW, gpu_cluster

from hetpipe.config import (
    ClusterConfig,
)
from hetpipe.planner import make_plan, synthetic_profile
from hetpipe.profiling import predicted_summary
from hetpipe.views import explain_lines, render_comparison


def generated(seed: int, slow: float) -> tuple[ClusterConfig, object, str]:
    """2-4 GPUs of one or two helpful types on one node, and one GPU of speed ``slow`` on
    it; returns the cluster, a profile and the slow GPU's name."""
    r = random.Random(seed)
    types = {"a": 1.0, "b": r.uniform(0.5, 1.0)}
    good = [(t, types[t]) for t in r.choices(list(types), k=r.randint(2, 4))]
    at = r.randrange(len(good) + 1)
    specs = [*good[:at], ("w", slow), *good[at:]]
    prof = synthetic_profile(r.randint(12, 24), {**types, "w": slow}, r)
    return gpu_cluster([specs]), prof, f"g{at}"


@pytest.mark.parametrize("seed", range(6))
def test_a_device_so_slow_it_costs_its_vw_more_than_it_adds_is_left_out(seed):
    c, prof, slow = generated(seed, 0.02)
    plan = make_plan(c, prof, num_vws=1, **KW)
    assert slow in plan.unused
    assert all(slow not in vw.devices for vw in plan.vws)
    (e,) = [e for e in plan.details["left_out"] if e["device"] == slow]
    assert e["without_samples_per_s"] > e["with_samples_per_s"] > 0
    assert e["without_samples_per_s"] == pytest.approx(plan.samples_per_s)
    # named with the reason in the plan's warnings, the explanation and the job's figures
    (w,) = [w for w in plan.warnings if w.startswith(f"{slow} unused: left out of its VW")]
    assert "samples/s with it" in w and "without" in w
    assert any(line.startswith(f"left out: {slow} (w, n0)") for line in explain_lines(plan.details))
    summary = predicted_summary(plan)
    assert slow in summary["unused"] and summary["left_out"][0]["device"] == slow
    result = render_comparison({"predicted": summary, "stages": [], "samples_per_s": 1.0})
    assert f"  left out: {slow}: predicted " in result  # the finished job's result says it
    # and the plan with it is what the figure says: slower
    kept = make_plan(c, prof, num_vws=1, nm=len(c.devices), **KW)  # a fixed Nm keeps all
    assert slow in {d for vw in kept.vws for d in vw.devices}


@pytest.mark.parametrize("seed", range(6))
def test_a_helpful_device_is_kept(seed):
    c, prof, _ = generated(seed, 0.9)
    plan = make_plan(c, prof, num_vws=1, **KW)
    assert plan.unused == () and plan.details["left_out"] == []
    assert len(plan.vws[0].devices) == len(c.devices)


def test_a_lone_slow_vw_that_holds_the_others_at_the_gate_is_left_out():
    c = gpu_cluster([[("a", 1.0)] * 4, [("w", 0.05)]])
    prof = synthetic_profile(16, {"a": 1.0, "w": 0.05}, 0)
    plan = make_plan(c, prof, policy="np", **KW)
    assert plan.unused == ("g4",) and len(plan.vws) == 1
    (e,) = plan.details["left_out"]
    assert e["whole_vw"] and e["without_samples_per_s"] > e["with_samples_per_s"]
    assert any("left out with its whole VW (g4)" in w for w in plan.warnings)


def test_explain_states_each_vws_rate_and_share():
    c = gpu_cluster([[("a", 1.0)] * 2, [("b", 0.5)] * 2])
    prof = synthetic_profile(16, {"a": 1.0, "b": 0.5}, 0)
    plan = make_plan(c, prof, policy="np", staleness=4, minibatch=32, optimizer_state_factor=1)
    shares = plan.details["vw_shares"]
    assert [s["devices"] for s in shares] == [list(v.devices) for v in plan.vws]
    assert sum(s["share"] for s in shares) == pytest.approx(1.0)
    for s, vw in zip(shares, plan.vws, strict=True):
        assert s["samples_per_s"] == vw.samples_per_s and s["nm"] == vw.nm
    text = "\n".join(explain_lines(plan.details))
    assert "under WSP each VW runs at its own pace" in text
    for v in range(len(plan.vws)):
        assert f"  VW {v}: " in text
