"""A whole cluster on this host with ephemeral ports: for tests, benchmarks and the demo.

Every daemon binds port 0 and reports the port it got in its ready file; shard 0 (the head)
starts first and the others are told its address. The object owns its child processes and
reaps them on exit (SIGTERM, then SIGKILL), also when start-up fails halfway.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import subprocess
import sys
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hetpipe import launch, security
from hetpipe.client import HeadClient, client_curve

__all__ = ["DeviceDef", "LocalCluster", "cluster_toml", "free_ports"]


@dataclass(frozen=True)
class DeviceDef:
    """One emulated device of a generated cluster file."""

    name: str
    type: str = "fast"
    memory: str = "256MiB"
    speed: float = 1.0
    device: str = "cpu"
    port: int = 0  # 0: ephemeral, chosen when the worker binds
    host_gbps: float | None = None  # host copy bandwidth (None: the config's default)


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct TCP ports that were free a moment ago (bound to port 0, then released):
    for a cluster file whose daemons must keep their address across a restart."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def cluster_toml(
    devices: Sequence[DeviceDef],
    *,
    shards: int = 2,
    shard_ports: Sequence[int] | None = None,
    heartbeat_s: float = 0.5,
    lost_after_s: float = 3.0,
    curve: bool = True,
    allowed_modules: Sequence[str] = (),
    cuda_ipc: bool = True,
    host_shm: bool = True,
    inline_ms: int | None = None,
    ship_code: bool = False,
) -> str:
    """A cluster file for this host; ports are ephemeral unless given (``inline_ms``: the
    runtime's default unless given).

    Its keys live in ``.hetpipe/keys`` beside the file (made by :class:`LocalCluster`).
    """
    ports = list(shard_ports) if shard_ports is not None else [0] * shards
    modules = ", ".join(f'"{m}"' for m in allowed_modules)
    lines = [
        "[ps]",
        "shards = [" + ", ".join(f'"127.0.0.1:{p}"' for p in ports) + "]",
        "",
        "[runtime]",
        f"heartbeat_s = {heartbeat_s}",
        f"lost_after_s = {lost_after_s}",
        f"cuda_ipc = {'true' if cuda_ipc else 'false'}",
        f"host_shm = {'true' if host_shm else 'false'}",
        *([f"inline_ms = {inline_ms}"] if inline_ms is not None else []),
        "",
        "[security]",
        f"curve = {'true' if curve else 'false'}",
        f"allowed_modules = [{modules}]",
        *(["ship_code = true"] if ship_code else []),
        "",
        "[[node]]",
        'name = "node0"',
        'host = "127.0.0.1"',
        "",
    ]
    for d in devices:
        lines += [
            "[[node.device]]",
            f'name = "{d.name}"',
            f'device = "{d.device}"',
            f'type = "{d.type}"',
            f'memory = "{d.memory}"',
            f"speed = {d.speed}",
            f"port = {d.port}",
            *([f"host_gbps = {d.host_gbps}"] if d.host_gbps is not None else []),
            "",
        ]
    return "\n".join(lines)


class LocalCluster:
    """Start the shards and workers of a cluster file; ``with LocalCluster(...) as c``."""

    def __init__(
        self,
        cluster_path: str | Path,
        run_dir: str | Path,
        *,
        timeout: float = 60.0,
        worker_args: Sequence[str] = (),
    ) -> None:
        from hetpipe.config import load_cluster

        self.cluster_path = str(cluster_path)
        self.cluster = load_cluster(self.cluster_path)
        self.run_dir = Path(run_dir)
        self.timeout = timeout
        self.worker_args = tuple(worker_args)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.daemons: dict[str, launch.Daemon] = {}
        self.ready: dict[str, dict[str, Any]] = {}
        self.head = ""
        self._finalizer = weakref.finalize(self, _reap, self.procs)
        if self.cluster.security.curve:
            security.ensure_keys(
                self.cluster.security.keys,
                security.key_names(len(self.cluster.ps), [d.name for d in self.cluster.devices]),
            )
        self.curve = client_curve(self.cluster)

    def client(self, *, timeout: float = 10.0) -> HeadClient:
        """A client of this cluster's head, with the cluster's client keys."""
        return HeadClient(self.head, timeout=timeout, curve=self.curve)

    def start(self) -> LocalCluster:
        daemons = self._daemons(None)
        head_d = next(d for d in daemons if d.name == "ps0")
        self.daemons["ps0"] = head_d
        self.procs["ps0"] = launch.spawn(head_d, self.run_dir)
        self.ready.update(launch.wait_ready({"ps0": self.procs["ps0"]}, self.run_dir, self.timeout))
        self.head = self.ready["ps0"]["address"]
        rest = self._daemons(self.head)
        started = {}
        for d in rest:
            if d.name == "ps0":
                continue
            argv = d.argv + (self.worker_args if d.name.startswith("worker-") else ())
            self.daemons[d.name] = launch.Daemon(d.name, argv)
            started[d.name] = self.procs[d.name] = launch.spawn(self.daemons[d.name], self.run_dir)
        launch.write_pids(self.run_dir, {n: p.pid for n, p in self.procs.items()})
        self.ready.update(launch.wait_ready(started, self.run_dir, self.timeout))
        self.run(self._registered())
        return self

    def _daemons(self, head: str | None) -> list[launch.Daemon]:
        """The daemons to start (non-head shards and workers told ``head``)."""
        return launch.local_daemons(
            self.cluster, self.cluster_path, run_dir=self.run_dir, head=head
        )

    async def _registered(self) -> None:
        devices = {d.name for d in self.cluster.devices}
        async with self.client() as client:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + self.timeout
            while True:
                info = await client.cluster()
                live = {w["device"] for w in info["workers"] if w["state"] == "idle"}
                shards = set(info["shards"])
                if devices <= live and len(shards) == len(self.cluster.ps):
                    return
                if loop.time() > deadline:
                    raise TimeoutError(
                        f"cluster not ready in {self.timeout:g} s: "
                        f"workers {sorted(live)}, shards {sorted(shards)}"
                    )
                await asyncio.sleep(0.1)

    def __enter__(self) -> LocalCluster:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._finalizer()

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to one daemon (e.g. ``worker-gpu1``) and reap it."""
        proc = self.procs[name]
        proc.send_signal(sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)

    def restart(self, name: str) -> None:
        """Start a daemon that was killed again, with its command line; wait until it is ready.

        A restarted head keeps its address only when the cluster file fixes its port.
        """
        assert not self.alive(name), f"{name} is still running"
        self.procs[name] = launch.spawn(self.daemons[name], self.run_dir)
        launch.write_pids(self.run_dir, {n: p.pid for n, p in self.procs.items()})
        self.ready.update(launch.wait_ready({name: self.procs[name]}, self.run_dir, self.timeout))
        if name == "ps0":
            self.head = self.ready["ps0"]["address"]

    def alive(self, name: str) -> bool:
        return self.procs[name].poll() is None

    @staticmethod
    def run(coro: Any) -> Any:
        return asyncio.run(coro)

    def submit(self, job: dict[str, Any], *, timeout: float = 300.0) -> dict[str, Any]:
        """Submit a job dict and follow it to its end; return the final status."""

        async def go() -> dict[str, Any]:
            async with self.client() as client:
                job_id = await client.submit(job)
                return await client.follow(job_id, timeout=timeout, every_s=0.2)

        return self.run(go())

    def status(self) -> dict[str, Any]:
        async def go() -> dict[str, Any]:
            async with self.client() as client:
                return await client.cluster()

        return self.run(go())


def _reap(procs: dict[str, subprocess.Popen[bytes]]) -> None:
    for p in procs.values():
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs.values():
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=5)
    procs.clear()


if __name__ == "__main__":  # pragma: no cover - manual use: python -m hetpipe.localcluster FILE
    with LocalCluster(sys.argv[1], ".hetpipe-local") as c:
        print(c.head)
        input("running; Enter stops it")
