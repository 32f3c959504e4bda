"""``[[fault]] kind = "slow"``: parsed, checked and applied as a stretched compute."""

from __future__ import annotations

import time
from typing import Any

import pytest

from hetpipe import emulate
from hetpipe.job import FaultSpec, JobError, JobSpec, ReplanSpec, SlowSpec

BASE: dict[str, Any] = {
    "name": "k",
    "model": {"name": "mlp"},
    "data": {},
    "optimizer": {},
    "train": {"minibatch": 4, "minibatches": 9},
}


def job(*faults: dict[str, Any], **extra: Any) -> JobSpec:
    return JobSpec.from_dict({**BASE, "fault": list(faults), **extra}, source="f")


def test_a_slow_fault_is_read_beside_a_stall() -> None:
    spec = job(
        {"vw": 0, "stage": 1, "minibatch": 2, "seconds": 1.0},
        {"kind": "slow", "device": "gpu1", "factor": 3.0, "at_minibatch": 5},
    )
    assert spec.faults == (FaultSpec(0, 1, 2, 1.0),)
    assert spec.slowdowns == (SlowSpec("gpu1", 3.0, 5),)
    again = JobSpec.from_dict(spec.to_dict())  # what travels to the head and the workers
    assert again.faults == spec.faults and again.slowdowns == spec.slowdowns


@pytest.mark.parametrize(
    ("fault", "key", "problem"),
    [
        ({"kind": "slow", "factor": 3.0, "at_minibatch": 5}, "device", "missing"),
        ({"kind": "slow", "device": "g", "factor": 0.5, "at_minibatch": 5}, "factor", "> 1"),
        (
            {"kind": "slow", "device": "g", "factor": 2.0, "at_minibatch": 1, "seconds": 1.0},
            "seconds",
            'no effect with kind "slow"',
        ),
        ({"vw": 0, "stage": 0, "minibatch": 0}, "seconds", "missing"),
        ({"kind": "hot"}, "kind", "unknown fault kind"),
    ],
)
def test_a_fault_missing_or_mixing_its_kind_keys_is_refused(
    fault: dict[str, Any], key: str, problem: str
) -> None:
    with pytest.raises(JobError) as info:
        job(fault)
    assert str(info.value).startswith(f"f: fault[0].{key}: "), info.value
    assert problem in str(info.value)


def test_the_replan_table_defaults_and_round_trips() -> None:
    assert job().replan == ReplanSpec()
    spec = job(replan={"threshold": 2.0, "window": 4, "enabled": False})
    assert spec.replan == ReplanSpec(False, 2.0, 4, ReplanSpec().min_gain)
    assert JobSpec.from_dict(spec.to_dict()).replan == spec.replan
    assert "replan" not in job().to_dict()  # only what differs from the defaults travels


def test_speed_at_divides_from_the_fault_minibatch_on() -> None:
    assert emulate.speed_at(1.0, [(5, 3.0)], 4) == 1.0
    assert emulate.speed_at(1.0, [(5, 3.0)], 5) == pytest.approx(1 / 3)
    assert emulate.speed_at(0.5, [(5, 3.0)], 9) == pytest.approx(0.5 / 3)
    assert emulate.speed_at(0.5, [(1, 2.0), (3, 2.0)], 3) == pytest.approx(0.125)  # compound


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_a_slowed_real_device_sleeps_the_extra_time() -> None:
    """speed 1 (a real device, never padded) under factor 3: the pass takes about 3x its
    work, the extra slept, not computed."""
    started = emulate.mark()
    _spin(0.02)
    cpu_before = time.thread_time()
    took = emulate.pad(started, emulate.speed_at(1.0, [(0, 3.0)], 0), "cpu")
    assert time.thread_time() - cpu_before < 0.02  # slept, not spun
    assert took >= 0.055


def test_a_stage_on_the_slowed_device_computes_slower_from_the_minibatch_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The fault reaches the stage through the task's spec: a single-stage VW of the mlp
    on gpu1 (speed 0.5), slowed 4x from minibatch 3, pads its passes at a quarter of its
    speed from there (how long a pad then takes: the test above); a stage on another
    device is not slowed."""
    import torch

    from hetpipe.config import DeviceSpec
    from hetpipe.core.layout import StageLayout
    from hetpipe.models import build_model
    from hetpipe.stage import StageCompute
    from hetpipe.task import StageTask

    slow = {"kind": "slow", "device": "gpu1", "factor": 4.0, "at_minibatch": 3}
    spec = job(slow)
    n = len(build_model(spec.model))

    def stage(name: str) -> StageCompute:
        task = StageTask.standalone("s", spec.to_dict(), StageLayout((name,), 0, n), minibatches=8)
        compute = StageCompute(task, DeviceSpec(name, "cpu", "m", 1 << 30, 0.5, 0, "n0", "h"))
        state = build_model(spec.model).state_dict()
        names = compute.state_names()
        compute.load({k: state[k] for k in names}, {k: [] for k in names})
        return compute

    other, slowed = stage("gpu2"), stage("gpu1")
    assert other.slowdowns == () and slowed.slowdowns == ((3, 4.0),)
    assert slowed._speed(2) == 0.5 and slowed._speed(3) == pytest.approx(0.125)
    speeds: list[float] = []
    real = emulate.pad
    monkeypatch.setattr(
        emulate, "pad", lambda m, speed, d, *pace: speeds.append(speed) or real(m, 1.0, d, *pace)
    )
    torch.manual_seed(0)
    x, y = torch.randn(4, 1, 8, 8), torch.randint(0, 10, (4,))
    for p in range(5):
        slowed.forward(p, x, y)
        slowed.backward(p, None)
        slowed.step(p)
    # each forward and backward is padded at its minibatch's speed
    assert speeds == [0.5] * 6 + [pytest.approx(0.125)] * 4
