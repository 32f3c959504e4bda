"""The planner decides stage replicas (hetpipe.planner.replicas.replicate): with
``train.max_replicas`` it runs a stage on several devices where the predictor says the job is
faster, and never where the runtime would refuse it."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from conftest import job, start_cluster
from helpers import check_expected, stages_json

from hetpipe.config import ClusterConfig, load_cluster
from hetpipe.job import JobSpec
from hetpipe.localcluster import DeviceDef, cluster_toml
from hetpipe.planner import CostModel, LayerProfile, ModelProfile, RuntimeCosts, make_plan
from hetpipe.planner.predict import predict
from hetpipe.planner.replicas import (
    Replicated,
    as_partition,
    describe_groups,
    partition_replicated,
    replica_memory,
)
from hetpipe.profiling import plan_for

CORES = 16  # the unit tests plan for a host whose cores the four devices do not share


def _layer(time_s: float, params: int, *, buffers: int = 0, out: int = 4096) -> LayerProfile:
    return LayerProfile(
        fwd_s=time_s / 3,
        bwd_s=2 * time_s / 3,
        param_bytes=params,
        buffer_bytes=buffers,
        out_bytes=out,
        saved_bytes=out,
        work_bytes=out,
    )


def _bottleneck_profile(*, heavy_params: int = 256 << 10, buffers: int = 0) -> ModelProfile:
    """Four layers, the second 40x the others' time: on one device each it is the
    pipeline's bottleneck whatever the cuts."""
    light = _layer(0.002, 4096)
    heavy = _layer(0.08, heavy_params, buffers=buffers)
    return ModelProfile("m", 32, 4096, {"fast": (light, heavy, light, light)})


def _cluster(tmp_path: Path, links_gbps: float | None = None) -> ClusterConfig:
    """Four equal devices on one node; ``links_gbps``: every pair joined by a link that
    slow instead of the node's 100 Gb/s."""
    devices = [DeviceDef(f"g{i}") for i in range(4)]
    text = cluster_toml(devices, shards=1)
    if links_gbps is not None:
        for i in range(4):
            for j in range(i + 1, 4):
                text += f'\n[[network.link]]\na = "g{i}"\nb = "g{j}"\ngbps = {links_gbps}\n'
    path = tmp_path / "cluster.toml"
    path.write_text(text)
    return load_cluster(path)


def _plan(cluster: ClusterConfig, prof: ModelProfile, max_replicas: int, **kw: Any) -> Any:
    return make_plan(
        cluster,
        prof,
        minibatch=32,
        staleness=0,
        optimizer_state_factor=1,
        num_vws=1,
        cores=CORES,
        max_replicas=max_replicas,
        **kw,
    )


def _heavy_stage(plan: Any) -> Any:
    return next(s for s in plan.vws[0].stages if s.layers[0] <= 1 < s.layers[1])


def test_planner_replicates_a_slow_bottleneck_stage(tmp_path: Path) -> None:
    """One layer holds the pipeline back and equal devices are spare on fast links: the
    chosen plan runs that layer's stage on several of them, its prediction says why, and
    the split the runtime gets has the groups."""
    cluster = _cluster(tmp_path)
    prof = _bottleneck_profile()
    plain = _plan(cluster, prof, 1)
    assert all(not s.replicas for s in plain.vws[0].stages)
    assert "replica_choice" not in plain.details
    plan = _plan(cluster, prof, 2)
    heavy = _heavy_stage(plan)
    assert len(heavy.replicas) == 1, plan.table()
    assert heavy.exchange_s > 0 and heavy.rows == (0, 16, 32)
    # every device used once, across the stages and their replicas
    used = [d for s in plan.vws[0].stages for d in (s.device, *s.replicas)]
    assert sorted(used) == ["g0", "g1", "g2", "g3"]
    (note,) = plan.details["replica_choice"]
    assert note["chosen"] and note["samples_per_s"] == plan.samples_per_s
    assert note["unreplicated_samples_per_s"] == pytest.approx(plain.samples_per_s, rel=1e-9)
    # half the rows of the 80 ms layer per replica: clearly faster, not a rounding win
    assert note["minibatch_s"] < 0.7 * note["unreplicated_minibatch_s"], note
    assert plan.samples_per_s > 1.3 * plain.samples_per_s
    # the replicated stage's expected peak is priced as its leader's bound (its rows)
    check_expected(plan)
    table = plan.table()
    assert "replicas, VW 0: chosen: devices" in table and "without replicas" in table
    assert f"[{heavy.device}, {heavy.replicas[0]}]" in table
    assert "replicated: " in table
    (vw,) = plan.run_layouts("keep")
    assert any(s.replicas for s in vw.stages)
    assert [s.devices for s in vw.stages] == [(s.device, *s.replicas) for s in plan.vws[0].stages]
    # three may be grouped: the planner takes three where that predicts faster still
    three = _plan(cluster, prof, 3)
    assert len(_heavy_stage(three).replicas) == 2, three.table()
    assert three.samples_per_s > plan.samples_per_s


def test_planner_keeps_a_stage_whole_over_slow_links(tmp_path: Path) -> None:
    """The same bottleneck, but the devices that could replicate it are joined by slow
    links: exchanging its 4 MiB of gradients every minibatch would cost more than the rows
    save, so the chosen plan has no replicas and says why."""
    cluster = _cluster(tmp_path, links_gbps=0.05)
    prof = _bottleneck_profile(heavy_params=4 << 20)
    plan = _plan(cluster, prof, 2)
    assert all(not s.replicas for s in plan.vws[0].stages), plan.table()
    plain = _plan(cluster, prof, 1)
    assert plan.samples_per_s == pytest.approx(plain.samples_per_s, rel=1e-9)
    (note,) = plan.details["replica_choice"]
    assert not note["chosen"]
    assert "replicas, VW 0: " in plan.table()
    # the same cluster on fast links replicates it: the link, not the model, decides
    fast = _plan(_cluster(tmp_path), prof, 2)
    assert len(_heavy_stage(fast).replicas) == 1, fast.table()


def test_predictor_prices_the_exchange_over_the_slowest_link(tmp_path: Path) -> None:
    """The simulator runs a replicated stage at its slowest replica's rows plus the
    exchange: one grouping predicts slower the slower the replicas' link, and its stage
    costs carry the replica DP's exchange."""
    prof = _bottleneck_profile(heavy_params=1 << 20)
    rates = []
    for gbps in (100.0, 1.0, 0.1):
        cluster = _cluster(tmp_path, links_gbps=gbps)
        model = CostModel(prof, cluster.network.bytes_per_s, 1, RuntimeCosts())
        groups = [[cluster.device(n) for n in g] for g in (["g0"], ["g1", "g2"], ["g3"])]
        r = describe_groups(model, groups, [(0, 1), (1, 2), (2, 4)], 2, 32)
        leaders, q = as_partition(model, list(cluster.devices), r, 2, 32)
        assert [d.name for d in leaders] == ["g0", "g1", "g3"] and q.rows[1] == (0, 16, 32)
        got = predict(model, [(leaders, q)], minibatch=32, staleness=0, cores=CORES)
        assert q.exchange_s[1] > 0 and got.costs[0][1].exchange_s == q.exchange_s[1]
        rates.append(got.sim.job_samples_per_s)
    assert rates[0] > rates[1] > rates[2], rates
    # on fast links the DP finds that grouping too
    fast = _cluster(tmp_path)
    r = partition_replicated(
        CostModel(prof, fast.network.bytes_per_s, 1, RuntimeCosts()), list(fast.devices), 2, 32, 2
    )
    assert isinstance(r, Replicated) and r.replicated


def _at_rows(prof: ModelProfile, rows: int, factor: float) -> ModelProfile:
    """``prof`` as if profiled at ``rows``: every forward and backward ``factor`` of the
    full minibatch's (bytes proportional to the rows)."""
    return ModelProfile(
        prof.model,
        rows,
        prof.input_bytes * rows // prof.minibatch,
        {
            t: tuple(
                dataclasses.replace(lp, fwd_s=lp.fwd_s * factor, bwd_s=lp.bwd_s * factor)
                for lp in lps
            )
            for t, lps in prof.layers.items()
        },
    )


def test_a_replica_computes_at_its_rows_profile(tmp_path: Path) -> None:
    """With the model profiled at a replica's rows too, its compute is read off that
    profile (interpolated between profiled rows), not taken proportional to its rows."""
    prof = _bottleneck_profile()
    full = prof.layers["fast"][1]
    cluster = _cluster(tmp_path)
    linear = CostModel(prof, cluster.network.bytes_per_s, 1)
    assert linear.compute_at("fast", 1, 2, 0.5) == pytest.approx((full.fwd_s / 2, full.bwd_s / 2))
    model = CostModel(
        prof, cluster.network.bytes_per_s, 1, row_profiles={16: _at_rows(prof, 16, 0.9)}
    )
    for share, factor in ((0.5, 0.9), (0.75, 0.95), (0.25, 0.45), (1.0, 1.0)):
        got = model.compute_at("fast", 1, 2, share)
        assert got == pytest.approx((full.fwd_s * factor, full.bwd_s * factor)), share
    # the planner that knows half the rows take as long as all of them keeps the stage
    # whole (a device a small batch under-uses: the exchange would be all it adds)
    plan = _plan(cluster, prof, 2, row_profiles={16: _at_rows(prof, 16, 1.0)})
    assert all(not s.replicas for s in plan.vws[0].stages), plan.table()
    (note,) = plan.details["replica_choice"]
    assert not note["chosen"]
    # at 90% it still replicates: 8 ms saved on the 80 ms layer against a 1 ms exchange
    plan = _plan(cluster, prof, 2, row_profiles={16: _at_rows(prof, 16, 0.9)})
    assert len(_heavy_stage(plan).replicas) == 1, plan.table()
    (note,) = plan.details["replica_choice"]
    assert 0.85 < note["minibatch_s"] / note["unreplicated_minibatch_s"] < 0.97, note


def test_each_replica_must_hold_its_rows_activations(tmp_path: Path) -> None:
    """A replica holds the whole stage's state but only its rows' activations: a stage
    whose minibatch's activations overflow a device runs on two of them, and not where
    even half of them overflow."""
    big = LayerProfile(
        fwd_s=0.01,
        bwd_s=0.02,
        param_bytes=1 << 20,
        buffer_bytes=0,
        out_bytes=4096,
        saved_bytes=64 << 20,
        work_bytes=4096,
    )
    prof = ModelProfile("m", 32, 4096, {"fast": (big,)})
    cluster = _cluster(tmp_path)
    model = CostModel(prof, cluster.network.bytes_per_s, 1)
    whole = model.stage_memory("fast", 0, 1, 0, 1, 1).total
    half = replica_memory(model, "fast", 0, 1, 0, 1, 1, 0.5).total
    assert half < whole - (30 << 20)  # the activations halve, the state does not
    for cap, fits in ((whole, True), ((whole + half) // 2, True), (half - 1, False)):
        devs = [dataclasses.replace(d, memory=cap) for d in cluster.devices[:2]]
        got = partition_replicated(model, devs, 1, 32, 2)
        assert isinstance(got, Replicated) == fits, (cap, got)
        if fits:
            assert got.groups == (("g0", "g1"),)
    # one device alone never fits below the whole stage's memory
    one = [dataclasses.replace(cluster.devices[0], memory=(whole + half) // 2)]
    assert not isinstance(partition_replicated(model, one, 1, 32, 1), Replicated)


def test_no_replicas_on_batch_norm_or_synchronous_schedules(tmp_path: Path) -> None:
    """The runtime refuses a replicated stage holding batch-norm statistics and replicas
    under gpipe/1f1b: the planner never chooses them there."""
    cluster = _cluster(tmp_path)
    bn = _bottleneck_profile(buffers=2048)
    plan = _plan(cluster, bn, 2)
    assert all(not s.replicas for s in plan.vws[0].stages), plan.table()
    # the heavy layer holds buffers, the light ones may still be grouped (never better
    # here), and nothing the runtime refuses is proposed
    for s in plan.vws[0].stages:
        assert not s.replicas or not (s.layers[0] <= 1 < s.layers[1])
    prof = _bottleneck_profile()
    for schedule in ("gpipe", "1f1b"):
        spec = JobSpec.from_dict(
            job("sync", nm=4, train={"max_replicas": 2, "vws": 1, "schedule": schedule})
        )
        got = plan_for(spec, cluster, dataclasses.replace(prof, model="mlp"))
        assert got.schedule == schedule
        assert all(not s.replicas for v in got.vws for s in v.stages)
        assert all(not s.replicas for v in got.run_layouts("keep") for s in v.stages)
    # the async schedule of the same job does replicate (the refusal is the schedule's)
    spec = JobSpec.from_dict(job("async", nm=2, train={"max_replicas": 2, "vws": 1}))
    got = plan_for(spec, cluster, dataclasses.replace(prof, model="mlp"))
    assert any(s.replicas for s in got.vws[0].stages), got.table()


def test_no_replicas_across_nodes_without_a_link(tmp_path: Path) -> None:
    """Devices on two nodes with no ``[[network.link]]`` between them may pipeline but not
    replicate a stage (the runtime would refuse the group)."""
    devices = [DeviceDef(f"g{i}") for i in range(4)]
    text = cluster_toml(devices, shards=1)
    # g2 and g3 on a second node of this host
    head, sep, tail = text.partition('[[node.device]]\nname = "g2"')
    text = f'{head}[[node]]\nname = "node1"\nhost = "127.0.0.1"\n\n{sep}{tail}'
    path = tmp_path / "cluster.toml"
    path.write_text(text)
    cluster = load_cluster(path)
    prof = _bottleneck_profile()
    plan = _plan(cluster, prof, 4)
    for s in plan.vws[0].stages:
        nodes = {cluster.device(d).node for d in (s.device, *s.replicas)}
        assert len(nodes) == 1, plan.table()


# -- real daemons ----------------------------------------------------------------------------

# three equal devices, 10x slower than this host, and an mlp whose first Linear (64 -> 4096,
# 128 rows) is most of its compute: on one device that stage holds the pipeline back; on two
# each computes half the rows (a compute-bound layer: its profile at 64 rows says so)
E2E_DEVICES = tuple(DeviceDef(f"s{i}", "slow", "256MiB", 0.1) for i in range(3))


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_planned_job_runs_its_replicated_stage(tmp_path: Path) -> None:
    """A job with ``train.max_replicas = 2`` and no split: the head plans a replicated
    stage, runs it to the end, and its status and ``stages.json`` name the replicas."""
    cluster = start_cluster(tmp_path, E2E_DEVICES, shards=1)
    try:
        spec = job("planned-replicas", model_args={"hidden": [4096]}, minibatch=128, minibatches=40)
        spec["train"].pop("nm")
        spec["train"].update({"vws": 1, "max_replicas": 2})
        info = cluster.submit(spec, timeout=380)
    finally:
        cluster.stop()
    assert info["state"] == "done", info.get("error")
    pred = info["predicted"]
    replicated = [s for s in info["stages"] if s["replicas"]]
    assert len(replicated) == 1, (info["stages"], pred)
    (st,) = replicated
    assert len(st["replicas"]) == 1 and st["layers"][0] <= 1 < st["layers"][1], info["stages"]
    # the planner's figures are those of the split that ran, replicas included
    ps = pred["vws"][0]["stages"][st["stage"]]
    assert ps["replicas"] == st["replicas"] and ps["exchange_s"] > 0
    assert [s["device"] for s in pred["vws"][0]["stages"]] == info["vws"][0]["devices"]
    assert info["minibatches"] == 40
    stages = stages_json(info)
    assert stages[f"vw0/stage{st['stage']}"]["replicas"] == st["replicas"]
    assert all(
        not stages[f"vw0/stage{s['stage']}"]["replicas"] for s in info["stages"] if s is not st
    )
