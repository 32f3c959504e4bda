"""Device-level schedules in torch's CSV: ``interleaved-1f1b`` and ``zbv`` exported one row
per device (torch's rank), each action naming its stage as torch numbers them, equal to what
torch's own ``_dump_csv`` writes for ``ScheduleInterleaved1F1B`` and
``ScheduleZBVZeroBubble`` (less its idle cells)."""

from __future__ import annotations

import csv
import io
from pathlib import Path
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from hetpipe.cli import main
from hetpipe.core.devschedule import device_orders
from hetpipe.core.schedule import ScheduleError
from hetpipe.core.schedule_csv import device_rows, dumps_devices

torch = pytest.importorskip("torch")
torch_schedules = pytest.importorskip("torch.distributed.pipelining.schedules")


def loss(out: object, target: object) -> object:
    return out


def torch_rows(kind: str, k: int, D: int, m: int, path: Path) -> list[list[str]]:
    """torch's schedule of ``kind`` for k stages on D ranks, written by its ``_dump_csv``,
    each row's idle cells dropped. Made from rank 0's stages (the schedule makes every
    rank's order; no process group needed)."""
    held = [0, k - 1] if kind == "zbv" else list(range(0, k, D))
    stages = [
        SimpleNamespace(
            num_stages=k, group_size=D, group_rank=0, stage_index=s, submod=torch.nn.Identity()
        )
        for s in held
    ]
    cls = (
        torch_schedules.ScheduleZBVZeroBubble
        if kind == "zbv"
        else torch_schedules.ScheduleInterleaved1F1B
    )
    sched = cls(stages, m, loss_fn=loss)
    sched._dump_csv(str(path), format="compute_only")
    table = list(csv.reader(io.StringIO(path.read_text())))
    while table and not any(table[-1]):
        table.pop()
    return [[c for c in row if c] for row in table]


CASES = [
    ("interleaved-1f1b", k, D, m)
    for D in (1, 2, 3)
    for v in (2, 3)
    for k in (v * D,)
    for m in (D, 2 * D, 4 if 4 % D == 0 else 3 * D)
] + [("zbv", 2 * D, D, m) for D in (1, 2, 3) for m in (1, 2, 4, 5)]


@pytest.mark.parametrize(("kind", "k", "D", "m"), CASES)
def test_our_export_equals_torchs_dump(kind: str, k: int, D: int, m: int, tmp_path: Path) -> None:
    ours = device_rows(device_orders(kind, k, D, m))
    assert ours == torch_rows(kind, k, D, m, tmp_path / "torch.csv")
    assert len(ours) == D


def test_the_csv_is_one_row_per_device() -> None:
    assert dumps_devices(device_orders("interleaved-1f1b", 4, 2, 2)) == (
        "0F0,0F1,2F0,2F1,2B0,2B1,0B0,0B1\r\n1F0,1F1,3F0,3B0,3F1,3B1,1B0,1B1\r\n"
    )
    with pytest.raises(ScheduleError, match="device 0, stage 0: 'X' is not an action"):
        device_rows([[(0, "X", 0)]])


def run(*args: str):  # type: ignore[no-untyped-def]
    return CliRunner().invoke(main, ["schedule", "export", *args])


def test_export_a_device_kind(tmp_path: Path) -> None:
    r = run("--kind", "interleaved-1f1b", "-k", "6", "-m", "4", "-d", "2")
    assert r.exit_code == 0, r.output
    want = dumps_devices(device_orders("interleaved-1f1b", 6, 2, 4))
    assert r.output.splitlines() == want.splitlines()
    r = run("--kind", "zbv", "-k", "4", "-m", "4")  # two stages a device: zbv's only shape
    assert r.exit_code == 0, r.output
    assert r.output.splitlines() == dumps_devices(device_orders("zbv", 4, 2, 4)).splitlines()
    assert r.output.splitlines() == [
        ",".join(row) for row in torch_rows("zbv", 4, 2, 4, tmp_path / "t.csv")
    ]


def test_export_a_jobs_device_schedule_from_its_split(tmp_path: Path) -> None:
    job = tmp_path / "job.toml"
    job.write_text(
        'name = "chunks"\n[model]\nname = "mlp"\n[train]\nminibatch = 8\nnm = 4\n'
        'minibatches = 8\nschedule = "interleaved-1f1b"\nseveral_stages = true\n'
        '[[vw]]\ndevices = ["gpu0", "gpu1", "gpu0", "gpu1", "gpu0", "gpu1"]\n'
        "layers = [1, 1, 1, 1, 1, 1]\n"
    )
    r = run(str(job))
    assert r.exit_code == 0, r.output
    want = dumps_devices(device_orders("interleaved-1f1b", 6, 2, 4))
    assert r.output.splitlines() == want.splitlines()
    out = tmp_path / "o.csv"
    assert run(str(job), "-o", str(out)).exit_code == 0
    assert out.read_bytes() == want.encode()


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--kind", "interleaved-1f1b", "-k", "6", "-m", "3", "-d", "2"], "multiple of the"),
        (["--kind", "zbv", "-k", "6", "-m", "4", "-d", "2"], "zbv: needs k = 2 D"),
        (["--kind", "1f1b", "-k", "4", "-m", "4", "-d", "2"], "-d is a device-level kind's"),
        (["--kind", "zbv", "-k", "4"], "give a job file, or -k"),
    ],
)
def test_what_cannot_be_exported_is_refused_in_one_line(args: list[str], says: str) -> None:
    r = run(*args)
    assert r.exit_code != 0 and says in r.output, r.output
