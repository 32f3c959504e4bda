"""Starting and stopping the daemons of a cluster.toml on this host (``hetpipe up/down``).

Each daemon runs in its own session (it outlives the CLI), writes its log to
``<run_dir>/logs/<name>.log`` and a ready file once it listens; the pids go to
``<run_dir>/pids.json`` so ``down`` can stop exactly what ``up`` started. ``up`` returns only
when the head sees every local worker, or fails with the log tail of the daemon that died.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hetpipe.config import ClusterConfig
from hetpipe.daemon import normal_host

__all__ = ["Daemon", "LaunchError", "local_daemons", "spawn", "start", "stop", "wait_ready"]


class LaunchError(RuntimeError):
    """The daemons could not be started or stopped; the text says which and why."""


@dataclass(frozen=True)
class Daemon:
    """One daemon process to start: a name for its files and its command line."""

    name: str
    argv: tuple[str, ...]


def is_local(host: str) -> bool:
    """Whether ``host`` names this machine: a known name, or an address it can bind."""
    if normal_host(host) in {"127.0.0.1", socket.gethostname(), socket.getfqdn()}:
        return True
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
    except OSError:
        return False
    return True


def local_daemons(
    cluster: ClusterConfig,
    cluster_path: str,
    *,
    run_dir: Path,
    head: str | None = None,
    local: Callable[[str], bool] = is_local,
) -> list[Daemon]:
    """The shards and workers of ``cluster`` whose host is ``local`` (default: this host)."""
    py = sys.executable
    out = []
    for spec in cluster.ps:
        if local(spec.host):
            argv = [
                py,
                "-m",
                "hetpipe.ps",
                "--cluster",
                cluster_path,
                "--shard",
                str(spec.index),
                "--run-dir",
                str(run_dir),
            ]
            if head and spec.index != 0:
                argv += ["--head", head]
            out.append(Daemon(f"ps{spec.index}", tuple(argv)))
    for dev in cluster.devices:
        if local(dev.host):
            argv = [py, "-m", "hetpipe.worker", "--cluster", cluster_path, "--device", dev.name]
            if head:
                argv += ["--head", head]
            out.append(Daemon(f"worker-{dev.name}", tuple(argv)))
    return out


def _pids_file(run_dir: Path) -> Path:
    return run_dir / "pids.json"


def running(run_dir: Path) -> dict[str, int]:
    """Daemons of a previous ``up`` in ``run_dir`` that are still alive."""
    path = _pids_file(run_dir)
    if not path.exists():
        return {}
    try:
        pids = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {name: pid for name, pid in pids.items() if pid_alive(pid)}


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists and has not exited: a zombie child of ours is reaped
    and counts as gone, and so does anyone else's zombie (Linux: its ``/proc`` state).

    The daemons of ``hetpipe up`` outlive the command that started them, so ``down`` finds
    them re-parented to init: each has exited well before init reaps it (seconds, where
    init reaps in rounds), and ``down`` waited for the reaping."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie child of ours counts as gone
    with contextlib.suppress(ChildProcessError):
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done == pid:
            return False
    return not _zombie(pid)


def _zombie(pid: int) -> bool:
    """Whether ``pid`` has exited and waits for its parent to reap it (False where there is
    no ``/proc`` to ask)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    # pid (comm) state ...: the command name may hold spaces and parentheses
    return stat[stat.rfind(")") + 2 :].startswith("Z")


def spawn(daemon: Daemon, run_dir: Path) -> subprocess.Popen[bytes]:
    """Start one daemon in its own session, logging to ``<run_dir>/logs/<name>.log``."""
    logs = run_dir / "logs"
    ready_dir = run_dir / "ready"
    logs.mkdir(parents=True, exist_ok=True)
    ready_dir.mkdir(parents=True, exist_ok=True)
    rf = ready_dir / f"{daemon.name}.json"
    rf.unlink(missing_ok=True)
    log_path = logs / f"{daemon.name}.log"
    with open(log_path, "ab") as log:  # until the daemon takes its log over (and rotates it)
        return subprocess.Popen(
            [*daemon.argv, "--ready-file", str(rf), "--log-file", str(log_path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )


def wait_ready(
    procs: dict[str, subprocess.Popen[bytes]], run_dir: Path, timeout: float
) -> dict[str, dict]:
    """Wait for each daemon's ready file; fail with the log tail of one that exited."""
    ready: dict[str, dict] = {}
    deadline = time.monotonic() + timeout
    while len(ready) < len(procs):
        for name, proc in procs.items():
            if name in ready:
                continue
            rf = run_dir / "ready" / f"{name}.json"
            if rf.exists():
                ready[name] = json.loads(rf.read_text())
            elif proc.poll() is not None:
                raise LaunchError(
                    f"{name} exited with code {proc.returncode}: "
                    f"{_tail(run_dir / 'logs' / f'{name}.log')}"
                )
        if time.monotonic() > deadline:
            late = [n for n in procs if n not in ready]
            raise LaunchError(
                f"not ready within {timeout:g} s: {', '.join(late)} (see {run_dir / 'logs'})"
            )
        time.sleep(0.05)
    return ready


def start(daemons: list[Daemon], run_dir: Path, *, timeout: float = 60.0) -> dict[str, dict]:
    """Start ``daemons``; wait for each ready file; return name -> ready info."""
    alive = running(run_dir)
    if alive:
        raise LaunchError(
            f"daemons of {run_dir} are already running ({', '.join(alive)}): `hetpipe down` first"
        )
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        for d in daemons:
            procs[d.name] = spawn(d, run_dir)
        write_pids(run_dir, {n: p.pid for n, p in procs.items()})
        return wait_ready(procs, run_dir, timeout)
    except BaseException:
        _terminate({n: p.pid for n, p in procs.items()})
        _pids_file(run_dir).unlink(missing_ok=True)
        raise


def write_pids(run_dir: Path, pids: dict[str, int]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    _pids_file(run_dir).write_text(json.dumps(pids))


def _tail(path: Path, lines: int = 3) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "(no log)"
    return " | ".join(text[-lines:]) or "(empty log)"


def _terminate(pids: dict[str, int], timeout: float = 10.0) -> list[str]:
    """SIGTERM, then SIGKILL after ``timeout``; return the names that needed SIGKILL."""
    for pid in pids.values():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(pid_alive(p) for p in pids.values()):
        time.sleep(0.05)
    killed = []
    for name, pid in pids.items():
        if pid_alive(pid):
            killed.append(name)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    return killed


def stop(run_dir: Path, timeout: float = 10.0) -> tuple[list[str], list[str]]:
    """Stop the daemons ``up`` started in ``run_dir``; return (stopped, killed) names."""
    pids = running(run_dir)
    killed = _terminate(pids, timeout)
    _pids_file(run_dir).unlink(missing_ok=True)
    return sorted(pids), killed
