"""Jobs still queued when the head stops are carried to the next head on the same run
directory (the next Slurm allocation with ``HETPIPE_DRAIN=1``, or ``hetpipe down``/``up``):
it queues them again under their own ids, after the job it resumes from its checkpoint and
in the order they had, and runs them to their end. The head's part without processes
(:meth:`hetpipe.head.recovery.RecoveryPart._recover` on records), then real daemons through
the CLI."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from conftest import UNIFORM, job
from helpers import (
    RecoveryHead,
    UpDown,
    cli_status,
    cli_until,
    hetpipe_cli,
    job_toml,
    stop_up_daemons,
)

from hetpipe.config import load_cluster
from hetpipe.daemon import Owner
from hetpipe.head import Head, JobState
from hetpipe.jobstore import read_result, recovered_line
from hetpipe.localcluster import DeviceDef, cluster_toml
from hetpipe.wire import Kind, Message

# -- the head's part, on records ----------------------------------------------------------------


def _queued(run_dir: Path, job_id: str, submitted: float, **extra: Any) -> None:
    d = run_dir / "jobs" / job_id
    d.mkdir(parents=True, exist_ok=True)
    record = {"id": job_id, "owner": "ann", "state": "queued", "error": None}
    (d / "job.json").write_text(json.dumps({**record, "submitted": submitted, **extra}))


def _queue(head: RecoveryHead) -> list[JobState]:
    out = []
    while not head.queue.empty():
        out.append(head.queue.get_nowait())
    return out


def test_a_restarted_head_queues_again_the_jobs_still_queued_in_their_order(
    tmp_path: Path,
) -> None:
    # job numbers and submit times disagree on purpose: the queue's order is the times'
    _queued(tmp_path, "late-2", 300.0, job=job("late"))
    _queued(tmp_path, "early-10", 100.0, job=job("early"))
    _queued(tmp_path, "mid-3", 200.0, job=job("mid", minibatches=7))
    # a job a head resumed from a checkpoint, stopped before it ran it: first again
    _queued(tmp_path, "back-4", 400.0, resume="gone-1", recovered=True)
    _queued(tmp_path, "bare-5", 50.0)  # a record that does not hold its job
    head = RecoveryHead(tmp_path)
    head._recover()

    queued = _queue(head)
    # back-4's checkpoint is gone: recorded as failed, and why; the others in their order
    assert [js.id for js in queued] == ["early-10", "mid-3", "late-2"]
    assert all(js.recovered and js.owner == "ann" for js in queued)
    assert [js.submitted for js in queued] == [100.0, 200.0, 300.0]
    assert queued[1].spec.minibatches == 7
    assert set(head.jobs) == {"early-10", "mid-3", "late-2"}
    back = read_result(tmp_path, "back-4")
    assert back is not None and back["state"] == "failed"
    assert back["error"].startswith("the head restarted; cannot queue the job again: ")
    assert "gone-1" in back["error"]
    bare = read_result(tmp_path, "bare-5")
    assert bare is not None and bare["error"] == "the head restarted before the job ran"
    assert read_result(tmp_path, "early-10") is None  # still queued: no final status
    lines = [recovered_line(e) for e in head.recovered]
    assert "queued job early-10 again (it had not started)" in lines
    assert len(lines) == 5


def test_a_job_queued_again_and_stopped_again_is_queued_a_third_time(tmp_path: Path) -> None:
    """Its record is left as it was: each head that starts before it runs queues it."""
    _queued(tmp_path, "slow-1", 10.0, job=job("slow"))
    for _ in range(2):
        head = RecoveryHead(tmp_path)
        head._recover()
        assert [js.id for js in _queue(head)] == ["slow-1"]
    assert json.loads((tmp_path / "jobs" / "slow-1" / "job.json").read_text())["job"]


class _Replies:
    """The head's channel, keeping what it sends."""

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []

    async def reply_error(self, _to: object, message: str, _rid: object = None) -> None:
        raise AssertionError(message)

    async def send(self, _kind: object, fields: dict[str, Any], **_kw: object) -> None:
        self.sent.append(fields)


def test_a_stopping_head_starts_no_queued_job_and_the_next_one_queues_them(
    tmp_path: Path,
) -> None:
    """Submitted jobs are recorded with what to run; a head that stops takes none of its
    queue any more (the job it ran ends, the next must not start in the moment before the
    process exits); a head on the same run directory queues them again, in order."""
    path = tmp_path / "c.toml"
    path.write_text(cluster_toml([DeviceDef("gpu0")], shards=1))
    run_dir = tmp_path / "run"

    async def first() -> list[str]:
        owner = Owner()
        try:
            head = Head(load_cluster(str(path)), owner, "tcp://127.0.0.1:1", str(run_dir))
            replies = _Replies()
            head.channel = replies  # type: ignore[assignment]
            for name in ("one", "two"):
                fields = {"rid": 1, "job": job(name, minibatches=9)}
                await head._submit(b"p", Message(Kind.SUBMIT, fields, {}, user="user-ann"))
            await head.stop()
            assert head.queue.empty()
            assert all(js.state == "queued" for js in head.jobs.values())
            return [r["info"]["job"] for r in replies.sent]
        finally:
            await owner.close()

    ids = asyncio.run(first())
    record = json.loads((run_dir / "jobs" / ids[0] / "job.json").read_text())
    assert record["state"] == "queued" and record["owner"] == "ann"
    assert record["job"]["name"] == "one" and isinstance(record["submitted"], float)

    async def second() -> list[JobState]:
        owner = Owner()
        try:
            head = Head(load_cluster(str(path)), owner, "tcp://127.0.0.1:1", str(run_dir))
            head._recover()
            assert head.recovered == [{"job": i, "queued": True} for i in ids]
            return _queue(head)  # type: ignore[arg-type]
        finally:
            await owner.close()

    again = asyncio.run(second())
    assert [js.id for js in again] == ids
    assert [js.spec.minibatches for js in again] == [9, 9]
    assert all(js.owner == "ann" and js.state == "queued" for js in again)


# -- real daemons through the CLI -------------------------------------------------------------


def _submit(cluster: Path, run_dir: Path, path: Path, spec: dict[str, Any]) -> str:
    path.write_text(job_toml(spec))
    sub = hetpipe_cli(cluster, run_dir, "submit", str(path))
    assert sub.returncode == 0, sub.stdout + sub.stderr
    return sub.stdout.strip()


def _done_in_log(run_dir: Path) -> list[str]:
    """The jobs the head's log says are done, in the order it said so."""
    done = []
    for line in (run_dir / "logs" / "ps0.log").read_text().splitlines():
        if '"job done"' in line:
            done.append(json.loads(line)["job"])
    return done


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_down_and_up_run_the_queued_jobs_after_the_resumed_one(tmp_path: Path) -> None:
    c = UpDown(tmp_path, UNIFORM[:2])
    cluster, run_dir, pids, up, down = c.cluster, c.run_dir, c.pids, c.up, c.down
    split = [(["gpu0", "gpu1"], [3, 3])]

    try:
        up()
        # still running whenever the test stops it; then two short ones behind it
        long_spec = job("long", split=split, nm=2, minibatches=200_000)
        long_spec["train"]["checkpoint_every"] = 5
        first = _submit(cluster, run_dir, tmp_path / "a.toml", long_spec)
        b = _submit(cluster, run_dir, tmp_path / "b.toml", job("b", split=split, minibatches=40))
        c = _submit(cluster, run_dir, tmp_path / "c.toml", job("c", split=split, minibatches=30))
        cli_until(cluster, run_dir, first, lambda i: i.get("checkpoints", 0) >= 1, 120)
        assert cli_status(cluster, run_dir, b)["state"] == "queued"
        down()

        said = up()
        resumed = [x for x in said.splitlines() if x.startswith(f"up: resumed job {first} as ")]
        assert len(resumed) == 1, said
        new = resumed[0].split(" as ")[1].split()[0]
        for queued in (b, c):
            assert f"up: queued job {queued} again (it had not started)" in said, said
        # the resumed job runs first; the queued ones wait behind it under their own ids
        cli_until(cluster, run_dir, new, lambda i: i["state"] == "running", 120)
        assert cli_status(cluster, run_dir, b)["state"] == "queued"
        assert cli_status(cluster, run_dir, c)["state"] == "queued"
        assert hetpipe_cli(cluster, run_dir, "cancel", new).returncode == 0
        done_b = cli_until(cluster, run_dir, b, lambda i: i["state"] == "done", 180)
        done_c = cli_until(cluster, run_dir, c, lambda i: i["state"] == "done", 180)
        assert done_b["minibatches"] == 40 and done_c["minibatches"] == 30
        assert (run_dir / "jobs" / b / "model.pt").exists()
        assert (run_dir / "jobs" / c / "model.pt").exists()
        assert _done_in_log(run_dir) == [b, c]  # one job at a time: each in its order
        down()
    finally:
        stop_up_daemons(cluster, run_dir, pids)
