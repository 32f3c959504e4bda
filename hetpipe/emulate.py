"""Emulated heterogeneity: speed padding and memory caps.

A CPU-only machine cannot show how a pipeline behaves on fast and slow GPUs unless the slow
ones really are slow. A device with ``speed = s < 1`` pads every forward and backward so that
it takes (measured time) / s, and its ``memory`` is a cap the runtime enforces on the bytes a
stage keeps alive, counted by the planner's own memory model
(:mod:`hetpipe.planner.memory`, :meth:`hetpipe.stage.StageCompute.memory`).

Only a padded device waits for its queued GPU work: measuring the time to pad needs the
work to have finished. A device running at its own speed (``speed = 1``, every real GPU)
never synchronises here, so the host keeps queueing kernels ahead of the GPU; the times it
reports are then the host's (launch) times, not the kernels'.
"""

from __future__ import annotations

import time

__all__ = ["emulated", "pad", "padded_speed", "synchronize"]


def emulated(speed: float) -> bool:
    """Whether a device of this ``speed`` is slowed on purpose (its compute is padded)."""
    return speed < 1.0


def padded_speed(speed: float) -> float:
    """The speed a device of config ``speed`` computes at once :func:`pad` has padded it:
    ``speed`` where it is slowed, 1 otherwise (padding never speeds a device up). The one
    home of that rule for every planner path that prices an emulated device."""
    return min(1.0, speed)


def synchronize(device: str) -> None:
    """Wait for queued GPU work so that a wall-clock measurement covers it."""
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize(device)


def pad(started: float, speed: float, device: str) -> float:
    """Sleep so that the work begun at ``started`` takes (measured)/speed; return the total.

    Sleeping releases the CPU, so a slowed device does not steal compute from the others on
    the same host: the emulated cluster keeps the relative speeds the config asks for. An
    unslowed device returns at once, without synchronising with its GPU.
    """
    if not emulated(speed):
        return time.perf_counter() - started
    synchronize(device)
    elapsed = time.perf_counter() - started
    time.sleep(elapsed * (1.0 / speed - 1.0))
    return elapsed / speed
