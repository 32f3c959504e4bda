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
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

import zmq
import zmq.asyncio

from hetpipe import log as logmod
from hetpipe.ratelog import Throttle, excerpt
from hetpipe.security import Curve, apply_curve
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
    """
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
            sock.bind(bind)
        if connect is not None:
            sock.connect(connect)
    except BaseException:
        sock.close(linger=0)
        raise
    return sock


def bound_address(sock: zmq.asyncio.Socket) -> str:
    """The address a socket really bound (port 0 resolved to the port it got)."""
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
        # only a Curve socket's messages carry a ZAP user id: a plain socket's lookup would
        # raise (and build a ZMQError) for every message
        self._has_user = sock.getsockopt(zmq.MECHANISM) != zmq.NULL
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
                self._reader(), name=f"reader:{self.name}"
            )
        return self

    async def close(self, linger_ms: int = 0) -> None:
        """Stop the reader, fail pending requests, close the socket.

        ``linger_ms`` lets messages already queued still leave (a stage's last gradient must
        reach its predecessor even if this stage is done first).
        """
        self.closed = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        for fut, _what in list(self._pending.values()):
            if not fut.done():
                fut.set_exception(ConnectionError(f"{self.name}: channel closed"))
        self._pending.clear()
        self._io.close()
        self.sock.close(linger=linger_ms)

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
        flags = 0
        if self._routed:
            if to is None:
                raise ValueError(f"{self.name}: a ROUTER send needs a peer identity")
            frames = [to, *frames]
            # A peer that does not read its replies fills its queue (HWM messages); waiting
            # for it would stall this socket's only reader, and with it every other peer.
            flags = zmq.NOBLOCK
        try:
            await self._io.send(frames, flags=flags, copy=not _large(frames))
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

    async def _reader(self) -> None:
        waited = False
        while True:
            try:
                frames = self._io.recv_now()
                if frames is None:
                    await self._io.wait(zmq.POLLIN)
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
            ident: bytes | None = None
            user = _user_id(frames[-1]) if self._has_user else None
            if self._routed:
                ident = frames[0].bytes
                frames = frames[1:]
            await self._dispatch(ident, frames, user)
            # A message already waiting is read without suspending, so under a flood this
            # loop would never give the event loop back: heartbeats, job starts and the
            # other sockets' readers would starve. Yield once per message that did not wait
            # (one that did already let the loop run).
            if not waited:
                await asyncio.sleep(0)
            waited = False

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
