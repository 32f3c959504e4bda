"""VW formation policies (NP, ED, HD, auto) on a 2-node, 3-type toy cluster."""

from __future__ import annotations

import pytest

from hetpipe.config import (
    ClusterConfig,
    DeviceSpec,
    NetworkSpec,
    NodeSpec,
    RuntimeSpec,
    ShardSpec,
)
from hetpipe.planner import make_plan, synthetic_profile
from hetpipe.planner.formation import (
    Formation,
    best_formation,
    candidate_formations,
    ed_formation,
    hd_formation,
    np_formation,
)

SPEED = {"fast": 1.0, "mid": 0.5, "slow": 0.25}


def toy_cluster(layout: dict[str, list[tuple[str, str]]], memory: int = 1 << 30) -> ClusterConfig:
    nodes = []
    for n, (node, devs) in enumerate(layout.items()):
        host = f"10.0.0.{n}"
        specs = tuple(
            DeviceSpec(name, "cpu", t, memory, SPEED[t], 0, node, host) for name, t in devs
        )
        nodes.append(NodeSpec(node, host, specs))
    shards = tuple(ShardSpec(i, f"10.0.0.{i}", 7100) for i in range(len(nodes)))
    return ClusterConfig("<toy>", shards, NetworkSpec(100.0, 10.0), tuple(nodes), RuntimeSpec())


# node0: two fast and a mid device; node1: a mid and two slow ones
LAYOUT = {
    "node0": [("f0", "fast"), ("f1", "fast"), ("m0", "mid")],
    "node1": [("m1", "mid"), ("s0", "slow"), ("s1", "slow")],
}


def names(f: Formation) -> list[set[str]]:
    return [{d.name for d in g} for g in f.groups]


def test_np_is_one_vw_per_node():
    devs = toy_cluster(LAYOUT).devices
    assert names(np_formation(devs)) == [{"f0", "f1", "m0"}, {"m1", "s0", "s1"}]


def test_ed_gives_every_vw_an_equal_share_of_every_type():
    devs = toy_cluster(LAYOUT).devices
    f = ed_formation(devs)  # gcd(2, 2, 2) = 2
    assert names(f) == [{"f0", "m0", "s0"}, {"f1", "m1", "s1"}]
    assert f.unused == ()
    one = ed_formation(devs, 1)
    assert names(one) == [{"f0", "f1", "m0", "m1", "s0", "s1"}]


def test_ed_leaves_out_what_does_not_divide_and_says_why():
    layout = {**LAYOUT, "node2": [("f2", "fast")]}
    devs = toy_cluster(layout).devices
    f = ed_formation(devs, 2)
    assert names(f) == [{"f0", "m0", "s0"}, {"f1", "m1", "s1"}]
    assert [n for n, _ in f.unused] == ["f2"]
    assert "do not split evenly" in f.unused[0][1]
    f3 = ed_formation(devs, 3)
    assert {n for n, _ in f3.unused} == {"m0", "m1", "s0", "s1"}
    assert "fewer devices of type mid (2) than VWs (3)" in dict(f3.unused)["m0"]


def test_hd_balances_compute_power_mixing_fast_and_slow():
    devs = toy_cluster(LAYOUT).devices
    f = hd_formation(devs, 2)
    assert names(f) == [{"f0", "m0", "s1"}, {"f1", "m1", "s0"}]
    power = [sum(SPEED[d.type] for d in g) for g in f.groups]
    assert power == [1.75, 1.75]
    assert len(hd_formation(devs, 6).groups) == 6
    assert len(hd_formation(devs, 60).groups) == 6  # never more VWs than devices


def test_candidates_are_unique_and_cover_the_policies():
    devs = toy_cluster(LAYOUT).devices
    cands = candidate_formations(devs, "auto")
    sigs = [f.signature() for f in cands]
    assert len(sigs) == len(set(sigs))
    assert {f.policy for f in cands} == {"np", "ed", "hd"}
    assert [f.policy for f in candidate_formations(devs, "np")] == ["np"]
    assert [len(f.groups) for f in candidate_formations(devs, "ed")] == [2]
    assert all(len(f.groups) == 3 for f in candidate_formations(devs, "auto", num_vws=3))
    with pytest.raises(ValueError, match="unknown policy"):
        candidate_formations(devs, "xx")
    with pytest.raises(ValueError, match=r"1\.\.6"):
        candidate_formations(devs, "hd", num_vws=7)


def test_best_formation_prunes_by_bound_and_keeps_earlier_on_ties():
    devs = toy_cluster(LAYOUT).devices
    cands = [np_formation(devs), ed_formation(devs), hd_formation(devs, 3)]
    seen = []

    def evaluate(f):
        seen.append(f.policy)
        return {"np": 5.0, "ed": 5.0, "hd": 1.0}[f.policy], f.policy

    bounds = {"np": 6.0, "ed": 9.0, "hd": 4.0}
    f, s, r = best_formation(cands, evaluate, lambda f: bounds[f.policy])
    assert (f.policy, s, r) == ("np", 5.0, "np")  # tie with ed: the earlier candidate wins
    assert seen == ["ed", "np"]  # hd's bound 4 < 5: never evaluated


def test_make_plan_follows_the_requested_policy():
    cluster = toy_cluster(LAYOUT)
    prof = synthetic_profile(12, SPEED, 0)
    for policy, want in (
        ("np", [{"f0", "f1", "m0"}, {"m1", "s0", "s1"}]),
        ("ed", [{"f0", "m0", "s0"}, {"f1", "m1", "s1"}]),
    ):
        plan = make_plan(
            cluster, prof, minibatch=32, staleness=0, optimizer_state_factor=1, policy=policy
        )
        assert [set(v.devices) for v in plan.vws] == want
        assert plan.policy == policy
    plan = make_plan(
        cluster, prof, minibatch=32, staleness=0, optimizer_state_factor=1, policy="hd", num_vws=2
    )
    assert [set(v.devices) for v in plan.vws] == [{"f0", "m0", "s1"}, {"f1", "m1", "s0"}]


def test_auto_is_at_least_as_good_as_every_policy():
    cluster = toy_cluster(LAYOUT)
    prof = synthetic_profile(12, SPEED, 0)
    kw = {"minibatch": 32, "staleness": 0, "optimizer_state_factor": 1}
    auto = make_plan(cluster, prof, **kw)
    for policy in ("np", "ed", "hd"):
        assert auto.samples_per_s >= make_plan(cluster, prof, policy=policy, **kw).samples_per_s
