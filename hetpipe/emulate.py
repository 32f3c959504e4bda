"""Emulated heterogeneity: speed padding and memory caps.

A CPU-only machine cannot show how a pipeline behaves on fast and slow GPUs unless the slow
ones really are slow. A device with ``speed = s`` pads every forward and backward so that it
takes (measured time) / s, and its ``memory`` is a cap the runtime enforces on the bytes a
stage keeps alive (weights of every stashed version, optimizer state, WSP accumulators,
activations saved for in-flight backwards). The same code path runs unpadded on ``cuda:N``:
there ``speed`` is 1.0 and the cap is the configured memory.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from hetpipe.config import format_size

__all__ = ["MemoryCapError", "Usage", "pad", "synchronize"]


class MemoryCapError(RuntimeError):
    """A stage needs more memory than its device's cap."""


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


@dataclass(frozen=True)
class Usage:
    """Bytes a stage keeps alive right now, by what holds them."""

    weights: int
    versions: int
    optimizer: int
    accumulators: int
    activations: int
    in_flight: int

    @property
    def total(self) -> int:
        return self.weights * self.versions + self.optimizer + self.accumulators + self.activations

    def check(self, cap: int, where: str) -> None:
        """Raise :class:`MemoryCapError` with the breakdown when the cap is exceeded."""
        if self.total > cap:
            raise MemoryCapError(
                f"{where} needs {format_size(self.total)} > memory cap {format_size(cap)} "
                f"(weights {format_size(self.weights)} x {self.versions} versions, "
                f"optimizer {format_size(self.optimizer)}, "
                f"WSP accumulators {format_size(self.accumulators)}, "
                f"activations {format_size(self.activations)} for {self.in_flight} in flight)"
            )
