"""Prediction probes of ``train.weights = "predict"`` (SpecTrain): how good a stage's weight
predictions are.

A forward that runs on weights predicted ``s_fwd`` updates ahead may start a probe: its
predicted and stale (current then) weights wait until the stage has taken those ``s_fwd``
updates, and are then scored ``||W_hat - W_target|| / ||W_stale - W_target||`` against the
weights of that moment (:meth:`Probes.judge`). Not every forward is probed: a probe starts
when none is outstanding and :attr:`Probes.every` minibatches have passed since the last one
started, so judging (two passes over the stage's weights) costs a fraction of a step on
average while the scores stay whole probes spread over the run. The scores stay on the
device and are read back in batches (:class:`hetpipe.readback.Readback`): reading each
would wait for the queued kernels. Its own module because it only observes training: the
compute (:mod:`hetpipe.stage`) offers it forwards and steps, and nothing it does changes
the weights.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

from hetpipe.readback import Readback

__all__ = ["PROBE_EVERY"]

# weights = "predict": a prediction is scored (Probes.judge) for at most one forward in this
# many minibatches; every probe is judged in full, the others cost nothing
PROBE_EVERY = 8


@dataclass
class Probe:
    """A forward's predicted and stale weights, waiting for the step count they aimed at."""

    target: int  # optimizer steps of this stage at which the prediction is judged
    predicted: dict[str, torch.Tensor]
    stale: dict[str, torch.Tensor]
    late: bool = False  # a late-bound forward's: released once judged (StageCompute._release)


class Probes:
    """The outstanding probe of one stage, when the next may start, and the scores on their
    way back from the device."""

    def __init__(self, dev: str) -> None:
        self.probe: Probe | None = None
        # a probe starts at most every ``every`` minibatches (judge): judging takes two
        # passes over the stage's weights and a read to the host
        self.every = PROBE_EVERY
        self.next = 0  # the first minibatch that may start the next probe
        self.quality = Readback(dev)  # the scores, read back in batches

    def offer(
        self,
        p: int,
        target: int,
        predicted: dict[str, torch.Tensor],
        stale: dict[str, torch.Tensor],
        late: bool,
    ) -> None:
        """The forward of ``p`` runs on ``predicted`` (``stale`` the weights then), aimed at
        the step count ``target``: probed if none is outstanding and it is ``p``'s turn."""
        if self.probe is None and p >= self.next:
            self.probe = Probe(target, predicted, stale, late)
            self.next = p + self.every

    def judge(
        self, params: Mapping[str, torch.Tensor], steps_taken: int
    ) -> dict[str, torch.Tensor] | None:
        """Score the outstanding prediction once the stage took the ``s_fwd`` updates it
        extrapolated: W(target) is ``params``, the stage's weights after ``steps_taken``
        steps (on stages past 0 one of them is the minibatch's own, which the prediction
        leaves out by design: a small, consistent handicap of the score).

        Returns a late-bound forward's prediction once scored, for the stage to release
        (its graph needs none of its values: a late forward's always differ), else None.
        """
        probe = self.probe
        if probe is None or steps_taken < probe.target:
            return None
        self.probe = None
        names = [n for n in probe.predicted if probe.predicted[n] is not probe.stale[n]]
        if not names:
            return None
        k = len(names)
        with torch.no_grad():
            # both differences in one fused op, both norms in another (each tensor's result
            # is the one separate calls give); the ratio stays on the device until read back
            # in a batch (read): reading it here would wait for the queued kernels
            now = [params[n] for n in names]
            diffs = torch._foreach_sub(
                [probe.predicted[n] for n in names] + [probe.stale[n] for n in names], now + now
            )
            norms = torch._foreach_norm(diffs)
            num, den = torch.stack(
                [torch.stack(norms[:k]).norm(), torch.stack(norms[k:]).norm()]
            ).double()
            # a probe whose stale weights were the target's scores nothing (NaN, dropped)
            self.quality.add(probe.target, torch.where(den > 0, num / den, torch.nan))
        return probe.predicted if probe.late else None

    def read(self, block: bool = False) -> Iterator[float]:
        """The scores read back since the previous call (all of them with ``block``),
        without those of probes that had nothing to score."""
        return (v for _, v in self.quality.ready(block) if not math.isnan(v))
