"""Shared link capacity: transfers that cross one link between hosts at once share it (the
simulator's channels, :mod:`hetpipe.planner.simulate`; the predictor names them,
:mod:`hetpipe.planner.predict`)."""

from __future__ import annotations

import dataclasses
import json

import pytest
from helpers import HOST, KW, model_of, two_hosts

from hetpipe.planner import CostModel, LayerProfile, ModelProfile
from hetpipe.planner.placement import shard_routes
from hetpipe.planner.predict import links_alone, predict
from hetpipe.planner.runtime import RuntimeCosts
from hetpipe.planner.simulate import SimLink, SimStage, SimVW, simulate

FLIGHT = 0.1  # seconds of one activation on the link: far above any stage's compute


def link_bound_vw(channel: str) -> SimVW:
    """Two stages of quick compute whose activations take :data:`FLIGHT` on ``channel``."""
    stage = SimStage(1e-3, 1e-3, state=False)
    return SimVW((stage, stage), 4, (SimLink(FLIGHT, 0.0, channel, ""),))


def test_two_vws_crossing_one_link_each_take_twice_as_long_as_one_alone():
    alone = simulate([link_bound_vw("a>b")], 0, 64)
    shared = simulate([link_bound_vw("a>b"), link_bound_vw("a>b")], 0, 64)
    assert alone.vw_samples_per_s[0] == pytest.approx(1 / FLIGHT, rel=0.02)
    for rate in shared.vw_samples_per_s:
        assert rate == pytest.approx(alone.vw_samples_per_s[0] / 2, rel=0.02)
    assert shared.samples_per_s == pytest.approx(alone.samples_per_s, rel=0.02)


def test_transfers_on_different_links_or_their_own_channels_do_not_share():
    alone = simulate([link_bound_vw("")], 0, 64)
    for a, b in (("a>b", "c>b"), ("", ""), ("a>b", "b>a")):
        two = simulate([link_bound_vw(a), link_bound_vw(b)], 0, 64)
        assert two.vw_samples_per_s == pytest.approx((alone.vw_samples_per_s[0],) * 2, rel=1e-9), (
            a,
            b,
        )


def test_pushes_of_two_vws_to_a_shard_across_one_link_share_it():
    """One-stage VWs whose pushes take a long flight to the shards (their pull answers a
    short one back): apart, each VW's wave is its own push's flight and answer; sharing the
    link, the pushes of both VWs go one after the other, so each VW gets a wave per two
    flights."""
    flight, back = 0.05, 0.005
    stage = SimStage(1e-3, 1e-3, push_s=1e-4, pull_s=1e-4 + back, push_flight_s=flight)
    shared = dataclasses.replace(stage, push_channel="a>b", pull_channel="b>a", pull_flight_s=back)
    apart, both = (simulate([SimVW((s,), 1), SimVW((s,), 1)], 0, 64) for s in (stage, shared))
    for u, s in zip(apart.vw_samples_per_s, both.vw_samples_per_s, strict=True):
        assert s == pytest.approx(1 / (2 * flight), rel=0.05)
        assert u > 1.5 * s


def activations_profile() -> ModelProfile:
    """Quick layers of no state whose activations are large: the link sets the pace."""
    lp = LayerProfile(1e-4, 2e-4, 0, 0, 64 << 10, 1024, 1024)
    return ModelProfile("wide", 32, 4096, {"fast": (lp,) * 4})


def test_the_predictor_shares_a_link_between_vws_whose_stages_cross_it():
    """ED over the slow link: two VWs a0 > b0 and a1 > b1 each get half of what one VW
    alone gets; two VWs inside one host each (nothing crosses) keep a VW's rate."""
    cluster = two_hosts()
    model = CostModel(activations_profile(), cluster.network.bytes_per_s, 1, RuntimeCosts.zero())

    def rates(names: list[tuple[str, str]]) -> tuple[float, ...]:
        chosen = []
        for a, b in names:
            devs = (cluster.device(a), cluster.device(b))
            chosen.append((devs, model.describe(devs, [(0, 2), (2, 4)], 4)))
        got = predict(
            model,
            chosen,
            minibatch=KW["minibatch"],
            staleness=0,
            cores=16,
            shard_hosts=[HOST["a"], HOST["b"]],
            minibatches=64,
        )
        return got.sim.vw_samples_per_s

    (alone,) = rates([("a0", "b0")])
    ed = rates([("a0", "b0"), ("a1", "b1")])
    assert ed == pytest.approx((alone / 2, alone / 2), rel=0.05)
    inside = rates([("a0", "a1"), ("b0", "b1")])
    (alone_inside,) = rates([("a0", "a1")])
    assert inside == pytest.approx((alone_inside, alone_inside), rel=1e-6)
    # priced as if alone, every VW gets a lone VW's rate
    with links_alone():
        assert rates([("a0", "b0"), ("a1", "b1")]) == pytest.approx((alone, alone), rel=0.05)


def test_a_stages_pushes_take_the_link_to_the_host_of_most_of_its_state():
    cluster = two_hosts(shards=("b",))
    model = model_of(cluster)
    devs = tuple(cluster.device(n) for n in ("a0", "b0"))
    p = model.describe(devs, [(0, 3), (3, 8)], 2)
    assert shard_routes(model, [(devs, p)], [HOST["b"]]) == ((HOST["b"], ""),)
    assert shard_routes(model, [(devs, p)], [HOST["a"], HOST["b"]]) == (("", ""),)
    assert shard_routes(model, [(devs, p)], []) == (("", ""),)


def test_the_simulators_command_line_reads_a_links_channels(tmp_path, capsys):
    from hetpipe.planner.simulate import main

    vw = {
        "nm": 4,
        "stages": [[1e-3, 1e-3], [1e-3, 1e-3]],
        "links": [{"fwd_s": FLIGHT, "bwd_s": 0.0, "fwd_channel": "a>b"}],
    }
    path = tmp_path / "vws.json"
    path.write_text(json.dumps({"staleness": 0, "minibatches": 64, "vws": [vw, vw]}))
    assert main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "total 10.0 samples/s" in out  # two VWs at 5 each: alone each would get 10
