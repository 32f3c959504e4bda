"""How stale each minibatch's weights are, counted from the schedule (for weight prediction).

Weight prediction (``train.weights = "predict"``, the SpecTrain technique) runs the forward
and the backward of minibatch p at a stage on weights extrapolated ``s`` updates ahead. ``s``
is not taken from a closed formula: it is counted from the action sequence the stages of a
virtual worker actually run (:mod:`hetpipe.schedule`, timed in lock step by
:func:`hetpipe.schedule.clock_cycles`), so it is right for any k, Nm (they differ in hetpipe:
a pipeline need not be full) and stage position, and for the last stage whose backward
follows its forward at once.

**The target: the weights minibatch SGD would use.** A stage applies its updates in
minibatch order, each right after that minibatch's backward, so the update of minibatch p at
stage i is always applied to ``W_i(p)``, the stage's weights after the updates of minibatches
``0 .. p - 1``: exactly the weights synchronous minibatch SGD (Nm = 1) would compute p's
gradient on. With Nm > 1 the forward of p at a stage before the last runs when some of those
updates have not been applied yet. So the runtime predicts p onto ``W_i(p)``:

- ``s_fwd`` = this stage's updates of minibatches before p applied after its forward of p
  (the updates still to come when the forward runs);
- ``s_bwd`` = the same after its backward of p: always 0 in the async kind, since the
  backward of p follows every step of a minibatch before p (kept as a count, not assumed).

So ``s_fwd - s_bwd`` is what a run's records observe as ``bwd_version - fwd_version``, a
perfect prediction turns the pipeline into minibatch SGD, with Nm = 1 every s is 0 (nothing is
predicted) and the last stage, whose backward follows its forward at once, never extrapolates.

**The paper's count** (``paper=True``) aims further: at the moment p's update has landed at
*every* stage (the end of its backward at stage 0), counting the stage's own update of p. On
a uniform k-stage 1F1B pipeline with Nm = k, at stage index k_i (1-based) of N in steady
state, it gives ``s_bwd = floor(k_i / 2)`` as in the paper, and
``s_fwd = floor(k_i / 2) + N - k_i``: one more than the paper's forward figure
``floor(k_i/2) + N - k_i - 1``, which gives the last stage a forward staleness one *below*
its backward staleness although the two run back to back (no action sequence does that).
That target lies ``s_bwd`` updates past ``W_i(p)`` (the update of p and of later
minibatches, up to floor(N/2) at the last stage): a gradient computed there is applied to
weights it was not computed on, a look-ahead that minibatch SGD does not take and that a
stage without staleness (the last) does not need. The runtime does not use it.

Other virtual workers' updates (merged at wave boundaries under WSP) are not counted: the
prediction extrapolates this stage's own momentum only.
"""

from __future__ import annotations

from collections.abc import Sequence

from hetpipe.schedule import Backward, Forward, OptimizerStep, StageSchedule, clock_cycles

__all__ = ["StageTable", "lockstep_orders", "version_gaps"]


def version_gaps(k: int, nm: int, total: int, *, paper: bool = False
                 ) -> list[dict[int, tuple[int, int]]]:
    """``(s_fwd, s_bwd)`` of every minibatch ``0 .. total - 1`` at every stage of a virtual
    worker alone in its job (async kind), counted from its lock-step action tables.

    By default the updates up to ``W_i(p)`` (what the runtime predicts with); ``paper``: the
    paper's count, up to p's update at every stage, its own included (see the module docs).
    """
    return [_count_gaps(ops, total, paper) for ops in lockstep_orders(k, nm, total)]


def lockstep_orders(k: int, nm: int, total: int) -> list[list[tuple[str, int, int]]]:
    """Each stage's forwards ``("F", p, tick)``, backwards ``("B", p, tick)`` and optimizer
    steps ``("S", p, tick)`` in the order the lock-step tables run them."""
    schedules = [StageSchedule("async", k=k, stage=s, nm=nm, total=total, pushes=False)
                 for s in range(k)]
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


def _count_gaps(ops: Sequence[tuple[str, int, int]], total: int, paper: bool
                ) -> dict[int, tuple[int, int]]:
    fwd = {p: t for op, p, t in ops if op == "F"}
    bwd = {p: t for op, p, t in ops if op == "B"}
    steps = [(t, i) for op, i, t in ops if op == "S"]
    if paper:  # every step up to the end of p's backward at stage 0
        end = {p: t for op, p, t in ops if op == "E"}
        return {p: (_count([t for t, _i in steps], fwd[p], end[p]),
                    _count([t for t, _i in steps], bwd[p], end[p])) for p in range(total)}
    # the steps of minibatches before p still to come: those that make W_i(p)
    gaps = {}
    for p in range(total):
        before = [t for t, i in steps if i < p]
        gaps[p] = (_count(before, fwd[p], _END), _count(before, bwd[p], _END))
    return gaps


_END = 1 << 62  # no end: every later step counts


def _count(ticks: Sequence[int], start: int, end: int) -> int:
    """Steps at ticks in ``[start, end)`` (a backward's step is in its own tick)."""
    return sum(1 for t in ticks if start <= t < end)


class StageTable:
    """One stage's lock-step compute order and ``(s_fwd, s_bwd)``, for runs of any length.

    A stage that predicts weights runs exactly this order of forwards and backwards
    (:class:`hetpipe.schedule.StageSchedule` ``sequence``), whatever the relative speed of its
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
        self.gaps = _count_gaps(ops, self.window, paper=False)
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
