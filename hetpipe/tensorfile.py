"""Tensors by name in one file, in the wire's own encoding: no pickle, no zip container.

Why not ``torch.save``: a checkpoint holds many small tensors (every layer's weights, buffers
and optimizer state, per stage), and ``torch.save`` pays per tensor for its pickler and zip
records: over half of a checkpoint's write time on a small model. The wire already
describes tensors (name, dtype, shape) and checks every field of what it reads against the
bytes there are (:func:`hetpipe.wire.decode`), because peers may be hostile; a file is a
message's frames laid end to end, so reading one is as guarded as receiving one, and a file
damaged in a way its checksum missed still gives one line, not a crash.

Layout: :data:`MAGIC`, the frame count (u32, little-endian), each frame's length (u64), then
the frames (the first is the wire header).
"""

from __future__ import annotations

import struct
from collections.abc import Mapping

import torch

from hetpipe import wire

__all__ = ["MAGIC", "dumps", "loads"]

MAGIC = b"HPTENS1\n"
_COUNT = struct.Struct("<I")
_LENGTH = struct.Struct("<Q")


def dumps(tensors: Mapping[str, torch.Tensor]) -> list[bytes | memoryview]:
    """The pieces of one file holding ``tensors``, to be written in order (tensor bytes are
    views of the tensors' memory, not copies)."""
    frames = wire.encode(wire.Kind.TENSORS, {}, tensors)
    lengths = b"".join(_LENGTH.pack(memoryview(f).nbytes) for f in frames)
    return [MAGIC + _COUNT.pack(len(frames)) + lengths, *frames]


def loads(data: bytes | bytearray | memoryview, where: str) -> dict[str, torch.Tensor]:
    """The tensors of one file's bytes (they alias ``data`` where large); ``ValueError``
    naming ``where`` if the bytes are not such a file."""
    view = memoryview(data).cast("B")
    start = len(MAGIC) + _COUNT.size
    if view.nbytes < start or bytes(view[: len(MAGIC)]) != MAGIC:
        raise ValueError(f"{where}: not a tensor file (no {MAGIC!r} at its start)")
    (count,) = _COUNT.unpack_from(view, len(MAGIC))
    offset = start + count * _LENGTH.size
    if count < 1 or offset > view.nbytes:
        raise ValueError(f"{where}: {count} frames do not fit its {view.nbytes} bytes")
    frames = []
    for i in range(count):
        (length,) = _LENGTH.unpack_from(view, start + i * _LENGTH.size)
        if offset + length > view.nbytes:
            raise ValueError(f"{where}: frame {i} ends past its {view.nbytes} bytes")
        frames.append(view[offset : offset + length])
        offset += length
    if offset != view.nbytes:
        raise ValueError(f"{where}: {view.nbytes - offset} bytes after its last frame")
    try:
        message = wire.decode(frames, max_frame_bytes=view.nbytes)
    except wire.WireError as exc:
        raise ValueError(f"{where}: {exc}") from None
    if message.kind is not wire.Kind.TENSORS:
        raise ValueError(f"{where}: holds a {message.kind} message, not tensors")
    return dict(message.tensors)
