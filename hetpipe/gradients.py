"""A stage's weight gradients between its backwards and its optimizer step.

Asynchronous schedules step once per minibatch: each backward's gradients wait in
:attr:`Gradients.pending` for the step of that minibatch (and, for a replicated stage, are
sent to the other replicas from there). Synchronous schedules step once per iteration on
the mean gradient: the backwards add their microbatch's gradients, weighted by its samples,
to one sum (:meth:`Gradients.add`), which goes to the shards (:meth:`Gradients.to_host`) and
comes back as every virtual worker's mean (:meth:`Gradients.merge`) where several share the
iteration. A tie whose copies sit on several stages (:mod:`hetpipe.modelstate`) has its part
of the sum replaced by the sum over every copy's (:meth:`Gradients.tied` out,
:meth:`Gradients.set_tied` in) before any of it is used. Kept apart from the weights
(:mod:`hetpipe.versions`) because it is what the schedule's kind changes, not what a weight
version is.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from hetpipe.hostcopy import HostCopier, HostCopy

__all__: list[str] = []


class Gradients:
    """Per-minibatch gradients awaiting their step (async), or the iteration's sum (sync)."""

    def __init__(self, dev: str, copier: HostCopier) -> None:
        self.dev = dev
        self.copier = copier
        self.pending: dict[int, dict[str, torch.Tensor]] = {}  # async: gradients awaiting step
        self.sum: dict[str, torch.Tensor] = {}  # sync: this iteration's, sample-weighted
        self.samples = 0
        self.merged: dict[str, torch.Tensor] | None = None  # sync: every VW's mean

    def add(self, grads: Mapping[str, torch.Tensor], samples: int) -> None:
        """Add a microbatch's mean gradient times its samples to the iteration's sum."""
        with torch.no_grad():
            for n, g in grads.items():
                if n in self.sum:
                    self.sum[n].add_(g, alpha=samples)
                else:
                    self.sum[n] = g * samples
        self.samples += samples

    def tied(
        self, names: tuple[str, ...], like: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """This stage's part of the iteration's sum for the ties ``names``: zeros shaped as
        ``like`` where its use of one took no gradient."""
        with torch.no_grad():
            return {n: self.sum[n] if n in self.sum else torch.zeros_like(like[n]) for n in names}

    def set_tied(self, summed: Mapping[str, torch.Tensor]) -> None:
        """Take the sum over every copy of each tie as this stage's part of the iteration's
        sum (the same bits on every copy: each added them in stage order)."""
        for n, g in summed.items():
            self.sum[n] = g.to(self.dev)

    def take_mean(self) -> dict[str, torch.Tensor]:
        """The iteration's mean gradient (every virtual worker's once merged, else this
        stage's own); the iteration's sum starts again."""
        mean = self.merged
        if mean is None:
            with torch.no_grad():
                mean = {n: g / self.samples for n, g in self.sum.items()}
        self.sum, self.samples, self.merged = {}, 0, None
        return mean

    def to_host(self) -> tuple[HostCopy, int]:
        """This iteration's sample-weighted gradient sum, on its way to the host for the
        shards (a side-stream copy: the compute thread does not wait for it), and its
        samples."""
        return self.copier.to_host(self.sum), self.samples

    def merge(self, mean: Mapping[str, torch.Tensor]) -> None:
        """Adopt the mean gradient of every virtual worker's samples of the iteration."""
        self.merged = {n: g.to(self.dev) for n, g in mean.items()}
