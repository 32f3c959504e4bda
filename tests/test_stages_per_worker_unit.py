"""Several stages per worker, the parts that start no process: the job check of repeated
devices, the split's validation, and the device's memory counted over its stages."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from conftest import job
from helpers import repo_cluster

from hetpipe.config import DeviceSpec
from hetpipe.core.layout import SplitError, StageLayout, VWLayout, validate
from hetpipe.core.memory import MemoryCapError
from hetpipe.core.units import format_size
from hetpipe.job import JobError, JobSpec
from hetpipe.jobplan import device_memory_problem, one_stage_per_device
from hetpipe.models import build_model
from hetpipe.stage import DeviceMemory, StageCompute
from hetpipe.task import StageTask


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


def _whole_mlp(memory: int, where: int) -> StageCompute:
    """The whole mlp as stage 0 of its own virtual worker ``where`` on a device of cap
    ``memory`` (the figure does not matter to a stage that runs in process)."""
    spec = JobSpec.from_dict(job("unit", model="mlp", minibatches=4, nm=1))
    n = len(build_model("mlp"))
    task = StageTask.standalone("unit", spec.to_dict(), StageLayout(("gpu0",), 0, n))
    task = dataclasses.replace(task, vw=where)
    compute = StageCompute(task, DeviceSpec("gpu0", "cpu", "fast", memory, 1.0, 0, "n0", "h"))
    torch.manual_seed(0)
    state = build_model("mlp").state_dict()
    names = compute.state_names()
    compute.load({k: state[k] for k in names}, {k: [] for k in names})
    return compute


def test_stages_on_one_device_are_counted_together_at_run_time() -> None:
    """Each stage alone fits the device; the second one's forward takes the two past the
    cap: refused with one line naming the device (what the worker's stages share)."""
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    alone = _whole_mlp(1 << 30, 0)
    alone.forward(0, x, y)
    peak = alone.memory().total
    shared = DeviceMemory("gpu0", int(peak * 1.5))
    first, second = _whole_mlp(int(peak * 1.5), 0), _whole_mlp(int(peak * 1.5), 1)
    first.device_memory = second.device_memory = shared
    first.forward(0, x, y)
    with pytest.raises(MemoryCapError, match=r"^device gpu0: its 2 stages need .* together >"):
        second.forward(0, x, y)


def test_the_planner_prices_repeated_devices_as_clones() -> None:
    """Each later stage of a repeated device goes to a clone of it (its type, memory, speed
    and node), which the memory check maps back to the device."""
    cluster = repo_cluster()
    parsed = JobSpec.from_dict(spec(["gpu0", "gpu1", "gpu0", "gpu0"], layers=(1, 2, 2, 1)))
    one, clones, home = one_stage_per_device(parsed, cluster)
    assert one.vws[0].devices == ("gpu0", "gpu1", "gpu0#1", "gpu0#2")
    assert not one.several_stages and one.vws[0].layers == (1, 2, 2, 1)
    assert home == {"gpu0": "gpu0", "gpu1": "gpu1", "gpu0#1": "gpu0", "gpu0#2": "gpu0"}
    clone = clones.device("gpu0#2")
    gpu0 = cluster.device("gpu0")
    assert (clone.type, clone.memory, clone.speed, clone.host) == (
        gpu0.type,
        gpu0.memory,
        gpu0.speed,
        gpu0.host,
    )
    validate(one.vws, {d.name for d in clones.devices}, 6)  # one stage per device now
    cap = gpu0.memory
    fits = [("vw0/stage0", "gpu0", cap // 2), ("vw0/stage1", "gpu1", cap), ("s2", "gpu0#1", 1)]
    assert device_memory_problem(fits, home, cluster) is None
    over = [*fits, ("vw0/stage3", "gpu0#2", cap // 2)]
    line = device_memory_problem(over, home, cluster)
    assert line is not None and line.startswith("device gpu0: its 3 stages need ")
    assert f"> memory cap {format_size(cap)} (predicted peaks: vw0/stage0 " in line


def test_no_replicated_stage_beside_a_repeated_device() -> None:
    with pytest.raises(JobError, match=r"vw\[0\] repeats a device: its stages are not replicated"):
        JobSpec.from_dict(spec(["a", ["b", "c"], "a"], layers=(2, 2, 2)))
