"""How stale each minibatch's weights are, counted from the schedule (for weight prediction).

Weight prediction (``train.weights = "predict"``, the SpecTrain technique) runs the forward
and the backward of minibatch p at a stage on weights extrapolated ``s`` updates ahead. ``s``
is not taken from a closed formula: it is counted from the action sequence the stages of a
virtual worker actually run (:mod:`hetpipe.schedule`, timed in lock step by
:func:`hetpipe.schedule.clock_cycles`), so it is right for any k, Nm (they differ in hetpipe:
a pipeline need not be full) and stage position, and for the last stage whose backward
follows its forward at once.

**The target moment.** A minibatch's update does not land at one moment: each stage applies
its share after its own backward of p, the last stage first and stage 0 last. The target is
the moment p's update has landed at *every* stage, i.e. the end of its backward at stage 0
(its optimizer step there): a minibatch predicted to that moment sees, at every stage, the
weights of one consistent point of training, the version the whole model has once p is
done. For stage i and minibatch p:

- ``s_fwd`` = this stage's optimizer steps from its forward of p up to (not including) the
  tick of p's backward at stage 0;
- ``s_bwd`` = the same from its backward of p (its own step of p included).

The stage's own step of p lies before that moment (at every stage but 0) and is not counted
by the runtime: a minibatch is predicted onto the weights it would see if nothing were in
flight, which never include its own update (so with Nm = 1 every s is 0 and prediction
changes nothing). The paper counts it; :func:`version_gaps` gives both conventions.

So ``s_fwd - s_bwd`` is the number of updates between the forward and the backward of p at
this stage: exactly what a run's records observe as ``bwd_version - fwd_version``.

On a uniform k-stage 1F1B pipeline with Nm = k, at stage index k_i (1-based) of N in steady
state, ``s_bwd = floor(k_i / 2)`` as in the paper, and ``s_fwd = floor(k_i / 2) + N - k_i``:
one more than the paper's ``floor(k_i/2) + N - k_i - 1``. The paper's forward figure gives the
last stage a forward staleness one *below* its backward staleness although the two run back
to back, which no action sequence produces; counted, the stage's N - k_i updates between its
forward and backward of p (Nm - 1 at stage 0: minibatches p - Nm + 1 .. p - 1) are all there.

Other virtual workers' updates (merged at wave boundaries under WSP) are not counted: the
prediction extrapolates this stage's own momentum only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hetpipe.schedule import Backward, Forward, OptimizerStep, StageSchedule, clock_cycles

__all__ = ["StageGaps", "version_gaps"]


def version_gaps(k: int, nm: int, total: int, *, own: bool = False
                 ) -> list[dict[int, tuple[int, int]]]:
    """``(s_fwd, s_bwd)`` of every minibatch ``0 .. total - 1`` at every stage of a virtual
    worker alone in its job (async kind), counted from its lock-step action tables.

    ``own``: count the stage's own step of p too (the paper's convention; see the module
    docs). Without it (what the runtime predicts with) only other minibatches' updates count:
    a minibatch run synchronously never sees its own update, so with Nm = 1 every s is 0.
    """
    schedules = [StageSchedule("async", k=k, stage=s, nm=nm, total=total, pushes=False)
                 for s in range(k)]
    fwd: list[dict[int, int]] = [{} for _ in range(k)]
    bwd: list[dict[int, int]] = [{} for _ in range(k)]
    steps: list[list[tuple[int, int]]] = [[] for _ in range(k)]
    for tick, s, a in clock_cycles(schedules):
        if isinstance(a, Forward):
            fwd[s][a.p] = tick
        elif isinstance(a, Backward):
            bwd[s][a.p] = tick
        elif isinstance(a, OptimizerStep):
            steps[s].append((tick, a.i))
    out: list[dict[int, tuple[int, int]]] = []
    for s in range(k):
        gaps = {}
        for p in range(total):
            end = bwd[0][p]
            mine = [t for t, i in steps[s] if own or i != p]
            gaps[p] = (_count(mine, fwd[s][p], end), _count(mine, bwd[s][p], end))
        out.append(gaps)
    return out


def _count(ticks: Sequence[int], start: int, end: int) -> int:
    """Steps at ticks in ``[start, end)`` (a backward's step is in its own tick)."""
    return sum(1 for t in ticks if start <= t < end)


@dataclass
class StageGaps:
    """``(s_fwd, s_bwd)`` of any minibatch at one stage, for runs of any length.

    The lock-step tables of a long run are periodic with period Nm once the pipeline is full
    and until it drains, so a window of ``window`` minibatches (as long as the run modulo Nm)
    is counted once: its head gives
    the first minibatches, its tail the last ones, and its middle (one period) the rest.
    """

    k: int
    stage: int
    nm: int
    total: int

    def __post_init__(self) -> None:
        window = 6 * (self.nm + self.k) + 4 * self.nm
        # the same phase modulo Nm as the run, so the window's drain is the run's drain
        self.window = min(self.total, window + (self.total - window) % self.nm)
        self.gaps = version_gaps(self.k, self.nm, self.window)[self.stage]
        self.half = self.window // 2

    def __call__(self, p: int) -> tuple[int, int]:
        if self.window == self.total or p < self.half:
            return self.gaps[p]
        from_end = self.total - p
        if from_end <= self.window - self.half:
            return self.gaps[self.window - from_end]
        start = self.half - self.nm
        return self.gaps[start + (p - start) % self.nm]
