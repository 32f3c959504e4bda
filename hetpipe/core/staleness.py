"""How stale each minibatch's weights are, counted from the schedule (for weight prediction).

Weight prediction (``train.weights = "predict"``, the SpecTrain technique) runs the forward
and the backward of minibatch p at a stage on weights extrapolated ``s`` updates ahead. ``s``
is not taken from a closed formula: it is counted from the action sequence the stages of a
virtual worker actually run (:mod:`hetpipe.core.schedule`, timed in lock step by
:func:`hetpipe.core.schedule.clock_cycles`), so it is right for any k, Nm (they differ in hetpipe:
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

**A nearer target, measured worse.** Every stage applies its updates in minibatch order, so
p's update at stage i is always applied to ``W_i(p)``, the stage's weights after the updates
of minibatches before p: the weights minibatch SGD would compute p's gradient on. Aiming
there instead (``s_fwd`` = the updates of earlier minibatches still to come, ``s_bwd`` = 0,
nothing extrapolated at the last stage) would make a perfect prediction exactly minibatch
SGD, but with real predictions it trained worse: on the digits CNN with k = Nm = 8 (lr 0.02,
200 minibatches) it ended at 0.967 and 0.936 test accuracy (seeds 0 and 1) against 0.986 and
0.992 with the target above, and on the synthetic-token GPT at k = 4 at 0.198 against 0.207.
Aiming past ``W_i(p)`` along the momentum pays: the target above stays.

Other virtual workers' updates (merged at wave boundaries under WSP) are not counted: the
prediction extrapolates this stage's own momentum only.
"""

from __future__ import annotations

from collections.abc import Sequence

from hetpipe.core.schedule import Backward, Forward, OptimizerStep, StageSchedule, clock_cycles

__all__ = ["StageTable", "lockstep_orders", "version_gaps"]


def version_gaps(
    k: int, nm: int, total: int, *, own: bool = False
) -> list[dict[int, tuple[int, int]]]:
    """``(s_fwd, s_bwd)`` of every minibatch ``0 .. total - 1`` at every stage of a virtual
    worker alone in its job (async kind), counted from its lock-step action tables.

    ``own``: count the stage's own step of p too (the paper's convention; see the module
    docs). Without it (what the runtime predicts with) only other minibatches' updates count:
    a minibatch run synchronously never sees its own update, so with Nm = 1 every s is 0.
    """
    return [_count_gaps(ops, total, own) for ops in lockstep_orders(k, nm, total)]


def lockstep_orders(k: int, nm: int, total: int) -> list[list[tuple[str, int, int]]]:
    """Each stage's forwards ``("F", p, tick)``, backwards ``("B", p, tick)`` and optimizer
    steps ``("S", p, tick)`` in the order the lock-step tables run them."""
    schedules = [
        StageSchedule("async", k=k, stage=s, nm=nm, total=total, pushes=False) for s in range(k)
    ]
    out: list[list[tuple[str, int, int]]] = [[] for _ in range(k)]
    for tick, s, a in clock_cycles(schedules):
        if isinstance(a, Forward):
            out[s].append(("F", a.p, tick))
        elif isinstance(a, Backward):
            out[s].append(("B", a.p, tick))
        elif isinstance(a, OptimizerStep):
            out[s].append(("S", a.i, tick))
    # every stage's gaps end at stage 0's backward: carry its ticks along
    ends = {p: t for op, p, t in out[0] if op == "B"}
    return [[*ops, *(("E", p, t) for p, t in ends.items())] for ops in out]


def _count_gaps(
    ops: Sequence[tuple[str, int, int]], total: int, own: bool
) -> dict[int, tuple[int, int]]:
    fwd = {p: t for op, p, t in ops if op == "F"}
    bwd = {p: t for op, p, t in ops if op == "B"}
    end = {p: t for op, p, t in ops if op == "E"}
    steps = [(t, i) for op, i, t in ops if op == "S"]
    gaps = {}
    for p in range(total):
        mine = [t for t, i in steps if own or i != p]
        gaps[p] = (_count(mine, fwd[p], end[p]), _count(mine, bwd[p], end[p]))
    return gaps


def _count(ticks: Sequence[int], start: int, end: int) -> int:
    """Steps at ticks in ``[start, end)`` (a backward's step is in its own tick)."""
    return sum(1 for t in ticks if start <= t < end)


class StageTable:
    """One stage's lock-step compute order and ``(s_fwd, s_bwd)``, for runs of any length.

    A stage that predicts weights runs exactly this order of forwards and backwards
    (:class:`hetpipe.core.schedule.StageSchedule` ``sequence``), whatever the relative speed of its
    neighbours: so the s it predicts with is the number of updates that really come, on a
    heterogeneous pipeline as on a uniform one (greedy 1F1B would let timing reorder them).

    The lock-step tables of a long run are periodic once the pipeline is full and until it
    drains (period Nm in minibatches, 2 Nm in compute actions), so a window as long as the run
    modulo Nm is counted once: its head gives the start, its tail the drain, one period of its
    middle the rest.
    """

    def __init__(self, k: int, stage: int, nm: int, total: int) -> None:
        self.k, self.stage, self.nm, self.total = k, stage, nm, total
        window = 6 * (nm + k) + 4 * nm
        self.window = min(total, window + (total - window) % nm)
        ops = lockstep_orders(k, nm, self.window)[stage]
        self.ops = [(op, p) for op, p, _t in ops if op in ("F", "B")]
        self.gaps = _count_gaps(ops, self.window, own=False)
        self.half = self.window // 2
        self.shift = total - self.window  # minibatch offset of the window's tail in the run

    def s(self, p: int) -> tuple[int, int]:
        """``(s_fwd, s_bwd)`` of minibatch ``p``."""
        if self.shift == 0 or p < self.half:
            return self.gaps[p]
        if p - self.shift >= self.half:
            return self.gaps[p - self.shift]
        start = self.half - self.nm
        return self.gaps[start + (p - start) % self.nm]

    def op(self, n: int) -> tuple[str, int]:
        """The ``n``-th forward or backward of this stage: ``("F", p)`` or ``("B", p)``."""
        if self.shift == 0 or n < self.window:
            return self.ops[n]
        if n - 2 * self.shift >= self.window:
            kind, p = self.ops[n - 2 * self.shift]
            return kind, p + self.shift
        start = self.window - 2 * self.nm
        periods, j = divmod(n - start, 2 * self.nm)
        kind, p = self.ops[start + j]
        return kind, p + periods * self.nm
