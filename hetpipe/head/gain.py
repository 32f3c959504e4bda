"""The measured gain of a re-plan's live migration, beside the gain the re-plan predicted.

A re-plan promises a speed-up (its ``gain``: the virtual worker's predicted throughput on the
new split over the old one with the drifted device's measured slowdown). Whether the
migration delivered it is measured from the pace of the virtual worker's first stage, which
reports how many minibatches it admitted every half second (:class:`Pace`):

- **before**: the rate over the ``span`` seconds before the first stage reached the boundary
  (the drifted pace the re-plan answered: the watch spans two of its windows, the one the
  drift was seen over and the one that confirmed it, both before the decision);
- **after**: the rate over the same ``span`` from the first report past the new split's
  first wave (the migration's stall and its first wave left out), or up to the virtual
  worker's last report where it ends sooner.

``measured_gain = after / before``. A virtual worker that ends too soon after the boundary
(within the new split's first wave, or with fewer than two reports or less than one wave
after it) gets no measurement, and the record says why. In steady state a first stage
admits at its virtual worker's throughput, so its pace is the virtual worker's rate without
waiting for its last stage.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field
from typing import Any

__all__ = ["GainProbe", "Pace"]

PACE_KEEP = 4096  # reports kept per virtual worker: half an hour at two a second


@dataclass
class Pace:
    """When each virtual worker's first stage reported each count of admitted minibatches."""

    keep: int = PACE_KEEP
    seen: dict[int, deque[tuple[float, int]]] = field(default_factory=dict)

    def note(self, vw: int, t: float, admitted: int) -> None:
        """A report of ``vw``'s first stage at ``t``: ``admitted`` minibatches so far."""
        got = self.seen.setdefault(vw, deque(maxlen=self.keep))
        if got and (t < got[-1][0] or admitted < got[-1][1]):
            got.clear()  # a new attempt or a re-formed VW counts again
        got.append((t, admitted))

    def of(self, vw: int) -> list[tuple[float, int]]:
        return list(self.seen.get(vw, ()))


def _rate(points: list[tuple[float, int]]) -> float | None:
    """Minibatches per second between the first and the last of ``points``."""
    if len(points) < 2 or points[-1][0] <= points[0][0]:
        return None
    return (points[-1][1] - points[0][1]) / (points[-1][0] - points[0][0])


@dataclass
class GainProbe:
    """One migration carried out at boundary ``at`` (``nm``: its wave) of virtual worker
    ``vw`` that ``total`` minibatches, whose re-plan predicted ``predicted``; measured over
    ``span`` seconds either side (:meth:`measure`)."""

    vw: int
    at: int
    nm: int
    total: int
    predicted: float
    span: float

    def measure(self, points: list[tuple[float, int]]) -> dict[str, Any] | None:
        """The measurement once the reports ``points`` (time, admitted) cover both sides;
        None while they do not yet. A virtual worker that ended first gets a record whose
        ``measured_gain`` is None and whose ``why`` says so."""
        out: dict[str, Any] = {
            "vw": self.vw,
            "at": self.at,
            "predicted_gain": round(self.predicted, 4),
            "span_s": self.span,
        }
        ended = bool(points) and points[-1][1] >= self.total
        counts = [n for _, n in points]
        reach = bisect.bisect_left(counts, self.at)  # the first report at the boundary
        resume = bisect.bisect_left(counts, self.at + self.nm)
        if resume >= len(points):
            if not ended:
                return None
            return {
                **out,
                "measured_gain": None,
                "why": "it ended within its new split's first wave",
            }
        t_reach, t_resume = points[reach][0], points[resume][0]
        if points[-1][0] < t_resume + self.span and not ended:
            return None  # the span after is not over yet
        before = [p for p in points[: reach + 1] if p[0] >= t_reach - self.span]
        after = [p for p in points[resume:] if p[0] <= t_resume + self.span]
        r0, r1 = _rate(before), _rate(after)
        if r0 is None or r1 is None or r0 <= 0 or after[-1][1] - after[0][1] < self.nm:
            side = "before" if r0 is None or r0 <= 0 else "after"
            return {**out, "measured_gain": None, "why": f"too few reports {side} the boundary"}
        return {
            **out,
            "before_per_s": round(r0, 3),
            "after_per_s": round(r1, 3),
            "measured_gain": round(r1 / r0, 4),
        }
