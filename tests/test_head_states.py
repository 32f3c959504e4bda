"""The life cycle of a job: one enum of states, one transition function (no process)."""

from __future__ import annotations

import json

import pytest

from hetpipe.head import FINISHED, JobStatus, transition
from hetpipe.head.states import TRANSITIONS, IllegalTransition

LIVE = [
    (JobStatus.QUEUED, JobStatus.PLANNING),
    (JobStatus.PLANNING, JobStatus.RUNNING),
    (JobStatus.RUNNING, JobStatus.DONE),
]


def test_the_wire_values_are_the_words_the_cli_reads() -> None:
    assert [s.value for s in JobStatus] == [
        "queued",
        "planning",
        "running",
        "done",
        "failed",
        "cancelled",
        "interrupted",
        "resumed",
        "lost",
    ]
    assert JobStatus.RUNNING == "running" and "done" in FINISHED
    assert json.dumps({"state": JobStatus.FAILED}) == '{"state": "failed"}'
    assert {"done", "failed", "cancelled"} == FINISHED


@pytest.mark.parametrize(("frm", "to"), LIVE)
def test_a_job_goes_queued_planning_running_done(frm: JobStatus, to: JobStatus) -> None:
    assert transition(frm, to) is to
    assert transition(frm.value, to.value) is to  # a record's plain strings


@pytest.mark.parametrize("frm", [JobStatus.QUEUED, JobStatus.PLANNING, JobStatus.RUNNING])
def test_a_job_may_be_cancelled_or_fail_before_it_ends(frm: JobStatus) -> None:
    assert transition(frm, JobStatus.CANCELLED) is JobStatus.CANCELLED
    assert transition(frm, JobStatus.FAILED) is JobStatus.FAILED


@pytest.mark.parametrize("frm", sorted(FINISHED))
def test_an_ended_job_never_runs_again(frm: JobStatus) -> None:
    for to in (JobStatus.QUEUED, JobStatus.PLANNING, JobStatus.RUNNING, JobStatus.DONE):
        with pytest.raises(IllegalTransition, match=f"a job {frm} cannot become {to}"):
            transition(frm, to)


@pytest.mark.parametrize(
    ("frm", "to"),
    [
        (JobStatus.QUEUED, JobStatus.RUNNING),  # never unplanned
        (JobStatus.QUEUED, JobStatus.DONE),
        (JobStatus.PLANNING, JobStatus.DONE),
        (JobStatus.RUNNING, JobStatus.PLANNING),  # a re-plan is an attempt, still running
        (JobStatus.DONE, JobStatus.FAILED),
        (JobStatus.CANCELLED, JobStatus.FAILED),
        (JobStatus.DONE, JobStatus.INTERRUPTED),  # only a failure is an interruption
        (JobStatus.RESUMED, JobStatus.LOST),
        (JobStatus.LOST, JobStatus.RESUMED),
    ],
)
def test_moves_outside_the_life_cycle_are_refused(frm: JobStatus, to: JobStatus) -> None:
    with pytest.raises(IllegalTransition):
        transition(frm, to)


def test_records_of_a_head_that_died_or_stopped_are_resumed_or_lost() -> None:
    """A record says ``running`` (the head died) or ``interrupted`` (it stopped, after the
    job failed for that): the next head resumes it or records it lost."""
    assert transition(JobStatus.FAILED, JobStatus.INTERRUPTED) is JobStatus.INTERRUPTED
    for was in (JobStatus.RUNNING, JobStatus.INTERRUPTED):
        assert transition(was, JobStatus.RESUMED) is JobStatus.RESUMED
        assert transition(was, JobStatus.LOST) is JobStatus.LOST


def test_unknown_states_are_refused_and_every_state_has_a_row() -> None:
    with pytest.raises(IllegalTransition, match="no job state"):
        transition("running", "paused")
    with pytest.raises(IllegalTransition, match="no job state"):
        transition("Running", "done")
    assert set(TRANSITIONS) == set(JobStatus)
    assert all(not TRANSITIONS[s] for s in (JobStatus.DONE, JobStatus.CANCELLED))
