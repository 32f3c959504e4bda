"""The head's registry: the workers and shards of the cluster, and whether each is alive.

A worker registers with ``hello`` and stays alive by its heartbeats; a shard says
``shard_hello`` every few seconds. Only the devices and shards of the cluster file register
(:func:`hello_problem`, :func:`shard_problem`). A worker or shard silent for
``lost_after_s`` is lost: the registry says which became lost (:meth:`Registry.newly_lost`),
and the head decides what that means for the jobs using them.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import zmq

from hetpipe.config import ClusterConfig, ConfigError, check_address
from hetpipe.daemon import Owner
from hetpipe.head.states import JobFailed
from hetpipe.transport import Channel

__all__ = ["SHARD_TIMEOUT_S", "Registry", "WorkerInfo", "hello_problem", "shard_problem"]

SHARD_TIMEOUT_S = 120.0  # the head's requests to a shard
SHARD_GRACE_S = 1.0  # shards say hello every max(heartbeat_s, 1) s: a second more for them


@dataclass
class WorkerInfo:
    """A registered ``hetpipe-worker`` as the head sees it."""

    device: str
    ident: bytes
    address: str
    pid: int
    host: str
    type: str
    last_seen: float
    state: str = "idle"  # the worker's own word (idle, assigned, running), not a job state
    job: str | None = None
    vw: int | None = None
    stage: int | None = None
    lost: bool = False


def hello_problem(cluster: ClusterConfig, fields: dict[str, Any]) -> str | None:
    """Why a worker's ``hello`` is refused, or None: the device must be the cluster file's,
    of the type the file says, with an address the runtime can connect to."""
    device = fields["device"]
    try:
        spec = cluster.device(device)
    except ConfigError:
        return f"hello refused: {device!r} is not a device of {cluster.path}"
    if fields["type"] != spec.type:
        return (
            f"hello refused: {device} is of type {spec.type!r} in "
            f"{cluster.path}, the worker says {fields['type']!r}"
        )
    try:
        check_address(fields["address"])
    except ValueError as exc:
        return f"hello refused: {device}: {exc}"
    return None


def shard_problem(cluster: ClusterConfig, fields: dict[str, Any]) -> str | None:
    """Why a ``shard_hello`` is refused, or None: only the cluster file's shards register.

    The head is shard 0 itself; an index outside the file (or a malformed address) once
    took the place of a real shard and broke every later job that placed state there.
    """
    index, n = fields["shard"], len(cluster.ps)
    if not 1 <= index < n:
        return (
            f"shard_hello refused: shard {index} is not a shard of "
            f"{cluster.path} (1..{n - 1} register; 0 is this head)"
        )
    try:
        check_address(fields["address"])
    except ValueError as exc:
        return f"shard_hello refused: shard {index}: {exc}"
    return None


class Registry:
    """The workers and shards the head knows, their liveness, and its channels to shards."""

    def __init__(self, cluster: ClusterConfig, owner: Owner, address: str) -> None:
        self.cluster = cluster
        self.owner = owner
        self.workers: dict[str, WorkerInfo] = {}
        self.shards: dict[int, str] = {0: address}
        self.shard_seen: dict[int, float] = {}  # monotonic time of each shard's last hello
        self.shard_pids: dict[int, int] = {}  # the process of each shard's last hello
        self.shards_lost: set[int] = set()
        self.shard_channels: dict[int, Channel] = {}

    # -- workers ----------------------------------------------------------------------------

    def register(self, peer: bytes, fields: dict[str, Any]) -> WorkerInfo | None:
        """Register a worker whose ``hello`` passed :func:`hello_problem`; the registration
        it replaces where that one was another process with a job (it restarted)."""
        device = fields["device"]
        old = self.workers.get(device)
        self.workers[device] = WorkerInfo(
            device=device,
            ident=peer,
            address=fields["address"],
            pid=fields["pid"],
            host=fields["host"],
            type=self.cluster.device(device).type,
            last_seen=time.monotonic(),
        )
        if old is not None and old.job is not None and old.ident != peer:
            return old
        return None

    def heartbeat(self, peer: bytes, fields: dict[str, Any]) -> bool:
        """Note a worker's heartbeat; False where the head does not know it (it must say
        hello again: a lost worker that speaks again registers afresh)."""
        w = self.workers.get(fields["device"])
        if w is None or w.ident != peer or w.lost:
            return False
        w.last_seen = time.monotonic()
        w.state = fields["state"]
        return True

    def alive(self) -> dict[str, WorkerInfo]:
        """The registered workers not lost, by device."""
        return {d: w for d, w in self.workers.items() if not w.lost}

    def idle(self) -> set[str]:
        """The devices of live workers without a job."""
        return {d for d, w in self.alive().items() if w.job is None}

    def release(self, job: str) -> None:
        """The workers of ``job`` are free again."""
        for w in self.workers.values():
            if w.job == job:
                w.job = w.vw = w.stage = None

    def complete(self) -> bool:
        """Whether every device and shard of the cluster file has registered."""
        devices = {d.name for d in self.cluster.devices}
        return devices <= set(self.alive()) and len(self.shards) == len(self.cluster.ps)

    async def wait_complete(self, timeout: float) -> None:
        """Until :meth:`complete` (or ``timeout``)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while loop.time() < deadline:
            if self.complete():
                return
            await asyncio.sleep(0.2)

    # -- shards -----------------------------------------------------------------------------

    async def shard_hello(self, fields: dict[str, Any]) -> list[str]:
        """Note a shard's hello (one that passed :func:`shard_problem`); what changed, for
        the log: ``back`` (it was lost), ``restarted`` (another process than before, which
        holds none of the state the previous one held) and/or ``registered`` (a new
        address)."""
        index, address = fields["shard"], fields["address"]
        said = []
        self.shard_seen[index] = time.monotonic()
        pid = fields.get("pid")
        if isinstance(pid, int):
            if self.shard_pids.get(index, pid) != pid:
                said.append("restarted")
            self.shard_pids[index] = pid
        if index in self.shards_lost:
            self.shards_lost.discard(index)
            said.append("back")
        if self.shards.get(index) != address:
            said.append("registered")
            old = self.shard_channels.pop(index, None)
            if old is not None:
                await old.close()
        self.shards[index] = address
        return said

    def live_shards(self) -> dict[int, str]:
        """The address of every registered shard not lost, by index."""
        return {i: a for i, a in self.shards.items() if i not in self.shards_lost}

    async def shard(self, index: int) -> Channel:
        """The head's channel to shard ``index`` (made on first use)."""
        ch = self.shard_channels.get(index)
        if ch is None:
            address = self.shards.get(index)
            if address is None:
                raise JobFailed(
                    f"shard {index} has not registered with the head: "
                    f"is hetpipe-ps --shard {index} running?"
                )
            rt = self.cluster.runtime
            ch = self.owner.connect(zmq.DEALER, address, f"to-shard{index}", rt)
            self.owner.channels.append(ch)
            self.shard_channels[index] = ch
        return ch

    # -- liveness ---------------------------------------------------------------------------

    def newly_lost(
        self, now: float
    ) -> tuple[list[tuple[WorkerInfo, float]], list[tuple[int, float]]]:
        """Mark lost the workers and shards silent past ``lost_after_s`` as of ``now``
        (monotonic): those that were not lost before, each with its silence in seconds.
        A lost shard is left out of new plans until it says hello again."""
        lost_after = self.cluster.runtime.lost_after_s
        workers = []
        for w in self.workers.values():
            silent = now - w.last_seen
            if not w.lost and silent > lost_after:
                w.lost = True
                workers.append((w, silent))
        shards = []
        for index, seen in self.shard_seen.items():
            silent = now - seen
            if index not in self.shards_lost and silent > lost_after + SHARD_GRACE_S:
                self.shards_lost.add(index)
                shards.append((index, silent))
        return workers, shards
