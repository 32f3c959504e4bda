"""Wave Synchronous Parallel: the clock rules of one parameter-server shard.

Pure logic (no sockets, no torch, no asyncio) so that the rules can be tested on their own; the
shard daemon owns one :class:`WaveClock` per job and calls it on every push and pull.

Index letters used below:

====  =====================================================================
p     minibatch number inside one VW (0, 1, 2, ...)
nm    minibatches per wave of that VW (its ``Nm``)
c     wave number; wave c = minibatches c*nm .. (c+1)*nm - 1
D     staleness bound (``staleness``)
====  =====================================================================

The contract (DESIGN.md, "WSP across VWs"): a stage pushes the sum of its updates of wave c once
it has finished the backward of the last minibatch of wave c; the shard applies each
(vw, stage, wave) once. VW v's clock on a shard is the number of waves, counted from 0 without
gaps, for which every stage of v with parameters on the shard has pushed; the global clock is the
minimum over the VWs. Before wave c a stage pulls with ``need = c - 1 - D`` and the shard answers
once the global clock is >= need.

One addition to the contract: a VW that has *finished* (it will push no wave >= some W, because
it has run all its minibatches, or because it was lost) must stop holding back the global clock
once its clock reaches W, otherwise VWs with more waves (a smaller Nm, or more data) wait forever.
:meth:`WaveClock.finish` declares that.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Generic, TypeVar

__all__ = [
    "WaveClock",
    "WspError",
    "covers",
    "first_of_wave",
    "is_last_of_wave",
    "pull_need",
    "unincluded_waves",
    "wave_of",
    "wave_ranges",
]

T = TypeVar("T")


class WspError(ValueError):
    """A push, pull or clock set-up that breaks the WSP rules; ``str(e)`` is one line."""


def _check_nm(nm: int) -> None:
    if nm < 1:
        raise WspError(f"nm: must be >= 1, got {nm}")


def wave_of(p: int, nm: int) -> int:
    """The wave that minibatch ``p`` belongs to."""
    _check_nm(nm)
    if p < 0:
        raise WspError(f"minibatch: must be >= 0, got {p}")
    return p // nm


def first_of_wave(c: int, nm: int) -> int:
    """The first minibatch of wave ``c``: the one before whose forward a stage pulls."""
    _check_nm(nm)
    if c < 0:
        raise WspError(f"wave: must be >= 0, got {c}")
    return c * nm


def is_last_of_wave(p: int, nm: int, total: int) -> bool:
    """Whether minibatch ``p`` closes its wave, i.e. its backward triggers the wave's push.

    ``total`` is the number of minibatches the VW runs; when it is not a multiple of ``nm`` the
    final wave is partial and ends at ``total - 1`` (it is still pushed, or the clock would stall).
    """
    _check_nm(nm)
    if not 0 <= p < total:
        raise WspError(f"minibatch: {p} is outside 0..{total - 1}")
    return p % nm == nm - 1 or p == total - 1


def pull_need(wave: int, staleness: int) -> int:
    """The global clock a pull for ``wave`` waits for: ``wave - 1 - staleness``.

    It may be negative (early waves): such a pull is answered at once.
    """
    if wave < 0:
        raise WspError(f"wave: must be >= 0, got {wave}")
    if staleness < 0:
        raise WspError(f"staleness: must be >= 0, got {staleness}")
    return wave - 1 - staleness


def unincluded_waves(local_waves: Iterable[int], applied: Sequence[Sequence[int]]) -> list[int]:
    """The waves whose update a stage holds locally and the shard had not applied when it answered.

    After a pull the stage sets its weights to the pulled ones plus exactly these updates: a pushed
    update can still be on its way to the shard, and adding an already-applied one would count it
    twice. ``applied`` is what the shard reported for that stage alongside the pulled weights:
    ``[first, end)`` runs (:func:`wave_ranges`), whose size does not grow with the job.
    """
    return sorted(w for w in set(local_waves) if not covers(applied, w))


def wave_ranges(waves: Iterable[int]) -> list[list[int]]:
    """Sorted waves as ``[first, end)`` runs: ``[[0, 5]]`` is waves 0..4, each once."""
    out: list[list[int]] = []
    for w in waves:
        if out and out[-1][1] == w:
            out[-1][1] = w + 1
        else:
            out.append([w, w + 1])
    return out


def covers(runs: Iterable[Sequence[int]], wave: int) -> bool:
    """Whether ``wave`` is in one of the ``[first, end)`` runs (:func:`wave_ranges`)."""
    return any(lo <= wave < hi for lo, hi in runs)


class _StageLog:
    """The waves one stage of one VW has pushed: a gap-free prefix plus the ones pushed early.

    Keeping a count plus a small set (not the full list) keeps memory flat over a long job.
    """

    __slots__ = ("ahead", "count")

    def __init__(self) -> None:
        self.count = 0  # waves 0 .. count-1 are all applied
        self.ahead: set[int] = set()  # applied waves > count (pushed out of order)

    def has(self, wave: int) -> bool:
        return wave < self.count or wave in self.ahead

    def add(self, wave: int) -> bool:
        if self.has(wave):
            return False
        self.ahead.add(wave)
        while self.count in self.ahead:
            self.ahead.discard(self.count)
            self.count += 1
        return True

    def waves(self) -> list[int]:
        return [*range(self.count), *sorted(self.ahead)]

    def ranges(self) -> list[list[int]]:
        """The waves as ``[first, end)`` runs (:func:`wave_ranges`), without listing them:
        one run for the prefix, however long the job, and the few pushed early."""
        # the early ones start after ``count`` + 1 (``count`` itself is not applied)
        return ([[0, self.count]] if self.count else []) + wave_ranges(sorted(self.ahead))


class WaveClock(Generic[T]):
    """Per-shard, per-VW clocks and the parked pulls of one job on one shard.

    ``members`` maps each VW to the stages of that VW with parameters on this shard (VWs with no
    parameters here are simply not listed). Parked pulls live in a heap ordered by (need, arrival)
    so that :meth:`release` only looks at the ones it answers; nothing polls.
    """

    def __init__(self, members: Mapping[int, Iterable[int]], staleness: int) -> None:
        if staleness < 0:
            raise WspError(f"staleness: must be >= 0, got {staleness}")
        self.staleness = staleness
        self._logs: dict[int, dict[int, _StageLog]] = {}
        for vw, stages in members.items():
            logs = {stage: _StageLog() for stage in stages}
            if not logs:
                raise WspError(f"members: vw {vw} has no stages on this shard")
            self._logs[vw] = logs
        if not self._logs:
            raise WspError("members: no virtual workers on this shard")
        self._final: dict[int, int] = {}  # vw -> number of waves it will push in all
        self._floor = 0  # the global clock never goes below it (a VW removed: remove_vw)
        self._heap: list[tuple[int, int, T]] = []
        self._arrival = itertools.count()

    # -- pushes -----------------------------------------------------------------------------

    def _log(self, vw: int, stage: int) -> _StageLog:
        stages = self._logs.get(vw)
        if stages is None:
            raise WspError(f"push: unknown vw {vw}")
        log = stages.get(stage)
        if log is None:
            raise WspError(f"push: vw {vw} has no stage {stage} on this shard")
        return log

    def record_push(self, vw: int, stage: int, wave: int) -> bool:
        """Record the push of (vw, stage, wave).

        True: it is new and the caller must apply the update now. False: a duplicate (a retry),
        which the caller acknowledges and ignores. Pushes may arrive out of order; the clock only
        counts waves without gaps.
        """
        log = self._log(vw, stage)
        if wave < 0:
            raise WspError(f"push: vw {vw} stage {stage}: wave must be >= 0, got {wave}")
        final = self._final.get(vw)
        if final is not None and wave >= final and not log.has(wave):
            raise WspError(f"push: vw {vw} finished after {final} waves; wave {wave} refused")
        return log.add(wave)

    def finish(self, vw: int, waves: int) -> None:
        """Declare that ``vw`` pushes no wave >= ``waves`` (it ran all its minibatches, or is lost).

        Once its clock reaches ``waves`` it no longer holds back the global clock; until then its
        remaining pushes are still waited for, so the staleness bound keeps holding for them.
        """
        if vw not in self._logs:
            raise WspError(f"finish: unknown vw {vw}")
        if waves < 0:
            raise WspError(f"finish: vw {vw}: waves must be >= 0, got {waves}")
        self._final[vw] = waves

    def join(self, vw: int, stage: int, applied_below: int) -> None:
        """Make ``stage`` of ``vw`` a member here, its waves ``0 .. applied_below - 1`` counted
        as pushed: a live migration gave it state on this shard at that wave boundary, and
        the waves before were pushed by the stages that held the state then
        (:mod:`hetpipe.migrate`). A member already stays as it is."""
        stages = self._logs.get(vw)
        if stages is None:
            raise WspError(f"join: unknown vw {vw}")
        if stage not in stages:
            log = _StageLog()
            log.count = applied_below
            stages[stage] = log

    def leave(self, vw: int, stage: int) -> None:
        """``stage`` of ``vw`` holds no state here any more (a live migration); the virtual
        worker keeps its other stages here."""
        stages = self._logs.get(vw)
        if stages is None or stage not in stages:
            return
        if len(stages) == 1:
            raise WspError(f"leave: vw {vw} would hold nothing on this shard")
        del stages[stage]

    def remove_vw(self, vw: int, of_vw: Callable[[T], bool]) -> tuple[int, list[T]]:
        """``vw`` is no member any more (its worker was lost: :mod:`hetpipe.head.reform`):
        it holds the global clock back no longer. Returns its clock as it was and its parked
        pulls (``of_vw`` says which items are its), to be refused; the pulls of the other
        VWs its clock held back are then answered by :meth:`release`. The global clock
        keeps its value where no VW is left (a one-VW job, until :meth:`add_vw`)."""
        if vw not in self._logs:
            raise WspError(f"remove: unknown vw {vw}")
        self._floor = max(self._floor, self.global_clock())
        clock = self.vw_clock(vw)
        del self._logs[vw]
        self._final.pop(vw, None)
        mine = [entry for entry in self._heap if of_vw(entry[2])]
        if mine:
            self._heap = [entry for entry in self._heap if not of_vw(entry[2])]
            heapq.heapify(self._heap)
        return clock, [item for _, _, item in sorted(mine, key=lambda e: e[1])]

    def add_vw(self, vw: int, stages: Iterable[int], waves: int) -> int:
        """Make ``vw`` a member again (re-formed after a loss), its clock starting at the
        global clock ``g`` as of now: every one of its stages counts waves ``0 .. g - 1`` as
        pushed, it pushes ``waves`` more (``g .. g + waves - 1``), and the global clock does
        not go back. Returns ``g``, the offset of the VW's own wave numbers here."""
        if vw in self._logs:
            raise WspError(f"add: vw {vw} is a member already")
        if waves < 0:
            raise WspError(f"add: vw {vw}: waves must be >= 0, got {waves}")
        g = self.global_clock()
        logs = {}
        for stage in stages:
            log = _StageLog()
            log.count = g
            logs[stage] = log
        if not logs:
            raise WspError(f"add: vw {vw} has no stages on this shard")
        self._logs[vw] = logs
        self._final[vw] = g + waves
        return g

    # -- clocks -----------------------------------------------------------------------------

    def applied(self, vw: int, stage: int) -> list[int]:
        """The waves applied for that stage, sorted."""
        return self._log(vw, stage).waves()

    def applied_ranges(self, vw: int, stage: int) -> list[list[int]]:
        """The waves applied for that stage as ``[first, end)`` runs: what a pull answer
        carries, of a size that does not grow with the job (:meth:`applied` would)."""
        return self._log(vw, stage).ranges()

    def is_applied(self, vw: int, stage: int, wave: int) -> bool:
        """Whether the push of (vw, stage, wave) has been applied (cheaper than ``applied``)."""
        return self._log(vw, stage).has(wave)

    def contiguous(self, vw: int, stage: int) -> int:
        """W such that waves 0..W-1 of that stage are all applied."""
        return self._log(vw, stage).count

    def vw_clock(self, vw: int) -> int:
        """Waves, counted from 0 without gaps, for which every stage of ``vw`` here has pushed."""
        stages = self._logs.get(vw)
        if stages is None:
            raise WspError(f"clock: unknown vw {vw}")
        return min(log.count for log in stages.values())

    def done(self, vw: int) -> bool:
        """Whether ``vw`` has finished and all its waves are applied here."""
        final = self._final.get(vw)
        return final is not None and self.vw_clock(vw) >= final

    def global_clock(self) -> int:
        """Minimum of the clocks of the VWs that are not done.

        When every VW is done it is the largest clock (nothing is held back any more); either
        way it never decreases (nor where a VW leaves and joins again: :meth:`remove_vw`).
        """
        clocks = {vw: self.vw_clock(vw) for vw in self._logs}
        active = [c for vw, c in clocks.items() if not self.done(vw)]
        now = min(active) if active else max(clocks.values(), default=self._floor)
        return max(now, self._floor)

    def _horizon(self) -> int | None:
        """The largest need answered now; None when every VW is done (then all are answered)."""
        if self._logs and all(self.done(vw) for vw in self._logs):
            return None
        return self.global_clock()

    @staticmethod
    def _met(need: int, horizon: int | None) -> bool:
        return horizon is None or need <= horizon

    # -- pulls ------------------------------------------------------------------------------

    def park(self, need: int, item: T) -> bool:
        """True if the pull can be answered now (global clock >= need); else park it, False."""
        if self._met(need, self._horizon()):
            return True
        heapq.heappush(self._heap, (need, next(self._arrival), item))
        return False

    def release(self) -> list[T]:
        """Remove and return the parked pulls whose need is now met, in arrival order.

        Call after every push (and after :meth:`finish`).
        """
        horizon = self._horizon()
        out: list[tuple[int, T]] = []
        while self._heap and self._met(self._heap[0][0], horizon):
            _, seq, item = heapq.heappop(self._heap)
            out.append((seq, item))
        out.sort(key=lambda x: x[0])
        return [item for _, item in out]

    def release_all(self) -> list[T]:
        """Remove and return every parked pull, in arrival order (the job is being dropped)."""
        items = sorted(self._heap, key=lambda x: x[1])
        self._heap.clear()
        return [item for _, _, item in items]

    def parked(self) -> int:
        """How many pulls are waiting."""
        return len(self._heap)

    def snapshot(self) -> dict:
        """Plain data for status and metrics (string keys: it travels in msgpack)."""
        return {
            "global": self.global_clock(),
            "vws": {str(vw): self.vw_clock(vw) for vw in self._logs},
            "parked": len(self._heap),
            "done": sorted(vw for vw in self._logs if self.done(vw)),
        }
