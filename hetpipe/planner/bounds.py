"""Memory-aware bounds on a virtual worker's rate, before any of its orders is searched.

The formation search skips a formation whose bound (the sum of its VWs' bounds) cannot
beat the best one found, or sits below the estimates' margin
(:meth:`hetpipe.planner.plan._Search.evaluate`). A VW's rate is at most ``Nm`` minibatches
per round trip, and the plain bounds let Nm grow freely and every layer run on the fastest
type present. Memory limits both: a VW of small devices fits only a shallow pipeline, and
its fast devices cannot hold every layer. Two bounds, each true for every order and split
of the devices (and of any subset of them, which has less memory):

* :meth:`MemoryBounds.nm_ceiling`: the most Nm any split fits. Under the asynchronous
  schedule every stage but the last keeps at least ``f(Nm)`` minibatches in flight
  (:func:`hetpipe.core.memory.in_flight`, its least over the positions before the last),
  and the last stage holds a suffix of the layers that must fit its one device. Each layer
  costs its device at least its own parameter copies, buffers and (activations kept) the
  saved tensors no neighbour shares (:meth:`MemoryBounds.layer_bytes`), so whichever device
  runs the last stage, the layers outside the longest suffix it holds need their bytes at
  ``f(Nm)`` on the other devices; an Nm where they exceed the others' memory together,
  for every choice of that device, fits no split.
* :meth:`MemoryBounds.trip_floor`: the least round trip (every layer's forward and
  backward on the type that runs it) when each device holds no more layer bytes than its
  memory: a device of type ``t`` takes at least ``ratio(t)`` times the reference type's time
  on any layer, so the fractional assignment that puts the layers with the most time per
  byte on the fastest types first is the least (an exchange argument), and every real
  split costs at least that.

Both give up (no bound) where the profile has tied tensors, whose bytes a stage holding
several of their layers counts once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from hetpipe.core.memory import in_flight, kept_copies, param_copies
from hetpipe.planner.costs import least_ratio

__all__ = ["MemoryBounds"]


class MemoryBounds:
    """The per-layer figures of one cost model, and its bounds by device group."""

    def __init__(self, model: Any) -> None:
        """``model``: a :class:`hetpipe.planner.partition.CostModel`."""
        self.model = model
        prof = model.profile
        self.usable = not prof.ties and bool(prof.layers)
        self._ceilings: dict[tuple, int] = {}
        self._floors: dict[tuple, float] = {}
        self._flights: dict[tuple[int, int], int] = {}
        if not self.usable:
            return
        lps = list(prof.layers.values())
        self.params = np.min([[lp.param_bytes for lp in x] for x in lps], axis=0).astype(float)
        self.buffers = np.min([[lp.buffer_bytes for lp in x] for x in lps], axis=0).astype(float)
        own = [[max(0, lp.saved_bytes - lp.saved_input_bytes) for lp in x] for x in lps]
        keeps = model.activations == "keep"
        self.saved = np.min(own, axis=0).astype(float) if keeps else np.zeros(len(self.params))
        self.ref = model.costs(next(iter(prof.layers))).passes  # any type: ratios are to it
        self._ratio: dict[str, float] = {}
        # what every group's bounds read: the bytes at one minibatch, those of each suffix
        # [a, L), and the layers densest first (time per byte) with their running sums
        one = self.layer_bytes(1)
        self._suffix = np.concatenate((np.cumsum(one[::-1])[::-1], [0.0]))
        dense = np.argsort(-(self.ref / np.maximum(one, 1.0)), kind="stable")
        self._dense_m = np.concatenate(([0.0], np.cumsum(one[dense])))
        self._dense_t = np.concatenate(([0.0], np.cumsum(self.ref[dense])))

    def layer_bytes(self, flight: int) -> np.ndarray:
        """Per layer, the least bytes it costs a stage keeping ``flight`` minibatches: its
        parameter copies (weights, optimizer state, accumulators, stashed versions), its
        buffers and its kept saved tensors."""
        m = self.model
        copies = param_copies(m.factor, flight, "async", m.weights)
        return (
            copies * self.params
            + self.buffers
            + kept_copies(flight, "async", m.weights) * self.saved
        )

    def least_flight(self, k: int, nm: int) -> int:
        """The fewest minibatches any stage before the last keeps at ``nm``, over every VW
        of 2..``k`` stages."""
        key = (k, nm)
        hit = self._flights.get(key)
        if hit is None:
            w = self.model.weights
            hit = min(
                in_flight(i, kk, nm, weights=w) for kk in range(2, k + 1) for i in range(kk - 1)
            )
            self._flights[key] = hit
        return hit

    def nm_ceiling(self, devices: Sequence[Any], top: int) -> int:
        """The most Nm (at most ``top``, at least 1) for which some split of ``devices``, or
        of some of them, may fit (see the module docs); ``top`` where no bound is known."""
        if not self.usable or len(devices) < 2:
            return top
        key = (tuple(sorted(d.memory for d in devices)), top)
        hit = self._ceilings.get(key)
        if hit is not None:
            return hit
        suffix = self._suffix  # [a]: bytes of [a, L) at one minibatch
        total = sum(d.memory for d in devices)
        # per device that may run the last stage: the longest suffix it holds, and what the
        # other devices then hold together
        lasts = [
            (int(np.flatnonzero(suffix <= cap)[0]), total - cap)
            for cap in {d.memory for d in devices}
        ]
        hit = 1
        for n in range(2, top + 1):
            before = np.concatenate(
                ([0.0], np.cumsum(self.layer_bytes(self.least_flight(len(devices), n))))
            )
            if all(before[a] > others for a, others in lasts):
                break  # more Nm only keeps more
            hit = n
        self._ceilings[key] = hit
        return hit

    def ratio(self, dtype: str) -> float:
        """The least forward-and-backward time of ``dtype`` on a layer, relative to the
        reference type's on that layer."""
        r = self._ratio.get(dtype)
        if r is None:
            r = self._ratio[dtype] = least_ratio(self.model.costs(dtype).passes, self.ref)
        return r

    def trip_floor(self, devices: Sequence[Any]) -> float:
        """A lower bound on the round trip of any split of ``devices`` (or of some of them)
        whose stages fit their devices (see the module docs); 0 where none is known."""
        if not self.usable or not devices:
            return 0.0
        caps: dict[str, int] = {}
        for d in devices:
            caps[d.type] = caps.get(d.type, 0) + d.memory
        key = tuple(sorted(caps.items()))
        hit = self._floors.get(key)
        if hit is not None:
            return hit
        cum_m, cum_t = self._dense_m, self._dense_t
        fastest = sorted(caps, key=self.ratio)
        hit, start = 0.0, 0.0
        for t in fastest:
            end = min(start + caps[t], float(cum_m[-1]))
            took = np.interp([start, end], cum_m, cum_t)
            hit += self.ratio(t) * float(took[1] - took[0])
            start = end
        if start < cum_m[-1]:
            hit = float("inf")  # the layers need more than the devices hold
        hit *= 1.0 - 1e-9  # margin for rounding
        self._floors[key] = hit
        return hit
