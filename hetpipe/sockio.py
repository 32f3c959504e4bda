"""One ZeroMQ socket's sends and receives on the asyncio loop, a future only when it must wait.

Why not ``zmq.asyncio`` alone: it makes a future, a poller registration, several ``EVENTS``
reads and, for a receive, a try that raises ``zmq.Again`` for every message, also when the
message is already there. A pipeline stage sends and receives several small messages per
minibatch (a tensor's shared-memory description, not its bytes), on a host whose cores the
stages' compute already fills, so that per-message CPU is throughput lost
(``scripts/probe_message_cpu.py`` measures it against raw pyzmq).

:class:`SocketIO` sends and receives through the socket's synchronous shadow whenever
ZeroMQ's ``EVENTS`` says it can, and waits (one future, woken by the loop's reader on the
socket's ``FD``) only when it cannot. ZeroMQ's ``FD`` is edge-triggered: it signals that
``EVENTS`` may have changed, and any send, receive or ``EVENTS`` read may consume that
signal. So every look at ``EVENTS`` goes through :meth:`SocketIO.events`, which wakes whoever
waits for what is now possible, and a send made while a receive waits (or a receive made
while a send waits) looks once more: no signal is consumed without its waiter hearing.

The socket's ``zmq.asyncio`` methods must not be used beside it: their own reader on the
same ``FD`` would replace this one.
"""

from __future__ import annotations

import asyncio
from typing import Any

import zmq

__all__ = ["SocketIO"]

# plain ints: ``EVENTS`` is read as an int, and an int masked with pyzmq's flag enums goes
# through the enum machinery (about 1 us a time, several times per message)
_IN, _OUT, _NOBLOCK = int(zmq.POLLIN), int(zmq.POLLOUT), int(zmq.NOBLOCK)


class SocketIO:
    """Non-blocking sends and receives of one socket, with waits on its readiness."""

    def __init__(self, sock: zmq.Socket) -> None:
        self._owner = sock  # closing it frees the socket the shadow points to
        self.sock = zmq.Socket.shadow(sock.underlying)  # synchronous: no futures
        self._fd = self.sock.getsockopt(zmq.FD)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self._waiters: dict[int, list[asyncio.Future[None]]] = {_IN: [], _OUT: []}

    def _check_open(self) -> None:
        """A closed socket's shadow must not be used (its handle is freed), so every call
        raises what pyzmq raises for a closed socket, ``ENOTSOCK``."""
        if self._closed or self._owner.closed:
            raise zmq.ZMQError(zmq.ENOTSOCK)

    def events(self) -> int:
        """ZeroMQ's ``EVENTS`` now; wakes the waiters of whatever it allows."""
        self._check_open()
        ev: int = self.sock.getsockopt(zmq.EVENTS)
        for flag, waiters in self._waiters.items():
            if ev & flag and waiters:
                for fut in waiters:
                    if not fut.done():
                        fut.set_result(None)
                waiters.clear()
        return ev

    def _on_fd(self) -> None:
        """The loop's reader on the socket's ``FD``: reading ``EVENTS`` also clears the
        signal (the loop polls level-triggered: an unread signal would fire on every turn)."""
        try:
            self.events()
        except zmq.ZMQError:  # closed under us: nothing more to watch
            self.close()

    async def wait(self, flag: int) -> None:
        """Until ``EVENTS`` shows ``flag`` (``zmq.POLLIN`` or ``zmq.POLLOUT``) again. Call
        it right after a look that lacked it (:meth:`recv_now` gave None, a send found the
        queue full): any change since signals the ``FD``, whose reader wakes this wait."""
        self._check_open()
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self._loop.add_reader(self._fd, self._on_fd)
        fut = self._loop.create_future()
        self._waiters[int(flag)].append(fut)
        await fut

    def recv_now(self) -> list[Any] | None:
        """A waiting message's frames (``zmq.Frame``, not copied), or None if none waits.

        ``ZMQ_EVENTS`` may report a message that a receive then does not find (one dropped
        on arrival, e.g. by CurveZMQ): that is "none waits" too, not a failure."""
        if not self.events() & _IN:
            return None
        try:
            frames = self.sock.recv_multipart(_NOBLOCK, copy=False)
        except zmq.Again:
            return None
        if self._waiters[_OUT]:
            self.events()
        return frames

    async def send(self, frames: list[Any], *, flags: int = 0, copy: bool = True) -> None:
        """Send one message; with ``zmq.NOBLOCK`` in ``flags`` a full queue raises
        ``zmq.Again``, otherwise it waits for room. ``copy=False``: the frames keep their
        buffers alive until ZeroMQ has sent them."""
        while True:
            self._check_open()
            try:
                self.sock.send_multipart(frames, flags=flags | _NOBLOCK, copy=copy)
            except zmq.Again:
                if flags & _NOBLOCK:
                    raise
                await self.wait(_OUT)
                continue
            if self._waiters[_IN]:
                self.events()
            return

    def close(self) -> None:
        """Stop watching the socket (before it closes) and fail what still waits."""
        self._closed = True
        if self._loop is not None:
            if not self._loop.is_closed():
                self._loop.remove_reader(self._fd)  # before the socket (and its FD) closes
            self._loop = None
        for waiters in self._waiters.values():
            for fut in waiters:
                if not fut.done():
                    fut.set_exception(zmq.ZMQError(zmq.ENOTSOCK))
            waiters.clear()
