"""Portable schedules (:mod:`hetpipe.core.schedule_csv`): our orders in torch's CSV action
format and back, torch's own exports read as our orders, the dry run's deadlock and coverage
lines, and ``train.order`` in a job."""

from __future__ import annotations

import copy
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import job

from hetpipe.core.schedule import microbatch_order
from hetpipe.core.schedule_csv import (
    ScheduleCsvError,
    check_schedule,
    dumps,
    held,
    job_order_problem,
    load,
    loads,
    microbatches,
    order_value,
)
from hetpipe.job import JobError, JobSpec, load_job

torch = pytest.importorskip("torch")
torch_schedules = pytest.importorskip("torch.distributed.pipelining.schedules")


def ours(kind: str, k: int, m: int, warmup: int = 0) -> tuple:
    return tuple(microbatch_order(kind, k, s, m, warmup) for s in range(k))


def torch_stage(k: int) -> SimpleNamespace:
    """What torch's schedules read of their (first) stage to make the whole pipeline's order:
    rank 0 of k ranks, one stage each. Making the order needs no process group."""
    return SimpleNamespace(
        num_stages=k, group_size=k, group_rank=0, stage_index=0, submod=torch.nn.Identity()
    )


def torch_csv(schedule: object, path: Path, **kw: object) -> str:
    """The schedule written by torch's own ``_dump_csv`` (a single-stage schedule has none
    of its own: the multi-stage one's writes its ``pipeline_order`` the same way)."""
    dump = getattr(schedule, "_dump_csv", None)
    if dump is None:
        torch_schedules.PipelineScheduleMulti._dump_csv(schedule, str(path))
    else:
        dump(str(path), **kw)
    return path.read_text()


def loss(out: object, target: object) -> object:
    return out


# -- round trips ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("m", [1, 3, 8])
def test_our_orders_round_trip_and_pass_the_dry_run(kind: str, k: int, m: int) -> None:
    for warmup in [0, 2] if kind == "1f1b" else [0]:
        orders = ours(kind, k, m, warmup)
        assert loads(dumps(orders)) == orders
        assert microbatches(orders) == m
        run = check_schedule(orders, m)
        assert run.ok and run.reason is None, run


def test_the_csv_is_torchs_action_format() -> None:
    assert dumps(ours("1f1b", 2, 2)) == "0F0,0F1,0B0,0B1\r\n1F0,1B0,1F1,1B1\r\n"
    assert dumps([[("F", 0), ("I", 0), ("W", 0)]]) == "0F0,0I0,0W0\r\n"


@pytest.mark.parametrize(("kind", "k", "m"), [("1f1b", 4, 8), ("gpipe", 3, 5), ("1f1b", 2, 2)])
def test_torch_reads_and_validates_our_export(kind: str, k: int, m: int, tmp_path: Path) -> None:
    """Ours runs there: torch's ``_load_csv`` takes our file, checks it and adds its
    communication."""
    path = tmp_path / "ours.csv"
    path.write_text(dumps(ours(kind, k, m)), newline="")
    sched = torch_schedules._PipelineScheduleRuntime([torch_stage(k)], m, loss_fn=loss)
    sched._load_csv(str(path))
    got = {r: [str(a) for a in acts if a is not None] for r, acts in sched.pipeline_order.items()}
    assert got == {s: [f"{s}{op}{p}" for op, p in o] for s, o in enumerate(ours(kind, k, m))}
    assert sched.pipeline_order_with_comms  # lowered with its sends and receives


# -- torch's own schedules -----------------------------------------------------------------------


@pytest.mark.parametrize(("k", "m"), [(2, 4), (4, 4), (4, 6)])
def test_torch_gpipe_imports_as_our_gpipe(k: int, m: int, tmp_path: Path) -> None:
    sched = torch_schedules.ScheduleGPipe(torch_stage(k), m, loss_fn=loss)
    text = torch_csv(sched, tmp_path / "gpipe.csv")
    assert "REDUCE_GRAD" in text  # what hetpipe's step does itself: dropped
    assert loads(text) == ours("gpipe", k, m)


@pytest.mark.parametrize("fmt", ["compute_comms", "compute_only"])
@pytest.mark.parametrize(("k", "m"), [(2, 4), (4, 4), (4, 8)])
def test_torch_1f1b_imports_as_an_equivalent_valid_order(
    k: int, m: int, fmt: str, tmp_path: Path
) -> None:
    """torch's 1F1B with one stage per rank (its interleaved schedule, one chunk): sends,
    receives, reductions, FSDP's shard actions and idle cells are dropped; what is left is a
    1F1B order that warms each stage up as far as the one after it lets it, valid here."""
    sched = torch_schedules.ScheduleInterleaved1F1B([torch_stage(k)], m, loss_fn=loss)
    text = torch_csv(sched, tmp_path / "i1f1b.csv", format=fmt)
    orders = loads(text)
    assert len(orders) == k and microbatches(orders) == m
    assert check_schedule(orders, m).ok
    assert job_order_problem(orders, kind="gpipe", warmup=0, stages=[k], ms=[m]) is None
    mine = ours("1f1b", k, m)
    assert orders[0][0] == ("F", 0) and orders[-1] == mine[-1]  # the last stage alternates
    for s, order in enumerate(orders):  # a 1F1B order: warm-up, then one forward, one backward
        warm = next(i for i, a in enumerate(order) if a[0] == "B")
        rest = order[warm:]
        assert rest[: 2 * (m - warm) : 2] == tuple(("B", j) for j in range(m - warm)), s
        assert held(order) >= held(mine[s]), s


def test_torch_single_stage_1f1b_order_is_named_by_the_dry_run(tmp_path: Path) -> None:
    """torch's Schedule1F1B writes its own order (the schedule it runs itself is another
    code path); where that order names a microbatch its last stage never forwards, the dry
    run says so, else it is our 1f1b."""
    k, m = 4, 6
    sched = torch_schedules.Schedule1F1B(torch_stage(k), m, loss_fn=loss)
    orders = loads(torch_csv(sched, tmp_path / "1f1b.csv"))
    run = check_schedule(orders, m)
    if orders[-1][0] == ("F", 0):
        assert orders == ours("1f1b", k, m) and run.ok
    else:  # torch 2.13: the last stage runs F1..F6 for microbatches 0..5
        assert run.deadlock == (
            "stage 0, action 5 (B0) can never run: waits for stage 1's B0, which waits for "
            "stage 2's B0, which waits for stage 3's B0, which waits for stage 3's F0, which "
            "stage 3 never runs"
        )
        assert "stage 3: F6 names microbatch 6, not one of 0..5" in run.problems
        assert "stage 3: microbatch 0 has no forward" in run.problems


def test_torch_zero_bubble_parses_into_split_backward_entries(tmp_path: Path) -> None:
    k, m = 4, 8
    sched = torch_schedules.ScheduleInterleavedZeroBubble([torch_stage(k)], m, loss_fn=loss)
    orders = loads(torch_csv(sched, tmp_path / "zb.csv"))
    for s, order in enumerate(orders):
        assert {op for op, _ in order} == {"F", "I", "W"}, s
        assert sorted(p for op, p in order if op == "W") == list(range(m)), s
    assert check_schedule(orders, m).ok


def test_several_chunks_per_rank_are_refused_naming_row_and_column(tmp_path: Path) -> None:
    stage = SimpleNamespace(num_stages=4, group_size=2, group_rank=0, stage_index=0)
    other = SimpleNamespace(num_stages=4, group_size=2, group_rank=0, stage_index=2)
    sched = torch_schedules.ScheduleInterleaved1F1B([stage, other], 4, loss_fn=loss)
    path = tmp_path / "chunks.csv"
    torch_csv(sched, path, format="compute_only")
    with pytest.raises(ScheduleCsvError) as exc:
        load(path)
    msg = str(exc.value)
    assert "\n" not in msg and msg.startswith(f"{path}: row 1, column ")
    assert "one stage per rank" in msg


# -- the dry run ---------------------------------------------------------------------------------


def test_the_dry_run_names_the_blocking_action_of_a_cycle() -> None:
    """Stage 0 runs its first backward before its second forward, stage 1 both forwards
    before its first backward: each waits for the other."""
    broken = ([("F", 0), ("B", 0), ("F", 1), ("B", 1)], [("F", 0), ("F", 1), ("B", 0), ("B", 1)])
    run = check_schedule(broken, 2)
    assert run.problems == ()
    assert run.deadlock == (
        "stage 0, action 2 (B0) can never run: waits for stage 1's B0, which comes after "
        "stage 1's action 2 (F1), which waits for stage 0's F1, which comes after stage 0's "
        "action 2 (B0): a cycle"
    )
    assert run.reason == run.deadlock and not run.ok


def test_the_dry_run_names_a_backward_before_its_forward_and_a_missing_action() -> None:
    orders = [list(o) for o in ours("1f1b", 3, 4)]
    orders[2].remove(("B", 0))
    orders[2].insert(0, ("B", 0))  # the last stage's backward before its own forward
    assert check_schedule(orders, 4).deadlock == (
        "stage 0, action 4 (B0) can never run: waits for stage 1's B0, which waits for "
        "stage 2's B0, which waits for stage 2's F0, which comes after stage 2's action 1 "
        "(B0): a cycle"
    )
    orders = [list(o) for o in ours("gpipe", 2, 3)]
    orders[1].remove(("B", 2))
    run = check_schedule(orders, 3)
    assert run.deadlock == (
        "stage 0, action 6 (B2) can never run: waits for stage 1's B2, which stage 1 never runs"
    )
    assert run.problems == ("stage 1: microbatch 2 has no backward",)


def test_the_dry_run_splits_the_backward_into_i_and_w() -> None:
    ok = ([("F", 0), ("I", 0), ("W", 0)], [("F", 0), ("I", 0), ("W", 0)])
    assert check_schedule(ok, 1).ok
    early_w = ([("F", 0), ("W", 0), ("I", 0)], [("F", 0), ("B", 0)])
    assert check_schedule(early_w, 1).deadlock == (
        "stage 0, action 2 (W0) can never run: waits for stage 0's I0, which comes after "
        "stage 0's action 2 (W0): a cycle"
    )
    # a stage before an I waits for it as it would for a full backward
    assert check_schedule(([("F", 0), ("B", 0)], [("F", 0), ("I", 0), ("W", 0)]), 1).ok


def test_the_dry_run_reports_each_missing_and_duplicated_microbatch() -> None:
    orders = [
        [("F", 0), ("F", 0), ("F", 1), ("B", 0), ("B", 1)],
        [("F", 0), ("B", 0), ("F", 1), ("I", 1), ("B", 1), ("F", 2)],
    ]
    assert check_schedule(orders, 3).problems == (
        "stage 0: microbatch 0's forward runs 2 times",
        "stage 0: microbatch 2 has no forward",
        "stage 0: microbatch 2 has no backward",
        "stage 1: microbatch 1 has a full backward and a split one",
        "stage 1: microbatch 2 has no backward",
    )
    run = check_schedule([[("F", 0), ("I", 0)]], 1)
    assert run.problems == ("stage 0: microbatch 0 has no weight gradient (W) after its I",)
    assert run.reason == run.problems[0]


# -- malformed files -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "where", "says"),
    [
        ("0F0,0X1\r\n", "row 1, column 2", "'0X1' is not an action"),
        ("0F0,0B0\r\n0F0,1B0\r\n", "row 2, column 1", "runs stage 0 on the rank of stage 1"),
        ("0F,0B0\r\n", "row 1, column 1", "'0F': a forward needs its microbatch"),
        ("0F0,0B0x\r\n", "row 1, column 2", "not an action"),
        ("", "no rows", "one row per pipeline stage"),
        ('0F0,"0B0\r\n', "not CSV", ""),
    ],
)
def test_a_malformed_csv_is_refused_in_one_line(text: str, where: str, says: str) -> None:
    with pytest.raises(ScheduleCsvError) as exc:
        loads(text, "s.csv")
    msg = str(exc.value)
    assert "\n" not in msg and msg.startswith(f"s.csv: {where}") and says in msg, msg


def test_comm_idle_and_overlap_cells_are_read() -> None:
    text = "0UNSHARD,,0F0,0SEND_F0,(0F1;0B0)OVERLAP_F_B,0RECV_B1,0B1,0REDUCE_GRAD\r\n"
    assert loads(text) == ((("F", 0), ("F", 1), ("B", 0), ("B", 1)),)


def test_an_unreadable_file_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(ScheduleCsvError, match=r"missing\.csv: cannot read"):
        load(tmp_path / "missing.csv")


# -- in a job ------------------------------------------------------------------------------------


def test_the_job_checks_the_order_against_its_split() -> None:
    orders = ours("1f1b", 2, 4)
    kw = {"kind": "1f1b", "warmup": 0}
    assert job_order_problem(orders, stages=[2, 2], ms=[4, 4], **kw) is None
    assert "needs [[vw]] tables" in str(job_order_problem(orders, stages=[], ms=[], **kw))
    assert job_order_problem(orders, stages=[3], ms=[4], **kw) == (
        "has 2 rows (stages) but virtual worker 0 has 3 stages"
    )
    assert job_order_problem(orders, stages=[2], ms=[None], **kw) == (
        "runs 4 microbatches per iteration: give train.nm = 4 (virtual worker 0 has none)"
    )
    gpipe = ours("gpipe", 2, 4)
    assert job_order_problem(gpipe, stages=[2], ms=[4], **kw) == (
        "stage 0 holds 4 microbatches at once, more than schedule '1f1b' charges it (2): "
        "give train.warmup_forwards = 3 (1f1b) or schedule gpipe"
    )
    assert job_order_problem(gpipe, stages=[2], ms=[4], kind="1f1b", warmup=3) is None
    broken = ([("F", 0), ("B", 0), ("F", 1), ("B", 1)], [("F", 0), ("F", 1), ("B", 0), ("B", 1)])
    assert str(job_order_problem(broken, stages=[2], ms=[2], **kw)).startswith(
        "dry run: stage 0, action 2 (B0) can never run"
    )
    backwards = ([("F", 0), ("F", 1), ("B", 1), ("B", 0)],)
    assert job_order_problem(backwards, stages=[1], ms=[2], kind="gpipe", warmup=0) == (
        "stage 0: order must run forwards and backwards of 0..1 in order"
    )


def _job_dict(order: object, schedule: str = "1f1b", nm: int = 4) -> dict:
    d = job("imported", split=[(["gpu0", "gpu1"], [3, 3])], nm=nm, train={"schedule": schedule})
    d["train"]["order"] = order
    return d


def test_a_job_file_names_a_csv_relative_to_itself(tmp_path: Path) -> None:
    (tmp_path / "sched").mkdir()
    (tmp_path / "sched" / "o.csv").write_text(dumps(ours("1f1b", 2, 4)), newline="")
    jobfile = tmp_path / "job.toml"
    jobfile.write_text(
        'name = "imported"\n[model]\nname = "mlp"\n[train]\nminibatch = 8\nnm = 4\n'
        'minibatches = 8\nschedule = "1f1b"\norder = "sched/o.csv"\n'
        '[[vw]]\ndevices = ["gpu0", "gpu1"]\n'
    )
    spec = load_job(jobfile)
    assert spec.order == ours("1f1b", 2, 4)
    # the job travels with the rows inline: the head and the workers read no file
    d = spec.to_dict()
    assert d["train"]["order"] == [["0F0", "0F1", "0B0", "0F2", "0B1", "0F3", "0B2", "0B3"], [
        "1F0", "1B0", "1F1", "1B1", "1F2", "1B2", "1F3", "1B3"
    ]]  # fmt: skip
    assert JobSpec.from_dict(copy.deepcopy(d), strict=True) == spec


def test_a_bad_order_is_refused_at_submit_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "broken.csv"
    path.write_text("0F0,0B0,0F1,0B1\r\n1F0,1F1,1B0,1B1\r\n")
    with pytest.raises(JobError) as exc:
        JobSpec.from_dict(_job_dict(str(path), "gpipe", nm=2), source="j.toml")
    msg = str(exc.value)
    assert "\n" not in msg
    assert msg.startswith("j.toml: train.order: dry run: stage 0, action 2 (B0) can never run")
    with pytest.raises(JobError, match=r"^j\.toml: train\.order: .*row 1, column 2"):
        JobSpec.from_dict(_job_dict([["0F0", "0Q"]]), source="j.toml")
    with pytest.raises(JobError, match=r"^j\.toml: train\.order: has no effect with schedule"):
        d = _job_dict([r.split(",") for r in dumps(ours("1f1b", 2, 4)).split()], "async")
        JobSpec.from_dict(d, source="j.toml", strict=True)


def test_order_value_reads_a_path_or_rows(tmp_path: Path) -> None:
    (tmp_path / "o.csv").write_text(dumps(ours("gpipe", 2, 2)))
    assert order_value("o.csv", tmp_path) == ours("gpipe", 2, 2)
    assert order_value([["0F0", "0B0"]]) == ((("F", 0), ("B", 0)),)
    with pytest.raises(ScheduleCsvError, match="expected a CSV file's path"):
        order_value({"x": 1})


def test_torchs_zero_bubble_order_is_a_job_order(tmp_path: Path) -> None:
    """torch's zero-bubble CSV (one stage per rank) passes the job's checks under zb-h1's
    memory charge: the split backward runs it."""
    k, m = 2, 4
    sched = torch_schedules.ScheduleInterleavedZeroBubble([torch_stage(k)], m, loss_fn=loss)
    orders = loads(torch_csv(sched, tmp_path / "zb.csv"))
    assert job_order_problem(orders, stages=[k], ms=[m], kind="zb-h1", warmup=0) is None
    spec = JobSpec.from_dict(_job_dict([r.split(",") for r in dumps(orders).split()], "zb-h1"))
    assert spec.order == orders
