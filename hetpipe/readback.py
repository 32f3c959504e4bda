"""Scalars made on a device (the last stage's losses, the prediction probes' scores), read
back to the host in batches.

Reading one scalar of a CUDA tensor into a Python float waits for every kernel queued before
it: once per minibatch, that keeps the host from running ahead of the GPU. Here the values
are stacked every :attr:`Readback.every` additions and copied to pinned host memory without
blocking (``non_blocking``), an event marking the copy's end; :meth:`Readback.ready` returns
the batches whose copy has finished and waits only when asked to (at the end of a job). On
the CPU the values are there at once, so each batch is read when it is closed. Values travel
in double precision: a float32 or bf16 value reads back exactly as it would alone, and a
ratio computed in double on the device keeps its last bits.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch

__all__ = ["Readback"]


class Readback:
    """Keyed scalars of one device, read back in batches, in the order they were added."""

    def __init__(self, device: str, every: int = 16) -> None:
        if every < 1:
            raise ValueError(f"readback: every must be >= 1, got {every}")
        self.device = torch.device(device)
        self.every = every
        self._open: list[tuple[int, torch.Tensor]] = []
        self._moving: deque[tuple[list[int], torch.Tensor, Any]] = deque()

    def add(self, key: int, value: torch.Tensor) -> None:
        """Queue ``value`` (a scalar tensor on the device) under ``key``; nothing waits."""
        self._open.append((key, value.detach()))
        if len(self._open) >= self.every:
            self._close()

    def _close(self) -> None:
        """Stack the open values and start their copy to the host."""
        keys = [k for k, _ in self._open]
        stacked = torch.stack([v.reshape(()).double() for _, v in self._open])
        self._open = []
        if self.device.type != "cuda":
            self._moving.append((keys, stacked, None))
            return
        host = stacked.to("cpu", non_blocking=True)  # pinned: the copy runs asynchronously
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))
        self._moving.append((keys, host, done))

    def ready(self, block: bool = False) -> list[tuple[int, float]]:
        """The values whose copy has finished, as ``(key, value)``; with ``block`` every
        value added so far (waiting for the device if needed)."""
        if block and self._open:
            self._close()
        out: list[tuple[int, float]] = []
        while self._moving:
            keys, host, done = self._moving[0]
            if done is not None and not done.query():
                if not block:
                    break
                done.synchronize()
            self._moving.popleft()
            out.extend(zip(keys, host.tolist(), strict=True))
        return out

    def __len__(self) -> int:
        """Values added and not yet returned by :meth:`ready`."""
        return len(self._open) + sum(len(keys) for keys, _, _ in self._moving)
