"""Every planner entry point refuses figures it cannot price, naming the device, link or layer."""

from __future__ import annotations

import dataclasses
import math

import pytest

from hetpipe.config import ClusterConfig, DeviceSpec, NetworkSpec, NodeSpec, RuntimeSpec, ShardSpec
from hetpipe.planner import (
    CostModel,
    PlanError,
    explicit_plan,
    make_plan,
    partition,
    partition_best_nm,
    synthetic_profile,
)
from hetpipe.planner.syncplan import sync_plan

NAN = math.nan
KW = {"minibatch": 32, "staleness": 0, "optimizer_state_factor": 1}


def dev(name: str, memory: int = 1 << 30, speed: float = 1.0, **kw) -> DeviceSpec:
    return DeviceSpec(name, "cpu", "a", memory, speed, 0, "n0", "127.0.0.1", **kw)


def cluster(devices, intra: float = 100.0) -> ClusterConfig:
    nodes = (NodeSpec("n0", "127.0.0.1", tuple(devices)),) if devices else ()
    shards = (ShardSpec(0, "127.0.0.1", 7100),)
    return ClusterConfig("<t>", shards, NetworkSpec(intra, 10.0), nodes, RuntimeSpec())


PROF = synthetic_profile(6, {"a": 1.0}, 1)


def bw(a, b) -> float:
    return 1e9


BAD_DEVICES = [
    ([dev("g0"), dev("g1", speed=0.0)], "device g1: speed"),
    ([dev("g0", speed=-1.0)], "device g0: speed"),
    ([dev("g0", speed=NAN)], "device g0: speed"),
    ([dev("g0"), dev("g1", memory=-5)], "device g1: memory"),
    ([dev("g0", memory=NAN)], "device g0: memory"),
    ([dev("g0", host_gbps=0.0)], "device g0: host_gbps"),
    ([dev("g0", host_gbps=NAN)], "device g0: host_gbps"),
    ([], "empty"),
]


@pytest.mark.parametrize(("devices", "expect"), BAD_DEVICES)
def test_partition_entry_points_name_the_bad_device(devices, expect):
    with pytest.raises(PlanError, match=expect):
        partition(PROF, devices, 1, bw, 1)
    with pytest.raises(PlanError, match=expect):
        partition_best_nm(PROF, devices, bw, 1)


@pytest.mark.parametrize(("devices", "expect"), BAD_DEVICES)
def test_plan_entry_points_name_the_bad_device(devices, expect):
    c = cluster(devices)
    with pytest.raises(PlanError, match=expect):
        make_plan(c, PROF, **KW)
    with pytest.raises(PlanError, match=expect):
        explicit_plan(c, PROF, [(tuple(d.name for d in devices), None, 1)], **KW)
    with pytest.raises(PlanError, match=expect):
        sync_plan(c, PROF, minibatch=32, m=2, optimizer_state_factor=1)


@pytest.mark.parametrize("value", [0.0, -1.0, NAN])
def test_a_bad_link_is_named(value):
    devices = [dev("g0"), dev("g1")]

    def link(a, b):
        return value if {a.name, b.name} == {"g0", "g1"} else 1e9

    for call in (
        lambda: partition(PROF, devices, 1, link, 1),
        lambda: partition_best_nm(PROF, devices, link, 1),
    ):
        with pytest.raises(PlanError, match="bandwidth between g0 and g1"):
            call()
    with pytest.raises(PlanError, match="bandwidth between g0 and g1"):
        make_plan(cluster(devices, intra=value), PROF, **KW)


@pytest.mark.parametrize("field", ["fwd_s", "bwd_s", "update_s", "param_bytes", "out_bytes"])
@pytest.mark.parametrize("value", [-1, NAN, math.inf])
def test_a_bad_layer_figure_is_named(field, value):
    lps = list(PROF.layers["a"])
    lps[3] = dataclasses.replace(lps[3], **{field: value})
    prof = dataclasses.replace(PROF, layers={"a": tuple(lps)})
    expect = f"layer 3 on a: {field}"
    with pytest.raises(PlanError, match=expect):
        partition(prof, [dev("g0")], 1, bw, 1)
    with pytest.raises(PlanError, match=expect):
        CostModel(prof, bw, 1)
    with pytest.raises(PlanError, match=expect):
        make_plan(cluster([dev("g0")]), prof, **KW)
    with pytest.raises(PlanError, match=expect):
        sync_plan(cluster([dev("g0")]), prof, minibatch=32, m=2, optimizer_state_factor=1)


def test_a_bad_speed_by_type_and_negative_figures_are_refused():
    with pytest.raises(PlanError, match="device type a: speed"):
        CostModel(PROF, bw, 1, speeds={"a": 0.0})
    with pytest.raises(PlanError, match="optimizer_state_factor"):
        CostModel(PROF, bw, -1)
    with pytest.raises(PlanError, match="Nm must be >= 1"):
        partition(PROF, [dev("g0")], 0, bw, 1)
    with pytest.raises(PlanError, match="input_bytes"):
        partition(dataclasses.replace(PROF, input_bytes=-1), [dev("g0")], 1, bw, 1)


def test_valid_inputs_still_plan():
    c = cluster([dev("g0"), dev("g1", speed=0.5)])
    plan = make_plan(c, PROF, **KW)
    assert plan.samples_per_s > 0
    assert partition(PROF, [dev("g0")], 1, lambda a, b: math.inf, 0)
