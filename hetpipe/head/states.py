"""The states of a job, and the one function that moves a job from one to another.

A job lives ``queued`` -> ``planning`` -> ``running`` -> ``done``; it may fail while planning or
running, and be cancelled at any point before it ends. The three states after ``running``
that only a job's record on disk (``<job dir>/job.json``) holds are what a restarted head
reads: ``interrupted`` (the head shut down under it), then ``resumed`` (queued again from its
last checkpoint under a new id) or ``lost`` (no checkpoint to resume from).

The values are what travels to the CLI and what the records hold: a :class:`JobStatus` is a
``str`` and compares equal to its value.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum

__all__ = ["FINISHED", "TRANSITIONS", "IllegalTransition", "JobFailed", "JobStatus", "transition"]


class JobStatus(StrEnum):
    """Every state a job or its record can be in; the value is the wire's and the file's."""

    QUEUED = "queued"
    PLANNING = "planning"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"
    # a record's only: the head was shut down while the job ran (resume it later)
    INTERRUPTED = "interrupted"
    # a record's only, written by the head that starts after it
    RESUMED = "resumed"
    LOST = "lost"


FINISHED = frozenset({JobStatus.DONE, JobStatus.FAILED, JobStatus.CANCELLED})
"""A job in one of these has ended: it runs no more and cannot be cancelled."""

TRANSITIONS: Mapping[JobStatus, frozenset[JobStatus]] = {
    JobStatus.QUEUED: frozenset({JobStatus.PLANNING, JobStatus.CANCELLED, JobStatus.FAILED}),
    JobStatus.PLANNING: frozenset({JobStatus.RUNNING, JobStatus.FAILED, JobStatus.CANCELLED}),
    JobStatus.RUNNING: frozenset(
        {
            JobStatus.DONE,
            JobStatus.FAILED,
            JobStatus.CANCELLED,
            JobStatus.RESUMED,
            JobStatus.LOST,
        }
    ),
    JobStatus.DONE: frozenset(),
    JobStatus.FAILED: frozenset({JobStatus.INTERRUPTED}),
    JobStatus.CANCELLED: frozenset(),
    JobStatus.INTERRUPTED: frozenset({JobStatus.RESUMED, JobStatus.LOST}),
    JobStatus.RESUMED: frozenset(),
    JobStatus.LOST: frozenset(),
}
"""From each state, the states a job may go to next. ``running`` -> ``resumed``/``lost`` and
``failed`` -> ``interrupted`` happen to records only: a head that died or stopped under a
running job."""


class IllegalTransition(ValueError):
    """A job was told to go where its state does not lead: a bug in the head, not the job's."""


class JobFailed(Exception):
    """The running job must stop; the text is what the user reads."""


def transition(current: str, new: str) -> JobStatus:
    """The state ``new``, if a job in ``current`` may go there; else :class:`IllegalTransition`.

    Both may be given as their values (a record read from disk holds plain strings).
    """
    try:
        frm, to = JobStatus(current), JobStatus(new)
    except ValueError as exc:
        raise IllegalTransition(f"no job state {exc}") from None
    if to not in TRANSITIONS[frm]:
        allowed = ", ".join(sorted(TRANSITIONS[frm])) or "nothing: it has ended"
        raise IllegalTransition(f"a job {frm} cannot become {to} (it may become {allowed})")
    return to
