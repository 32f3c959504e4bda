"""Talking to the head from the CLI, tests and scripts.

One DEALER channel to the head, requests with deadlines. Every failure becomes a
:class:`HeadError` whose text says what to check, so the CLI can print it as one line.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq

from hetpipe.config import ClusterConfig
from hetpipe.daemon import Owner
from hetpipe.security import (
    ADMIN,
    Curve,
    KeysError,
    check_user_name,
    load_curve,
    user_key,
)
from hetpipe.transport import Channel, RemoteError, make_socket
from hetpipe.wire import Kind

__all__ = ["TERMINAL", "HeadClient", "HeadError", "checkpoint_reached", "client_curve"]

TERMINAL = frozenset({"done", "failed", "cancelled"})


class HeadError(RuntimeError):
    """The head refused a request or could not be reached."""


def client_curve(cluster: ClusterConfig, user: str | None = None) -> Curve | None:
    """User ``user``'s Curve keys for ``cluster`` (None when its ``[security] curve`` is off).

    ``user`` None or ``admin`` is the cluster's ``client`` key (the admin: every job); any
    other name is that user's own key ``user-<name>`` (``hetpipe keys add-user``), read from
    the keys folder of this host's cluster file.
    """
    try:
        if user is None or user == ADMIN:
            return load_curve(cluster.security, user_key(ADMIN), serve=False)
        check_user_name(user)
        if not cluster.security.curve:
            return None
        key = user_key(user)
        secret = Path(cluster.security.keys) / f"{key}.key_secret"
        if not secret.exists():
            raise KeysError(
                f"no key of user {user!r}: {secret} is missing (the cluster's admin makes it "
                f"with `hetpipe keys add-user {user}`; keep it in [security] keys)"
            )
        return load_curve(cluster.security, key, serve=False)
    except KeysError as exc:
        raise HeadError(str(exc)) from None


class HeadClient:
    """An async client of the head; use ``async with HeadClient(address, curve=...) as head``.

    ``curve``: the cluster's client keys (:func:`client_curve`); a head with Curve on refuses
    a client without them in the handshake, so its requests then time out.
    """

    def __init__(self, address: str, *, timeout: float = 10.0, curve: Curve | None = None) -> None:
        self.address = address
        self.timeout = timeout
        self.curve = curve
        self._owner: Owner | None = None
        self._ch: Channel | None = None

    async def __aenter__(self) -> HeadClient:
        self._owner = Owner()
        try:
            sock = make_socket(
                self._owner.ctx,
                zmq.DEALER,
                connect=self.address,
                max_frame_bytes=1 << 30,
                curve=self.curve,
            )
        except zmq.ZMQError as exc:
            await self._owner.close()
            raise HeadError(f"cannot connect to the head at {self.address!r}: {exc}") from None
        self._ch = self._owner.channel(Channel(sock, None, name="head", max_frame_bytes=1 << 30))
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._owner is not None:
            await self._owner.close()

    async def call(
        self, kind: Kind, fields: dict[str, Any] | None = None, timeout: float | None = None
    ) -> dict[str, Any]:
        """Send a request to the head and return the ``info`` of its answer."""
        assert self._ch is not None, "use `async with HeadClient(...)`"
        try:
            reply = await self._ch.request(
                kind,
                fields or {},
                timeout=timeout or self.timeout,
                what=f"the head at {self.address}",
            )
        except TimeoutError:
            keys = ", and with these keys (a head refuses keys not its own)" if self.curve else ""
            raise HeadError(
                f"the head at {self.address} did not answer within "
                f"{timeout or self.timeout:g} s: is the cluster up "
                f"(`hetpipe up`){keys}?"
            ) from None
        except RemoteError as exc:
            raise HeadError(str(exc)) from None
        return reply.get("info") or {}

    async def submit(self, job: dict[str, Any] | None, *, resume: str | None = None) -> str:
        """Queue ``job``; with ``resume``, continue that job from its last checkpoint (its own
        job, or ``job`` if given). Returns the new job's id."""
        return (await self.call(Kind.SUBMIT, {"job": job, "resume": resume}))["job"]

    async def job(self, job_id: str) -> dict[str, Any]:
        return await self.call(Kind.JOB_STATUS, {"job": job_id})

    async def cluster(self) -> dict[str, Any]:
        return await self.call(Kind.CLUSTER_STATUS)

    async def cancel(self, job_id: str) -> None:
        await self.call(Kind.CANCEL, {"job": job_id})

    async def checkpoint(
        self, job_id: str, *, wait: bool = False, every_s: float = 0.5, timeout: float = 600.0
    ) -> dict[str, Any]:
        """Ask the head for a checkpoint of running job ``job_id`` at the next wave boundary
        its every stage can reach: ``{"wave": N, ...}``. With ``wait``, return once the
        checkpoint of wave N (or a later one) is written, with its ``path``; a job that ends
        first, or a wait past ``timeout`` seconds, raises :class:`HeadError`."""
        info = await self.call(Kind.CHECKPOINT, {"job": job_id}, timeout=60.0)
        if not wait:
            return info
        wave = int(info["wave"])
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            view = await self.job(job_id)
            done, problem = checkpoint_reached(job_id, view, wave)
            if problem is not None:
                raise HeadError(problem)
            if done:
                return {**info, **(view.get("last_checkpoint") or {}), "wave": wave}
            if loop.time() > deadline:
                raise HeadError(
                    f"checkpoint: job {job_id} wrote no checkpoint of wave {wave} "
                    f"within {timeout:g} s"
                )
            await asyncio.sleep(every_s)

    async def follow(
        self,
        job_id: str,
        on_update: Callable[[dict[str, Any]], None] | None = None,
        *,
        every_s: float = 0.5,
        timeout: float | None = None,
    ) -> dict[str, Any]:
        """Poll a job until it ends; call ``on_update`` with each status; return the last."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            info = await self.job(job_id)
            if on_update is not None:
                on_update(info)
            if info["state"] in TERMINAL:
                return info
            if deadline is not None and loop.time() > deadline:
                raise HeadError(
                    f"job {job_id} did not finish within {timeout:g} s (state {info['state']})"
                )
            await asyncio.sleep(every_s)


def checkpoint_reached(job_id: str, view: dict[str, Any], wave: int) -> tuple[bool, str | None]:
    """Whether job status ``view`` shows a checkpoint of ``wave`` or later written; and why it
    never will (one line), where the job is no longer running."""
    last = (view.get("last_checkpoint") or {}).get("wave")
    if last is not None and int(last) >= wave:
        return True, None
    if view.get("state") != "running":
        return False, (
            f"checkpoint: job {job_id} ended ({view.get('state')}) before its checkpoint "
            f"at wave {wave}"
        )
    return False, None
