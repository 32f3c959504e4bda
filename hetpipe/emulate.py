"""Emulated heterogeneity: speed padding and memory caps.

A CPU-only machine cannot show how a pipeline behaves on fast and slow GPUs unless the slow
ones really are slow. A device with ``speed = s`` pads every forward and backward so that it
takes (measured time) / s, and its ``memory`` is a cap the runtime enforces on the bytes a
stage keeps alive, counted by the planner's own memory model
(:mod:`hetpipe.planner.memory`, :meth:`hetpipe.stage.StageCompute.memory`). The same code
path runs unpadded on ``cuda:N``: there ``speed`` is 1.0 and the cap is the configured memory.
"""

from __future__ import annotations

import time

__all__ = ["pad", "synchronize"]


def synchronize(device: str) -> None:
    """Wait for queued GPU work so that a wall-clock measurement covers it."""
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize(device)


def pad(started: float, speed: float, device: str) -> float:
    """Sleep so that the work begun at ``started`` takes (measured)/speed; return the total.

    Sleeping releases the CPU, so a slowed device does not steal compute from the others on
    the same host: the emulated cluster keeps the relative speeds the config asks for.
    """
    synchronize(device)
    elapsed = time.perf_counter() - started
    if speed < 1.0:
        time.sleep(elapsed * (1.0 / speed - 1.0))
        return elapsed / speed
    return elapsed
