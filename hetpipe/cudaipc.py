"""Activations and gradients between stages on GPUs of one host, device to device.

Across hosts a stage's output must go device -> host -> ZeroMQ -> host -> device. Between
two worker processes of one host it need not touch the host at all: the sender exports the
tensor's memory as a CUDA IPC handle (``cudaIpcGetMemHandle``, through PyTorch's own
sharing of CUDA storages, which also records an event after the kernels that made it and
keeps the memory alive until the receiver lets go of it), ZeroMQ carries only the handle
(a hundred bytes) in the message header, and the receiver maps the same memory into its
own address space. On the same GPU that is no copy at all; from another GPU of the host it
is one peer copy onto the receiver's device.

Why not pickle, as ``torch.multiprocessing`` does: a handle comes from the network, and
unpickling peer input would run peer code. Here it is a plain map whose every field is
checked (types, sizes, that the view stays inside the exported memory) before anything is
opened; a malformed one raises ``ValueError`` with one line.

Both workers must see the devices under the same numbers (no per-worker
``CUDA_VISIBLE_DEVICES``); where they do not, ``[runtime] cuda_ipc = false`` turns this off
and the host path is used.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hetpipe.wire import MAX_DIMS, dtype_name, dtype_named

__all__ = ["Shared", "open_shared", "parse", "share"]

_MAX_HANDLE_BYTES = 4096  # IPC and event handles are 64 bytes; the counter a file name


@dataclass(frozen=True)
class Shared:
    """A checked handle to a tensor in another process's GPU memory."""

    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int  # elements into the exported storage view
    dtype: torch.dtype
    device: int
    handle: bytes
    nbytes: int  # bytes of the exported storage
    at: int  # byte offset of that storage in the exported allocation
    counter: bytes
    counter_at: int
    event: bytes | None
    sync: bool


def share(t: torch.Tensor) -> dict[str, Any]:
    """Export a CUDA tensor of this process: the plain map :func:`parse` reads back.

    Call it on the thread (stream) that made ``t``: the event the receiver waits for is
    recorded on the current stream here. Do not write into ``t`` afterwards.
    """
    from torch.multiprocessing.reductions import reduce_tensor

    if not t.is_cuda:
        raise ValueError(f"only CUDA tensors are shared, got one on {t.device}")
    _rebuild, args = reduce_tensor(t.detach())
    (
        _cls,
        size,
        stride,
        offset,
        _storage_cls,
        dtype,
        device,
        handle,
        nbytes,
        at,
        _grad,
        counter,
        counter_at,
        event,
        sync,
    ) = args
    return {
        "size": list(size),
        "stride": list(stride),
        "offset": int(offset),
        "dtype": dtype_name(dtype),
        "device": int(device),
        "handle": bytes(handle),
        "nbytes": int(nbytes),
        "at": int(at),
        "counter": bytes(counter),
        "counter_at": int(counter_at),
        "event": None if event is None else bytes(event),
        "sync": bool(sync),
    }


def _is_count(v: Any) -> bool:
    """A non-negative int (a bool is not a count)."""
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _index(d: dict[str, Any], key: str) -> int:
    v = d.get(key)
    if not _is_count(v):
        raise ValueError(f"shared tensor: {key!r} must be a non-negative int, got {v!r}")
    return v


def _blob(d: dict[str, Any], key: str, optional: bool = False) -> bytes | None:
    v = d.get(key)
    if v is None and optional:
        return None
    if not isinstance(v, bytes) or not 0 < len(v) <= _MAX_HANDLE_BYTES:
        raise ValueError(f"shared tensor: {key!r} must be 1-{_MAX_HANDLE_BYTES} bytes")
    return v


def _dims(d: dict[str, Any], key: str) -> tuple[int, ...]:
    v = d.get(key)
    if not isinstance(v, list) or len(v) > MAX_DIMS or not all(map(_is_count, v)):
        raise ValueError(
            f"shared tensor: {key!r} must be a list of at most {MAX_DIMS} non-negative ints"
        )
    return tuple(v)


_KEYS = frozenset(
    {
        "size",
        "stride",
        "offset",
        "dtype",
        "device",
        "handle",
        "nbytes",
        "at",
        "counter",
        "counter_at",
        "event",
        "sync",
    }
)


def parse(d: Any) -> Shared:
    """Check a handle map from a peer; ``ValueError`` (one line) if it is malformed or its
    view reaches outside the memory it names."""
    if not isinstance(d, dict):
        raise ValueError(f"shared tensor: expected a map, got {type(d).__name__}")
    if set(d) != _KEYS:
        raise ValueError(f"shared tensor: keys {sorted(map(str, d))}, expected {sorted(_KEYS)}")
    size, stride = _dims(d, "size"), _dims(d, "stride")
    if len(size) != len(stride):
        raise ValueError(f"shared tensor: {len(size)} sizes but {len(stride)} strides")
    name = d["dtype"]
    dtype = dtype_named(name) if isinstance(name, str) else None
    if dtype is None:
        raise ValueError(f"shared tensor: unknown dtype {name!r}")
    if not isinstance(d["sync"], bool):
        raise ValueError("shared tensor: 'sync' must be true or false")
    offset, nbytes = _index(d, "offset"), _index(d, "nbytes")
    if all(size):  # the last element the view reads must lie inside the storage
        end = offset + sum((n - 1) * s for n, s in zip(size, stride, strict=True)) + 1
        if end * dtype.itemsize > nbytes:
            raise ValueError(
                f"shared tensor: view of {end * dtype.itemsize} bytes reaches "
                f"past its storage of {nbytes}"
            )
    handle, counter = _blob(d, "handle"), _blob(d, "counter")
    assert handle is not None and counter is not None
    return Shared(
        size,
        stride,
        offset,
        dtype,
        _index(d, "device"),
        handle,
        nbytes,
        _index(d, "at"),
        counter,
        _index(d, "counter_at"),
        _blob(d, "event", optional=True),
        d["sync"],
    )


def open_shared(s: Shared, device: str | torch.device) -> torch.Tensor:
    """The shared tensor, on ``device``: the peer's memory itself where it lies there,
    else one (peer) copy. Call it on the thread whose stream will read it: the wait for
    the sender's event is queued on the current stream, nothing blocks the host."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    if s.device >= torch.cuda.device_count():
        raise ValueError(
            f"shared tensor on cuda:{s.device}, this process sees "
            f"{torch.cuda.device_count()} GPU(s)"
        )
    t = rebuild_cuda_tensor(
        torch.Tensor,
        s.size,
        s.stride,
        s.offset,
        torch.UntypedStorage,
        s.dtype,
        s.device,
        s.handle,
        s.nbytes,
        s.at,
        False,
        s.counter,
        s.counter_at,
        s.event,
        s.sync,
    )
    return t.to(device)
