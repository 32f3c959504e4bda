"""Device-to-host copies that do not stall the compute: side stream, pinned memory, event.

What a stage sends (activations, gradients, its wave's update) must reach host memory before
ZeroMQ can send it. A plain ``tensor.cpu()`` on the compute thread waits for every kernel
queued before it, then copies through pageable memory, and only then can the next minibatch
be queued. Here the copy is queued on a side CUDA stream behind an event of the compute
stream, into pinned host memory, and :meth:`HostCopy.wait` (on another thread than the
compute's) waits for that copy alone. The device tensors are marked as used by the side
stream (``record_stream``), so the caching allocator does not hand their memory to new
tensors of the compute stream before the copy has read it.

On the CPU nothing moves: the tensors are already in host memory and the handle is ready.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["HostCopier", "HostCopy"]


class HostCopy:
    """Host tensors on their way from a device; :meth:`wait` returns them once there."""

    def __init__(self, tensors: dict[str, torch.Tensor], done: Any = None) -> None:
        self._tensors = tensors
        self._done = done  # a CUDA event recorded after the copies, or None: already there

    @property
    def ready(self) -> bool:
        """Whether :meth:`wait` would return at once."""
        return self._done is None or bool(self._done.query())

    def wait(self) -> dict[str, torch.Tensor]:
        """The host tensors, after waiting for their copy (blocks this thread only)."""
        if self._done is not None:
            self._done.synchronize()
            self._done = None
        return self._tensors


class HostCopier:
    """Starts the device-to-host copies of one device (one side stream per device)."""

    def __init__(self, device: str) -> None:
        self.device = torch.device(device)
        self._stream: Any = None
        if self.device.type == "cuda":
            self._stream = torch.cuda.Stream(self.device)

    def to_host(self, tensors: Mapping[str, torch.Tensor]) -> HostCopy:
        """Queue copies of ``tensors`` (detached) to host memory; nothing waits here."""
        if self._stream is None or not any(t.is_cuda for t in tensors.values()):
            return HostCopy({n: t.detach().cpu() for n, t in tensors.items()})
        compute = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(compute)  # the tensors are made by the queued compute
        out: dict[str, torch.Tensor] = {}
        with torch.cuda.stream(self._stream):
            for name, t in tensors.items():
                t = t.detach()
                if not t.is_cuda:
                    out[name] = t
                    continue
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                host.copy_(t, non_blocking=True)
                t.record_stream(self._stream)
                out[name] = host
            done = torch.cuda.Event()
            done.record(self._stream)
        return HostCopy(out, done)
