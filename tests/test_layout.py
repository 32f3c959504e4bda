"""The one layout type of a split and its one validation (hetpipe.core.layout)."""

from __future__ import annotations

import pytest

from hetpipe.core.layout import SplitError, StageLayout, VWLayout, VWSpec, bounds_of, validate

DEVICES = {"gpu0", "gpu1", "gpu2", "gpu3"}


def vw(groups, counts, nm=2, **kw) -> VWLayout:
    return VWLayout.from_counts(
        [[g] if isinstance(g, str) else g for g in groups], counts, nm, **kw
    )


def refused(layouts, n_layers=6) -> str:
    with pytest.raises(SplitError) as info:
        validate(layouts, DEVICES, n_layers, known_as="cluster.toml")
    return str(info.value)


def test_counts_become_half_open_ranges_in_pipeline_order():
    layout = vw(["gpu1", ["gpu0", "gpu2"]], [2, 4], nm=3, limits=[0, 2])
    assert [s.layers for s in layout.stages] == [(0, 2), (2, 6)]
    assert layout.devices == ("gpu1", "gpu0")
    assert layout.all_devices() == ("gpu1", "gpu0", "gpu2")
    assert layout.stages[1].replicas == ("gpu2",)
    assert layout.counts == (2, 4)
    assert layout.k == 2
    assert [s.in_flight_limit for s in layout.stages] == [0, 2]
    assert bounds_of([1, 1, 3]) == [(0, 1), (1, 2), (2, 5)]


def test_a_layout_travels_as_plain_data_and_back():
    layout = vw(["gpu0", ["gpu1", "gpu2"]], [3, 3], recompute=[(1,), ()], swap=[(), (4, 5)])
    layout = layout.with_stages(rows=[(), (0, 3, 8)], in_flight_fill=[2, 1])
    assert VWLayout.from_dict(layout.to_dict()) == layout
    with pytest.raises(ValueError, match="malformed stage layout"):
        StageLayout.from_dict({"devices": ["gpu0"], "first": 0})


def test_a_whole_split_passes():
    validate([vw(["gpu0", "gpu1"], [3, 3]), vw(["gpu2"], [6])], DEVICES, 6)


@pytest.mark.parametrize(
    ("layouts", "message"),
    [
        ([vw(["gpu7"], [6])], "vw[0].devices[0]: 'gpu7' is not a device of cluster.toml (known: "),
        (
            [vw(["gpu0", "gpu1"], [3, 4])],
            "vw[0].layers: [3, 4] sums to 7, the model has 6 layers",
        ),
        (
            [vw(["gpu0"], [6]), vw(["gpu0"], [6])],
            "vw[1].devices[0]: device 'gpu0' is already in vw[0]",
        ),
        ([vw(["gpu0", "gpu0"], [3, 3])], "vw[0].devices[1]: device 'gpu0' is already in this vw"),
        ([vw(["gpu0", "gpu1", "gpu2"], [1, 1, 1])], "vw[0].layers: [1, 1, 1] sums to 3"),
        ([vw(["gpu0", "gpu1"], [6, 0])], "vw[0].layers[1]: must be >= 1, got 0"),
        ([vw(["gpu0"], [6], nm=0)], "vw[0].nm: must be >= 1, got 0"),
        (
            [vw(["gpu0", "gpu1"], [3, 3], recompute=[(4,), ()])],
            "vw[0].stages[0].recompute: layer 4 is not in the stage's layers 0..2",
        ),
        (
            [vw(["gpu0"], [6], recompute=[(2,)], swap=[(2,)])],
            "vw[0].stages[0].swap: layer 2 is also recomputed",
        ),
    ],
)
def test_each_problem_is_one_line_naming_its_key(layouts, message):
    assert message in refused(layouts)


def test_more_stages_than_layers_is_named_before_the_counts():
    layout = vw(["gpu0", "gpu1", "gpu2"], [1, 1, 1])
    assert refused([layout], n_layers=2) == "vw[0].devices: 3 stages for a model of 2 layers"


def test_stages_must_meet_end_to_start():
    stages = (StageLayout(("gpu0",), 0, 2), StageLayout(("gpu1",), 3, 5))
    gap = VWLayout((*stages, StageLayout(("gpu2",), 4, 6)), 2)
    assert "stage 0 ends at layer 2 but stage 1 starts at 3" in refused([gap], n_layers=6)
    short = VWLayout((StageLayout(("gpu0",), 1, 3), StageLayout(("gpu1",), 3, 5)), 2)
    assert "stages cover layers 1..4, the model has layers 0..3" in refused([short], n_layers=4)


def test_a_job_files_split_is_checked_as_far_as_it_goes():
    planned = VWSpec(("gpu0", "gpu1"))  # layers and Nm left to the planner
    validate([planned], DEVICES, 6)
    assert "vw[0].devices: 2 stages for a model of 1 layers" in refused([planned], n_layers=1)
    given = VWSpec(("gpu0", "gpu1"), layers=(2, 2), replicas=((), ("gpu2",)))
    assert "vw[0].layers: [2, 2] sums to 4" in refused([given])
    assert "device 'gpu2' is already in vw[0]" in refused([given, VWSpec(("gpu2",))], n_layers=4)
    layout = VWSpec(("gpu0", "gpu1"), layers=(2, 4), nm=5).layout(2, recompute=[(), (3,)])
    assert layout == vw(["gpu0", "gpu1"], [2, 4], nm=5, recompute=[(), (3,)])
    assert VWSpec(("gpu0",), layers=(6,)).layout(2).nm == 2
    with pytest.raises(ValueError, match="gives no layers"):
        planned.layout(2)


def test_replica_rows_and_in_flight_fill_are_checked():
    bad_rows = vw([["gpu0", "gpu1"]], [6]).with_stages(rows=[(0, 5)])
    assert "vw[0].stages[0].rows: [0, 5] must rise from 0" in refused([bad_rows])
    good_rows = vw([["gpu0", "gpu1"]], [6]).with_stages(rows=[(0, 3, 8)])
    validate([good_rows], DEVICES, 6)
    overfilled = vw(["gpu0"], [6], limits=[2]).with_stages(in_flight_fill=[3])
    assert "fills 3 forwards past its limit 2" in refused([overfilled])


def test_with_stages_wants_one_value_per_stage():
    with pytest.raises(ValueError, match="1 values for 2 stages"):
        vw(["gpu0", "gpu1"], [3, 3]).with_stages(rows=[()])


@pytest.mark.parametrize("activations", ["keep", "recompute", "swap", "auto"])
def test_a_pinned_policy_covers_every_layer_of_every_stage(activations):
    layout = vw(["gpu0", "gpu1"], [2, 4], recompute=[(1,), ()]).pinned(activations)
    every = [(0, 1), (2, 3, 4, 5)]
    assert [s.recompute for s in layout.stages] == (
        every if activations == "recompute" else [(), ()]
    )
    assert [s.swap for s in layout.stages] == (every if activations == "swap" else [(), ()])
