"""What every daemon shares: signals, readiness reports, the owner of sockets and tasks.

A daemon binds (port 0 allowed), writes a JSON *ready file* with the addresses it really
got, and runs until SIGTERM or SIGINT. :class:`Owner` keeps every channel and task of the
process and closes them in reverse order, also when start-up fails halfway.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import click
import zmq
import zmq.asyncio

from hetpipe import hostmem, security
from hetpipe import log as logmod
from hetpipe.config import ClusterConfig, RuntimeSpec, check_address
from hetpipe.security import Curve, SecuritySpec
from hetpipe.transport import Channel, make_socket

__all__ = ["Owner", "normal_host", "start_daemon", "wait_for_signal", "write_ready"]


def start_daemon(
    name: str, cluster: ClusterConfig, log_file: str | None, log_level: str, head: str | None
) -> str | None:
    """What every daemon does once its cluster file loaded: take over its rotating log file
    (when given one), have its allocator keep freed memory for the next minibatch's
    tensors (:mod:`hetpipe.hostmem`) and check ``--head``; returns the checked head
    address. A bad ``--head`` is one line for the user (click), not a traceback."""
    rt = cluster.runtime
    hostmem.retain_freed(rt.retain_freed_mib)
    if log_file is not None:
        logmod.rotate_to(
            name, log_file, level=log_level, max_bytes=rt.log_max_bytes, keep=rt.log_keep
        )
    if head is None:
        return None
    try:
        return check_address(head)
    except ValueError as exc:
        raise click.ClickException(f"--head: {exc}") from None


def normal_host(host: str) -> str:
    """Hosts that name this machine compare equal."""
    return "127.0.0.1" if host in ("localhost", "127.0.0.1", "::1") else host


def write_ready(path: str | None, info: dict[str, Any]) -> None:
    """Report readiness atomically: a parent polls for the file and reads it whole."""
    if not path:
        return
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps({**info, "pid": os.getpid()}))
    tmp.replace(path)


async def wait_for_signal() -> str:
    """Wait until SIGTERM or SIGINT; return its name."""
    loop = asyncio.get_running_loop()
    got: asyncio.Future[str] = loop.create_future()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda s=sig: got.done() or got.set_result(s.name))
    try:
        return await got
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


class Owner:
    """Owns a process's ZeroMQ context, channels and background tasks.

    It also holds the process's Curve keys (``curve``, handed to every socket it makes) and,
    for a daemon, its one ZAP authenticator: ZAP is per context, so one per process.
    """

    def __init__(self) -> None:
        self.ctx = zmq.asyncio.Context()
        self.channels: list[Channel] = []
        self.tasks: list[asyncio.Task[Any]] = []
        self.curve: Curve | None = None
        self.auth: security.ZapAuthenticator | None = None

    def secure(self, spec: SecuritySpec, name: str, *, serve: bool) -> None:
        """Load key ``name``; a daemon (``serve``) also starts the ZAP authenticator.

        Call inside the event loop, before any socket is made.
        """
        self.curve = security.load_curve(spec, name, serve=serve)
        if serve:
            self.auth = security.start_authenticator(self.ctx, spec, name)

    def channel(self, ch: Channel) -> Channel:
        self.channels.append(ch)
        return ch.start()

    def connect(self, kind: int, address: str, name: str, runtime: RuntimeSpec) -> Channel:
        """A channel on a new socket of ``kind`` (PUSH, DEALER) connected to ``address``
        with the cluster's bounds and this process's keys; started where it reads replies
        (DEALER). Its caller owns it: a job's channels close with the job."""
        sock = make_socket(
            self.ctx,
            kind,
            connect=address,
            hwm=runtime.hwm,
            max_frame_bytes=runtime.max_frame_bytes,
            curve=self.curve,
            mac_link=True,  # a data channel: tagged on plain TCP where data_path = "mac"
        )
        ch = Channel(sock, None, name=name, max_frame_bytes=runtime.max_frame_bytes)
        return ch.start() if kind == zmq.DEALER else ch

    def watch_handshakes(self, ch: Channel) -> None:
        """Log handshakes a Curve server socket refuses in libzmq (see :mod:`security`)."""
        if self.curve is not None and ch.sock.getsockopt(zmq.CURVE_SERVER):
            self.spawn(
                security.log_refused_handshakes(ch.sock, self.curve.name), f"handshakes:{ch.name}"
            )

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self.tasks.append(task)
        return task

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        for task in self.tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for ch in reversed(self.channels):
            with contextlib.suppress(Exception):
                await ch.close()
        if self.auth is not None:
            self.auth.stop()
            self.auth = None
        self.ctx.term()
