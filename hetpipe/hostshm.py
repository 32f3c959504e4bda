"""Activations and gradients between worker processes of one host, through shared memory.

Between hosts a stage's output must cross the network, and CurveZMQ encrypts every byte of
it. Between two worker processes of one host nothing crosses a network: encrypting there buys
nothing that the operating system does not already give, and on a CPU-bound host it costs
more than the copy itself (about a millisecond per megabyte on each side). So, as
:mod:`hetpipe.cudaipc` does for GPU tensors, the sender puts the tensor's bytes where the
receiver can read them, and ZeroMQ carries only their description in the (still encrypted and
authenticated) message header: the sender writes the bytes into a file of the host's
shared memory (``/dev/shm``) under a new name, and the receiver copies that file into its own
tensor and hands it back: it renames it to the same name with :data:`FREE` appended. The
sender's next tensor of the same size goes into that file again (renamed to the next new
name): a file's pages are allocated once, not per message, which costs more than the copy
itself (measured, 1 MiB: 480 us for a new file written, read and removed, 310 us for a file
rewritten and read). Both sides keep each file mapped (:class:`_Mapped`) for as long as it
carries messages, so a message's bytes are one memory copy on each side, not a ``pwrite``
and a ``preadv`` through the kernel (measured on this project's 2-core virtual machine,
1 MiB: 76 us to write and 80 us to read that way, 18 and 16 us through a kept mapping).
Mapping a file per message instead would cost more than reading it (every page faults in
again, and unmapping interrupts the other cores to flush their address caches: 130 us for
1 MiB mapped, copied and unmapped). The receiver still copies: the tensor is its own, and the
file can go back at once.

Trust. The file is created with ``O_EXCL`` and mode 0600: nobody else can read it, and
nobody can have slipped a file in under its name first. The receiver opens a name only after
checking it is of this module's shape (no path), then opens it without following links and
takes it only if it is a regular file owned by this user with no group or other permission,
exactly as large as its dtype and shape say; anything else raises ``ValueError`` with one
line and the file is left alone. A peer must already hold the cluster's keys to send a
header at all, and then it can only make a worker read and hand back a file of the runtime's
naming owned by this user (another stage's untaken tensor at worst), never one elsewhere or
another user's. A file handed back is written again only after the sender checked it as
the receiver does (no link, a regular private file of this user, of the expected size) and
found under the new name the very file it keeps mapped; anything else is removed and a new
file made. A new file's pages are allocated before it is mapped (``posix_fallocate``): a full
``/dev/shm`` refuses the tensor with an error (it then travels in the message) instead of
killing the sender with ``SIGBUS`` on its first write into the mapping. The receiver finds a
kept mapping by the file's device and inode, which no other file can take while the mapping
keeps the inode alive. Only a process of this same user could still shrink a mapped file
under a reader (and crash it): a process that can already signal it.

Leftovers. The sender keeps the names it made, and at most :data:`KEEP_FREE` handed-back files
per size. When its stage ends it removes the handed-back files (:meth:`Outbox.settle`), and
the rest :data:`UNTAKEN_S` later, or when its worker stops (:meth:`Outbox.close`): not at
once, since a neighbour may still be about to take (and hand back) the stage's last
message. A worker that starts removes the files of
processes of this user that no longer run (:func:`sweep`: the pid is in the name), which a
killed or stopped worker left behind. A receiver keeps at most :data:`KEEP_MAPPED` files
mapped (the least recently read go first) and drops them all when its stage ends
(:meth:`Inbox.close`), so a file its sender removed frees its memory then at the latest.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import math
import mmap
import os
import re
import secrets
import stat
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hetpipe.wire import MAX_DIMS, ZERO_COPY_MIN_BYTES, dtype_name, dtype_named

__all__ = [
    "DIRECTORY",
    "FREE",
    "KEEP_FREE",
    "KEEP_MAPPED",
    "MIN_BYTES",
    "UNTAKEN_S",
    "Inbox",
    "Outbox",
    "Placed",
    "available",
    "parse",
    "sweep",
]

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
# files a receiver keeps mapped, the least recently read unmapped first (a replica's weight
# gradients come one file per tensor)
KEEP_MAPPED = 64
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


class _Mapped:
    """One shared-memory file mapped into this process, kept while it carries messages: its
    bytes as a ``uint8`` tensor, copied into or out of with one memory copy."""

    def __init__(self, fd: int, st: os.stat_result, writable: bool) -> None:
        self.inode = (st.st_dev, st.st_ino)
        self.nbytes = st.st_size
        self._mm = mmap.mmap(
            fd, self.nbytes, mmap.MAP_SHARED, mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        )
        with warnings.catch_warnings():
            # a reader's mapping is read-only, which torch cannot mark: only copied from
            warnings.simplefilter("ignore", UserWarning)
            self.bytes = torch.frombuffer(self._mm, dtype=torch.uint8)

    def is_file(self, st: os.stat_result) -> bool:
        """Whether ``st`` (checked private) describes this very file, at its size."""
        return (st.st_dev, st.st_ino) == self.inode and st.st_size == self.nbytes

    def close(self) -> None:
        """Unmap now (the file's memory goes once its name is gone too)."""
        del self.bytes
        self._mm.close()


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's storage as flat ``uint8`` (no copy)."""
    return t.reshape(-1).view(torch.uint8)


class Outbox:
    """The files one stage put in shared memory for its neighbours on this host."""

    def __init__(self, directory: Path = DIRECTORY) -> None:
        self.directory = directory
        self._in = _prefix(directory)
        # names put and not handed back yet, with their files (None: an empty tensor's)
        self.pending: collections.deque[tuple[str, int, _Mapped | None]] = collections.deque()
        # handed-back files (names without FREE) by size
        self.free: dict[int, list[tuple[str, _Mapped | None]]] = {}
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
        flat = t.detach().contiguous()
        nbytes = flat.numel() * t.element_size()
        name = f"hetpipe-{os.getpid()}-{next(self._counter)}-{secrets.token_hex(4)}"
        path = self._in + name
        found, file = self._reuse(nbytes, path)
        if found:
            self.reused += 1
        else:
            file = self._create(nbytes, path)
        if file is not None:
            file.bytes.copy_(_bytes_of(flat))
        self.pending.append((name, nbytes, file))
        self.sent += 1
        return {
            "file": name,
            "dtype": dtype_name(t.dtype),
            "shape": list(t.shape),
            "nbytes": nbytes,
        }

    def _create(self, nbytes: int, path: str) -> _Mapped | None:
        """A new file of ``nbytes`` at ``path``, its pages allocated, mapped (None for an
        empty one: nothing to map)."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            if not nbytes:
                return None
            os.posix_fallocate(fd, 0, nbytes)  # a full /dev/shm fails here, not with SIGBUS
            return _Mapped(fd, os.fstat(fd), writable=True)
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)

    def _reuse(self, nbytes: int, path: str) -> tuple[bool, _Mapped | None]:
        """A handed-back file of ``nbytes`` renamed to ``path``: (True, its mapping), or
        (False, None) where there is none (one that is no longer the file this stage keeps
        mapped, or fails the receiver's checks, is removed)."""
        entries = self.free.get(nbytes)
        while entries:
            name, file = entries.pop()
            try:
                os.rename(self._in + name + FREE, path)
                st = os.stat(path, follow_symlinks=False)
            except OSError:
                with contextlib.suppress(OSError):
                    os.unlink(path)
                _unmap(file)
                continue
            if _private(st) and (
                file.is_file(st) if file is not None else st.st_size == nbytes == 0
            ):
                return True, file
            os.unlink(path)
            _unmap(file)
        return False, None

    def place(
        self, tensors: dict[str, torch.Tensor]
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
        kept: collections.deque[tuple[str, int, _Mapped | None]] = collections.deque()
        for name, nbytes, file in self.pending:
            if os.path.exists(self._in + name):
                kept.append((name, nbytes, file))
                continue
            free = self.free.setdefault(nbytes, [])
            if os.path.exists(self._in + name + FREE) and len(free) < KEEP_FREE:
                free.append((name, file))
                continue
            # removed, not handed back; or one more than this stage keeps
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._in + name + FREE)
            _unmap(file)
        self.pending = kept

    def settle(self) -> None:
        """At the end of the stage: remove the handed-back files (no tensor will be put
        again); what is not taken yet stays for :meth:`close`."""
        self._reclaim()
        entries = [e for f in self.free.values() for e in f]
        self.free.clear()
        for name, file in entries:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._in + name + FREE)
            _unmap(file)

    def close(self) -> None:
        """Remove every file not taken yet (its message will not be) and the handed-back
        ones."""
        entries = [(n, f) for n, _, f in self.pending] + [e for f in self.free.values() for e in f]
        self.pending.clear()
        self.free.clear()
        for name, file in entries:
            for path in (self._in + name, self._in + name + FREE):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            _unmap(file)


def _unmap(file: _Mapped | None) -> None:
    if file is not None:
        file.close()


def _prefix(directory: Path) -> str:
    """``directory`` as a string ending in a separator: a file's path is this plus its name
    (joining ``Path`` objects cost more than the rest of a message's bookkeeping)."""
    return os.path.join(directory, "")


def parse(d: Any) -> Placed:
    """Check a description from a peer (``ValueError``, one line, if it is malformed)."""
    if not isinstance(d, dict) or set(d) != _KEYS:
        keys = sorted(map(str, d)) if isinstance(d, dict) else type(d).__name__
        raise ValueError(f"shared-memory tensor: expected keys {sorted(_KEYS)}, got {keys}")
    name = d["file"]
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(
            f"shared-memory tensor: {str(name)[:80]!r} is not a file name this runtime makes"
        )
    dtype = dtype_named(d["dtype"]) if isinstance(d["dtype"], str) else None
    if dtype is None:
        raise ValueError(f"shared-memory tensor: unknown dtype {d['dtype']!r}")
    shape = d["shape"]
    if (
        not isinstance(shape, list)
        or len(shape) > MAX_DIMS
        or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape)
    ):
        raise ValueError(
            f"shared-memory tensor: shape must be a list of at most {MAX_DIMS} "
            f"non-negative ints, got {shape!r}"
        )
    numel = math.prod(shape)
    if d["nbytes"] != numel * dtype.itemsize:
        raise ValueError(
            f"shared-memory tensor: {d['dtype']}{shape} needs "
            f"{numel * dtype.itemsize} bytes, the description says {d['nbytes']!r}"
        )
    return Placed(name, dtype, tuple(shape), numel * dtype.itemsize)


class Inbox:
    """What one stage reads from its neighbours' shared-memory files: each file it read stays
    mapped (at most :data:`KEEP_MAPPED`, found by device and inode), since its sender writes
    the next tensor of its size into it again."""

    def __init__(self, directory: Path = DIRECTORY) -> None:
        self._in = _prefix(directory)
        self.mapped: collections.OrderedDict[tuple[int, int], _Mapped] = collections.OrderedDict()

    def take(self, p: Placed) -> torch.Tensor:
        """The tensor ``p`` describes, copied from its file, which then goes back to its
        sender (renamed with :data:`FREE` appended). ``ValueError`` (one line) if the file
        is missing or not one this user's runtime made."""
        path = self._in + p.file
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise ValueError(f"shared-memory tensor {p.file}: {exc.strerror}") from None
        try:
            st = os.fstat(fd)
            if not _private(st):
                raise ValueError(f"shared-memory tensor {p.file}: not a private file of this user")
            if st.st_size != p.nbytes:
                raise ValueError(
                    f"shared-memory tensor {p.file}: {st.st_size} bytes, expected {p.nbytes}"
                )
            out = torch.empty(p.shape, dtype=p.dtype)
            if p.nbytes:
                _bytes_of(out).copy_(self._mapping(fd, st).bytes)
        finally:
            os.close(fd)
        try:
            os.rename(path, path + FREE)  # back to its sender
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(path)
        return out

    def _mapping(self, fd: int, st: os.stat_result) -> _Mapped:
        """The kept mapping of the open file ``fd`` (``st``), mapped now if it is new."""
        key = (st.st_dev, st.st_ino)
        file = self.mapped.get(key)
        if file is not None and file.is_file(st):
            self.mapped.move_to_end(key)
            return file
        if file is not None:
            del self.mapped[key]
            file.close()
        file = self.mapped[key] = _Mapped(fd, st, writable=False)
        while len(self.mapped) > KEEP_MAPPED:
            self.mapped.popitem(last=False)[1].close()
        return file

    def close(self) -> None:
        """Unmap every kept file (the stage reads no more)."""
        while self.mapped:
            self.mapped.popitem()[1].close()


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
