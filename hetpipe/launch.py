"""Starting and stopping the daemons of a cluster.toml on this host (``hetpipe up/down``).

Each daemon runs in its own session (it outlives the CLI), writes its log to
``<run_dir>/logs/<name>.log`` and a ready file once it listens; the pids go to
``<run_dir>/pids.json`` so ``down`` can stop exactly what ``up`` started. ``up`` returns only
when the head sees every local worker, or fails with the log tail of the daemon that died.

Also the Slurm batch script's handler of the time limit's warning
(``python -m hetpipe.launch slurm-time-limit JOB_ID RESERVE_S``): see the section below.
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
from typing import Any

from hetpipe.config import ClusterConfig
from hetpipe.daemon import normal_host

__all__ = [
    "Daemon",
    "LaunchError",
    "checkpoint_before_limit",
    "local_daemons",
    "slurm_end_time",
    "spawn",
    "start",
    "stop",
    "wait_ready",
]


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


# -- Slurm: the allocation's time limit ------------------------------------------------------
#
# workers/slurm/hetpipe.sbatch asks Slurm for a warning signal before the time limit
# (``--signal=B:USR1@SECONDS``); on it, ``python -m hetpipe.launch slurm-time-limit`` asks the
# head for a checkpoint of each running job now (``hetpipe checkpoint JOB``: a cut at the next
# wave boundary all its stages can reach, whether or not the job has
# ``train.checkpoint_every``), waits until each has written it (or until little enough time
# is left to stop the daemons), and the script then stops them: the head records the job as
# interrupted and the next allocation on the same run directory resumes it from that
# checkpoint.

Status = Callable[[], "dict[str, Any] | None"]
Ask = Callable[[str], "str | None"]  # job -> why no checkpoint could be asked for, or None


def slurm_end_time(show_job: str) -> float | None:
    """The earliest ``EndTime`` in ``scontrol -o show job`` output (one line per component of
    a heterogeneous job; each component has its own limit, and the first to end ends the
    job), as seconds since the epoch; None where no line has a known end."""
    ends = []
    for line in show_job.splitlines():
        for word in line.split():
            key, _, value = word.partition("=")
            if key != "EndTime":
                continue
            with contextlib.suppress(ValueError, OverflowError):
                ends.append(time.mktime(time.strptime(value, "%Y-%m-%dT%H:%M:%S")))
    return min(ends, default=None)


def running_checkpoints(status: dict[str, Any]) -> dict[str, int]:
    """Job id -> checkpoints written so far, for each job of ``hetpipe status --json`` that
    is running (a queued job has nothing to checkpoint yet)."""
    return {
        j["id"]: int(j.get("checkpoints") or 0)
        for j in status.get("jobs", [])
        if j.get("state") == "running" and "id" in j
    }


def awaiting_checkpoint(before: dict[str, int], status: dict[str, Any]) -> list[str]:
    """The jobs of ``before`` (job -> checkpoints at the warning) that still run without a
    checkpoint newer than those: the ones the stop must still wait for."""
    now = running_checkpoints(status)
    return sorted(j for j, n in before.items() if j in now and now[j] <= n)


def checkpoint_before_limit(
    status: Status,
    until: float,
    *,
    ask: Ask | None = None,
    clock: Callable[[], float] = time.time,
    sleep: Callable[[float], None] = time.sleep,
    every: float = 1.0,
    say: Callable[[str], None] = print,
) -> dict[str, bool]:
    """Ask for a checkpoint of each job running now (``ask``: ``hetpipe checkpoint JOB``;
    without it, only the periodic ones are waited for) and wait until each has written a new
    one (or ended), but not past ``until`` (seconds since the epoch); job -> whether it did.

    ``status`` asks the head (``hetpipe status --json``), None where it did not answer; a
    head that never answers before ``until`` leaves nothing to wait for. A job that could not
    be asked is still waited for (a periodic checkpoint may come, or its end)."""
    before: dict[str, int] | None = None
    waiting: list[str] = []
    last: dict[str, Any] = {}
    while True:
        got = status()
        if got is not None:
            last = got
            if before is None:
                before = running_checkpoints(got)
                if before:
                    say(
                        "hetpipe: the time limit is near: "
                        + (
                            "asking for a checkpoint of "
                            if ask
                            else "waiting for the next checkpoint of "
                        )
                        + ", ".join(f"{j} ({n} so far)" for j, n in sorted(before.items()))
                    )
                for j in sorted(before) if ask else []:
                    problem = ask(j)
                    if problem is not None:
                        say(f"hetpipe: {problem}")
            waiting = awaiting_checkpoint(before, got)
            if not waiting:
                break
        if clock() + every > until:
            break
        sleep(every)
    if before is None:
        say("hetpipe: the head did not answer: no checkpoint to wait for")
        return {}
    if waiting:
        say(f"hetpipe: no new checkpoint before the time limit: {', '.join(waiting)}")
    views = {j.get("id"): j for j in last.get("jobs", [])}
    for j in sorted(set(before) - set(waiting)):
        view = views.get(j, {})
        if view.get("state") == "running":
            wave = (view.get("last_checkpoint") or {}).get("wave")
            say(f"hetpipe: checkpoint before the time limit: {j} at wave {wave}")
        else:
            say(f"hetpipe: {j} ended before the time limit ({view.get('state', 'gone')})")
    return {j: j not in waiting for j in before}


def _status_json() -> dict[str, Any] | None:
    """``hetpipe status --json`` (the cluster from ``HETPIPE_CLUSTER``), None where the head
    did not answer."""
    try:
        r = subprocess.run(
            [sys.executable, "-m", "hetpipe.cli", "status", "--json"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        return json.loads(r.stdout) if r.returncode == 0 else None
    except (subprocess.TimeoutExpired, ValueError, OSError):
        return None


def _ask_checkpoint(job: str) -> str | None:
    """``hetpipe checkpoint JOB`` (the cluster from ``HETPIPE_CLUSTER``): None once the head
    took the request, else its one-line error."""
    try:
        r = subprocess.run(
            [sys.executable, "-m", "hetpipe.cli", "checkpoint", job],
            capture_output=True,
            text=True,
            timeout=90,
        )
    except (subprocess.TimeoutExpired, OSError) as exc:
        return f"checkpoint: {job}: {exc}"
    if r.returncode == 0:
        return None
    lines = (r.stderr or r.stdout).strip().splitlines()
    return lines[-1].removeprefix("Error: ") if lines else f"checkpoint: {job}: exit {r.returncode}"


def slurm_time_limit(job_id: str, reserve_s: float) -> int:
    """The time-limit warning of Slurm job ``job_id``: ask each running job for a checkpoint
    now and wait for it until ``reserve_s`` seconds before the job's end (what stopping the daemons
    needs); 0 when every running job wrote one (or none ran), 1 otherwise."""
    r = subprocess.run(
        ["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True, timeout=30
    )
    end = slurm_end_time(r.stdout)
    if end is None:
        print(f"hetpipe: job {job_id} has no known end time: no checkpoint to wait for")
        return 1
    left = end - time.time()
    print(f"hetpipe: {left:.0f} s left before the time limit, {reserve_s:g} s kept to stop")
    done = checkpoint_before_limit(_status_json, end - reserve_s, ask=_ask_checkpoint)
    return 0 if all(done.values()) else 1


def main(argv: list[str] | None = None) -> int:
    """``python -m hetpipe.launch slurm-time-limit JOB_ID RESERVE_S`` (the batch script's
    handler of Slurm's time-limit warning)."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 3 or args[0] != "slurm-time-limit":
        print("usage: python -m hetpipe.launch slurm-time-limit JOB_ID RESERVE_S", file=sys.stderr)
        return 2
    return slurm_time_limit(args[1], float(args[2]))


if __name__ == "__main__":
    sys.exit(main())
