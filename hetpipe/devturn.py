"""A device's turn gate: the stages one worker runs take their passes in the device's order.

Under a device-level schedule (:mod:`hetpipe.core.devschedule`: ``interleaved-1f1b``,
``zbv``) a device holding several stages of one virtual worker runs their forwards and
backwards in one fixed order, not whichever is ready first. Each stage's own order is already
its projection of that order (:class:`hetpipe.core.schedule.StageSchedule`); the gate makes
the stages take turns: a :class:`hetpipe.pipeline.StageRunner` awaits :meth:`DeviceTurn.wait`
before handing a pass to the compute thread and calls :meth:`DeviceTurn.passed` once it ran.
Only passes go through the gate; pulls, merges, optimizer steps and pushes do not.

The gate waits for nothing but the device's own order: a stage whose turn it is runs as soon
as its input is there, and a deadlock-free device order (checked by
:func:`hetpipe.core.devschedule.device_cycles`) always lets the stage whose turn it is run.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from hetpipe.core.devschedule import check_placement, device_order
from hetpipe.core.schedule import (
    DEVICE_KINDS,
    Action,
    Backward,
    BackwardInput,
    BackwardWeight,
    Forward,
)

__all__ = ["DeviceTurn", "device_turn"]

_LETTER = {Forward: "F", Backward: "B", BackwardInput: "I", BackwardWeight: "W"}


class DeviceTurn:
    """The position of one device in its iteration's order, and the stages waiting for it.

    ``kind``, ``k``, ``devices``, ``device``: the schedule, the virtual worker's stages and
    devices, and this device's index; ``nm``: microbatches per iteration; ``total``: the
    microbatches of the run (the last iteration may be short)."""

    def __init__(self, kind: str, k: int, devices: int, device: int, nm: int, total: int) -> None:
        self.kind, self.k, self.devices, self.device = kind, k, devices, device
        self.nm, self.total = nm, total
        self.c = 0  # the iteration in progress
        self.pos = 0  # the next entry of its order
        self._changed = asyncio.Event()

    def order(self, c: int) -> tuple[tuple[int, str, int], ...]:
        """This device's order in iteration ``c``."""
        m = min(self.nm, self.total - c * self.nm)
        return device_order(self.kind, self.k, self.devices, self.device, m)

    @property
    def next(self) -> tuple[int, str, int] | None:
        """The device's next ``(stage, op, p)``; None once the run's last has passed."""
        if self.c * self.nm >= self.total:
            return None
        s, op, j = self.order(self.c)[self.pos]
        return s, op, self.c * self.nm + j

    @staticmethod
    def gated(action: Action) -> bool:
        """Whether ``action`` takes a turn (a forward, a backward or one of its halves)."""
        return type(action) in _LETTER

    def is_turn(self, stage: int, action: Action) -> bool:
        return self.next == (stage, _LETTER[type(action)], action.p)  # type: ignore[union-attr]

    async def wait(self, stage: int, action: Action) -> None:
        """Return once it is ``stage``'s turn to run ``action``."""
        while not self.is_turn(stage, action):
            changed = self._changed
            await changed.wait()

    def passed(self, stage: int, action: Action) -> None:
        """``stage`` ran ``action`` (its turn): the device moves on to its next entry."""
        if not self.is_turn(stage, action):
            raise RuntimeError(f"stage {stage} ran {action!r} out of turn (next: {self.next})")
        self.pos += 1
        if self.pos == len(self.order(self.c)):
            self.c, self.pos = self.c + 1, 0
        self._changed.set()
        self._changed = asyncio.Event()


def device_turn(
    spec: Any, vw: int, stages: Sequence[int], k: int, nm: int, total: int
) -> DeviceTurn | None:
    """The gate of a device running ``stages`` of virtual worker ``vw`` of a job (``spec``: its
    :class:`hetpipe.job.JobSpec`), or None where it needs none: one stage here, or a schedule
    whose order is set per stage."""
    if spec.schedule not in DEVICE_KINDS or len(stages) < 2 or not spec.vws:
        return None
    devices = check_placement(spec.schedule, spec.vws[vw].devices)
    names = list(dict.fromkeys(spec.vws[vw].devices))
    device = names.index(spec.vws[vw].devices[stages[0]])
    return DeviceTurn(spec.schedule, k, devices, device, nm, total)
