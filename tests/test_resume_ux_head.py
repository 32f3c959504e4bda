"""The head's part of resuming, without processes: what a restarted head does with each job
its predecessor recorded (:meth:`RecoveryPart._recover`), and which resumes it refuses
(:meth:`RecoveryPart._resume_source`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from conftest import job
from helpers import RecoveryHead

from hetpipe.head import JobState, JobStatus
from hetpipe.head.states import JobFailed
from hetpipe.job import JobSpec
from hetpipe.jobstore import read_result, write_result


def _record(run_dir: Path, job_id: str, state: str, **extra: Any) -> Path:
    d = run_dir / "jobs" / job_id
    d.mkdir(parents=True, exist_ok=True)
    record = {"id": job_id, "owner": "local", "state": state, "error": None, **extra}
    (d / "job.json").write_text(json.dumps(record))
    return d


def _job_json(run_dir: Path, job_id: str) -> dict[str, Any]:
    return json.loads((run_dir / "jobs" / job_id / "job.json").read_text())


def test_a_restarted_head_keeps_every_job_its_predecessor_knew(tmp_path: Path) -> None:
    _record(tmp_path, "cut-1", "running")  # the head died under it, no checkpoint yet
    _record(tmp_path, "stopped-2", "interrupted", error="the head is shutting down")
    write_result(tmp_path, "stopped-2", {"id": "stopped-2", "state": "failed"})
    _record(tmp_path, "waiting-3", "queued")  # queued when the head died
    _record(tmp_path, "refused-4", "queued")  # refused at planning: it has a result
    write_result(tmp_path, "refused-4", {"id": "refused-4", "state": "failed", "error": "x"})
    _record(tmp_path, "done-5", "done")
    write_result(tmp_path, "done-5", {"id": "done-5", "state": "done"})
    head = RecoveryHead(tmp_path)
    head._recover()
    assert head.queue.empty()  # nothing had a checkpoint to resume from

    cut = read_result(tmp_path, "cut-1")
    assert cut is not None and cut["state"] == "failed" and cut["name"] == "cut"
    assert cut["error"] == "the head restarted; cannot resume: no complete checkpoint"
    assert _job_json(tmp_path, "cut-1")["state"] == "lost"
    stopped = read_result(tmp_path, "stopped-2")
    assert stopped is not None and stopped["state"] == "failed"
    assert "no complete checkpoint" in stopped["error"]
    assert "the head is shutting down" in stopped["error"]
    waiting = read_result(tmp_path, "waiting-3")
    assert waiting is not None and waiting["state"] == "failed"
    assert waiting["error"] == "the head restarted before the job ran"
    assert read_result(tmp_path, "refused-4") == {
        "id": "refused-4",
        "state": "failed",
        "error": "x",
    }
    assert read_result(tmp_path, "done-5") == {"id": "done-5", "state": "done"}
    assert [e["job"] for e in head.recovered] == ["cut-1", "stopped-2", "waiting-3"]
    assert all("error" in e and "as" not in e for e in head.recovered)


def _spec() -> JobSpec:
    return JobSpec.from_dict(job("t"))


def test_a_job_is_resumed_once_and_only_once_it_has_ended(tmp_path: Path) -> None:
    head = RecoveryHead(tmp_path)
    running = JobState(id="t-1", spec=_spec(), submitted=0.0, state=JobStatus.RUNNING)
    head.jobs["t-1"] = running
    with pytest.raises(JobFailed, match=r"^resume: job t-1 is running, not ended"):
        head._resume_source("t-1")

    # a successor the head holds: the new job names the old one
    running.state = JobStatus.FAILED
    new = JobState(id="t-2", spec=_spec(), submitted=0.0)
    head.jobs["t-2"] = new
    _record(tmp_path, "t-1", "failed")
    write_result(tmp_path, "t-1", {"id": "t-1", "state": "failed", "error": "lost"})
    head._link("t-1", new)
    assert new.resumed_of == "t-1" and running.result["resumed_as"] == "t-2"
    got = read_result(tmp_path, "t-1")
    assert got is not None and got["resumed_as"] == "t-2" and got["error"] == "lost"
    assert _job_json(tmp_path, "t-1")["resumed_as"] == "t-2"
    with pytest.raises(JobFailed) as refused:
        head._resume_source("t-1")
    text = str(refused.value)
    assert "\n" not in text
    assert text.startswith("resume: job t-1 was already resumed as t-2 (queued)")

    # a successor only the disk remembers (another head's): refused alike
    fresh = RecoveryHead(tmp_path)
    with pytest.raises(JobFailed, match=r"already resumed as t-2"):
        fresh._resume_source("t-1")
    # a job never resumed goes on to its checkpoint (here: none, said in one line)
    _record(tmp_path, "u-3", "failed")
    with pytest.raises(JobFailed, match=r"^no complete checkpoint of job 'u-3'"):
        fresh._resume_source("u-3")
