"""What a stage spent its time on: spans for the trace, totals for live telemetry.

Every segment of a stage's main loop is one span of one kind, so the kinds add up to the
stage's elapsed time (up to the few microseconds of the loop's own decisions):

=========  ================================================================
forward    the forward of a minibatch (compute, padded to the device speed)
backward   the backward and (async) the local optimizer step after it
step       a synchronous iteration's optimizer step (after its last backward)
send       handing an activation or gradient to the next/previous stage
push       handing the update of a wave to the parameter server
merge      loading pulled weights plus own not-yet-applied updates
gate       waiting for a pull to be answered: the WSP staleness gate
bubble     waiting for work: an activation, a gradient, or admission
replicas   a replicated stage's gradient exchange: sending its gradients to the
           other replicas and waiting for theirs (hetpipe.replicas)
=========  ================================================================

Times are wall-clock (``time.time``) so spans of different daemons on one host line up.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["BUSY", "KINDS", "Timeline", "shares"]

KINDS = ("forward", "backward", "step", "send", "push", "merge", "gate", "bubble", "replicas")
BUSY = ("forward", "backward", "step")


class Timeline:
    """Spans of one stage and running totals per kind."""

    def __init__(self, keep_spans: bool = True) -> None:
        self.keep_spans = keep_spans
        self.spans: list[list[Any]] = []  # [kind, t0, t1, p, wave]
        self.totals = dict.fromkeys(KINDS, 0.0)
        self.started = time.time()

    @contextmanager
    def span(self, kind: str, p: int | None = None, wave: int | None = None) -> Iterator[None]:
        t0 = time.time()
        try:
            yield
        finally:
            self.add(kind, t0, time.time(), p, wave)

    def add(
        self, kind: str, t0: float, t1: float, p: int | None = None, wave: int | None = None
    ) -> None:
        """A span measured elsewhere (on the compute thread)."""
        self.totals[kind] += t1 - t0
        if self.keep_spans:
            self.spans.append([kind, t0, t1, p, wave])

    def elapsed(self) -> float:
        return time.time() - self.started


def shares(totals: dict[str, float], elapsed: float) -> dict[str, float]:
    """Busy, communication, gate and bubble as fractions of ``elapsed``."""
    if elapsed <= 0:
        return {"busy": 0.0, "comm": 0.0, "gate": 0.0, "bubble": 0.0}
    return {
        "busy": sum(totals.get(k, 0.0) for k in BUSY) / elapsed,
        "comm": sum(totals.get(k, 0.0) for k in ("send", "push", "merge")) / elapsed,
        "gate": totals.get("gate", 0.0) / elapsed,
        "bubble": totals.get("bubble", 0.0) / elapsed,
    }
