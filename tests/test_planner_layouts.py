"""The planner's result is layouts plus predictions: each planned stage holds its
:class:`hetpipe.core.layout.StageLayout`, a planned virtual worker's layout is its stages'
and its Nm, and :meth:`Plan.run_layouts` gives what the runtime runs."""

from __future__ import annotations

import json

import pytest
from helpers import KW, profile16, repo_cluster

from hetpipe.core.layout import validate
from hetpipe.core.schedule import fill_counts
from hetpipe.planner import Plan, PlanError, PlanInputs, explicit_plan, make_plan
from hetpipe.planner.syncplan import sync_plan


def test_a_planned_stage_is_its_layout_plus_predictions():
    cluster, prof = repo_cluster(), profile16()
    plan = make_plan(cluster, prof, **KW, num_vws=1, policy="np", nm=8, in_flight="plan")
    (vw,) = plan.vws
    assert vw.layout.stages == tuple(s.layout for s in vw.stages) and vw.layout.nm == vw.nm
    for s in vw.stages:
        assert s.device == s.layout.device and s.layers == (s.layout.first, s.layout.last)
        assert s.limit == s.layout.in_flight_limit and s.replicas == s.layout.replicas
    limits = [s.limit for s in vw.stages]
    assert any(limits)
    assert [s.layout.in_flight_fill for s in vw.stages] == list(fill_counts(limits, vw.nm))
    assert vw.devices == tuple(s.device for s in vw.stages)
    validate(plan.run_layouts("keep"), {d.name for d in cluster.devices}, 16)
    for run, s in zip(plan.run_layouts("keep")[0].stages, vw.stages, strict=True):
        assert (run.devices, run.layers, run.in_flight_limit) == (
            s.layout.devices,
            s.layers,
            s.limit,
        )
    # the JSON holds no fill: reading it back derives the same one
    back = Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert back == plan and back.run_layouts("keep") == plan.run_layouts("keep")


def test_a_plan_written_before_layouts_reads():
    """A stage's JSON from before the replicas, rows and limits were planned still reads."""
    plan = make_plan(repo_cluster(), profile16(), **KW, num_vws=1, policy="np")
    d = plan.to_dict()
    for v in d["vws"]:
        for s in v["stages"]:
            for key in ("replicas", "rows", "limit", "expected_memory", "in_flight"):
                s.pop(key)
    back = Plan.from_dict(d)
    assert [v.layout.stages for v in back.vws] == [
        tuple(s.layout for s in v.stages) for v in plan.vws
    ]


@pytest.mark.parametrize("activations", ["keep", "recompute", "swap", "auto"])
def test_a_synchronous_plan_runs_the_jobs_pinned_policy(activations):
    """The synchronous planner keeps every activation: the job's train.activations pins
    every layer of every stage; an async plan runs its own choice."""
    cluster, prof = repo_cluster(), profile16()
    plan = sync_plan(cluster, prof, minibatch=32, m=4, optimizer_state_factor=1, budget_s=2)
    got = plan.run_layouts(activations)
    assert [[s.layers for s in v.stages] for v in got] == [
        [s.layers for s in v.stages] for v in plan.vws
    ]
    for vw in got:
        for s in vw.stages:
            every = tuple(range(s.first, s.last))
            assert s.recompute == (every if activations == "recompute" else ())
            assert s.swap == (every if activations == "swap" else ())
    free = make_plan(cluster, prof, **KW, num_vws=1)
    assert free.run_layouts(activations) == tuple(v.layout for v in free.vws)


@pytest.mark.parametrize(
    ("vws", "says"),
    [
        ([(("gpu9",), None, 1)], "vw[0].devices[0]: unknown device: 'gpu9' is not a device"),
        (
            [(("gpu0",), None, 1), (("gpu1", "gpu0"), None, 1)],
            "vw[1].devices[1]: device used twice: device 'gpu0' is already in vw[0]",
        ),
        (
            [(("gpu0", "gpu1"), (3, 3), 2)],
            "vw[0].layers: layers must sum to 16: [3, 3] sums to 6, the model has 16 layers",
        ),
        ([(("gpu0", "gpu1"), (0, 16), 2)], "vw[0].layers[0]: must be >= 1, got 0"),
        ([(("gpu0",), None, 0)], "vw[0].nm: must be >= 1, got 0"),
    ],
)
def test_a_given_split_is_refused_as_the_one_validation_says(vws, says):
    """explicit_plan checks a user's split with hetpipe.core.layout.validate: its key and
    problem, led by the words explicit plans always used for the same problem."""
    with pytest.raises(PlanError) as got:
        explicit_plan(repo_cluster(), profile16(), vws, **KW)
    assert str(got.value).startswith(says), got.value


def test_a_given_synchronous_split_is_refused_as_the_one_validation_says():
    with pytest.raises(PlanError, match=r"^vw\[0\]\.devices\[1\]: unknown device: 'gpu9'"):
        sync_plan(
            repo_cluster(),
            profile16(),
            minibatch=32,
            m=4,
            optimizer_state_factor=1,
            vws=[(("gpu0", "gpu9"), None)],
        )


def test_plan_inputs_say_once_what_the_keywords_say():
    """make_plan and explicit_plan take the job's PlanInputs, or its fields as keywords,
    or both (the keywords replace the fields); an unknown keyword is refused."""
    cluster, prof = repo_cluster(), profile16()
    inputs = PlanInputs(**KW, num_vws=1, policy="np", nm=4)
    assert make_plan(cluster, prof, inputs) == make_plan(
        cluster, prof, **KW, num_vws=1, policy="np", nm=4
    )
    assert make_plan(cluster, prof, inputs, nm=2) == make_plan(
        cluster, prof, **KW, num_vws=1, policy="np", nm=2
    )
    split = [(("gpu1", "gpu2"), (8, 8), None)]
    assert explicit_plan(cluster, prof, split, inputs) == explicit_plan(
        cluster, prof, split, **KW, nm=4
    )
    with pytest.raises(TypeError):
        make_plan(cluster, prof, inputs, nosuch=1)
