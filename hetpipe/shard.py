"""The state of one parameter-server shard: global weights and WSP clocks, per job.

No sockets here: :mod:`hetpipe.ps` feeds messages in and sends the answers out. Updates are
applied out of place (``w = w + U`` builds a new tensor), so a pull answered zero-copy from the
old tensor is never changed under ZeroMQ while it is still being sent.

Cuts (checkpoints). Under WSP the virtual workers are not at the same wave: when the slowest
pushes wave c - 1, a faster one may already have pushed c or c + 1 (by up to the staleness
bound), and those are applied here. A checkpoint must hold the global weights of one *cut*:
exactly the pushes of waves < c of every (vw, stage), the point each stage snapshots itself
right after its own push of wave c - 1. So the shard keeps, for each cut point c (every
``cut_every`` waves, and the job's last wave) still incomplete, a copy of its weights taken
just before the first push of a wave >= c was applied, and adds to that copy only the pushes
of waves < c that come later. Updates are out of place, so the copy is a dict of references
(no tensor is copied). A VW with fewer waves than c is cut at its end. The cut's applied
sets, which the checkpoint keeps, are exactly waves 0..c-1 of every stage: that is the proof
that no update is in a checkpoint twice or missing from it.

A VW that leaves and joins again (a worker of it was lost: :mod:`hetpipe.head.reform`) takes
its place in this one count of waves: it joins at the global clock, or past every wave its old
stages pushed here where that is later (:meth:`JobShard.rejoin_vw`), and the head may move it
further on to the wave it joins at on every shard (:meth:`JobShard.rebase_vw`), so that its
own wave ``c`` is the same wave ``base + c`` on every shard and a cut past ``base`` holds all
its old stages pushed and exactly its new waves before the cut.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import torch

from hetpipe.checkpoint import cut_after
from hetpipe.core.wsp import WaveClock

__all__ = ["JobShard", "ShardError", "ShardStore"]

T = TypeVar("T")


def _below(runs: list[list[int]], limit: int) -> list[list[int]]:
    """The ``[first, end)`` runs cut at ``limit`` (the waves below it)."""
    return [[lo, min(hi, limit)] for lo, hi in runs if lo < limit]


class ShardError(ValueError):
    """A push or pull this shard cannot serve (unknown job, stage or tensor)."""


@dataclass
class Reduction(Generic[T]):
    """One synchronous iteration's gradients on this shard, until every stage contributed."""

    sums: dict[tuple[int, int], dict[str, torch.Tensor]] = field(default_factory=dict)
    samples: dict[tuple[int, int], int] = field(default_factory=dict)
    parked: list[tuple[T, int, int]] = field(default_factory=list)  # (item, vw, stage)


@dataclass
class JobShard(Generic[T]):
    """One job's weights on this shard and its WSP clock."""

    job: str
    weights: dict[str, torch.Tensor]
    names: dict[tuple[int, int], list[str]]  # (vw, stage) -> names it holds here
    clock: WaveClock[T]
    pushes: int = 0
    pushed_bytes: int = 0
    meta: dict[str, Any] = field(default_factory=dict)
    reductions: dict[int, Reduction[T]] = field(default_factory=dict)
    duplicates: int = 0  # pushes acknowledged and ignored: (vw, stage, wave) already applied
    cut_every: int = 0  # waves between cuts (train.checkpoint_every); 0: no cuts
    finals: dict[int, int] = field(default_factory=dict)  # vw -> waves it pushes in all
    next_cut: int | None = None  # the first cut point not complete yet
    open_cuts: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    cuts: dict[int, tuple[dict[str, torch.Tensor], dict[str, Any]]] = field(
        default_factory=dict
    )  # complete cuts not yet taken by the head (the newest few)
    # vw -> the wave here of its own wave 0 (its base): a VW re-formed after a loss counts its
    # waves from 0 again, from the global clock or later (:meth:`rejoin_vw`, :meth:`rebase_vw`)
    offsets: dict[int, int] = field(default_factory=dict)
    asked: set[int] = field(default_factory=set)  # cuts asked for on demand (hetpipe checkpoint)
    closed: int = 0  # the newest cut point complete (0: none yet)
    # vw -> the wave past every push of a VW that left (it joins again there at the earliest)
    reach: dict[int, int] = field(default_factory=dict)

    KEEP_CUTS = 2

    def __post_init__(self) -> None:
        if self.cut_every > 0 and self.finals:
            self.next_cut = self._cut_after(0)

    def _last_wave(self) -> int:
        return max(self.finals.values(), default=0)

    def _cut_after(self, c: int) -> int | None:
        return cut_after(c, self.cut_every, self._last_wave(), self.asked)

    def ask_cut(self, c: int) -> int | None:
        """Keep a cut at wave ``c`` as well (the head's on-demand checkpoint); None where it
        can, else the earliest wave it could: a cut takes the weights before any push of its
        wave or later lands, so every stage's applied waves here must all lie below ``c``."""
        past = max(
            (end for key in self.names for _first, end in self.clock.applied_ranges(*key)),
            default=0,
        )
        if not 0 < c <= self._last_wave():
            raise ShardError(f"job {self.job}: no wave {c} to cut at (last {self._last_wave()})")
        if past > c:
            return past
        self.asked.add(c)
        if self.next_cut is None or c < self.next_cut:
            self.next_cut = c
        self._close_cuts()  # every push below c may be in already
        return None

    def _cut_points(self, upto: int) -> list[int]:
        """The incomplete cut points <= ``upto``."""
        out, c = [], self.next_cut
        while c is not None and c <= upto:
            out.append(c)
            c = self._cut_after(c)
        return out

    def _cut_complete(self, c: int) -> bool:
        return all(
            self.clock.contiguous(vw, stage) >= min(c, self.finals.get(vw, c))
            for vw, stage in self.names
        )

    def _before_apply(self, wave: int, deltas: Mapping[str, torch.Tensor]) -> None:
        """Keep the cuts a push of ``wave`` must not enter, and add it to those it belongs to."""
        if self.next_cut is None:
            return
        for c in self._cut_points(wave):  # cuts this push is past: copy before it lands
            self.open_cuts.setdefault(c, dict(self.weights))
        with torch.no_grad():
            for c, held in self.open_cuts.items():
                if wave < c:
                    for name, d in deltas.items():
                        held[name] = held[name] + d.to(held[name].dtype)

    def _close_cuts(self) -> None:
        """Move every cut whose pushes have all arrived to :attr:`cuts`."""
        while self.next_cut is not None and self._cut_complete(self.next_cut):
            c = self.next_cut
            weights = self.open_cuts.pop(c, None)
            if weights is None:  # no push past c arrived yet: the weights are the cut
                weights = dict(self.weights)
            applied = {
                f"{vw}/{stage}": _below(
                    self.clock.applied_ranges(vw, stage), min(c, self.finals.get(vw, c))
                )
                for vw, stage in sorted(self.names)
            }
            self.cuts[c] = (weights, {"wave": c, "applied": applied})
            for old in sorted(self.cuts)[: -self.KEEP_CUTS]:
                del self.cuts[old]
            self.closed = c
            self.next_cut = self._cut_after(c)

    def _recut(self) -> None:
        """The cut points after the newest complete one again, for the job's last wave as
        it is now (a VW left or joined: :meth:`remove_vw`, :meth:`rejoin_vw`); the copies
        kept for points that are no cut points any more are let go."""
        if self.cut_every <= 0 and not self.asked:
            return
        self.next_cut = self._cut_after(self.closed)
        if self.open_cuts:
            keep = set(self._cut_points(max(self.open_cuts)))
            for c in [c for c in self.open_cuts if c not in keep]:
                del self.open_cuts[c]
        self._close_cuts()

    def cut(self, c: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]] | None:
        """The weights and applied sets of cut ``c`` once complete (None until then)."""
        if c in self.cuts:
            return self.cuts[c]
        if c not in self._cut_points(c):
            raise ShardError(
                f"job {self.job}: no cut at wave {c} here (kept: "
                f"{sorted(self.cuts)}, next {self.next_cut})"
            )
        return None

    def reduce(
        self,
        vw: int,
        stage: int,
        iteration: int,
        samples: int,
        grads: Mapping[str, torch.Tensor],
        item: T,
    ) -> list[tuple[T, dict[str, Any], dict[str, torch.Tensor]]]:
        """Take one stage's gradient sum of a synchronous iteration; once every stage holding
        state here has contributed, return each waiting requester's answer: the mean
        gradient of its names over the samples of every virtual worker that holds them.

        Sums are added in (vw, stage) order, so every virtual worker gets the same bits and
        a run is reproducible whatever order the contributions arrived in.
        """
        self._check(vw, stage, grads, "gradients")
        if samples < 1:
            raise ShardError(f"job {self.job}: vw{vw}/stage{stage} reduced {samples} samples")
        red = self.reductions.setdefault(iteration, Reduction())
        if (vw, stage) in red.sums:
            raise ShardError(
                f"job {self.job}: vw{vw}/stage{stage} already contributed to iteration {iteration}"
            )
        red.sums[(vw, stage)] = dict(grads)
        red.samples[(vw, stage)] = samples
        red.parked.append((item, vw, stage))
        if len(red.sums) < len(self.names):
            return []
        del self.reductions[iteration]
        total: dict[str, torch.Tensor] = {}
        count: dict[str, int] = {}
        with torch.no_grad():
            for key in sorted(red.sums):
                for name, g in red.sums[key].items():
                    total[name] = total[name] + g if name in total else g.clone()
                    count[name] = count.get(name, 0) + red.samples[key]
            mean = {n: t / count[n] for n, t in total.items()}
        return [
            (
                it,
                {"samples": max((count[n] for n in self.names[(v, s)] if n in count), default=0)},
                {n: mean[n] for n in self.names[(v, s)] if n in mean},
            )
            for it, v, s in red.parked
        ]

    def _check(self, vw: int, stage: int, tensors: Mapping[str, torch.Tensor], what: str) -> None:
        """Refuse tensors a stage does not hold here, or of the wrong shape."""
        allowed = self.names.get((vw, stage))
        if allowed is None:
            raise ShardError(f"job {self.job}: vw{vw}/stage{stage} holds nothing on this shard")
        unknown = set(tensors) - set(allowed)
        if unknown:
            raise ShardError(
                f"job {self.job}: vw{vw}/stage{stage} pushed unknown {what} {sorted(unknown)[:3]}"
            )
        for name, d in tensors.items():
            w = self.weights[name]
            if d.shape != w.shape:
                raise ShardError(
                    f"job {self.job}: {name}: {what} of shape {list(d.shape)} "
                    f"for a weight of shape {list(w.shape)}"
                )

    def push(self, vw: int, stage: int, wave: int, deltas: Mapping[str, torch.Tensor]) -> bool:
        """Apply a stage's update of a wave exactly once; False for a duplicate. ``wave`` is
        the VW's own number (:attr:`offsets` maps a re-formed VW's to this shard's)."""
        self._check(vw, stage, deltas, "update")
        wave += self.offsets.get(vw, 0)
        if not self.clock.record_push(vw, stage, wave):
            self.duplicates += 1
            return False
        self._before_apply(wave, deltas)
        with torch.no_grad():
            for name, d in deltas.items():
                w = self.weights[name]
                self.weights[name] = w + d.to(w.dtype)
                self.pushed_bytes += d.numel() * d.element_size()
        self.pushes += 1
        self._close_cuts()
        return True

    def migrate(self, vw: int, stage: int, names: list[str], wave: int) -> None:
        """From wave ``wave`` on, stage ``stage`` of ``vw`` holds ``names`` here (none: it
        leaves this shard): a live migration moved layers between the stages of ``vw`` at
        that boundary (:mod:`hetpipe.migrate`). The weights stay (every virtual worker pushes
        a name to the same shard); the pushes and pulls of the name are the new stage's. A
        stage new here counts the waves before as pushed: their updates came from the
        stages that held the names then, all applied before the boundary."""
        missing = [n for n in names if n not in self.weights]
        if missing:
            raise ShardError(f"job {self.job}: vw{vw}/stage{stage} migrated unknown {missing[:3]}")
        if names:
            self.names[(vw, stage)] = list(names)
            self.clock.join(vw, stage, wave)
        elif (vw, stage) in self.names:
            self.clock.leave(vw, stage)
            del self.names[(vw, stage)]

    def need_of(self, vw: int, need: int) -> int:
        """A pull's ``need`` (a global clock in the VW's own wave numbers) in this shard's."""
        return need + self.offsets.get(vw, 0)

    def remove_vw(self, vw: int, of_vw: Any) -> tuple[int, list[T]]:
        """``vw`` leaves the job here (a worker of it was lost; :mod:`hetpipe.head.reform`):
        its stages hold no names, its clock holds nobody back, its later pushes are refused.
        Returns its clock in its own wave numbers (the waves every one of its stages here
        has pushed: what the global weights hold of it) and its parked pulls (``of_vw``
        tells them), to be refused."""
        if not any(v == vw for v, _ in self.names):
            raise ShardError(f"job {self.job}: vw{vw} holds nothing on this shard")
        self.reach[vw] = max(
            (
                end
                for key in self.names
                if key[0] == vw
                for _, end in self.clock.applied_ranges(*key)
            ),
            default=0,
        )
        clock, parked = self.clock.remove_vw(vw, of_vw)
        for key in [k for k in self.names if k[0] == vw]:
            del self.names[key]
        self.finals.pop(vw, None)
        own = clock - self.offsets.pop(vw, 0)
        self._recut()  # it holds no cut back either, and the job may end earlier
        return max(0, own), parked

    def rejoin_vw(self, vw: int, stages: Mapping[int, list[str]], waves: int) -> int:
        """``vw``, re-formed on other devices with stages ``stages`` (stage -> the names it
        holds here), joins the job again and pushes ``waves`` waves, counted from its own 0:
        its clock restarts at the global clock ``g``, so the staleness bound stays one
        bound for every VW (its pull before its own wave ``c`` waits for ``g + c - 1 - D``);
        where its old stages had pushed a wave ``g`` or later (it ran ahead), past the last
        of those, so that a cut past its own wave 0 holds every update its old stages made.
        Returns that wave (its *base* here)."""
        if any(v == vw for v, _ in self.names):
            raise ShardError(f"job {self.job}: vw{vw} is a member here already")
        for stage, held in stages.items():
            missing = [n for n in held if n not in self.weights]
            if missing:
                raise ShardError(f"job {self.job}: vw{vw}/stage{stage}: no {missing[:3]} here")
        g = self.clock.add_vw(vw, list(stages), waves)
        for stage, held in stages.items():
            self.names[(vw, int(stage))] = list(held)
        self.offsets[vw] = g
        self.finals[vw] = g + waves
        return self.rebase_vw(vw, max(g, self.reach.pop(vw, 0)))

    def rebase_vw(self, vw: int, base: int) -> int:
        """Move re-formed ``vw``, which has pushed nothing since it joined, on to ``base``:
        its waves before it count as pushed here, its own wave 0 is the shards' ``base``
        (the head gives every shard the largest base one of them joined it at, so that its
        waves are one count on every shard: :mod:`hetpipe.head.reform`). The global clock
        never goes back (``base`` is at least its base now). Returns ``base``."""
        was = self.offsets.get(vw)
        if was is None:
            raise ShardError(f"job {self.job}: vw{vw} has not joined again here")
        keys = [k for k in self.names if k[0] == vw]
        if any(self.clock.applied_ranges(*k) != ([[0, was]] if was else []) for k in keys):
            raise ShardError(f"job {self.job}: vw{vw} pushed already; its base stays {was}")
        if base < was:
            raise ShardError(f"job {self.job}: vw{vw} joined at wave {was}, not {base}")
        waves = self.finals[vw] - was
        self.clock.finish(vw, base + waves)
        for key in keys:
            for w in range(was, base):
                self.clock.record_push(*key, w)  # counted as pushed, nothing applied
        self.offsets[vw] = base
        self.finals[vw] = base + waves
        self._recut()  # the job may end later
        return base

    def applied_sets(self) -> dict[str, list[list[int]]]:
        """Every stage's applied waves here: ``"vw/stage"`` -> ranges (core.wsp.wave_ranges)."""
        return {
            f"{vw}/{stage}": self.clock.applied_ranges(vw, stage)
            for vw, stage in sorted(self.names)
        }

    def answer(self, vw: int, stage: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """The fields and tensors of a ``pulled`` reply for one stage, as of now."""
        names = self.names.get((vw, stage))
        if names is None:
            raise ShardError(f"job {self.job}: vw{vw}/stage{stage} holds nothing on this shard")
        off = self.offsets.get(vw, 0)
        applied = self.clock.applied_ranges(vw, stage)  # runs: flat over a long job
        if off:  # in the VW's own wave numbers (those before its own 0 are not its)
            applied = [[lo - off, hi - off] for lo, hi in applied if hi > off]
            applied = [[max(0, lo), hi] for lo, hi in applied]
        fields = {
            "clock": self.clock.global_clock(),
            "vw_clock": self.clock.vw_clock(vw),
            "applied": applied,
        }
        return fields, {n: self.weights[n] for n in names}


class ShardStore(Generic[T]):
    """Every job this shard holds."""

    def __init__(self) -> None:
        self.jobs: dict[str, JobShard[T]] = {}

    def init(
        self,
        job: str,
        members: Mapping[str, Mapping[str, Any]],
        staleness: int,
        weights: Mapping[str, torch.Tensor],
        cut_every: int = 0,
    ) -> JobShard[T]:
        """Hold ``weights`` for ``job``.

        ``members`` maps each VW (str key) to ``{"waves": n, "stages": {stage: [names]}}``:
        the stages with state on this shard and how many waves the VW will push in all, so
        that a VW which finishes early stops holding the global clock back. ``cut_every``:
        keep a cut of the weights every that many waves (see the module docstring).
        """
        names: dict[tuple[int, int], list[str]] = {}
        waves: dict[int, int] = {}
        for vw, member in members.items():
            try:
                stages, waves[int(vw)] = member["stages"], int(member["waves"])
                items = list(stages.items())
            except (KeyError, TypeError, ValueError, AttributeError):
                raise ShardError(f"job {job}: malformed members entry for vw {vw}") from None
            for stage, held in items:
                missing = [n for n in held if n not in weights]
                if missing:
                    raise ShardError(f"job {job}: no initial value for {missing[:3]}")
                names[(int(vw), int(stage))] = list(held)
        clock_members: dict[int, list[int]] = {}
        for vw, stage in names:
            clock_members.setdefault(vw, []).append(stage)
        if cut_every < 0:
            raise ShardError(f"job {job}: cut_every must be >= 0, got {cut_every}")
        self.jobs[job] = JobShard(
            job=job,
            weights={n: t.detach().clone() for n, t in weights.items()},
            names=names,
            clock=WaveClock(clock_members, staleness),
            cut_every=cut_every,
            finals={vw: waves[vw] for vw in clock_members},
        )
        for vw in clock_members:
            self.jobs[job].clock.finish(vw, waves[vw])
        return self.jobs[job]

    def get(self, job: str) -> JobShard[T]:
        try:
            return self.jobs[job]
        except KeyError:
            raise ShardError(f"unknown job {job!r} on this shard") from None

    def drop(self, job: str) -> list[T]:
        """Forget a job; return its parked pulls and reductions so the caller can fail them."""
        js = self.jobs.pop(job, None)
        if js is None:
            return []
        waiting = [it for red in js.reductions.values() for it, _vw, _stage in red.parked]
        return js.clock.release_all() + waiting
