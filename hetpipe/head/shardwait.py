"""A lost parameter-server shard pauses the job; it does not fail it.

A shard holds part of the job's global weights and every virtual worker's clocks on them, so
a shard that dies takes the running attempt with it. It is a daemon its supervisor restarts
(systemd's ``Restart=``, a Slurm step, a Kubernetes pod: see ``workers/``); the restarted
process registers again under the same index, on whatever address it now listens. So the
head, instead of failing the job, ends the attempt, waits up to ``train.shard_wait_s`` for
every lost shard of the cluster to say hello again, and starts a new attempt of the job on
the same layout from its last complete checkpoint (:func:`hetpipe.head.recovery.resume_plan`:
the shards get the cut, every stage its state, every virtual worker its data position), or
from the job's start where no checkpoint was written yet. While it waits, the job stays
``running`` and its status says what it waits for and since when (``waiting``); past the
bound it fails with one line naming the shard.

:class:`ShardWaitPart` is the part of :class:`hetpipe.head.server.Head` that does it; the
pure helpers say what the job waits for (:func:`waiting_view`; its line for a person is
:func:`hetpipe.jobstore.waiting_text`) and how a job that waited in vain fails
(:func:`gave_up`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, Any

from hetpipe.head.recovery import lost_since
from hetpipe.head.states import JobFailed
from hetpipe.jobplan import JobPlanError, plan_job

if TYPE_CHECKING:
    from hetpipe.head.jobs import JobState

__all__ = ["MAX_SHARD_WAITS", "ShardWaitPart", "gave_up", "waiting_view"]

MAX_SHARD_WAITS = 3  # a job paused this often for lost shards fails at the next loss
POLL_S = 0.1  # how often the waiting head looks at the registry


# -- pure: what the job waits for -------------------------------------------------------------


def waiting_view(
    shards: Collection[int], addresses: Mapping[int, str], since: float, wait_s: float, why: str
) -> dict[str, Any]:
    """The ``waiting`` field of a paused job's status: the shards it waits for (index and
    last address), since when (wall clock), until when it waits, and why it paused."""
    return {
        "for": "shards",
        "shards": {str(i): addresses.get(i) for i in sorted(shards)},
        "since": since,
        "until": since + wait_s,
        "wait_s": wait_s,
        "reason": why,
    }


def gave_up(shards: Collection[int], addresses: Mapping[int, str], wait_s: float) -> str:
    """The one line a job fails with when its lost shards did not come back in time."""
    names = ", ".join(
        f"shard {i} ({addresses[i]})" if addresses.get(i) else f"shard {i}" for i in sorted(shards)
    )
    first = min(shards)
    return (
        f"{names} lost and not registered again within {wait_s:g} s (train.shard_wait_s): "
        f"start hetpipe-ps --shard {first} again, then resume the job"
    )


# -- the head's part --------------------------------------------------------------------------


class ShardWaitPart:
    """Pause a job for its lost shards (a part of :class:`hetpipe.head.server.Head`); its
    attempts are numbered with the re-plans' (:meth:`_next_wire`)."""

    def _next_wire(self, js: JobState) -> str:
        """The wire id of the job's next attempt: one per attempt, whatever started it."""
        return f"{js.id}.r{len(js.replans) + len(js.shard_waits) + 1}"

    def _lost_shards(self) -> set[int]:
        """The shards of the cluster file that are lost or have never registered."""
        n = len(self.cluster.ps)
        return set(self.registry.shards_lost) | {
            i for i in range(n) if i not in self.registry.shards
        }

    def _shard_restarted(self, index: int, pid: int) -> None:
        """Shard ``index`` said hello from another process before the head missed it (a
        supervisor that restarts at once): the running job's state there is gone, so its
        attempt ends as if the shard had been lost (and the job resumes: it is back)."""
        js = self.current
        self.log.warning("shard restarted", shard=index, pid=pid)
        if js is not None and js.plan is not None and index in js.plan.shards_used():
            if js.lost_shard is None:
                js.lost_shard = index
            js.fail(f"shard {index} restarted (now pid {pid}): the job's state there is gone")

    def _may_wait_shard(self, js: JobState) -> bool:
        return (
            js.lost_shard is not None
            and js.lost_device is None
            and js.spec.shard_wait_s > 0
            and not js.cancelled
            and not self._stopping
            and len(js.shard_waits) < MAX_SHARD_WAITS
        )

    async def _wait_shard(self, js: JobState, reason: str) -> None:
        """End the attempt a lost shard broke, wait for every lost shard to register again
        (up to ``train.shard_wait_s``), then make the next attempt: the same layout on the
        shards' new addresses, from the job's last complete checkpoint (or its start)."""
        assert js.plan is not None and js.lost_shard is not None
        loop = asyncio.get_running_loop()
        log = self.log.bind(job=js.id)
        old = js.plan
        wait_s = js.spec.shard_wait_s
        positions = js.info().get("positions") or [0]
        self._drop_cuts(js)
        await self._abort(js, reason)
        await self._drop_shards(js)  # the survivors drop the attempt's state
        self.registry.release(js.id)
        t0, since = time.monotonic(), time.time()
        lost = self._lost_shards() | {js.lost_shard}
        addresses = dict(self.registry.shards)
        js.waiting = waiting_view(lost, addresses, since, wait_s, reason)
        ever = set(lost)  # every shard the job waited for
        log.warning("shard lost: the job waits for it", shards=sorted(lost), wait_s=wait_s)
        try:
            while True:
                lost = self._lost_shards()
                if not lost:
                    break
                if js.cancelled:
                    raise JobFailed("cancelled by the user")
                if self._stopping:
                    raise JobFailed("the head is shutting down")
                if time.monotonic() - t0 > wait_s:
                    raise JobFailed(gave_up(lost, addresses, wait_s))
                ever |= lost
                js.waiting["shards"] = {str(i): addresses.get(i) for i in sorted(lost)}
                await asyncio.sleep(POLL_S)
        finally:
            js.waiting = None
        waited = time.monotonic() - t0
        ck = self._latest_of(js)
        wire = self._next_wire(js)
        try:
            new = await loop.run_in_executor(
                None,
                lambda: plan_job(
                    js.spec,
                    wire,
                    self.cluster,
                    self.registry.alive(),
                    self.registry.live_shards(),
                    vws=old.vws,
                    predicted=old.predicted,
                ),
            )
            if ck is not None:
                self._restore(js, new, ck)
        except (JobPlanError, JobFailed) as exc:
            raise JobFailed(
                f"{reason}; the shard is back, but the job cannot go on: {exc}"
            ) from None
        if ck is None:  # nothing written yet: the job starts again from its beginning
            js.totals = tuple(new.minibatches_of(v) for v in range(len(new.vws)))
        js.start_attempt(new)
        js.lost_shard = None
        js.shard_waits.append(
            {
                "lost": sorted(ever),
                "reason": reason,
                "since": since,
                "waited_s": round(waited, 2),
                "shards": {str(i): a for i, a in self.registry.live_shards().items()},
                "after_minibatches": positions,
                "checkpoint": str(ck.path) if ck is not None else None,
                "checkpoint_positions": ck.meta.get("positions") if ck is not None else None,
                "lost_minibatches": lost_since(positions, ck.meta.get("positions"))
                if ck is not None
                else positions,
                "starts": list(new.starts),
                "attempt": wire,
            }
        )
        log.warning(
            "shards back: the job resumes",
            waited_s=round(waited, 2),
            attempt=wire,
            checkpoint=js.shard_waits[-1]["checkpoint"],
        )
