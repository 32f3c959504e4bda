"""Emulated heterogeneity: speed padding and memory caps.

A CPU-only machine cannot show how a pipeline behaves on fast and slow GPUs unless the slow
ones really are slow. A device with ``speed = s < 1`` pads every forward and backward so that
it takes (its work's time) / s, and its ``memory`` is a cap the runtime enforces on the bytes
a stage keeps alive, counted by the planner's own memory model
(:mod:`hetpipe.core.memory`, :meth:`hetpipe.stage.StageCompute.memory`).

**Which clock measures the work.** An emulated device on the host's CPU computes on one
thread (the worker's torch runs one intra-op thread), so its work is that thread's CPU time
(:func:`time.thread_time`): the cycles the layers took, co-running cores' cache and memory
contention included. Time the thread spent descheduled or waiting for the GIL is the host's,
not the modelled device's: padding the wall clock would multiply every such stall by 1 / s,
so a slowed device would measure its host's contention more than its own speed. The pad
sleeps until the wall clock reaches the CPU time / s; a stall longer than that still shows
(the host really was that slow). Where the CPU time does not cover the work
(a CUDA device, whose kernels are not the thread's, or torch on several intra-op threads) the
wall clock stays the measure.

**The least work, not the last.** A pass's CPU time also varies with the host: after the
pad's sleep the core has cooled (caches refilled, clocks ramped, a virtual CPU rescheduled)
and other processes' work has evicted the thread's data, so the next pass takes more CPU
than the same pass back to back, by milliseconds whatever its size. A real slow GPU pays
none of that, and padding it by 1 / speed would multiply it: a device at speed 0.0025 turned
a 10 ms cold start into 4 s a pass. So a device pads each kind of pass (forward, backward,
each half of a split one; per input shape, recomputing or not: :class:`Pace`) to the least
CPU time that pass has taken on its thread so far, the closest measure of the work itself,
as a profile that times layers back to back measures it. A pass whose wall-clock time
already exceeds that / speed is not padded (the host really was that slow). Where every pass
of a kind follows a sleep (a device so slow that its microbatches never run back to back),
the least still holds a cold start: on such a host, keep speeds within what it can show.

**A slowed device** (``[[fault]] kind = "slow"``, :func:`speed_at`) rehearses a GPU that
throttles or is shared mid-job: from a given minibatch on, the device computes at its speed
divided by the fault's factor. The same pad does it on every device: an emulated one's
padding stretches, and a real one (speed 1) becomes padded, i.e. waits for its GPU work and
sleeps the extra time after each forward and backward.

Only a padded device waits for its queued GPU work: measuring the time to pad needs the
work to have finished. A device running at its own speed (``speed = 1``, every real GPU)
never synchronises here, so the host keeps queueing kernels ahead of the GPU; the times it
reports are then the host's (launch) times, not the kernels'.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from hetpipe.core.profile import padded_speed

__all__ = [
    "Mark",
    "Pace",
    "emulated",
    "mark",
    "on_thread_clock",
    "pad",
    "padded_speed",
    "speed_at",
    "synchronize",
]


@dataclass(frozen=True)
class Mark:
    """When a piece of work began, on both clocks :func:`pad` may measure it with."""

    wall: float  # time.perf_counter()
    cpu: float  # time.thread_time() of the thread doing the work


def mark() -> Mark:
    """Start timing a forward or backward on the calling thread (see :func:`pad`)."""
    return Mark(time.perf_counter(), time.thread_time())


class Pace:
    """The least CPU time each kind of pass has taken on one device's compute thread: the
    work :func:`pad` stretches (see the module docs)."""

    def __init__(self) -> None:
        self.least: dict[Hashable, float] = {}

    def work(self, key: Hashable, measured: float) -> float:
        """The work of a pass of kind ``key`` that measured ``measured`` CPU seconds."""
        least = min(self.least.get(key, measured), measured)
        self.least[key] = least
        return least


def on_thread_clock(device: str) -> bool:
    """Whether the calling thread's CPU time is the whole of a pass's work on ``device``:
    a host device with one torch intra-op thread. Else the pad measures the wall clock."""
    if not device.startswith("cpu"):
        return False
    import torch

    return torch.get_num_threads() == 1


def emulated(speed: float) -> bool:
    """Whether a device of this ``speed`` is slowed on purpose (its compute is padded)."""
    return speed < 1.0


def speed_at(speed: float, slowdowns: Sequence[tuple[int, float]], p: int) -> float:
    """The speed minibatch ``p`` computes at on a device of config ``speed`` under the
    slowdowns ``(at_minibatch, factor)`` it is given (``[[fault]] kind = "slow"``): each one
    from its minibatch on divides the device's padded speed by its factor (several
    compound). Unslowed, ``speed`` as configured."""
    factor = 1.0
    for at, f in slowdowns:
        if p >= at:
            factor *= f
    return speed if factor == 1.0 else padded_speed(speed) / factor


def synchronize(device: str) -> None:
    """Wait for queued GPU work so that a wall-clock measurement covers it."""
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize(device)


def pad(
    started: Mark,
    speed: float,
    device: str,
    pace: Pace | None = None,
    key: Hashable = None,
) -> float:
    """Sleep so that the work begun at ``started`` takes (its work's time) / speed, on the
    clock that measures the work (:func:`on_thread_clock`); return its wall-clock time.
    With ``pace``, a pass of kind ``key`` on the thread clock is stretched from the least
    CPU time such a pass has taken (:class:`Pace`).

    Sleeping releases the CPU, so a slowed device does not steal compute from the others on
    the same host: the emulated cluster keeps the relative speeds the config asks for. An
    unslowed device returns at once, without synchronising with its GPU.
    """
    if not emulated(speed):
        return time.perf_counter() - started.wall
    synchronize(device)
    elapsed = time.perf_counter() - started.wall
    if on_thread_clock(device):
        work = time.thread_time() - started.cpu
        if pace is not None:
            work = pace.work(key, work)
    else:
        work = elapsed
    rest = work / speed - elapsed
    if rest > 0:
        time.sleep(rest)
    return max(elapsed, work / speed)
