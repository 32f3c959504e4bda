"""A stage's pushes and pulls on the links to shards on other hosts (planner.placement), as
the predictor and the simulator price them, on a two-hosts layout with one slow link."""

from __future__ import annotations

import dataclasses

import pytest
from helpers import HOST, KW, LAYERS, PARAM, SLOW_BPS, model_of, two_hosts
from helpers import placement_profile as profile

from hetpipe.config import (
    ClusterConfig,
)
from hetpipe.planner import explicit_plan, make_plan
from hetpipe.planner.placement import shard_flights
from hetpipe.planner.predict import predict, stage_costs
from hetpipe.planner.runtime import RuntimeCosts
from hetpipe.planner.simulate import SimStage, SimVW, simulate


def test_a_stages_bytes_to_a_shard_across_the_slow_link_take_their_size_over_its_rate():
    cluster = two_hosts(shards=("b",))  # the only shard is on host b
    model = model_of(cluster)
    devs = tuple(cluster.device(n) for n in ("a0", "b0"))
    p = model.describe(devs, [(0, 3), (3, 8)], 2)
    [(on_a, on_b)] = shard_flights(model, [(devs, p)], [HOST["b"]])
    assert on_a == pytest.approx(3 * PARAM / SLOW_BPS)  # a0's three layers cross the link
    assert on_b == 0.0  # b0's shard shares its host: no link
    # one shard per host: each stage's state stays on its host, nothing crosses
    both = shard_flights(model, [(devs, p)], [HOST["a"], HOST["b"]])
    assert both == ((0.0, 0.0),)
    assert shard_flights(model, [(devs, p)], []) == ((0.0, 0.0),)
    # the same layout with a fast a-b link: the same bytes over the inter-node default
    fast = model_of(two_hosts(slow_gbps=10.0, shards=("b",)))
    [(quick, _)] = shard_flights(fast, [(devs, p)], [HOST["b"]])
    assert quick == pytest.approx(3 * PARAM / (10.0 * 1e9 / 8))


def test_a_pull_waits_for_the_weights_way_back_and_a_push_costs_no_more_cpu():
    cluster = two_hosts(shards=("b",))
    costs = RuntimeCosts(wave_s=1e-3, latency_s=2e-3, wave_byte_s=1e-9)
    model = model_of(cluster, costs)
    devs = tuple(cluster.device(n) for n in ("a0", "b0"))
    p = model.describe(devs, [(0, 3), (3, 8)], 2)
    flight = 3 * PARAM / SLOW_BPS
    local = stage_costs(model, devs, p, vws=2, shards=1)
    remote = stage_costs(model, devs, p, vws=2, shards=1, shard_link_s=(flight, 0.0))
    assert remote[0].pull_s == pytest.approx(local[0].pull_s + flight)
    assert remote[0].shard_link_s == flight and remote[1] == local[1]
    # link time, not the worker's CPU: the push, the merge and the CPU stay as they were
    assert (remote[0].push_s, remote[0].merge_s, remote[0].cpu_s) == (
        local[0].push_s,
        local[0].merge_s,
        local[0].cpu_s,
    )
    # a synchronous exchange waits for the gradients' way there and the mean's way back
    sync_local = stage_costs(model, devs, p, vws=2, shards=1, schedule="1f1b")
    sync_remote = stage_costs(
        model, devs, p, vws=2, shards=1, schedule="1f1b", shard_link_s=(flight, 0.0)
    )
    assert sync_remote[0].pull_s == pytest.approx(sync_local[0].pull_s + 2 * flight)


def test_a_pushs_flight_holds_back_the_other_vws_pulls_but_not_a_vw_alone():
    stage = SimStage(1e-3, 2e-3, push_s=1e-4, pull_s=1e-4)
    late = dataclasses.replace(stage, push_flight_s=0.05)
    alone = simulate([SimVW((stage,), 2)], 0, 40)
    alone_late = simulate([SimVW((late,), 2)], 0, 40)
    # a VW alone pulls nothing: its pushes' way to the shards is off its path
    assert alone_late.vw_finish_s == pytest.approx(alone.vw_finish_s)
    pair = simulate([SimVW((stage,), 2), SimVW((stage,), 2)], 0, 40)
    pair_late = simulate([SimVW((late,), 2), SimVW((stage,), 2)], 0, 40)
    # D = 0: the pull of wave c waits until every VW's pushes of waves < c - 1 have landed:
    # the VW whose own pushes are quick is held to one 50 ms flight per two of the 20 waves
    assert pair_late.vw_finish_s[1] >= 9 * 0.05
    assert pair_late.makespan_s > 3 * pair.makespan_s


def test_a_pull_reaches_the_shard_behind_the_push_sent_before_it():
    """One connection per shard carries a stage's pushes and pulls in order: the pull that
    opens wave c leaves right after the push of wave c - 1 and arrives once that push has
    landed, whatever the staleness bound allows."""
    stage = SimStage(1e-3, 2e-3, push_s=1e-4, pull_s=1e-4)
    late = dataclasses.replace(stage, push_flight_s=0.05)
    loose = simulate([SimVW((late,), 2), SimVW((stage,), 2)], 100, 40)  # WSP never gates
    # 19 of the 20 waves open with a pull behind a 50 ms push
    assert loose.vw_finish_s[0] >= 19 * 0.05
    assert loose.vw_finish_s[1] < 0.2  # the other VW: its own pushes are quick, D is large
    no_flight = simulate([SimVW((stage,), 2), SimVW((stage,), 2)], 100, 40)
    assert no_flight.vw_finish_s[0] < 0.2


def dp(cluster: ClusterConfig, nm: int = 4):
    """Data parallelism: one VW of one stage per device, each holding the whole model."""
    return explicit_plan(
        cluster,
        profile(),
        [((d.name,), (LAYERS,), nm) for d in cluster.devices],
        minibatches=64,
        **KW,
    )


def test_data_parallelism_across_the_slow_link_is_priced_by_its_pushes_and_pulls():
    """The whole model's state lives on one host's shard (a tie of two devices per host):
    the other host's VWs push it and pull it back every wave over the slow link."""
    slow, fast = dp(two_hosts()), dp(two_hosts(slow_gbps=10.0))
    # b0's pull that opens wave c leaves behind its push of wave c - 1: a push's way there
    # and a pull's way back (each the whole model over the link, ~4.2 s) every wave of Nm = 4
    flight = LAYERS * PARAM / SLOW_BPS
    bound = 4 * KW["minibatch"] / (2 * flight)
    # b0's and b1's VWs; a0's and a1's are held by WSP one wave behind them at most, and the
    # first wave pulls nothing, hence the margin
    assert all(v.samples_per_s <= 1.2 * bound for v in slow.vws[2:])
    assert all(v.samples_per_s <= 2.4 * bound for v in slow.vws)
    assert all(v.samples_per_s > 10 * bound for v in fast.vws)  # the same plan, fast link


def test_the_planner_leaves_data_parallelism_when_its_state_must_cross_the_slow_link():
    """Left to choose, the planner runs data parallelism where the link is fast, and a
    formation whose pushes and pulls stay on their host where the a-b link is slow."""
    fast = make_plan(two_hosts(slow_gbps=10.0), profile(), minibatches=64, **KW)
    assert [v.devices for v in fast.vws] and all(len(v.devices) == 1 for v in fast.vws)
    assert len(fast.vws) == 4
    slow = make_plan(two_hosts(), profile(), minibatches=64, **KW)
    model = model_of(two_hosts())
    devices = {d.name: d for d in two_hosts().devices}
    chosen = [
        (
            tuple(devices[n] for n in v.devices),
            model.describe(
                tuple(devices[n] for n in v.devices), [s.layers for s in v.stages], v.nm
            ),
        )
        for v in slow.vws
    ]
    flights = shard_flights(model, chosen, [HOST["a"], HOST["b"]])
    assert all(f == 0.0 for row in flights for f in row)
    assert slow.samples_per_s > max(v.samples_per_s for v in dp(two_hosts()).vws) * 4


def test_a_single_vws_pushes_to_another_host_are_off_its_path():
    """One VW, a stage per device. With a shard on each host nothing crosses a link; with
    both shards on host a, b0's and b1's pushes do, but a VW alone pulls nothing and the
    runtime awaits its pushes' acknowledgements only at the end: the same rate."""
    cluster = two_hosts()
    model = model_of(cluster, RuntimeCosts())
    devs = tuple(cluster.device(n) for n in ("a0", "a1", "b0", "b1"))
    p = model.describe(devs, [(0, 2), (2, 4), (4, 6), (6, 8)], 4)

    def run(hosts: list[str]):
        return predict(
            model,
            [(devs, p)],
            minibatch=32,
            staleness=0,
            cores=4,
            shard_hosts=hosts,
            minibatches=32,
        )

    local, remote = run([HOST["a"], HOST["b"]]), run([HOST["a"], HOST["a"]])
    assert [c.shard_link_s for c in local.costs[0]] == [0.0] * 4
    assert [c.shard_link_s for c in remote.costs[0]] == pytest.approx(
        [0.0, 0.0, 2 * PARAM / SLOW_BPS, 2 * PARAM / SLOW_BPS]
    )
    # (to a trace: the second shard's CPU moved to host a, beside a0's and a1's workers; a
    # push's flight on the path would add ~1 s per wave)
    assert remote.sim.vw_finish_s == pytest.approx(local.sim.vw_finish_s, rel=1e-3)
