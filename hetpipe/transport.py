"""Sockets and message channels on the asyncio loop.

One factory makes every socket, with its high-water mark and linger set at creation, so no
socket in the project is ever left with an unbounded queue or a close that hangs. A
:class:`Channel` owns one socket and its single long-lived reader task: it decodes every
frame set with :mod:`hetpipe.wire`, answers malformed messages with an ``error`` reply where
the pattern has a reply, matches replies to requests by ``rid``, and hands everything else to
the owner's handler. Nothing here cancels an in-flight ``recv``: waits for replies are waits on
futures, with deadlines whose errors say what to check. The sockets are ``zmq.asyncio``'s,
but a channel sends and receives through :class:`hetpipe.sockio.SocketIO` (no future per
message).

**The MAC data path** (``[security] data_path = "mac"``, :mod:`hetpipe.framemac`): a Curve
socket that binds also binds a plain endpoint at its port + 1000 on the same socket, which
takes only MAC-tagged messages of sessions keyed over Curve. A socket made with
``mac_link=True`` that connects (the daemons' data channels: to a neighbour's data port, to
a shard) gets a plain twin: the Curve socket carries only the session key, sent again at each
handshake (a restarted peer learns it anew), and every message goes tagged on the twin, which
connects once the key is on its way. A message that fails its check is dropped, counted
(:attr:`Channel.mac_refused`) and logged in one line; nothing of it is decoded.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import itertools
import time
import weakref
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from hetpipe import framemac
from hetpipe import log as logmod
from hetpipe.framemac import TO_BINDER, TO_CONNECTOR, Inbox, MacError, Sealer, Session
from hetpipe.ratelog import Throttle, excerpt
from hetpipe.security import DATA_PORT_OFFSET, Curve, apply_curve, data_address
from hetpipe.sockio import SocketIO
from hetpipe.wire import (
    ZERO_COPY_MIN_BYTES,
    Kind,
    Message,
    WireError,
    decode,
    encode,
    error_frames,
)

if TYPE_CHECKING:
    import torch

__all__ = [
    "Channel",
    "RemoteError",
    "bound_address",
    "make_socket",
    "tcp",
]

Handler = Callable[[bytes | None, Message], Awaitable[None]]


class RemoteError(RuntimeError):
    """The peer answered a request with an ``error`` message."""


def tcp(host: str, port: int) -> str:
    """The ZeroMQ address of a TCP endpoint."""
    return f"tcp://{host}:{port}"


CURVE_FRAME_OVERHEAD = 64  # bytes CurveZMQ adds to a frame on the wire (33 today), rounded up
MAC_THREAD_MIN_BYTES = 256 << 10  # a message this large is MAC'd on a thread, off the loop
_BIND_TRIES = 32  # ephemeral ports tried for a Curve port whose port + 1000 is free too


@dataclass
class _Link:
    """A connecting socket's plain twin and the session it tags its messages with."""

    data: zmq.asyncio.Socket
    address: str
    sealer: Sealer
    replies: Session  # what came back on the twin (direction TO_CONNECTOR)
    monitor: zmq.asyncio.Socket  # the Curve socket's handshakes, watched from before connect
    connected: bool = False


@dataclass
class _Bound:
    """A binding socket's Curve endpoint (what peers are told) and its sessions."""

    endpoint: str
    inbox: Inbox = field(default_factory=Inbox)


_LINKS: weakref.WeakKeyDictionary[zmq.Socket, _Link] = weakref.WeakKeyDictionary()
_BOUND: weakref.WeakKeyDictionary[zmq.Socket, _Bound] = weakref.WeakKeyDictionary()
_MAC_POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="mac")


async def _mac(key: bytes, head: bytes, frames: list[Any]) -> bytes:
    """A message's MAC: on a thread when large (the MAC drops the GIL), so the loop and
    ZeroMQ's I/O thread go on meanwhile; inline when small (a thread hop costs more)."""
    if framemac.payload_bytes(frames) < MAC_THREAD_MIN_BYTES:
        return framemac.mac_of(key, head, frames)
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_MAC_POOL, framemac.mac_of, key, head, frames)


def _bind_with_data_port(sock: zmq.Socket, bind: str, curve: Curve) -> None:
    """Bind the Curve endpoint ``bind`` and, on the same socket, the plain data endpoint
    at its port + DATA_PORT_OFFSET (ZeroMQ takes a listener's mechanism at bind time). An
    ephemeral port (0) is retried until both are free; a fixed one fails naming both."""
    for _ in range(_BIND_TRIES):
        apply_curve(sock, curve, server=True)
        sock.bind(bind)
        endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        sock.curve_server = False  # the next listener is plain (NULL mechanism)
        try:
            port = int(endpoint.rpartition(":")[2]) + DATA_PORT_OFFSET
            if port > 65535:
                raise zmq.ZMQError(zmq.EADDRINUSE)
            sock.bind(data_address(endpoint))
        except zmq.ZMQError as exc:
            sock.unbind(endpoint)
            if not bind.endswith(":0"):
                raise zmq.ZMQError(
                    exc.errno,
                    f"{endpoint} serves Curve, and its data port (port + {DATA_PORT_OFFSET}, "
                    f'[security] data_path = "mac") is unusable: {exc.strerror}',
                ) from None
            continue
        # the socket reads as a Curve server again (its plain listener keeps the options it
        # was bound with): handshake monitors and user ids go by that
        apply_curve(sock, curve, server=True)
        _BOUND[sock] = _Bound(endpoint)
        return
    raise zmq.ZMQError(zmq.EADDRINUSE, f"no free port pair (p, p + {DATA_PORT_OFFSET}) for {bind}")


def make_socket(
    ctx: zmq.asyncio.Context,
    kind: int,
    *,
    bind: str | None = None,
    connect: str | None = None,
    identity: bytes | None = None,
    hwm: int = 64,
    linger_ms: int = 0,
    router_mandatory: bool = False,
    max_frame_bytes: int | None = None,
    curve: Curve | None = None,
    mac_link: bool = False,
) -> zmq.asyncio.Socket:
    """Create a socket with every option that matters set before it binds or connects.

    ``max_frame_bytes`` becomes ZeroMQ's ``MAXMSGSIZE`` (checked per frame): a peer that
    sends a larger frame is disconnected as soon as the frame's length is read, before its
    bytes are buffered, so an oversize frame costs no memory (the wire's own check comes
    after the whole frame arrived). The limit covers headers too (the cluster file's
    ``max_frame_bytes`` is at least 1 MiB, far above any header).

    With ``curve``, a socket that binds is a CurveZMQ server (its peers are authenticated by
    the process's ZAP handler) and one that connects is a Curve client; None: plain TCP.
    Curve's framing (command name, nonce, MAC) is added to ``MAXMSGSIZE``: without it a
    frame of exactly ``max_frame_bytes``, which the wire allows, would cost its sender the
    connection.

    With Curve and ``data_path = "mac"``: a socket that binds also takes MAC-tagged data on
    its port + 1000; one that connects with ``mac_link`` (a data channel) gets a plain twin
    that carries its messages (see the module's doc). Other sockets stay Curve only.
    """
    mac = curve is not None and curve.data_path == "mac"
    sock = ctx.socket(kind)
    try:
        # -- trust (hetpipe.security): Curve keys before bind/connect --
        apply_curve(sock, curve, server=bind is not None)
        sock.setsockopt(zmq.LINGER, linger_ms)
        sock.setsockopt(zmq.SNDHWM, hwm)
        sock.setsockopt(zmq.RCVHWM, hwm)
        if max_frame_bytes is not None:
            # under Curve libzmq checks the encrypted frame, which is a few bytes longer
            extra = CURVE_FRAME_OVERHEAD if curve is not None else 0
            sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes + extra)
        sock.copy_threshold = ZERO_COPY_MIN_BYTES
        if identity is not None:
            sock.setsockopt(zmq.IDENTITY, identity)
        if router_mandatory:
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if bind is not None:
            if mac:
                assert curve is not None
                _bind_with_data_port(sock, bind, curve)
            else:
                sock.bind(bind)
        if connect is not None:
            if mac and mac_link:  # before connecting: its first handshake must be seen
                _LINKS[sock] = _twin(sock, kind, connect, hwm, linger_ms, max_frame_bytes)
            sock.connect(connect)
    except BaseException:
        link = _LINKS.pop(sock, None)
        if link is not None:
            link.monitor.close(linger=0)
            link.data.close(linger=0)
        sock.close(linger=0)
        raise
    return sock


def _twin(
    sock: zmq.asyncio.Socket,
    kind: int,
    connect: str,
    hwm: int,
    linger_ms: int,
    max_frame_bytes: int | None,
) -> _Link:
    """A plain socket of ``kind`` for a data channel's tagged messages, and a new session.
    It connects only when the Curve socket's handshake has sent the key (:class:`Channel`)."""
    ctx = sock.context
    data = make_socket(ctx, kind, hwm=hwm, linger_ms=linger_ms, max_frame_bytes=max_frame_bytes)
    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    sid, key = framemac.new_session()
    session = Session(sid, key, None)
    return _Link(data, data_address(connect), Sealer(sid, key, TO_BINDER), session, monitor)


def bound_address(sock: zmq.asyncio.Socket) -> str:
    """The address a socket really bound (port 0 resolved to the port it got); its Curve
    endpoint where it also binds a data port."""
    bound = _BOUND.get(sock)
    if bound is not None:
        return bound.endpoint
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


def _large(frames: list[Any]) -> bool:
    return any(len(memoryview(f)) >= ZERO_COPY_MIN_BYTES for f in frames)


class Channel:
    """One socket, one reader task, requests matched to replies by ``rid``.

    Works for ROUTER (messages carry the peer identity; replies go back to it) and for
    DEALER/PULL/PUSH (no identity). Sends of large tensors are zero-copy: the frames keep the
    source tensors alive until ZeroMQ has sent them, so callers must not modify a tensor in
    place after sending it (the runtime never does: weights are updated out of place).
    """

    def __init__(
        self,
        sock: zmq.asyncio.Socket,
        handler: Handler | None,
        *,
        name: str,
        max_frame_bytes: int,
        routed: bool | None = None,
    ) -> None:
        self.sock = sock
        self._io = SocketIO(sock)  # every send and receive: no future per message
        # the MAC data path: a connecting data channel's plain twin, or a binding socket's
        # sessions (hetpipe.framemac); None on Curve-only and plain sockets
        self._link = _LINKS.get(sock)
        self._bound = _BOUND.get(sock)
        self._data_io = SocketIO(self._link.data) if self._link is not None else None
        self._keyer: asyncio.Task[None] | None = None
        self._data_task: asyncio.Task[None] | None = None
        self._seal_lock = asyncio.Lock()  # sequence numbers leave in the order they are taken
        self._reply_sessions: dict[bytes, Session] = {}  # plain peer identity -> its session
        self._refused: Counter[str] = Counter()  # tagged replies dropped (connecting side)
        # only a Curve socket's messages carry a ZAP user id: a plain socket's lookup would
        # raise (and build a ZMQError) for every message
        self._has_user = sock.getsockopt(zmq.MECHANISM) != zmq.NULL or self._bound is not None
        self.name = name
        self._handler = handler
        self._max_frame_bytes = max_frame_bytes
        self._routed = sock.type == zmq.ROUTER if routed is None else routed
        self._pending: dict[int, tuple[asyncio.Future[Message], str]] = {}
        self._rids = itertools.count(1)
        self._task: asyncio.Task[None] | None = None
        self._log = logmod.get(name)
        self._bad = Throttle(self._log)  # malformed messages: once per peer per interval
        self._flood = [time.monotonic(), 0]  # [window start, bad messages in it]
        self.closed = False

    # -- life cycle -------------------------------------------------------------------------

    def start(self) -> Channel:
        """Start the reader task (only for sockets that receive)."""
        if self._task is None and self.sock.type != zmq.PUSH:
            self._task = asyncio.get_running_loop().create_task(
                self._reader(self._io, self._on_frames), name=f"reader:{self.name}"
            )
        self._start_link()
        return self

    @property
    def mac_refused(self) -> Counter[str]:
        """Tagged messages dropped on this channel, by reason (``forged``, ``replayed``,
        ``untagged``, ``unknown`` session, ...)."""
        return self._bound.inbox.refused if self._bound is not None else self._refused

    def _start_link(self) -> None:
        """A data channel's twin: hand the key over at each Curve handshake, read replies."""
        if self._link is None or self._keyer is not None:
            return
        loop = asyncio.get_running_loop()
        self._keyer = loop.create_task(self._keep_keyed(), name=f"key:{self.name}")
        if self.sock.type != zmq.PUSH:
            assert self._data_io is not None
            self._data_task = loop.create_task(
                self._reader(self._data_io, self._on_tagged_reply), name=f"data:{self.name}"
            )

    async def _keep_keyed(self) -> None:
        """Send the session key on the Curve socket after each handshake (a restarted peer
        knows no session); connect the twin after the first, so the key leads the data."""
        link = self._link
        assert link is not None
        mon = link.monitor
        try:
            while True:
                parse_monitor_message(await mon.recv_multipart())
                key = framemac.key_frames(link.sealer.sid, link.sealer.key)
                try:
                    await self._io.send(key, flags=zmq.NOBLOCK)
                except zmq.ZMQError as exc:  # the next handshake sends it again
                    self._log.warning("session key not sent", error=str(exc))
                    continue
                if not link.connected:
                    link.data.connect(link.address)
                    link.connected = True
        finally:
            with contextlib.suppress(zmq.ZMQError):
                self.sock.disable_monitor()
            mon.close(linger=0)

    async def close(self, linger_ms: int = 0) -> None:
        """Stop the reader, fail pending requests, close the socket.

        ``linger_ms`` lets messages already queued still leave (a stage's last gradient must
        reach its predecessor even if this stage is done first).
        """
        self.closed = True
        for task in (self._task, self._data_task, self._keyer):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        for fut, _what in list(self._pending.values()):
            if not fut.done():
                fut.set_exception(ConnectionError(f"{self.name}: channel closed"))
        self._pending.clear()
        self._io.close()
        self.sock.close(linger=linger_ms)
        if self._link is not None and self._data_io is not None:
            self._data_io.close()
            self._link.data.close(linger=linger_ms)
            if self._keyer is None:  # never started: its monitor is closed here
                self._link.monitor.close(linger=0)

    # -- sending ----------------------------------------------------------------------------

    async def send(
        self,
        kind: Kind | str,
        fields: Mapping[str, Any] | None = None,
        tensors: Mapping[str, torch.Tensor] | None = None,
        *,
        to: bytes | None = None,
    ) -> None:
        """Send one message; ``to`` is the peer identity on a ROUTER."""
        frames: list[Any] = encode(kind, dict(fields or {}), tensors)
        await self.send_frames(frames, to=to)

    async def send_frames(self, frames: list[Any], *, to: bytes | None = None) -> None:
        """Send already-encoded frames (zero-copy when any frame is large)."""
        if self._link is not None:  # a data channel: tagged, on the plain twin
            self._start_link()
            assert self._data_io is not None
            async with self._seal_lock:
                sealer = self._link.sealer
                head = sealer.head()
                tag = head + await _mac(sealer.key, head, frames)
                await self._send(self._data_io, [tag, *frames], to)
            return
        if to is not None and (session := self._reply_sessions.get(to)) is not None:
            async with self._seal_lock:  # a reply to a peer that spoke on the data port
                assert session.reply is not None
                head = session.reply.head()
                tag = head + await _mac(session.key, head, frames)
                await self._send(self._io, [tag, *frames], to)
            return
        await self._send(self._io, frames, to)

    async def _send(self, io: SocketIO, frames: list[Any], to: bytes | None) -> None:
        flags = 0
        if self._routed:
            if to is None:
                raise ValueError(f"{self.name}: a ROUTER send needs a peer identity")
            frames = [to, *frames]
            # A peer that does not read its replies fills its queue (HWM messages); waiting
            # for it would stall this socket's only reader, and with it every other peer.
            flags = zmq.NOBLOCK
        try:
            await io.send(frames, flags=flags, copy=not _large(frames))
        except zmq.Again as exc:
            raise ConnectionError(
                f"{self.name}: peer {to!r} does not read (its queue is full); message dropped"
            ) from exc
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                raise ConnectionError(f"{self.name}: peer {to!r} is not connected") from exc
            raise

    async def send_request(
        self,
        kind: Kind | str,
        fields: Mapping[str, Any] | None = None,
        tensors: Mapping[str, torch.Tensor] | None = None,
        *,
        to: bytes | None = None,
        what: str,
    ) -> asyncio.Future[Message]:
        """Send a request with a fresh ``rid`` now; the returned future gets its reply.

        Sending before returning keeps the order of requests on the socket the order of the
        calls. ``what`` names the peer in errors; an ``error`` reply fails the future with
        :class:`RemoteError` carrying the peer's text.
        """
        rid = next(self._rids)
        fut: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        self._pending[rid] = (fut, what)
        fut.add_done_callback(lambda _f: self._pending.pop(rid, None))
        try:
            await self.send(kind, {**(fields or {}), "rid": rid}, tensors, to=to)
        except BaseException:
            fut.cancel()
            raise
        return fut

    async def request(
        self,
        kind: Kind | str,
        fields: Mapping[str, Any] | None = None,
        tensors: Mapping[str, torch.Tensor] | None = None,
        *,
        to: bytes | None = None,
        timeout: float,
        what: str,
    ) -> Message:
        """Send a request and wait for its reply, at most ``timeout`` seconds."""
        fut = await self.send_request(kind, fields, tensors, to=to, what=what)
        try:
            return await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            raise TimeoutError(f"no answer to {kind} from {what} within {timeout:g} s") from None

    async def reply_error(self, to: bytes | None, message: str, rid: int | None = None) -> None:
        """Answer a sender with an ``error`` message (best effort: the peer may be gone)."""
        if self.sock.type in (zmq.PULL, zmq.PUSH):
            return
        # error texts often quote what the peer sent: never echo it unbounded
        with contextlib.suppress(ConnectionError, zmq.ZMQError):
            await self.send_frames(error_frames(excerpt(message, 1000), rid), to=to)

    # -- receiving --------------------------------------------------------------------------

    async def _reader(self, io: SocketIO, take: Callable[[list[Any]], Awaitable[None]]) -> None:
        waited = False
        while True:
            try:
                frames = io.recv_now()
                if frames is None:
                    await io.wait(zmq.POLLIN)
                    waited = True
                    continue
            except asyncio.CancelledError:
                raise
            except zmq.ZMQError as exc:
                if self.closed or self.sock.closed or exc.errno == zmq.ETERM:
                    return
                self._log.warning("recv failed", error=str(exc))
                await asyncio.sleep(0.01)  # a socket that keeps failing must not spin
                continue
            await take(frames)
            # A message already waiting is read without suspending, so under a flood this
            # loop would never give the event loop back: heartbeats, job starts and the
            # other sockets' readers would starve. Yield once per message that did not wait
            # (one that did already let the loop run).
            if not waited:
                await asyncio.sleep(0)
            waited = False

    async def _on_frames(self, frames: list[Any]) -> None:
        """One message from the socket: its sender, then the MAC path or the wire's."""
        ident: bytes | None = None
        user = _user_id(frames[-1]) if self._has_user else None
        if self._routed:
            ident = frames[0].bytes
            frames = frames[1:]
        if self._bound is None:
            await self._dispatch(ident, frames, user)
        elif user is None:  # from the plain data port: tagged, or dropped
            await self._on_tagged(ident, frames)
        elif (
            frames
            and len(frames[0]) == len(framemac.KEY_MAGIC)
            and (frames[0].bytes == framemac.KEY_MAGIC)
        ):
            await self._on_key(user, frames[1:])
        else:
            await self._dispatch(ident, frames, user)

    async def _on_key(self, user: str, frames: list[Any]) -> None:
        """A session key from a Curve peer: the data held for it goes on now."""
        inbox = self._bound.inbox  # type: ignore[union-attr]
        try:
            _session, held = inbox.register(frames, user)
        except MacError as exc:
            inbox.refuse(exc.reason)
            self._bad.warning("session key refused", str(user), str(exc), user=user)
            return
        for ident, message in held:
            await self._on_tagged(ident, message)

    def _mac_refused(self, ident: bytes | None, exc: MacError, counts: Counter[str] | None) -> None:
        """Count (where not yet counted) and log, in one line per peer and interval."""
        if counts is not None:
            counts[exc.reason] += 1
        self._bad.warning(
            "data message refused", f"mac:{_peer(ident)}", str(exc), reason=exc.reason
        )

    async def _on_tagged(self, ident: bytes | None, frames: list[Any]) -> None:
        """A message from the plain data port: decoded only once its MAC and sequence
        number check out, as from the user that keyed its session."""
        inbox = self._bound.inbox  # type: ignore[union-attr]
        try:
            if not frames:
                raise MacError("untagged", "empty message")
            session, head, mac = inbox.check(frames[0])
            body = frames[1:]
            if not hmac.compare_digest(mac, await _mac(session.key, head, body)):
                raise MacError("forged", "MAC does not match (altered, truncated or forged)")
            inbox.accept(session, head)
        except MacError as exc:
            if exc.reason == "unknown":  # its key may still be on its way (Curve)
                sid = framemac.parse_tag(frames[0])[0]
                if inbox.hold(sid, (ident, frames), sum(len(f) for f in frames)):
                    return
                exc = MacError("unknown", "no key for its session, and no room to wait")
                self._mac_refused(ident, exc, None)  # hold() counted it
            else:
                self._mac_refused(ident, exc, inbox.refused)
            await self._slow_down_under_flood()
            return
        if ident is not None:
            if session.reply is None:
                session.reply = Sealer(session.sid, session.key, TO_CONNECTOR, clock=True)
            self._reply_sessions[ident] = session
            while len(self._reply_sessions) > inbox.max_sessions:
                del self._reply_sessions[next(iter(self._reply_sessions))]
        await self._dispatch(ident, body, session.user)

    async def _on_tagged_reply(self, frames: list[Any]) -> None:
        """A reply on a data channel's twin: checked against this channel's own session."""
        assert self._link is not None
        session = self._link.replies
        try:
            if not frames:
                raise MacError("untagged", "empty message")
            sid, direction, seq, head, mac = framemac.parse_tag(frames[0])
            if sid != session.sid or direction != TO_CONNECTOR:
                raise MacError("unknown", "not this channel's session")
            if seq <= session.last_seq:
                raise MacError("replayed", f"sequence {seq} after {session.last_seq}")
            body = frames[1:]
            if not hmac.compare_digest(mac, await _mac(session.key, head, body)):
                raise MacError("forged", "MAC does not match (altered, truncated or forged)")
            if seq <= session.last_seq:
                raise MacError("replayed", f"sequence {seq} after {session.last_seq}")
            session.last_seq = seq
        except MacError as exc:
            self._mac_refused(None, exc, self._refused)
            return
        await self._dispatch(None, body, None)

    async def _slow_down_under_flood(self) -> None:
        """Past ``FLOOD_PER_S`` bad messages a second, pause after each one.

        Reading garbage as fast as it comes would take the process's CPU (and the GIL)
        from its own work: a worker's compute thread, the head's job start. Pausing lets
        ZeroMQ's queues fill, so the flooding sender is held back by the high-water mark
        while well-formed messages from other peers (fair-queued by ZeroMQ) still pass,
        each behind at most one bad message per flooding peer.
        """
        now = time.monotonic()
        if now - self._flood[0] >= 1.0:
            self._flood = [now, 0]
        self._flood[1] += 1
        if self._flood[1] > FLOOD_PER_S:
            await asyncio.sleep(1.0 / FLOOD_PER_S)

    async def _dispatch(
        self, ident: bytes | None, frames: list[Any], user: str | None = None
    ) -> None:
        try:
            msg = decode(frames, max_frame_bytes=self._max_frame_bytes)
        except WireError as exc:
            if (
                self._bad.warning("bad message dropped", str(_peer(ident)), str(exc), user=user)
                or self._bad.count(str(_peer(ident))) < MAX_ERROR_REPLIES
            ):
                await self.reply_error(ident, f"bad message: {exc}")
            await self._slow_down_under_flood()
            return
        msg.user = user
        rid = msg.fields.get("rid")
        if isinstance(rid, int) and msg.kind in _REPLY_KINDS and rid in self._pending:
            fut, what = self._pending[rid]
            if not fut.done():
                if msg.kind == Kind.ERROR:
                    fut.set_exception(RemoteError(f"{what}: {msg['message']}"))
                else:
                    fut.set_result(msg)
            return
        if self._handler is None:
            self._log.debug("unexpected message dropped", kind=str(msg.kind))
            return
        try:
            await self._handler(ident, msg)
        except ConnectionError as exc:  # a peer gone or not reading: its loss, not a bug
            self._bad.warning(
                "reply undeliverable", str(_peer(ident)), str(exc), kind=str(msg.kind)
            )
        except Exception as exc:  # a handler bug must not kill the reader
            self._bad.warning(
                "handler failed",
                str(_peer(ident)),
                f"{type(exc).__name__}: {exc}",
                kind=str(msg.kind),
                user=msg.user,
                exc_info=True,
            )
            await self.reply_error(ident, f"{msg.kind} failed: {exc}", rid)


FLOOD_PER_S = 1000  # bad messages a second read at full speed; beyond, each costs a pause
MAX_ERROR_REPLIES = 100  # per peer and log interval; beyond, a flooding peer gets no answers
_REPLY_KINDS = frozenset({Kind.OK, Kind.ERROR, Kind.PULLED, Kind.REDUCED})


def _peer(ident: bytes | None) -> str | None:
    return None if ident is None else excerpt(ident.decode("utf-8", "replace"), 80)


def _user_id(frame: Any) -> str | None:
    """The peer's user id from ZAP (its key's name under Curve); None on plain sockets."""
    try:
        user = frame.get("User-Id")
    except (AttributeError, zmq.ZMQError):
        return None
    return user or None
