"""The HetPipe paper's testbed (4 nodes x 4 GPUs of one type each) and its formations and
parameter placements: NP, ED and the paper's HD; default and local placement.

Speeds are the GPUs' FP32 peak (TFLOPS), relative figures only; memory as the paper lists it.
"""

from __future__ import annotations

import itertools

import pytest
from helpers import GPUS, GiB, paper_cluster

from hetpipe.planner import make_plan, synthetic_profile
from hetpipe.planner.formation import (
    candidate_formations,
    ed_formation,
    np_formation,
    paper_hd_formation,
)
from hetpipe.planner.partition import CostModel, Partition
from hetpipe.planner.placement import (
    PLACEMENTS,
    default_placement,
    place_layers,
    shard_flights,
)
from hetpipe.views import explain_lines


def types_of(group) -> list[str]:
    return sorted(d.type for d in group)


def test_np_is_one_vw_per_node():
    devs = paper_cluster().devices
    f = np_formation(devs)
    assert len(f.groups) == 4
    for g in f.groups:
        assert len(g) == 4 and len({d.node for d in g}) == 1 and len({d.type for d in g}) == 1
    assert sorted(g[0].type for g in f.groups) == sorted("VRGQ")


def test_ed_gives_every_vw_one_gpu_of_each_node():
    f = ed_formation(paper_cluster().devices)
    assert len(f.groups) == 4 and not f.unused
    for g in f.groups:
        assert types_of(g) == sorted("VRGQ")
        assert len({d.node for d in g}) == 4
    assert sorted(d.name for g in f.groups for d in g) == sorted(
        d.name for d in paper_cluster().devices
    )


def test_paper_hd_pairs_most_memory_with_least_two_gpus_of_each():
    f = paper_hd_formation(paper_cluster().devices)
    assert f is not None and f.policy == "hd" and f.label == "hd-paper" and f.name == "hd-paper"
    assert len(f.groups) == 4
    # TITAN RTX (24 GB) with RTX 2060 (6 GB), TITAN V (12 GB) with Quadro P4000 (8 GB)
    assert sorted(types_of(g) for g in f.groups) == [
        ["G", "G", "R", "R"],
        ["G", "G", "R", "R"],
        ["Q", "Q", "V", "V"],
        ["Q", "Q", "V", "V"],
    ]
    for g in f.groups:
        nodes = [d.node for d in g]
        assert len(set(nodes)) == 2 and all(nodes.count(n) == 2 for n in set(nodes))
    names = [d.name for g in f.groups for d in g]
    assert sorted(names) == sorted(d.name for d in paper_cluster().devices)  # each GPU once
    # the paper's point: no VW holds only memory-poor GPUs, and VWs are alike in memory
    # within a pair
    memory = sorted(sum(d.memory for d in g) for g in f.groups)
    assert memory == [40 * GiB, 40 * GiB, 60 * GiB, 60 * GiB]
    # unlike ED, and unlike NP
    assert f.signature() != ed_formation(paper_cluster().devices).signature()
    assert f.signature() != np_formation(paper_cluster().devices).signature()


def test_paper_hd_shape_rules():
    assert paper_hd_formation(paper_cluster(per_node=3).devices) is None  # odd GPUs per node
    assert paper_hd_formation(paper_cluster("V").devices) is None  # one node: nothing to pair
    uneven = paper_cluster().devices[:-1]
    assert paper_hd_formation(uneven) is None
    odd = paper_hd_formation(paper_cluster("VRG").devices)  # the middle node forms its own VW
    assert odd is not None
    assert sorted(types_of(g) for g in odd.groups) == [
        ["G", "G", "R", "R"],
        ["G", "G", "R", "R"],
        ["V", "V", "V", "V"],
    ]
    eight = paper_hd_formation(paper_cluster(per_node=8).devices)
    assert eight is not None and [len(g) for g in eight.groups] == [8, 8, 8, 8]


def test_auto_and_hd_consider_the_papers_hd():
    devs = paper_cluster().devices
    auto = candidate_formations(devs, "auto")
    paper = paper_hd_formation(devs)
    assert paper is not None
    names = [f.name for f in auto]
    assert names.count("hd-paper") == 1
    assert next(f for f in auto if f.name == "hd-paper").signature() == paper.signature()
    assert {"np", "ed", "hd"} <= set(names)
    assert "hd-paper" in [f.name for f in candidate_formations(devs, "hd")]
    assert "hd-paper" in [f.name for f in candidate_formations(devs, "auto", num_vws=4)]
    assert "hd-paper" not in [f.name for f in candidate_formations(devs, "auto", num_vws=2)]


def stage_hosts(order, cuts):
    return [(d.host, ab) for d, ab in zip(order, cuts, strict=True)]


def test_default_placement_is_round_robin_and_ignores_the_stages():
    cluster = paper_cluster()
    shards = cluster.ps
    assert default_placement(shards, 10) == (0, 1, 2, 3, 0, 1, 2, 3, 0, 1)
    assert default_placement((), 3) == (0, 0, 0)
    vws = [[("10.0.0.3", (0, 10))]]
    assert place_layers("default", shards, vws, [1] * 10) == default_placement(shards, 10)
    with pytest.raises(ValueError, match="unknown placement"):
        place_layers("nearest", shards, vws, [1] * 10)


def test_ed_local_keeps_every_push_on_its_node_and_default_does_not():
    """The paper's ED-local: under ED every VW runs stage i on the same node, so local
    placement puts each layer on that node's shard: no push or pull crosses a link."""
    cluster = paper_cluster()
    prof = synthetic_profile(16, {t: s for t, (_, s) in GPUS.items()}, 0)
    model = CostModel(prof, cluster.network.bytes_per_s, 1)
    f = ed_formation(cluster.devices)
    # the same order of node types in every VW, as the planner gives alike VWs
    chosen = []
    for g in f.groups:
        p = model.partition(g, 1)
        assert isinstance(p, Partition)
        chosen.append((g, p))
    cuts = chosen[0][1].cuts
    assert all(p.cuts == cuts for _, p in chosen) and len(cuts) == 4
    shard_hosts = [s.host for s in cluster.ps]
    local = shard_flights(model, chosen, shard_hosts, "local")
    default = shard_flights(model, chosen, shard_hosts, "default")
    assert all(t == 0.0 for row in local for t in row)
    assert sum(t for row in default for t in row) > 0.0  # most layers' shard is remote
    layers = place_layers("local", cluster.ps, [stage_hosts(g, cuts) for g in f.groups], [1] * 16)
    for i, (a, b) in enumerate(cuts):
        for j in range(a, b):
            assert cluster.ps[layers[j]].host == f.groups[0][i].host


def test_np_local_puts_each_layer_on_a_node_that_runs_it():
    cluster = paper_cluster()
    f = np_formation(cluster.devices)
    cuts = ((0, 4), (4, 8), (8, 12), (12, 16))
    vws = [stage_hosts(g, cuts) for g in f.groups]
    layers = place_layers("local", cluster.ps, vws, [1] * 16)
    for shard in layers:
        assert cluster.ps[shard].host in {g[0].host for g in f.groups}
    # every VW runs every layer on its own node, so local placement still leaves 3 of 4 VWs
    # remote for each layer: it balances the bytes over the shards
    assert sorted(layers.count(s) for s in range(4)) == [4, 4, 4, 4]


@pytest.fixture(scope="module")
def paper_plan():
    cluster = paper_cluster()
    prof = synthetic_profile(16, {t: s for t, (_, s) in GPUS.items()}, 0)
    kw = {"minibatch": 32, "staleness": 0, "optimizer_state_factor": 1, "num_vws": 4}
    return make_plan(cluster, prof, **kw)


def test_auto_compares_np_ed_and_the_papers_hd_by_the_simulator(paper_plan):
    trace = paper_plan.details["candidates"]
    by_name = {c["name"]: c for c in trace}
    assert {"np", "ed", "hd-paper"} <= set(by_name)
    for name in ("np", "ed", "hd-paper"):
        c = by_name[name]
        assert c["score"] is not None or "bound" in (c["skipped"] or "")
    chosen = [c for c in trace if c["chosen"]]
    assert len(chosen) == 1
    assert chosen[0]["formation"] == paper_plan.details["formation"]
    scored = [c["score"] for c in trace if c["score"] is not None]
    assert chosen[0]["score"] == max(scored)
    places = paper_plan.details["placements"]
    assert [p["name"] for p in places] == list(PLACEMENTS)
    assert [p["chosen"] for p in places] == [True, False]
    assert all(p["score"] > 0 for p in places)


def test_explain_lists_every_candidate_and_why_one_won(paper_plan):
    lines = explain_lines(paper_plan.details)
    text = "\n".join(lines)
    for c in paper_plan.details["candidates"]:
        assert c["formation"] in text
    assert "hd-paper" in text
    assert any(line.startswith("chosen: ") for line in lines)
    assert "over the best other candidate" in text
    assert "parameter placements" in text and "round-robin" in text
    assert explain_lines({}) == [
        "explain: this plan records no candidate formations (a split from the job file, "
        "or a synchronous plan)"
    ]


def test_explain_names_candidates_skipped_by_bound():
    details = {
        "candidates": [
            {"name": "np", "formation": "a | b", "score": 5.0, "skipped": None, "chosen": True},
            {
                "name": "hd-paper",
                "formation": "ab | ab",
                "score": None,
                "skipped": "its bound 4 cannot beat 5",
                "chosen": False,
            },
            {"name": "ed", "formation": "ab", "score": 4.0, "skipped": None, "chosen": False},
        ]
    }
    text = "\n".join(explain_lines(details))
    assert "its bound 4 cannot beat 5" in text
    assert "+25.0% over the best other candidate (ed, 4.00: ab)" in text
    assert "1 skipped whose throughput bound" in text


def test_every_device_in_exactly_one_vw_of_each_paper_formation():
    devs = paper_cluster().devices
    paper = paper_hd_formation(devs)
    assert paper is not None
    for f in (np_formation(devs), ed_formation(devs), paper):
        names = [d.name for g in f.groups for d in g]
        assert len(names) == len(set(names)) == 16
        for a, b in itertools.combinations(f.groups, 2):
            assert not set(a) & set(b)


def test_plan_explain_prints_the_candidates(paper_plan, monkeypatch):
    """``hetpipe plan --explain`` renders the head's plan (no head here: its reply is faked)."""
    from types import SimpleNamespace

    from click.testing import CliRunner

    from hetpipe import cli

    reply = {"plan": paper_plan.to_dict(), "table": "TABLE"}
    monkeypatch.setattr(cli, "_load_job_or_fail", lambda obj, f: SimpleNamespace(to_dict=dict))
    monkeypatch.setattr(cli, "_ask", lambda obj, kind, fields, timeout: reply)
    env = {"HETPIPE_CLUSTER": None, "HETPIPE_RUN_DIR": None, "HETPIPE_HEAD": None}
    args = ["plan", "--job", "job.toml"]
    plain = CliRunner().invoke(cli.main, args, env=env)
    assert plain.exit_code == 0, plain.output
    assert plain.output == "TABLE\n"
    explained = CliRunner().invoke(cli.main, [*args, "--explain"], env=env)
    assert explained.exit_code == 0, explained.output
    assert explained.output.startswith("TABLE\ncandidate formations (")
    assert "hd-paper" in explained.output and "chosen: " in explained.output
