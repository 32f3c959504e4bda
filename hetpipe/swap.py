"""Swapped activations: what a layer saves for its backward waits in host memory.

A layer whose policy is ``swap`` (:mod:`hetpipe.core.memory`) runs under
:func:`torch.autograd.graph.saved_tensors_hooks` whose pack moves each saved tensor to host
memory and whose unpack brings it back, so autograd differentiates the very same values:
a swapped job trains the weights a kept one trains.

On a GPU (as :func:`torch.autograd.graph.save_on_cpu` does, but overlapped): the copy out
is queued on a side stream behind the compute stream, into pinned memory, and the device
tensor is marked as used by that stream (``record_stream``) so the allocator frees it once
the copy read it, while the later layers keep computing. In the backward, the first unpack
of a layer's tensors fetches that layer's whole group and starts the copy in of the swapped
layer before it (the next the backward differentiates), so one layer is in transit while
another is differentiated: the ``working`` room the memory model holds for it.

On an emulated (CPU) device the tensors are already in host memory and stay where they are;
the memory cap does not count them and the stage charges the copy time at the device's
``host_gbps`` instead (:meth:`hetpipe.stage.StageCompute.forward`), so :attr:`HostSwap.bytes`
counts what a real device would move.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import torch

__all__ = ["HostSwap"]


class _Parked:
    """One saved tensor in pinned host memory, and its copy back once fetched."""

    def __init__(self, host: torch.Tensor, device: torch.device, group: list[_Parked]) -> None:
        self.host = host
        self.device = device
        self.group = group  # every tensor its layer parked (fetched together)
        self.back: torch.Tensor | None = None
        self.handed = False  # given back to autograd, which then owns the device copy


class HostSwap:
    """Packs one stage's swapped layers' saved tensors to host memory and back."""

    def __init__(self, device: str) -> None:
        self.cuda = device.startswith("cuda")
        self.stream = torch.cuda.Stream(torch.device(device)) if self.cuda else None
        self.bytes = 0  # saved bytes packed since :meth:`start`
        self._last: list[_Parked] | None = None  # the group packed before the next one

    def start(self) -> None:
        """A new minibatch's forward: count its bytes afresh, and prefetch within it only."""
        self.bytes = 0
        self._last = None

    def layer(self, own: set[int]) -> AbstractContextManager[Any]:
        """Hooks for one swapped layer's call; ``own`` are the storages of its weights and
        buffers, which are state, not activations, and stay where they are."""
        seen = set(own)
        group: list[_Parked] = []
        previous = self._last
        self._last = group

        def pack(t: torch.Tensor) -> Any:
            ptr = t.untyped_storage().data_ptr()
            if ptr in own:
                return t
            if ptr not in seen:
                seen.add(ptr)
                self.bytes += t.untyped_storage().nbytes()
            if not self.cuda or t.device.type != "cuda":
                return t  # already in host memory (emulated device)
            assert self.stream is not None
            host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, pin_memory=True)
            self.stream.wait_stream(torch.cuda.current_stream(t.device))
            with torch.cuda.stream(self.stream):
                host.copy_(t, non_blocking=True)
            t.record_stream(self.stream)
            parked = _Parked(host, t.device, group)
            group.append(parked)
            return (parked, previous)

        def unpack(packed: Any) -> torch.Tensor:
            if isinstance(packed, torch.Tensor):
                return packed
            parked, before = packed
            for p in parked.group:
                self._fetch(p)
            for p in before or ():  # prefetch: the layer the backward reaches next
                self._fetch(p)
            current = torch.cuda.current_stream(parked.device)
            current.wait_stream(self.stream)
            out = parked.back
            assert out is not None
            out.record_stream(current)
            parked.back, parked.handed = None, True  # autograd frees it after its node
            return out

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def _fetch(self, parked: _Parked) -> None:
        """Queue the copy of ``parked`` back to its device on the side stream (once)."""
        if parked.back is not None or parked.handed:
            return
        with torch.cuda.stream(self.stream):
            parked.back = parked.host.to(parked.device, non_blocking=True)
