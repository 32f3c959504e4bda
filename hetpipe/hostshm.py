"""Activations and gradients between worker processes of one host, through shared memory.

Between hosts a stage's output must cross the network, and CurveZMQ encrypts every byte of
it. Between two worker processes of one host nothing crosses a network: encrypting there buys
nothing that the operating system does not already give, and on a CPU-bound host it costs
more than the copy itself (about a millisecond per megabyte on each side). So, as
:mod:`hetpipe.cudaipc` does for GPU tensors, the sender puts the tensor's bytes where the
receiver can read them, and ZeroMQ carries only their description in the (still encrypted and
authenticated) message header: the sender writes the bytes into a file of the host's
shared memory (``/dev/shm``) under a new name, and the receiver reads that file into its own
tensor and hands it back: it renames it to the same name with :data:`FREE` appended. The
sender's next tensor of the same size goes into that file again (renamed to the next new
name): a file's pages are allocated once, not per message, which costs more than the copy
itself (measured, 1 MiB: 480 us for a new file written, read and removed, 310 us for a file
rewritten and read). One copy in each, no socket buffers, no encryption. (Mapping the file
instead of reading it saves the receiver's copy but costs more on a virtual machine: every
page faults in, and unmapping a freed tensor interrupts the other cores to flush their
address caches; measured, reading was the faster of the two.)

Trust. The file is created with ``O_EXCL`` and mode 0600: nobody else can read it, and
nobody can have slipped a file in under its name first. The receiver opens a name only after
checking it is of this module's shape (no path), then opens it without following links and
takes it only if it is a regular file owned by this user with no group or other permission,
exactly as large as its dtype and shape say; anything else raises ``ValueError`` with one
line and the file is left alone. A peer must already hold the cluster's keys to send a
header at all, and then it can only make a worker read and hand back a file of the runtime's
naming owned by this user (another stage's untaken tensor at worst), never one elsewhere or
another user's. A file handed back is written again only after the sender checked it as
the receiver does (no link, a regular private file of this user, of the expected size);
anything else is removed and a new file made.

Leftovers. The sender keeps the names it made, and at most :data:`KEEP_FREE` handed-back files
per size. When its stage ends it removes the handed-back files (:meth:`Outbox.settle`), and
the rest :data:`UNTAKEN_S` later, or when its worker stops (:meth:`Outbox.close`): not at
once, since a neighbour may still be about to take (and hand back) the stage's last
message. A worker that starts removes the files of
processes of this user that no longer run (:func:`sweep`: the pid is in the name), which a
killed or stopped worker left behind.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import math
import os
import re
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hetpipe.wire import MAX_DIMS, ZERO_COPY_MIN_BYTES, dtype_name, dtype_named

__all__ = ["DIRECTORY", "FREE", "KEEP_FREE", "MIN_BYTES", "UNTAKEN_S", "Outbox", "Placed",
           "available", "parse", "sweep", "take"]

DIRECTORY = Path("/dev/shm")
# below this a tensor stays in the message's frames: a file's creation, mapping and removal
# (tens of microseconds) cost more than encrypting a small frame
MIN_BYTES = ZERO_COPY_MIN_BYTES
# how long after its stage ended a sender removes the files not taken: a receiver takes a
# message within milliseconds of its arrival unless its job is gone
UNTAKEN_S = 30.0
_NAME = re.compile(r"hetpipe-(\d{1,10})-\d{1,20}-[0-9a-f]{8}")
# appended to a taken file's name by its receiver: the sender may write it again
FREE = ".free"
_ANY = re.compile(_NAME.pattern + f"(?:{re.escape(FREE)})?")  # what sweep may remove
KEEP_FREE = 8  # handed-back files a sender keeps per size; more are removed
_KEYS = frozenset({"file", "dtype", "shape", "nbytes"})


def available(directory: Path = DIRECTORY) -> bool:
    """Whether this host has a shared-memory directory this process may write into."""
    return directory.is_dir() and os.access(directory, os.W_OK | os.X_OK)


@dataclass(frozen=True)
class Placed:
    """A checked description of a tensor a peer of this host put in shared memory."""

    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int


class Outbox:
    """The files one stage put in shared memory for its neighbours on this host."""

    def __init__(self, directory: Path = DIRECTORY) -> None:
        self.directory = directory
        # names put and not handed back yet, with their sizes
        self.pending: collections.deque[tuple[str, int]] = collections.deque()
        self.free: dict[int, list[str]] = {}  # handed-back files (without FREE) by size
        self.reused = 0  # tensors written into a handed-back file
        self.sent = 0  # tensors put (the stage's report says how its data travelled)
        self.error = ""  # why shared memory refused a tensor: from then on none is put
        self._counter = itertools.count()

    def put(self, t: torch.Tensor) -> dict[str, Any]:
        """Write ``t`` (a host tensor) into a file under a new name (a handed-back file of
        its size where there is one); the plain map :func:`parse` reads."""
        if t.device.type != "cpu":
            raise ValueError(f"only host tensors go through shared memory, got one on {t.device}")
        self._reclaim()
        flat = t.detach().contiguous().reshape(-1)
        nbytes = flat.numel() * t.element_size()
        name = f"hetpipe-{os.getpid()}-{next(self._counter)}-{secrets.token_hex(4)}"
        path = self.directory / name
        fd = self._reuse(nbytes, path)
        if fd is None:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                         | os.O_CLOEXEC, 0o600)
        else:
            self.reused += 1
        try:
            data = memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else b""
            done = 0
            while done < len(data):
                done += os.pwrite(fd, data[done:], done)
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        self.pending.append((name, nbytes))
        self.sent += 1
        return {"file": name, "dtype": dtype_name(t.dtype), "shape": list(t.shape),
                "nbytes": nbytes}

    def _reuse(self, nbytes: int, path: Path) -> int | None:
        """A handed-back file of ``nbytes`` renamed to ``path`` and open for writing, or None
        where there is none (one that fails the receiver's checks is removed)."""
        names = self.free.get(nbytes)
        while names:
            old = self.directory / (names.pop() + FREE)
            try:
                os.rename(old, path)
                fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except OSError:
                with contextlib.suppress(OSError):
                    os.unlink(path)
                continue
            st = os.fstat(fd)
            if _private(st) and st.st_size == nbytes:
                return fd
            os.close(fd)
            os.unlink(path)
        return None

    def place(self, tensors: dict[str, torch.Tensor]
              ) -> tuple[dict[str, dict[str, Any]], dict[str, torch.Tensor]]:
        """Put the host tensors of at least :data:`MIN_BYTES`: (their descriptions by name,
        the tensors that stay in the message). Shared memory that refuses one (full, gone)
        leaves it and the rest in the message, and says why in :attr:`error`."""
        placed: dict[str, dict[str, Any]] = {}
        for name, t in tensors.items():
            if t.device.type != "cpu" or t.nbytes < MIN_BYTES or self.error:
                continue
            try:
                placed[name] = self.put(t)
            except OSError as exc:
                self.error = f"{self.directory}: {exc.strerror or exc}"
        return placed, {n: t for n, t in tensors.items() if n not in placed}

    def _reclaim(self) -> None:
        """Move the files the receivers handed back to the free lists (at most
        :data:`KEEP_FREE` per size, the rest removed) and forget the names gone otherwise."""
        kept: collections.deque[tuple[str, int]] = collections.deque()
        for name, nbytes in self.pending:
            path = self.directory / name
            if path.exists():
                kept.append((name, nbytes))
                continue
            if not (self.directory / (name + FREE)).exists():
                continue  # removed, not handed back
            free = self.free.setdefault(nbytes, [])
            if len(free) < KEEP_FREE:
                free.append(name)
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.directory / (name + FREE))
        self.pending = kept

    def settle(self) -> None:
        """At the end of the stage: remove the handed-back files (no tensor will be put
        again); what is not taken yet stays for :meth:`close`."""
        self._reclaim()
        names = [n for f in self.free.values() for n in f]
        self.free.clear()
        for name in names:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.directory / (name + FREE))

    def close(self) -> None:
        """Remove every file not taken yet (its message will not be) and the handed-back
        ones."""
        names = [n for n, _ in self.pending] + [n for f in self.free.values() for n in f]
        self.pending.clear()
        self.free.clear()
        for name in names:
            for path in (self.directory / name, self.directory / (name + FREE)):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)


def parse(d: Any) -> Placed:
    """Check a description from a peer (``ValueError``, one line, if it is malformed)."""
    if not isinstance(d, dict) or set(d) != _KEYS:
        keys = sorted(map(str, d)) if isinstance(d, dict) else type(d).__name__
        raise ValueError(f"shared-memory tensor: expected keys {sorted(_KEYS)}, got {keys}")
    name = d["file"]
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"shared-memory tensor: {str(name)[:80]!r} is not a file name this "
                         "runtime makes")
    dtype = dtype_named(d["dtype"]) if isinstance(d["dtype"], str) else None
    if dtype is None:
        raise ValueError(f"shared-memory tensor: unknown dtype {d['dtype']!r}")
    shape = d["shape"]
    if (not isinstance(shape, list) or len(shape) > MAX_DIMS
            or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0
                       for n in shape)):
        raise ValueError(f"shared-memory tensor: shape must be a list of at most {MAX_DIMS} "
                         f"non-negative ints, got {shape!r}")
    numel = math.prod(shape)
    if d["nbytes"] != numel * dtype.itemsize:
        raise ValueError(f"shared-memory tensor: {d['dtype']}{shape} needs "
                         f"{numel * dtype.itemsize} bytes, the description says {d['nbytes']!r}")
    return Placed(name, dtype, tuple(shape), numel * dtype.itemsize)


def take(p: Placed, directory: Path = DIRECTORY) -> torch.Tensor:
    """The tensor ``p`` describes, read from its file, which then goes back to its sender
    (renamed with :data:`FREE` appended).
    ``ValueError`` (one line) if the file is missing or not one this user's runtime made."""
    path = directory / p.file
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise ValueError(f"shared-memory tensor {p.file}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not _private(st):
            raise ValueError(f"shared-memory tensor {p.file}: not a private file of this user")
        if st.st_size != p.nbytes:
            raise ValueError(f"shared-memory tensor {p.file}: {st.st_size} bytes, expected "
                             f"{p.nbytes}")
        out = torch.empty(p.shape, dtype=p.dtype)
        if p.nbytes:
            view = memoryview(out.reshape(-1).view(torch.uint8).numpy())
            done = 0
            while done < p.nbytes:
                n = os.preadv(fd, [view[done:]], done)
                if n == 0:
                    raise ValueError(f"shared-memory tensor {p.file}: ends after {done} bytes")
                done += n
    finally:
        os.close(fd)
    try:
        os.rename(path, directory / (p.file + FREE))  # back to its sender, to write again
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(path)
    return out


def _private(st: os.stat_result) -> bool:
    """A regular file of this user that nobody else may read or write."""
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o077


def sweep(directory: Path = DIRECTORY) -> int:
    """Remove the files of this user's processes that no longer run; how many."""
    removed = 0
    if not directory.is_dir():
        return 0
    for entry in os.scandir(directory):
        m = _ANY.fullmatch(entry.name)
        if m is None or _alive(int(m.group(1))):
            continue
        with contextlib.suppress(OSError):
            if entry.stat(follow_symlinks=False).st_uid == os.getuid():
                os.unlink(entry.path)
                removed += 1
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive (and not ours to judge)
        return True
    return True
