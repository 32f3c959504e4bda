"""``hetpipe schedule``: synchronous orders to and from ``torch.distributed.pipelining``'s CSV.

- ``export``: a job's per-stage orders (its ``train.order``, else its schedule's own), or a
  kind's for ``-k`` stages and ``-m`` microbatches, as torch's compute-only CSV; a
  device-level kind (``interleaved-1f1b``, ``zbv``) one row per device (``-d`` devices, else
  the job's split's, else two stages a device), as torch's ranks run it;
- ``import``: a CSV (torch's, either format) read as hetpipe orders, printed, checked and
  written back as the compute-only CSV a job names in ``train.order``;
- ``check``: the dry run of a CSV's or a job's orders
  (:func:`hetpipe.core.schedule_csv.check_schedule`); exit 1 with its one-line reason.

None of them talks to a cluster: the group reads files only. Refusals are one line
(``click.ClickException``, exit 1).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import click

from hetpipe.core import devschedule, schedule_csv
from hetpipe.core.schedule import (
    DEVICE_KINDS,
    SYNC_KINDS,
    SYNCHRONOUS,
    ScheduleError,
    check_order,
    max_in_flight,
    microbatch_order,
)

if TYPE_CHECKING:
    from hetpipe.job import JobSpec

__all__ = ["schedule"]

Orders = tuple[schedule_csv.Order, ...]


@click.group()
def schedule() -> None:
    """Synchronous schedules in torch.distributed.pipelining's CSV format, and their dry run."""


def _load_job(job_file: str) -> JobSpec:
    from hetpipe.job import JobError, load_job

    try:
        return load_job(job_file)
    except JobError as exc:
        raise click.ClickException(str(exc)) from None


def _job_orders(
    spec: JobSpec,
    source: str,
    kind: str | None = None,
    stages: int | None = None,
    micro: int | None = None,
    warmup: int | None = None,
) -> Orders:
    """A job's orders of its first virtual worker (its ``train.order``, else its schedule's
    own), or those of the kind, stages, microbatches and warm-up given over the job's."""
    if spec.order is not None and all(v is None for v in (kind, stages, micro, warmup)):
        return spec.order
    kind = kind or spec.schedule
    if kind not in SYNC_KINDS:
        raise click.ClickException(
            f"{source}: train.schedule: {kind!r} has no fixed order (give --kind gpipe or 1f1b)"
        )
    vw = spec.vws[0] if spec.vws else None
    stages = stages or (len(vw.devices) if vw is not None else None)
    micro = micro or (vw.nm if vw is not None else None) or spec.nm
    if stages is None or micro is None:
        raise click.ClickException(
            f"{source}: the planner picks its stages or microbatches; give -k and -m"
        )
    if warmup is None:
        warmup = (spec.warmup_forwards or 0) if kind == "1f1b" else 0
    return _kind_orders(kind, stages, micro, warmup)


def _kind_orders(kind: str, k: int, m: int, warmup: int) -> Orders:
    try:
        return tuple(microbatch_order(kind, k, s, m, warmup) for s in range(k))
    except ScheduleError as exc:
        raise click.ClickException(str(exc)) from None


def _read(path: str) -> Orders:
    try:
        return schedule_csv.load(path)
    except schedule_csv.ScheduleCsvError as exc:
        raise click.ClickException(str(exc)) from None


def _emit(text: str, out: str | None) -> None:
    if out is None:
        click.echo(text, nl=False)
        return
    try:
        Path(out).write_text(text, encoding="utf-8", newline="")
    except OSError as exc:
        raise click.ClickException(f"{out}: cannot write ({exc.strerror or exc})") from None
    click.echo(f"wrote {out}", err=True)


def _device_text(
    kind: str,
    spec: JobSpec | None,
    stages: int | None,
    micro: int | None,
    devices: int | None,
) -> str:
    """A device-level kind's orders as torch's CSV, one row per device: the job's first
    virtual worker's stages, microbatches and distinct devices where given, else ``-k``,
    ``-m`` and ``-d`` (default: two stages a device)."""
    vw = spec.vws[0] if spec is not None and spec.vws else None
    k = stages or (len(vw.devices) if vw is not None else None)
    m = micro or (vw.nm if vw is not None else None) or (spec.nm if spec is not None else None)
    if k is None or m is None:
        raise click.ClickException(f"{kind}: give -k (stages) and -m (microbatches)")
    if devices is None and vw is not None and stages is None:
        devices = len(set(vw.devices))
    try:
        D = devices if devices is not None else devschedule.default_devices(kind, k)
        return schedule_csv.dumps_devices(devschedule.device_orders(kind, k, D, m))
    except ScheduleError as exc:
        raise click.ClickException(str(exc)) from None


@schedule.command("export")
@click.argument("job_file", required=False, type=click.Path(dir_okay=False))
@click.option("--kind", type=click.Choice(SYNCHRONOUS), help="The schedule (default: the job's).")
@click.option("-k", "stages", type=click.IntRange(1), help="Stages (default: the job's).")
@click.option("-m", "micro", type=click.IntRange(1), help="Microbatches per iteration.")
@click.option("--warmup", type=click.IntRange(0), help="1f1b's extra warm-up forwards.")
@click.option(
    "-d",
    "devices",
    type=click.IntRange(1),
    help="Devices (torch's ranks) of a device-level kind (default: the job's, else k / 2).",
)
@click.option("-o", "out", type=click.Path(dir_okay=False), help="Write here, not stdout.")
def export(
    job_file: str | None,
    kind: str | None,
    stages: int | None,
    micro: int | None,
    warmup: int | None,
    devices: int | None,
    out: str | None,
) -> None:
    """Write a job's orders, or KIND's for -k stages and -m microbatches, as torch's CSV
    (one row per stage: 0F0,0F1,0B0,...), which torch's _load_csv reads; a device-level
    kind (interleaved-1f1b, zbv) one row per device, as torch's ranks run it."""
    if warmup and kind not in (None, "1f1b"):
        raise click.UsageError(f"--warmup is 1f1b's extra warm-up; {kind} has none")
    spec = _load_job(job_file) if job_file is not None else None
    chosen = kind or (spec.schedule if spec is not None else None)
    if chosen in DEVICE_KINDS:
        if spec is None and (stages is None or micro is None):
            raise click.UsageError("give a job file, or -k (stages) and -m (microbatches)")
        _emit(_device_text(chosen, spec, stages, micro, devices), out)
        return
    if devices is not None:
        raise click.UsageError(f"-d is a device-level kind's ({', '.join(DEVICE_KINDS)})")
    if job_file is not None:
        assert spec is not None
        orders = _job_orders(spec, job_file, kind, stages, micro, warmup)
    elif stages is None or micro is None:
        raise click.UsageError("give a job file, or -k (stages) and -m (microbatches)")
    else:
        orders = _kind_orders(kind or "1f1b", stages, micro, warmup or 0)
    _emit(schedule_csv.dumps(orders), out)


def _describe(orders: Orders, m: int) -> list[str]:
    """What hetpipe makes of the orders: which of its own they equal, and the schedule and
    warm-up whose memory charge holds them."""
    k = len(orders)
    lines = [f"{k} stages, {m} microbatches per iteration"]
    for kind in SYNC_KINDS:
        for w in range(m if kind == "1f1b" else 1):
            if orders == tuple(microbatch_order(kind, k, s, m, w) for s in range(k)):
                lines.append(f"equals hetpipe's {kind}" + (f" with {w} warm-up" if w else ""))
    need = max(schedule_csv.held(o) - (k - s) for s, o in enumerate(orders))
    if all(
        max_in_flight("1f1b", k, s, m, warmup=0) >= schedule_csv.held(o)
        for s, o in enumerate(orders)
    ):
        lines.append("runs under schedule 1f1b (or gpipe)")
    else:
        lines.append(
            f"runs under schedule 1f1b with train.warmup_forwards = {need}, or schedule gpipe"
        )
    return lines


def _checked(orders: Orders, m: int) -> None:
    """Refuse orders the dry run or the runtime's own check of an order refuses."""
    run = schedule_csv.check_schedule(orders, m)
    if not run.ok:
        raise click.ClickException(f"dry run: {run.reason}")
    for s, order in enumerate(orders):
        try:
            check_order(order, m)
        except ScheduleError as exc:
            raise click.ClickException(f"stage {s}: {exc}") from None


@schedule.command("import")
@click.argument("csv_file", type=click.Path(dir_okay=False))
@click.option(
    "-o",
    "out",
    type=click.Path(dir_okay=False),
    help="Write the orders here as the compute-only CSV a job names in train.order.",
)
def import_(csv_file: str, out: str | None) -> None:
    """Read torch's CSV (compute-only or with communication): print each stage's order,
    check it, and with -o write it for a job's train.order."""
    orders = _read(csv_file)
    m = schedule_csv.microbatches(orders)
    for s, order in enumerate(orders):
        click.echo(f"stage {s}: {' '.join(f'{op}{p}' for op, p in order)}")
    _checked(orders, m)
    for line in _describe(orders, m):
        click.echo(line)
    if out is not None:
        _emit(schedule_csv.dumps(orders), out)
        click.echo(f'in the job file: [train] order = "{out}" (relative to the job file)')


@schedule.command("check")
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("-m", "micro", type=click.IntRange(1), help="Microbatches per iteration.")
def check(file: str, micro: int | None) -> None:
    """Dry-run a CSV's or a job file's (.toml) orders: exit 1 naming the first action that
    can never run, or a microbatch a stage misses or runs twice."""
    orders = _job_orders(_load_job(file), file) if file.endswith(".toml") else _read(file)
    m = micro or schedule_csv.microbatches(orders)
    _checked(orders, m)
    click.echo(f"ok: {len(orders)} stages, {m} microbatches, every action runs")
