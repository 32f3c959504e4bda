"""The memory of a job whose devices run several stages under a device-level schedule
(``interleaved-1f1b``, ``zbv``): priced with its real device count D, not two stages a
device, so the head's memory check and the figures it keeps follow the job's own orders."""

from __future__ import annotations

import dataclasses
from typing import Any

from conftest import job
from helpers import profile16, repo_cluster

from hetpipe.core.devschedule import stage_order
from hetpipe.core.schedule import held_peak, max_in_flight
from hetpipe.job import JobSpec
from hetpipe.jobplan import (
    chunk_devices,
    device_memory_problem,
    one_stage_per_device,
    several_stage_summary,
)
from hetpipe.profiling import plan_for, predicted_summary

KIND = "interleaved-1f1b"
SIX = ["gpu1", "gpu2"] * 3  # 6 stages on 2 devices, 3 chunks each (round robin)
LAYERS = [3, 3, 3, 3, 2, 2]


def several(devices: list[str], layers: list[int], nm: int, kind: str = KIND) -> JobSpec:
    d: dict[str, Any] = job("m", model="mlp", nm=nm, minibatches=nm * 2)
    d["train"].update(several_stages=True, schedule=kind)
    d["vw"] = [{"devices": devices, "layers": layers}]
    return JobSpec.from_dict(d)


def priced(spec: JobSpec, cluster: Any, devices: int | None) -> tuple[Any, dict[str, str]]:
    """The head's pricing of a several-stage split (:meth:`JobManager._check_several`)."""
    one, clones, home = one_stage_per_device(spec, cluster)
    plan = plan_for(one, clones, profile16(), n_train=10_000, chunk_devices=devices)
    return plan, home


def test_the_device_count_is_the_virtual_workers_distinct_devices() -> None:
    assert chunk_devices(several(SIX, LAYERS, 6)) == 2
    assert chunk_devices(several(["gpu1", "gpu2", "gpu2", "gpu1"], [4, 4, 4, 4], 4, "zbv")) == 2
    spread = JobSpec.from_dict(job("m", model="mlp", split=[(["gpu1", "gpu2"], [3, 3])]))
    assert chunk_devices(spread) is None  # no device repeats


def test_six_interleaved_stages_on_two_devices_are_priced_with_two_devices() -> None:
    """3 chunks a device: each stage charged what its projection of its device's order on
    D = 2 devices holds; two stages a device (D = 3) would charge more."""
    spec = several(SIX, LAYERS, 6)
    plan, _ = priced(spec, repo_cluster(), chunk_devices(spec))
    want = [held_peak(stage_order(KIND, 6, 2, s, 6)) for s in range(6)]
    assert want == [max_in_flight(KIND, 6, s, 6, devices=2) for s in range(6)]
    got = [st.in_flight for st in plan.vws[0].stages]
    assert got == [st.expected_in_flight for st in plan.vws[0].stages] == want
    assert plan.details["orders"]["0"] == [f"{op}{j}" for op, j in stage_order(KIND, 6, 2, 0, 6)]
    default, _ = priced(spec, repo_cluster(), None)
    assert [st.in_flight for st in default.vws[0].stages] != want  # D = 3's counts
    assert sum(st.memory.total for st in plan.vws[0].stages) < sum(
        st.memory.total for st in default.vws[0].stages
    )


def _with_memory(cluster: Any, caps: dict[str, int]) -> Any:
    nodes = tuple(
        dataclasses.replace(
            n,
            devices=tuple(
                dataclasses.replace(d, memory=caps.get(d.name, d.memory)) for d in n.devices
            ),
        )
        for n in cluster.nodes
    )
    return dataclasses.replace(cluster, nodes=nodes)


def _per_device(plan: Any, home: dict[str, str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for st in plan.vws[0].stages:
        out[home[st.device]] = out.get(home[st.device], 0) + int(st.memory.total)
    return out


def _stages(plan: Any) -> list[tuple[str, str, int]]:
    return [
        (f"vw0/stage{s}", st.device, int(st.memory.total))
        for s, st in enumerate(plan.vws[0].stages)
    ]


def test_the_memory_check_follows_the_real_device_count() -> None:
    """A cap between what the stages hold together on 2 devices and what two stages a
    device would charge: the job is accepted, where pricing it with D = 3 refuses it."""
    spec = several(SIX, LAYERS, 6)
    base = repo_cluster()
    real, home = priced(spec, base, 2)
    default, _ = priced(spec, base, None)
    need, over = _per_device(real, home), _per_device(default, home)
    assert all(need[d] < over[d] for d in need)
    caps = {d: (need[d] + over[d]) // 2 for d in need}
    cluster = _with_memory(base, caps)
    real, home = priced(spec, cluster, chunk_devices(spec))
    assert device_memory_problem(_stages(real), home, cluster) is None
    default, _ = priced(spec, cluster, None)
    line = device_memory_problem(_stages(default), home, cluster)
    assert line is not None and line.startswith("device gpu") and "its 3 stages need" in line
    tight = _with_memory(base, {d: need[d] - 1 for d in need})
    real, home = priced(spec, tight, chunk_devices(spec))
    assert device_memory_problem(_stages(real), home, tight) is not None


def test_the_kept_figures_name_each_stages_own_device() -> None:
    """What the head keeps of a several-stage split's plan: every stage's memory, on the
    device it runs on, and a warning that its times are each stage's alone."""
    spec = several(SIX, LAYERS, 6)
    plan, home = priced(spec, repo_cluster(), chunk_devices(spec))
    kept = several_stage_summary(predicted_summary(plan), home)
    stages = kept["vws"][0]["stages"]
    assert [s["device"] for s in stages] == SIX
    assert [s["memory"] for s in stages] == [st.memory.total for st in plan.vws[0].stages]
    assert [s["in_flight"] for s in stages] == [
        max_in_flight(KIND, 6, s, 6, devices=2) for s in range(6)
    ]
    assert "several stages a device" in kept["warnings"][-1]


def test_an_interleaved_split_whose_m_fits_its_devices_only_is_simulated() -> None:
    """6 stages on 2 devices at m = 4: a multiple of D = 2, not of two stages a device's
    D = 3. The prediction simulates each stage's projection on the job's own D."""
    spec = several(SIX, LAYERS, 4)
    plan, _ = priced(spec, repo_cluster(), chunk_devices(spec))
    assert plan.samples_per_s > 0 and plan.iteration_s > 0
    assert plan.details["orders"]["0"] == [f"{op}{j}" for op, j in stage_order(KIND, 6, 2, 0, 4)]
