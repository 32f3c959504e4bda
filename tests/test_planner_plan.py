"""make_plan / explicit_plan on the repository's cluster shape, the table, and placement."""

from __future__ import annotations

import itertools
import json

import pytest
from helpers import KW, check_expected, profile16, repo_cluster

from hetpipe.config import (
    ClusterConfig,
    DeviceSpec,
    LinkSpec,
    NetworkSpec,
    NodeSpec,
    RuntimeSpec,
    ShardSpec,
    format_size,
)
from hetpipe.core.memory import stage_memory_of
from hetpipe.core.schedule import fill_counts, max_in_flight
from hetpipe.planner import (
    LayerProfile,
    ModelProfile,
    Plan,
    PlanError,
    explicit_plan,
    make_plan,
    place_stages,
    synthetic_profile,
)

MiB = 1 << 20


def check_plan(plan: Plan, cluster: ClusterConfig, L: int) -> None:
    used = [d for vw in plan.vws for d in vw.devices]
    assert len(used) == len(set(used))
    assert set(used) | set(plan.unused) == {d.name for d in cluster.devices}
    for vw in plan.vws:
        assert vw.stages[0].layers[0] == 0 and vw.stages[-1].layers[1] == L
        for s, t in itertools.pairwise(vw.stages):
            assert s.layers[1] == t.layers[0]
        for s in vw.stages:
            assert s.memory.total <= s.memory_cap == cluster.device(s.device).memory
            assert 0 <= s.shard < len(cluster.ps)
        assert vw.nm >= 1 and vw.samples_per_s > 0
    assert len(plan.layer_shards) == L
    # the job's rate (every sample / the time to the last VW's end) never beats the VWs' sum
    assert 0 < plan.samples_per_s <= sum(v.samples_per_s for v in plan.vws) * (1 + 1e-9)
    check_expected(plan)


def test_make_plan_uses_the_whimpy_device():
    cluster, prof = repo_cluster(), profile16()
    plan = make_plan(cluster, prof, **KW)
    check_plan(plan, cluster, 16)
    assert any("gpu3" in vw.devices for vw in plan.vws)
    assert plan.unused == ()
    whimpy = next(s for vw in plan.vws for s in vw.stages if s.device == "gpu3")
    assert whimpy.memory.total <= 3 * MiB


def test_every_policy_gives_a_valid_plan():
    cluster, prof = repo_cluster(), profile16()
    for policy in ("np", "ed", "hd"):
        check_plan(make_plan(cluster, prof, policy=policy, **KW), cluster, 16)
    four = make_plan(cluster, prof, policy="hd", num_vws=4, **KW)
    check_plan(four, cluster, 16)
    # alone, the 3MiB whimpy device cannot hold 16 layers: left out, with the reason
    assert four.unused == ("gpu3",)
    assert any("gpu3 unused" in w and "cannot hold the model" in w for w in four.warnings)


def test_fixed_nm_and_staleness():
    cluster, prof = repo_cluster(), profile16()
    plan = make_plan(cluster, prof, **{**KW, "staleness": 2}, nm=2, num_vws=2)
    assert all(vw.nm == 2 for vw in plan.vws) and plan.staleness == 2
    assert len(plan.vws) == 2
    assert any("cannot fill" in w for w in plan.warnings)


def test_a_model_that_fits_nowhere_is_a_plan_error():
    cluster = repo_cluster()
    big = LayerProfile(1e-3, 2e-3, 40 * MiB, 0, 1024, 1024, 1024)
    prof = ModelProfile("huge", 32, 1024, {t: (big,) * 4 for t in ("fast", "medium", "whimpy")})
    with pytest.raises(PlanError, match="needs at least") as e:
        make_plan(cluster, prof, **KW)
    assert "\n" not in str(e.value)


def test_devices_without_a_profile_are_unused_with_the_reason():
    cluster = repo_cluster()
    prof = synthetic_profile(16, {"fast": 1.0, "medium": 0.5}, 0)
    plan = make_plan(cluster, prof, **KW)
    assert "gpu3" in plan.unused
    assert any("no profile for its type 'whimpy'" in w for w in plan.warnings)
    with pytest.raises(PlanError, match="no device has a profile"):
        make_plan(cluster, synthetic_profile(4, {"other": 1.0}, 0), **KW)


def test_profile_at_another_minibatch_is_scaled_with_a_warning():
    cluster, prof = repo_cluster(), profile16()
    plan = make_plan(cluster, prof, **{**KW, "minibatch": 16})
    assert plan.minibatch == 16
    assert any("scaled linearly" in w for w in plan.warnings)


def test_link_overrides_are_respected():
    slow = (LinkSpec("gpu0", "gpu1", 0.001), LinkSpec("gpu0", "gpu2", 0.001))
    plan = make_plan(repo_cluster(slow), profile16(), **KW, num_vws=1, policy="hd")
    order = plan.vws[0].devices
    for a, b in itertools.pairwise(order):
        assert {a, b} not in ({"gpu0", "gpu1"}, {"gpu0", "gpu2"})


def test_table_and_round_trip():
    cluster, prof = repo_cluster(), profile16()
    plan = make_plan(cluster, prof, **KW)
    text = plan.table()
    for vw in plan.vws:
        assert " > ".join(vw.devices) in text and f"Nm={vw.nm}" in text
    assert "total predicted" in text and "MiB" in text and "samples/s" in text
    d = json.loads(json.dumps(plan.to_dict()))
    back = Plan.from_dict(d)
    assert back == plan
    assert back.table() == text


def test_the_plan_carries_the_expected_peak_of_its_simulated_timeline():
    """Two medium stages, Nm = 8: the second keeps pace with the first, so the first is
    predicted to hold fewer than the 8 the bound charges, and its expected memory is the one
    memory model at that count (stage_memory_of, the plain per-layer formula). The cap is
    still checked with the bound; the table shows both; a plan round-trips them. With
    weights = "latest" the stages run a fixed order: expected and bound agree."""
    cluster, prof = repo_cluster(), profile16()
    plan = explicit_plan(cluster, prof, [(("gpu1", "gpu2"), (8, 8), 8)], **KW)
    check_expected(plan)
    first, last = plan.vws[0].stages
    assert first.in_flight == max_in_flight("async", 2, 0, 8) == 8
    assert 1 <= first.expected_in_flight < first.in_flight
    for i, s in enumerate((first, last)):
        assert s.memory == stage_memory_of(prof, "medium", s.layers, i, 2, 8, 1)
        assert s.expected_memory == stage_memory_of(
            prof, "medium", s.layers, i, 2, 8, 1, flight=s.expected_in_flight
        )
    # the cap is checked with the bound: over gpu1's cap by it (the explicit plan warns, the
    # runtime would refuse), though the expected peak fits
    assert first.expected_memory.total <= first.memory_cap < first.memory.total
    assert any(w.startswith("vw 0: gpu1 needs") for w in plan.warnings), plan.warnings
    row = next(line for line in plan.table().splitlines() if line.strip().startswith("0 "))
    assert f"{first.expected_in_flight}/8" in row
    assert format_size(first.expected_memory.total) in row
    assert f"{format_size(first.memory.total)} / {format_size(first.memory_cap)}" in row
    back = Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert back == plan and back.vws[0].stages[0].expected_memory == first.expected_memory
    fixed = explicit_plan(cluster, prof, [(("gpu1", "gpu2"), (8, 8), 8)], weights="latest", **KW)
    check_expected(fixed)
    for i, s in enumerate(fixed.vws[0].stages):
        assert s.expected_in_flight == s.in_flight == max_in_flight("async", 2, i, 8, True)
        assert s.expected_memory == s.memory


@pytest.mark.parametrize("nm", [4, 8])
def test_in_flight_plan_makes_the_expected_peak_the_bound(nm):
    """``train.in_flight = "plan"``: each stage whose count depends on timing is limited to
    what the unlimited plan's timeline held and filled to it (fill_counts); its bound and
    memory become that count's, the timeline is simulated again as the runtime runs it (so
    it holds at least the fill and at most the limit), and its run layouts carry the limits to
    the runtime. The last stage, fixed orders and given splits are left as they are; the
    search's choice is the unlimited plan's."""
    cluster, prof = repo_cluster(), profile16()
    kw = {**KW, "num_vws": 1, "policy": "np", "nm": nm}
    free = make_plan(cluster, prof, **kw)
    limited = make_plan(cluster, prof, **kw, in_flight="plan")
    (vw,), (was_vw,) = limited.vws, free.vws
    assert vw.devices == was_vw.devices and vw.layers == was_vw.layers and len(vw.devices) > 1
    limits = [s.limit for s in vw.stages]
    assert limits == [s.expected_in_flight for s in was_vw.stages[:-1]] + [0]
    assert all(s.limit == 0 for s in was_vw.stages)
    for s, was, fill in zip(vw.stages[:-1], was_vw.stages, fill_counts(limits, nm), strict=False):
        assert s.in_flight == s.limit and fill <= s.expected_in_flight <= s.limit
        assert s.memory.total <= was.memory.total
        assert (s.memory == was.memory) == (s.limit == was.in_flight)
    assert vw.stages[-1].limit == 0 and vw.stages[-1].in_flight == 1
    assert abs(limited.samples_per_s / free.samples_per_s - 1) < 0.05
    row = next(line for line in limited.table().splitlines() if line.strip().startswith("0 "))
    first = vw.stages[0]
    assert f"{first.expected_in_flight}/{first.limit}!" in row
    assert 'train.in_flight = "plan"' in limited.table()
    assert Plan.from_dict(json.loads(json.dumps(limited.to_dict()))) == limited
    assert [s.in_flight_limit for s in limited.run_layouts("keep")[0].stages] == limits
    assert all(s.in_flight_limit == 0 for s in free.run_layouts("keep")[0].stages)
    fixed = make_plan(cluster, prof, **kw, weights="latest", in_flight="plan")
    assert all(s.limit == 0 for v in fixed.vws for s in v.stages)
    given = explicit_plan(cluster, prof, [(("gpu1", "gpu2"), (8, 8), 8)], **KW)
    assert all(s.limit == 0 for s in given.vws[0].stages)


def test_explicit_plan_prices_a_given_split():
    cluster, prof = repo_cluster(), profile16()
    vws = [(("gpu0", "gpu1", "gpu2", "gpu3"), (6, 4, 4, 2), 4)]
    plan = explicit_plan(cluster, prof, vws, **KW)
    assert plan.policy == "explicit"
    assert plan.vws[0].layers == (6, 4, 4, 2) and plan.vws[0].nm == 4
    assert plan.vws[0].stages[3].layers == (14, 16)
    assert plan.samples_per_s > 0
    # the planner's own split for the same order is at least as good: predicted throughput
    # (its slowest stage as simulated may be slower: sharing the host's cores slows the fast
    # unpadded device, while padded ones sleep such stretches off)
    auto = explicit_plan(cluster, prof, [(("gpu0", "gpu1", "gpu2", "gpu3"), None, 4)], **KW)
    assert auto.samples_per_s >= plan.samples_per_s
    over = explicit_plan(cluster, prof, [(("gpu3", "gpu0"), (12, 4), 2)], **KW)
    assert any("gpu3 needs" in w and "over its cap" in w for w in over.warnings)
    assert set(over.unused) == {"gpu1", "gpu2"}
    with pytest.raises(PlanError, match="sum to 16"):
        explicit_plan(cluster, prof, [(("gpu0", "gpu1"), (3, 3), 2)], **KW)
    with pytest.raises(PlanError, match="unknown device"):
        explicit_plan(cluster, prof, [(("gpu9",), None, 1)], **KW)
    with pytest.raises(PlanError, match="used twice"):
        explicit_plan(cluster, prof, [(("gpu0",), None, 1), (("gpu0",), None, 1)], **KW)


def test_place_stages_prefers_the_stage_host_and_balances_bytes():
    shards = [ShardSpec(0, "h0", 1), ShardSpec(1, "h0", 2), ShardSpec(2, "h1", 3)]
    layer_bytes = [100, 100, 100, 100, 50, 50]
    one_vw = [[("h0", (0, 2)), ("h0", (2, 4)), ("h1", (4, 6))]]
    layers, stages = place_stages(shards, one_vw, layer_bytes)
    assert stages == ((0, 1, 2),)  # host-local; the two h0 stages on the two h0 shards
    assert layers == (0, 0, 1, 1, 2, 2)
    # no shard on the stages' host: least loaded shard overall
    layers, stages = place_stages(shards[:2], [[("h9", (0, 3)), ("h9", (3, 6))]], layer_bytes)
    assert set(stages[0]) == {0, 1}
    # two VWs cutting differently: per-segment placement, one home per layer
    two = [[("h0", (0, 3)), ("h1", (3, 6))], [("h0", (0, 2)), ("h1", (2, 6))]]
    layers, stages = place_stages(shards, two, layer_bytes)
    assert layers[0] in (0, 1) and layers[5] == 2
    assert len(stages) == 2 and all(len(s) == 2 for s in stages)
    assert place_stages([], one_vw, layer_bytes) == ((0,) * 6, ((0, 0, 0),))


def test_shard_override():
    cluster, prof = repo_cluster(), profile16()
    plan = make_plan(cluster, prof, **KW, shard_of_stage=lambda v, i, d: 1)
    assert all(s.shard == 1 for vw in plan.vws for s in vw.stages)
    assert set(plan.layer_shards) == {1}


def _multi_node(links: tuple[LinkSpec, ...] = ()) -> ClusterConfig:
    kinds = {"a": (1.0, 64), "b": (0.5, 32), "c": (0.25, 8)}
    nodes = []
    for n in range(3):
        devs = tuple(
            DeviceSpec(f"d{n}{t}", "cpu", t, kinds[t][1] * MiB, kinds[t][0], 0, f"n{n}", f"h{n}")
            for t in "abc"
        )
        nodes.append(NodeSpec(f"n{n}", f"h{n}", devs))
    shards = tuple(ShardSpec(i, f"h{i}", 7100) for i in range(3))
    return ClusterConfig("<m>", shards, NetworkSpec(100.0, 1.0, links), tuple(nodes), RuntimeSpec())


def test_alike_vws_share_a_search_without_changing_the_plan():
    prof = synthetic_profile(24, {"a": 1.0, "b": 0.5, "c": 0.25}, 4)
    shared = make_plan(_multi_node(), prof, **KW)
    # a no-op link override (same bandwidth as between nodes) turns the sharing off
    exact = make_plan(_multi_node((LinkSpec("d0a", "d1a", 1.0),)), prof, **KW)
    assert shared.samples_per_s == pytest.approx(exact.samples_per_s, rel=1e-9)
    check_plan(shared, _multi_node(), 24)
    assert shared.details["orders_evaluated"] <= exact.details["orders_evaluated"]


def test_the_plan_table_names_the_model_as_a_person_reads_it():
    from hetpipe.job import JobSpec
    from hetpipe.planner.plans import model_title
    from hetpipe.profiling import model_key

    spec = JobSpec.from_dict(
        {
            "name": "t",
            "model": {"name": "cnn", "args": {"width": 8}},
            "data": {"name": "digits"},
            "train": {"minibatch": 4, "minibatches": 9},
        }
    )
    assert model_title(model_key(spec)) == "cnn (width=8) on digits"
    bf16 = JobSpec.from_dict(
        {**spec.to_dict(), "train": {**spec.to_dict()["train"], "precision": "bf16"}}
    )
    assert model_title(model_key(bf16)) == "cnn (width=8) on digits, bf16"
    assert model_title("synthetic") == "synthetic"
    assert model_title("") == "model"
