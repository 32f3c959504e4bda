"""Validation passes while a job trains (``train.eval_every``), run by virtual worker 0's
pipeline on the workers: where they run, at which wave boundaries, and one stage's
bookkeeping of them (:class:`Passes`). The runner (:class:`hetpipe.pipeline.StageRunner`)
carries them out; the head takes the figures (:mod:`hetpipe.head.evals`).

**Which weights.** A pass at *boundary* ``c`` (``c >= 1``, a wave in ``async``, an iteration
in the synchronous kinds) scores each stage's weights holding every update of the
minibatches before ``c * Nm`` and none after: the weights the shards' global clock ``c``
stands for, where virtual worker 0's weights are the job's global weights (:func:`on_workers`).

**How.** Stage 0 decides, when it is about to run the forward that opens wave ``c`` (no
stage can have taken a step of wave ``c`` before then): every ``waves`` waves, or once
``seconds`` have passed since the last pass. It *announces* the pass down the pipeline
(an ``act`` with ``eval = [c]``), ahead of that forward's activation, so every stage learns
of it before it could take a step of wave ``c``. Each stage runs its part of the pass as soon
as it has taken the steps of every minibatch before ``c * Nm``: forward only, eval mode, no
gradient (:meth:`hetpipe.stage.StageCompute.eval_forward`), on its current weights, training
paused meanwhile (nothing moves them: the pass is part of the stage's own loop). The last
stage scores the validation set (``val_loss`` and ``train.metrics``) and reports the figures
to the head. Training is not disturbed: the same steps run on the same inputs, in the same
order, whether a job evaluates or not; only their timing moves.

**The best model** (``train.keep_best``): the last stage keeps :class:`hetpipe.metrics.Best`
as the head does (the same figures in the same order: the same verdicts) and sends each
pass's verdict back up the pipeline (a ``grad`` with ``eval = [c, improved]``); each stage
waits for it before it trains on, and where the figures improved sends the head its
weights, which are still those the pass scored. The head writes ``model_best.pt`` from them
(no fetch from the shards, which have moved on by then).

**Where the head evaluates instead** (:func:`on_workers` false): with several
asynchronous virtual workers (no virtual worker's weights are the global ones: the head
scores the global weights it gathers from the shards, at the clock they reached), with
ties spanning stages in ``async`` (a copy's weights hold the other copies' updates only
after a pull), and with ``train.bn_recalibrate`` (the statistics are re-estimated on the
whole model first).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hetpipe.metrics import Best, best_rule

__all__ = ["Passes", "on_workers"]


def on_workers(*, sync: bool, num_vws: int, ties: bool, bn_recalibrate: int) -> bool:
    """Whether the evaluations while training run through virtual worker 0's pipeline on
    the workers (else the head scores the global weights it gathers from the shards): where
    virtual worker 0's weights at a boundary are the job's global weights (synchronous, or
    alone in its job without ties spanning stages) and nothing re-estimates batch-norm
    statistics first."""
    return (sync or (num_vws == 1 and not ties)) and not bn_recalibrate


@dataclass
class Passes:
    """One stage's passes while training: those announced, and (on stage 0) when the next
    is due. ``waves``/``seconds``: ``train.eval_every`` as :func:`hetpipe.metrics.parse_every`
    gives it; ``total``: the job's waves (the pass at the end is not one of these)."""

    waves: int
    seconds: float | None
    total: int
    keep_best: str | None = None
    metrics: tuple[str, ...] = ()
    last_t: float = 0.0  # stage 0: when the last pass was decided (or training began)
    pending: list[int] = field(default_factory=list)  # announced boundaries, not run yet
    to_pass_on: list[int] = field(default_factory=list)  # announced, not sent on yet
    verdicts: dict[int, bool] = field(default_factory=dict)  # keep_best: boundary -> improved
    best: Best | None = None  # the last stage's, where keep_best asks

    def __post_init__(self) -> None:
        if self.keep_best:
            self.best = Best(*best_rule(self.keep_best, self.metrics))

    @property
    def any(self) -> bool:
        """Whether any pass runs while training."""
        return bool(self.waves or self.seconds)

    def decide(self, c: int, now: float) -> bool:
        """Stage 0, before the forward that opens wave ``c``: whether a pass runs at
        boundary ``c`` (then it is pending here and to be announced)."""
        if c < 1 or c >= self.total or c in self.pending:
            return False
        if self.waves:
            due = c % self.waves == 0
        else:
            due = self.seconds is not None and now - self.last_t >= self.seconds
        if due:
            self.last_t = now
            self.announce(c)
        return due

    def announce(self, c: int) -> None:
        """A pass at boundary ``c`` (decided here, or announced by the previous stage)."""
        if c in self.pending:
            return
        self.pending.append(c)
        self.to_pass_on.append(c)

    def passing_on(self) -> list[int]:
        """The announcements not sent on yet (taken: the caller sends them)."""
        out, self.to_pass_on = self.to_pass_on, []
        return out

    def due(self, steps: int, per_boundary: int) -> int | None:
        """The first pending boundary this stage has reached: it has taken ``steps``
        optimizer steps, ``per_boundary`` per wave (``async``: one per minibatch, so Nm; the
        synchronous kinds: one per iteration)."""
        for c in sorted(self.pending):
            if steps >= c * per_boundary:
                return c
        return None

    def ran(self, c: int) -> None:
        self.pending.remove(c)

    def offer(self, figures: dict[str, float]) -> bool:
        """The last stage: whether the figures of a pass improve ``train.keep_best``."""
        assert self.best is not None
        return self.best.offer(figures)
