"""Keyed MACs on the data path: large frames on plain TCP, every byte authenticated.

CurveZMQ encrypts every byte it carries, which costs about as much CPU per byte as the rest
of the transport together. With ``[security] data_path = "mac"`` the bulk traffic between
daemons (activations, gradients, parameter-server tensors) goes on a plain TCP connection
instead, and every message on it carries a tag under a secret key that the sender chose and
handed to the receiver over its Curve connection (authenticated and encrypted, the sender's
identity from ZAP), over a sequence number and every frame. The receiver checks the tag
before it decodes anything; the key also says who sent the message, so the authority rules
(:mod:`hetpipe.security`) apply unchanged.

The MAC is AES-256-GMAC (:mod:`hetpipe.gmac`, several GB/s per core with the CPU's AES and
carry-less multiply instructions) where this Python's OpenSSL has it, else HMAC-SHA256; the
tag names which, and each is keyed with its own key derived from the session's. GMAC needs
an IV never used twice under a key: it is the sender's random salt and the message's
sequence number, which grows strictly for the life of a :class:`Sealer`; two sealers of one
session (the two directions, or a restarted binder's replies) have salts of their own.

Frames, as ZeroMQ multipart messages:

- key, on the Curve connection: ``[KEY_MAGIC, sid, key]`` -- the session ``sid``
  (16 random bytes, public) is keyed with ``key`` (32 random bytes, secret).
- data, on the plain connection: ``[tag, *frames]`` where ``tag`` is
  ``DATA_MAGIC | sid | direction | alg | salt | seq | mac``; ``direction`` is 0 from the
  connecting side to the binding side, 1 for the replies; ``seq`` starts at 1 and grows by
  at least 1 per message in each direction (a reconnect may lose messages, never reorder
  them), so a replayed or reordered message is refused; ``mac`` covers the tag's first part,
  the number of frames and each frame with its length (no shifting bytes across a frame
  boundary).

Both MACs read the frames where they lie and release the GIL on large buffers, so
:func:`mac_of` may run on a thread beside the event loop. This protects integrity and
authenticity, not confidentiality: anyone on the link can read the tensors
(``data_path = "curve"`` encrypts them).
"""

from __future__ import annotations

import hmac
import secrets
import struct
import time
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from hashlib import sha256
from typing import Any

from hetpipe import gmac

__all__ = [
    "DATA_MAGIC",
    "GMAC",
    "HMAC_SHA256",
    "KEY_MAGIC",
    "SEQ_AT",
    "TO_BINDER",
    "TO_CONNECTOR",
    "Inbox",
    "MacError",
    "Sealer",
    "Session",
    "default_alg",
    "key_frames",
    "mac_of",
    "new_session",
    "parse_tag",
    "payload_bytes",
]

KEY_MAGIC = b"hetpipe-key/1"
DATA_MAGIC = b"HPM2"
SID_BYTES = 16
KEY_BYTES = 32
SALT_BYTES = gmac.IV_BYTES - 8  # the IV: salt, then the 8-byte sequence number
TO_BINDER, TO_CONNECTOR = 0, 1
GMAC, HMAC_SHA256 = 1, 2
_MAC_BYTES = {GMAC: gmac.TAG_BYTES, HMAC_SHA256: sha256().digest_size}
_ALG_NAMES = {GMAC: b"aes-256-gmac", HMAC_SHA256: b"hmac-sha256"}
# magic, sid, direction, alg, salt, seq
_HEAD = struct.Struct(f"!{len(DATA_MAGIC)}s{SID_BYTES}sBB{SALT_BYTES}sQ")
SEQ_AT = _HEAD.size - 8  # where the sequence number lies in a tag
_LEN = struct.Struct("!Q")


class MacError(ValueError):
    """A data message that fails its check; ``reason`` is one word for the counters."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def _buf(frame: Any) -> memoryview:
    """A frame's bytes without a copy (``bytes``, ``zmq.Frame``, a tensor's buffer)."""
    mv = frame.buffer if hasattr(frame, "buffer") else memoryview(frame)
    return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv


def payload_bytes(frames: Sequence[Any]) -> int:
    """The bytes a MAC covers in ``frames``."""
    return sum(_buf(f).nbytes for f in frames)


def default_alg() -> int:
    """The MAC a new sender uses: GMAC where this Python's OpenSSL has AES-GCM."""
    return GMAC if gmac.available() else HMAC_SHA256


@lru_cache(maxsize=4096)
def _subkey(key: bytes, alg: int) -> bytes:
    """The session key's own key for one MAC (one key never serves two algorithms)."""
    return hmac.new(key, b"hetpipe-mac/" + _ALG_NAMES[alg], sha256).digest()


def _parts(head: bytes, frames: Sequence[Any]) -> list[Any]:
    """What a MAC covers: the head, the number of frames, each frame after its length."""
    parts: list[Any] = [head, _LEN.pack(len(frames))]
    for f in frames:
        mv = _buf(f)
        parts += (_LEN.pack(mv.nbytes), mv)
    return parts


def mac_of(key: bytes, head: bytes, frames: Sequence[Any]) -> bytes:
    """The MAC the head names (GMAC or HMAC-SHA256) under the session ``key`` of ``head``
    (the tag's first part), the number of frames and each frame after its length. Safe to
    call on a thread: both read the frames in place with the GIL released."""
    _magic, _sid, _direction, alg, salt, seq = _HEAD.unpack(head)
    if alg == GMAC:
        try:
            iv = salt + seq.to_bytes(8, "big")
            return gmac.gmac(_subkey(key, GMAC), iv, _parts(head, frames))
        except gmac.GmacUnavailable as exc:
            raise MacError("unsupported", f"a GMAC-tagged message, and {exc}") from None
    h = hmac.new(_subkey(key, HMAC_SHA256), digestmod=sha256)
    for part in _parts(head, frames):
        h.update(part)
    return h.digest()


def parse_tag(frame: Any) -> tuple[bytes, int, int, bytes, bytes]:
    """``(sid, direction, seq, head, mac)`` of a data message's first frame; MacError if it
    is not a tag at all."""
    raw = bytes(_buf(frame)) if not isinstance(frame, bytes) else frame
    if len(raw) < _HEAD.size or not raw.startswith(DATA_MAGIC):
        raise MacError("untagged", f"first frame of {len(raw)} bytes is not a MAC tag")
    head = raw[: _HEAD.size]
    _magic, sid, direction, alg, _salt, seq = _HEAD.unpack(head)
    if direction not in (TO_BINDER, TO_CONNECTOR):
        raise MacError("untagged", f"direction {direction}")
    if alg not in _MAC_BYTES or len(raw) != _HEAD.size + _MAC_BYTES[alg]:
        raise MacError("untagged", f"MAC {alg} of {len(raw) - _HEAD.size} bytes")
    return sid, direction, seq, head, raw[_HEAD.size :]


def new_session() -> tuple[bytes, bytes]:
    """A fresh ``(sid, key)``: the session's public name and its secret key."""
    return secrets.token_bytes(SID_BYTES), secrets.token_bytes(KEY_BYTES)


def key_frames(sid: bytes, key: bytes) -> list[bytes]:
    """The key message (sent on the Curve connection only: the key is secret)."""
    return [KEY_MAGIC, sid, key]


@dataclass
class Sealer:
    """One direction of one session, sending: numbers and tags each message.

    ``clock``: numbers also never fall below the wall clock in microseconds. The binding
    side's replies are numbered so: a restarted daemon knows nothing of the numbers it sent
    before, while its peer's session (and the last number it accepted) lives on.
    """

    sid: bytes
    key: bytes
    direction: int
    seq: int = 0
    clock: bool = False
    alg: int = field(default_factory=default_alg)
    salt: bytes = field(default_factory=lambda: secrets.token_bytes(SALT_BYTES))

    def head(self) -> bytes:
        """The next message's tag head (takes its sequence number)."""
        self.seq += 1
        if self.clock:
            self.seq = max(self.seq, time.time_ns() // 1000)
        return _HEAD.pack(DATA_MAGIC, self.sid, self.direction, self.alg, self.salt, self.seq)

    def seal(self, frames: Sequence[Any]) -> bytes:
        """The tag frame to send before ``frames`` (see :meth:`head` + :func:`mac_of` to
        compute the MAC elsewhere)."""
        head = self.head()
        return head + mac_of(self.key, head, frames)


def verify(key: bytes, head: bytes, mac: bytes, frames: Sequence[Any]) -> None:
    """Raise MacError unless ``mac`` is the MAC of ``head`` and ``frames`` (constant time)."""
    if not hmac.compare_digest(mac, mac_of(key, head, frames)):
        raise MacError("forged", "MAC does not match (altered, truncated or forged)")


@dataclass
class Session:
    """What the receiving side knows of one session: its key, who keyed it (their ZAP
    user id) and the last sequence number accepted from the other side."""

    sid: bytes
    key: bytes
    user: str | None
    last_seq: int = 0
    reply: Sealer | None = None  # the binder's replies on this session
    used: float = field(default_factory=time.monotonic)


class Inbox:
    """The binding side's sessions, and the data messages held until their key arrives.

    The key travels on the Curve connection and the data on the plain one, two TCP
    connections whose messages the socket reads in no set order, so a session's first
    messages may come before its key: they are held (at most ``max_held`` messages and
    ``max_held_bytes`` in all, for at most ``hold_s`` seconds: anyone who reaches the port
    can send such messages) and handed back when the key comes. ``refused`` counts every
    message dropped, by reason.
    """

    def __init__(
        self,
        *,
        max_sessions: int = 4096,
        max_held: int = 256,
        max_held_bytes: int = 256 << 20,
        hold_s: float = 10.0,
    ) -> None:
        self.sessions: dict[bytes, Session] = {}
        self.refused: Counter[str] = Counter()
        self.max_sessions = max_sessions
        self.max_held = max_held
        self.max_held_bytes = max_held_bytes
        self.hold_s = hold_s
        self._held: deque[tuple[float, bytes, Any, int]] = deque()
        self._held_bytes = 0

    def register(self, frames: Sequence[Any], user: str | None) -> tuple[Session, list[Any]]:
        """Take a key message from ``user`` (after its magic: ``[sid, key]``); return the
        session and the messages held for it, oldest first. A session keyed by one user
        cannot be taken over by another (MacError)."""
        if len(frames) != 2:
            raise MacError("badkey", f"key message of {len(frames) + 1} frames")
        sid, key = (bytes(_buf(f)) for f in frames)
        if len(sid) != SID_BYTES or len(key) != KEY_BYTES:
            raise MacError("badkey", "session id or key of the wrong length")
        old = self.sessions.get(sid)
        if old is not None and old.user != user:
            raise MacError("badkey", f"session already keyed by {old.user}")
        if old is not None and old.key == key:
            session = old  # the same key again (the sender reconnected): numbering goes on
        else:
            session = Session(sid, key, user)
            self.sessions[sid] = session
            while len(self.sessions) > self.max_sessions:  # the least recently used goes
                oldest = min(self.sessions.values(), key=lambda s: s.used)
                del self.sessions[oldest.sid]
        held = [m for _t, s, m, _n in self._held if s == sid]
        if held:
            self._held = deque(h for h in self._held if h[1] != sid)
            self._held_bytes = sum(h[3] for h in self._held)
        return session, held

    def check(self, tag: Any, direction: int = TO_BINDER) -> tuple[Session, bytes, bytes]:
        """The session a data message's tag names, its head and MAC, before the MAC is
        verified (the caller verifies, maybe on a thread, then calls :meth:`accept`).
        MacError ``unknown`` when the session has no key (yet)."""
        sid, d, seq, head, mac = parse_tag(tag)
        if d != direction:
            raise MacError("direction", "a message sent the other way")
        session = self.sessions.get(sid)
        if session is None:
            raise MacError("unknown", "no key for its session")
        if seq <= session.last_seq:
            raise MacError("replayed", f"sequence {seq} after {session.last_seq}")
        return session, head, mac

    def accept(self, session: Session, head: bytes) -> None:
        """Record a verified message's sequence number (later ones must be above it)."""
        seq = _HEAD.unpack(head)[-1]
        if seq <= session.last_seq:  # verified meanwhile on a thread: check once more
            raise MacError("replayed", f"sequence {seq} after {session.last_seq}")
        session.last_seq = seq
        session.used = time.monotonic()

    def open(self, frames: Sequence[Any]) -> tuple[Session, list[Any]]:
        """Check and verify a whole data message here (the synchronous path); return its
        session and its frames after the tag."""
        if not frames:
            raise MacError("untagged", "empty message")
        session, head, mac = self.check(frames[0])
        body = list(frames[1:])
        verify(session.key, head, mac, body)
        self.accept(session, head)
        return session, body

    def hold(self, sid: bytes, message: Any, nbytes: int = 0) -> bool:
        """Keep a message (of ``nbytes``) of a session not keyed yet; False (and counted)
        when that would pass the bounds."""
        self.expire()
        if len(self._held) >= self.max_held or self._held_bytes + nbytes > self.max_held_bytes:
            self.refused["unknown"] += 1
            return False
        self._held.append((time.monotonic(), sid, message, nbytes))
        self._held_bytes += nbytes
        return True

    def expire(self) -> int:
        """Drop held messages older than ``hold_s`` (their key never came); how many."""
        now, n = time.monotonic(), 0
        while self._held and now - self._held[0][0] > self.hold_s:
            self._held_bytes -= self._held.popleft()[3]
            n += 1
        self.refused["unknown"] += n
        return n

    def refuse(self, reason: str) -> None:
        self.refused[reason] += 1
