"""A schedule exported by torch runs here transparently: a synchronous job whose
``train.order`` is the CSV ``torch.distributed.pipelining`` writes for its 1F1B trains the
same weights as plain PyTorch on the union of each iteration's microbatches, and every stage
runs the imported order."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import assert_same_weights, job
from helpers import plain_training, stages_json

from hetpipe.core.schedule import microbatch_order
from hetpipe.core.schedule_csv import load

pytestmark = pytest.mark.slow

M = 4
ITERATIONS = 20


def torch_1f1b_csv(k: int, m: int, path: Path) -> Path:
    """torch's 1F1B for k ranks of one stage each (its interleaved schedule with one chunk,
    whose ``_dump_csv`` writes compute and communication), as torch writes it."""
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B

    stage = SimpleNamespace(num_stages=k, group_size=k, group_rank=0, stage_index=0)
    ScheduleInterleaved1F1B([stage], m, loss_fn=lambda out, target: out)._dump_csv(str(path))
    return path


@pytest.mark.timeout(240)
def test_a_torch_exported_1f1b_trains_like_plain_pytorch(uniform_cluster, tmp_path) -> None:
    k = 4
    csv = torch_1f1b_csv(k, M, tmp_path / "torch_1f1b.csv")
    assert "SEND_F" in csv.read_text()  # torch's own file, communication included
    orders = load(csv)
    assert orders != tuple(microbatch_order("1f1b", k, s, M) for s in range(k))  # its own
    spec = job(
        "torch-1f1b",
        model="mlp",
        split=[(["gpu0", "gpu1", "gpu2", "gpu3"], [1, 2, 2, 1])],
        nm=M,
        minibatches=M * ITERATIONS,
        # torch warms each stage up as far as the next one lets it: one more forward in
        # flight than 1F1B as published charges, said by warmup_forwards
        train={"schedule": "1f1b", "order": str(csv), "warmup_forwards": 1},
    )
    info = uniform_cluster.submit(spec)
    assert info["state"] == "done", info.get("error")
    assert_same_weights(
        torch.load(info["model_path"]), plain_training(spec, ITERATIONS, m=M, vws=1)
    )
    for where, r in stages_json(info).items():  # each iteration in the imported order
        stage = int(where.split("stage")[1])
        spans = [x for x in r["stats"]["spans"] if x[0] in ("forward", "backward")]
        for i in (0, ITERATIONS - 1):
            ran = sorted((x for x in spans if x[3] // M == i), key=lambda x: x[1])
            got = [("F" if x[0] == "forward" else "B", x[3] - i * M) for x in ran]
            assert got == list(orders[stage]), (where, i)
