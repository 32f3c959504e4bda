"""A stage's measured peak memory (every host allocation it makes, :mod:`hetpipe.memprobe`)
against the memory model's prediction (:func:`hetpipe.core.memory.stage_memory_of`), for the
builtin mlp split in two, M = 4, under 1f1b and zb-h1, and stages of it split in four."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import job

from hetpipe import memprobe
from hetpipe.core.memory import stage_memory_of
from hetpipe.core.profile import ModelProfile
from hetpipe.data import MinibatchStream, load_dataset
from hetpipe.job import JobSpec
from hetpipe.measure import measure_layers
from hetpipe.models import build_model
from hetpipe.optim import StageOptimizer

M = 4
CUTS = (0, 3, 6)


def test_the_trace_counts_what_is_allocated_inside_it_at_its_peak() -> None:
    before = torch.zeros(1 << 16)  # allocated before the trace: never counted, even freed
    with memprobe.AllocationTrace() as trace:
        kept = torch.zeros(1000, dtype=torch.uint8)
        transient = torch.zeros(5000, dtype=torch.uint8)
        del transient
        trace.mark()
        other = torch.zeros(3000, dtype=torch.uint8)
        del before, other
    assert trace.peak() == 1000 + 3000
    assert trace.final() == 1000
    assert kept.numel() == 1000


@pytest.fixture(scope="module")
def setup() -> dict[str, Any]:
    torch.manual_seed(0)
    net = build_model("mlp")
    state = {n: t.detach().clone() for n, t in net.state_dict().items()}
    stream = MinibatchStream(load_dataset("digits"), 32, 0, 0, 1)
    batches = [stream.batch(j) for j in range(M)]
    x = batches[0][0]
    layers = measure_layers(build_model("mlp"), x, repeats=2, warmup=1)
    profile = ModelProfile("mlp", 32, x.numel() * x.element_size(), {"cpu": layers})
    return {"state": state, "batches": batches, "profile": profile}


def spec_of(kind: str) -> JobSpec:
    return JobSpec.from_dict(
        job(
            "measured",
            model="mlp",
            nm=M,
            minibatches=2 * M,
            split=[(["gpu0", "gpu1"], [CUTS[1], CUTS[2] - CUTS[1]])],
            train={"schedule": kind},
        )
    )


@pytest.mark.parametrize(
    ("kind", "stage"),
    [
        ("1f1b", 0),
        ("1f1b", 1),
        ("zb-h1", 0),
        ("zb-h1", 1),
    ],
)
def test_measured_peak_within_ten_percent_of_the_model(
    setup: dict[str, Any], kind: str, stage: int
) -> None:
    spec = spec_of(kind)
    rec = memprobe.record(spec, CUTS, setup["batches"], setup["state"])
    got = memprobe.stage_peak(spec, CUTS, stage, rec, setup["state"]).peak
    factor = StageOptimizer.state_factor(spec.optimizer)
    want = stage_memory_of(
        setup["profile"], "cpu", (CUTS[stage], CUTS[stage + 1]), stage, 2, M, factor, kind
    ).total
    assert abs(got - want) / got <= 0.10, (kind, stage, got, want)


def four_stages(devices: list[str], train: dict[str, Any]) -> JobSpec:
    """The mlp as four stages of 2, 1, 1 and 2 layers on ``devices``."""
    return JobSpec.from_dict(
        job(
            "measured",
            model="mlp",
            nm=M,
            minibatches=2 * M,
            split=[(devices, [2, 1, 1, 2])],
            train=train,
        )
    )


def test_a_device_runs_its_stages_together_within_their_peaks_alone(
    setup: dict[str, Any],
) -> None:
    """zbv on four stages: the V places stages 0 and 3 on device 0, 1 and 2 on device 1; a
    device's stages run together never hold more than their peaks alone added."""
    cuts = (0, 2, 3, 4, 6)
    spec = four_stages(
        ["gpu0", "gpu1", "gpu1", "gpu0"], {"schedule": "zbv", "several_stages": True}
    )
    rec = memprobe.record(spec, cuts, setup["batches"], setup["state"])
    alone = [memprobe.stage_peak(spec, cuts, s, rec, setup["state"]).peak for s in range(4)]
    for device, want in ((0, (0, 3)), (1, (1, 2))):
        mine, got = memprobe.device_peak(spec, cuts, device, rec, setup["state"])
        assert mine == want
        assert max(alone[s] for s in mine) <= got.peak <= sum(alone[s] for s in mine)


@pytest.mark.parametrize(
    ("kind", "devices"),
    [("zb-h1", ["gpu0", "gpu1", "gpu2", "gpu3"]), ("zbv", ["gpu0", "gpu1", "gpu1", "gpu0"])],
)
def test_a_stage_without_weights_under_a_split_backward_is_predicted_to_the_byte(
    setup: dict[str, Any], kind: str, devices: list[str]
) -> None:
    """The mlp's ReLU alone (stage 1 of four): its input half keeps nothing for a weight
    half that has nothing to differentiate (no output gradient), and the model charges its
    held microbatches and its backward's working peak only."""
    cuts = (0, 2, 3, 4, 6)
    train: dict[str, Any] = {"schedule": kind}
    if kind == "zbv":
        train["several_stages"] = True
    spec = four_stages(devices, train)
    rec = memprobe.record(spec, cuts, setup["batches"], setup["state"])
    got = memprobe.stage_peak(spec, cuts, 1, rec, setup["state"]).peak
    want = stage_memory_of(setup["profile"], "cpu", (2, 3), 1, 4, M, 1, kind)
    assert want.accumulators == 0 and want.params == 0
    assert got == want.total, (got, want)


def test_the_measured_iteration_runs_beside_the_update_held_until_its_push(
    setup: dict[str, Any],
) -> None:
    """A virtual worker alone carries its update into the next iteration's until the last
    one's push, so the measured iteration of a stage of one Linear (the mlp's second of
    four under 1f1b) peaks at its step: weights, momentum, the mean gradient, the new
    weights, the update and the update held, six parameter-sized tensors to the byte."""
    cuts = (0, 2, 3, 4, 6)
    spec = four_stages(["gpu0", "gpu1", "gpu2", "gpu3"], {"schedule": "1f1b"})
    rec = memprobe.record(spec, cuts, setup["batches"], setup["state"])
    got = memprobe.stage_peak(spec, cuts, 2, rec, setup["state"])
    params = setup["profile"].layers["cpu"][3].param_bytes
    assert got.peak == 6 * params
    assert got.peak == stage_memory_of(setup["profile"], "cpu", (3, 4), 2, 4, M, 1, "1f1b").total
