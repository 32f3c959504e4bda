"""Several stages per worker, the parts that start no process: the job check of repeated
devices, the split's validation, and the device's memory counted over its stages."""

from __future__ import annotations

from typing import Any

import pytest
from conftest import job

from hetpipe.core.layout import SplitError, StageLayout, VWLayout, validate
from hetpipe.core.memory import MemoryCapError
from hetpipe.job import JobError, JobSpec
from hetpipe.stage import DeviceMemory


def spec(devices: list, layers: list | None = (1, 2, 2, 1), **train: Any) -> dict[str, Any]:
    out = job("t", model="mlp", train={"several_stages": True, **train})
    out["vw"] = [{"devices": devices, **({"layers": list(layers)} if layers else {})}]
    return out


def test_repeated_devices_are_taken_with_several_stages() -> None:
    for devices in (["a"] * 4, ["a", "b", "a", "b"]):
        parsed = JobSpec.from_dict(spec(devices))
        assert parsed.several_stages and parsed.vws[0].devices == tuple(devices)
        assert JobSpec.from_dict(parsed.to_dict()) == parsed


@pytest.mark.parametrize(
    ("changes", "problem"),
    [
        ({"several_stages": False}, "duplicate device 'a' (a device runs one stage unless "),
        ({"schedule": "auto"}, "train.schedule: auto"),
        ({"activations": "auto"}, "train.activations: auto is the planner's choice"),
        ({"on_worker_loss": "reform"}, "train.on_worker_loss: 'reform' is not supported"),
        ({"on_worker_loss": "replan"}, "train.on_worker_loss: 'replan' is not supported"),
    ],
)
def test_what_is_not_supported_is_one_line(changes: dict[str, Any], problem: str) -> None:
    with pytest.raises(JobError) as err:
        JobSpec.from_dict(spec(["a", "b", "a", "b"], **changes))
    assert problem in str(err.value) and "\n" not in str(err.value)


def test_a_repeated_device_needs_layers_and_no_replicas() -> None:
    with pytest.raises(JobError, match="give its layers"):
        JobSpec.from_dict(spec(["a", "a"], layers=None))
    with pytest.raises(JobError, match="a replicated stage's device runs that stage only"):
        JobSpec.from_dict(spec(["a", ["b", "a"]], layers=(3, 3)))


def _vw(devices: list[str], counts: list[int]) -> VWLayout:
    return VWLayout.from_counts([(d,) for d in devices], counts, 1)


def test_validate_takes_a_repeated_device_only_when_asked() -> None:
    split = [_vw(["a", "b", "a"], [2, 2, 2])]
    with pytest.raises(SplitError, match="already in this vw"):
        validate(split, {"a", "b"}, 6)
    validate(split, {"a", "b"}, 6, several=True)
    two = [_vw(["a"], [6]), _vw(["a"], [6])]
    with pytest.raises(SplitError, match=r"already in vw\[0\]"):  # never across VWs
        validate(two, {"a"}, 6, several=True)
    assert isinstance(split[0].stages[0], StageLayout)


def test_device_memory_holds_for_its_stages_together() -> None:
    mem = DeviceMemory("gpu0", 1000)
    mem.check("vw0/stage0", 600)
    mem.check("vw0/stage0", 400)  # a stage's count now replaces its count before
    mem.check("vw0/stage1", 500)
    assert mem.peak == 900
    with pytest.raises(MemoryCapError) as err:
        mem.check("vw0/stage2", 200)
    line = str(err.value)
    assert line.startswith("device gpu0: its 3 stages need 1.1KiB together > memory cap")
    assert "vw0/stage0 400" in line or "vw0/stage0 400B" in line, line
    mem.leave("vw0/stage2")
    mem.leave("vw0/stage1")
    mem.check("vw0/stage0", 1000)  # alone it is the stage's own check, not this one's
