"""The shipped batch script ``workers/slurm/hetpipe.sbatch`` under a real Slurm.

A fixture runs Debian's ``slurm-wlm`` on this host from a ``slurm.conf`` it writes in a
temporary directory it owns: one ``slurmctld`` and three ``slurmd`` (nodes ``n0``..``n2``, all
on this host with their own ports, ``AuthType=auth/none`` so no munge daemon or key is
needed), every state, spool and log directory under that directory, its children reaped at
the end. Three nodes because the components of a heterogeneous job never share a node: the
script is submitted as a heterogeneous job of three components (the shards on ``n0``, two
emulated devices of one type on ``n1``, one of another type on ``n2``) and must bring up the
daemons on loopback, train the builtin mlp on digits across both device types, write the
model and stop every daemon; a second case cancels it midway and finds nothing left running
and a usable checkpoint; a third lets it reach its time limit (Slurm's warning signal first:
the job checkpoints, every daemon stops, the job ends as ``TIMEOUT``) and the next allocation
resumes it.

Skipped, with its reason, only where the Slurm binaries are absent and ``CI`` is not set;
``.ci/run`` installs them, and under ``CI=true`` a missing binary fails the test.
"""

from __future__ import annotations

import contextlib
import getpass
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "workers" / "slurm" / "hetpipe.sbatch"
BINARIES = ("slurmctld", "slurmd", "sbatch", "srun", "scontrol", "squeue", "sinfo", "scancel")
NODES = ("n0", "n1", "n2")  # n0: the shards; n1: two "fast" devices; n2: one "slow" one
EMULATE = "fast:1.0:256MiB:2 slow:0.5:256MiB:1"
ONE = ["--cpus-per-task=1", "--gpus-per-node=0", "--time=15"]  # per component


def _which(name: str) -> str | None:
    """A Slurm binary's path (the daemons live in /usr/sbin, often off a user's PATH)."""
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")


def _missing() -> list[str]:
    return [b for b in BINARIES if _which(b) is None]


def _free_ports(n: int) -> list[int]:
    """``n`` ports free on loopback now (each bound and released; Slurm binds them itself)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _free_run(n: int) -> int:
    """The first of ``n`` consecutive ports free on loopback (the script's shard ports),
    below the kernel's ephemeral range: the daemons of the job (and of other tests) bind
    port 0 meanwhile, and a port from that range could be handed to one of them before the
    shard binds it."""
    low = _ephemeral_low()
    for _ in range(200):
        base = random.randrange(max(1024, low - 8000), low - n)
        try:
            held = []
            for p in range(base, base + n):
                s = socket.socket()
                held.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports on loopback")


def _ephemeral_low() -> int:
    """The lowest port the kernel hands to a bind of port 0 (Linux's default where unread)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _wait(what: str, check: Any, timeout: float, every: float = 0.5) -> Any:
    """Poll ``check()`` until it returns a true value; fail naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(every)


class Slurm:
    """A one-host Slurm of three nodes, in ``root``, run as this user."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.conf = root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.env.pop("SLURM_JOB_ID", None)  # never inherit an enclosing allocation
        self.children: list[subprocess.Popen[bytes]] = []

    def write_conf(self) -> None:
        user = getpass.getuser()
        ctld, *nodes = _free_ports(1 + len(NODES))
        # the machine's CPUs, at least 2 (the shards' component asks for 2 tasks; the
        # daemons of these tests are mostly idle): config_overrides lets a node declare more
        cpus = max(os.cpu_count() or 1, 2)
        for sub in ("state", "log", *(f"spool/{n}" for n in NODES)):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        r = self.root
        lines = [
            "ClusterName=hetpipetest",
            "SlurmctldHost=localhost(127.0.0.1)",
            f"SlurmctldPort={ctld}",
            f"SlurmUser={user}",
            f"SlurmdUser={user}",
            # no munge: the controller and the nodes trust each other on this one host
            "AuthType=auth/none",
            "CredType=cred/none",
            f"StateSaveLocation={r}/state",
            f"SlurmdSpoolDir={r}/spool/%n",
            f"SlurmctldPidFile={r}/slurmctld.pid",
            f"SlurmdPidFile={r}/slurmd-%n.pid",
            f"SlurmctldLogFile={r}/log/slurmctld.log",
            f"SlurmdLogFile={r}/log/slurmd-%n.log",
            "ProctrackType=proctrack/pgid",
            "TaskPlugin=task/none",
            "MpiDefault=none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            # heterogeneous jobs need the backfill scheduler; a pass a second keeps it quick
            "SchedulerType=sched/backfill",
            "SchedulerParameters=bf_interval=1",
            "JobCompType=jobcomp/none",
            "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none",
            "ReturnToService=2",
            "SlurmdParameters=config_overrides",
            "KillWait=20",
            # a job is killed at its first time-limit check past its limit (slurmctld checks
            # every 30 s, a fixed interval)
            "OverTimeLimit=0",
            "MinJobAge=600",
        ]
        for name, port in zip(NODES, nodes, strict=True):
            lines.append(
                f"NodeName={name} NodeHostname={socket.gethostname()} NodeAddr=127.0.0.1 "
                f"Port={port} CPUs={cpus} State=UNKNOWN"
            )
        lines.append(
            f"PartitionName=debug Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE "
            "State=UP OverSubscribe=YES"
        )
        self.conf.write_text("\n".join(lines) + "\n")

    def _spawn(self, name: str, args: list[str]) -> None:
        out = (self.root / "log" / f"{name}.out").open("wb")
        self.children.append(
            subprocess.Popen(
                args, stdout=out, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
            )
        )
        out.close()

    def start(self) -> None:
        self.write_conf()
        self._spawn("slurmctld", [str(_which("slurmctld")), "-D", "-i", "-f", str(self.conf)])
        for n in NODES:
            self._spawn(f"slurmd-{n}", [str(_which("slurmd")), "-D", "-N", n, "-f", str(self.conf)])

        def idle() -> bool:
            for c in self.children:
                if c.poll() is not None:
                    raise AssertionError(f"{c.args[0]} exited with {c.returncode}: {self.logs()}")
            r = self.run(["sinfo", "-h", "-N", "-o", "%N %T"], check=False)
            states = dict(line.split() for line in r.stdout.splitlines() if line.strip())
            return set(states) == set(NODES) and all(s == "idle" for s in states.values())

        _wait("the three slurmd nodes to be idle", idle, 60)

    def run(self, args: list[str], check: bool = True, **kw: Any) -> Any:
        """Run a Slurm client command against this cluster (``env``: more variables)."""
        return subprocess.run(
            args,
            env={**self.env, **kw.pop("env", {})},
            capture_output=True,
            text=True,
            timeout=60,
            check=check,
            **kw,
        )

    def job_state(self, job: str) -> dict[str, str]:
        """``scontrol show job``'s fields of the job's first component."""
        r = self.run(["scontrol", "-o", "show", "job", job], check=False)
        line = r.stdout.splitlines()[0] if r.stdout.strip() else ""
        return dict(w.split("=", 1) for w in line.split() if "=" in w)

    def wait_ended(self, job: str, timeout: float) -> dict[str, str]:
        """Wait until the job and all its steps have ended; its final fields."""

        def ended() -> dict[str, str] | None:
            state = self.job_state(job)
            pending = state.get("JobState") in (
                None,
                "PENDING",
                "RUNNING",
                "COMPLETING",
                "CONFIGURING",
                "SUSPENDED",
            )
            steps = self.run(["squeue", "-h", "-s", "-j", job], check=False).stdout.strip()
            return None if pending or steps else state

        return _wait(f"Slurm job {job} to end", ended, timeout, every=1.0)

    def logs(self) -> str:
        """The tail of every Slurm daemon's log, for a failure's message."""
        out = []
        for f in sorted((self.root / "log").glob("*")):
            out.append(f"--- {f.name}\n" + f.read_text(errors="replace")[-3000:])
        return "\n".join(out)

    def stop(self) -> None:
        """Cancel what is left, then stop the Slurm daemons (SIGTERM, then SIGKILL)."""
        self.run(["scancel", "--full", "-u", getpass.getuser()], check=False)
        with contextlib.suppress(AssertionError):
            _wait(
                "the jobs to leave the queue",
                lambda: not self.run(["squeue", "-h"], check=False).stdout.strip(),
                40,
            )
        for c in self.children:
            if c.poll() is None:
                c.send_signal(signal.SIGTERM)
        for c in self.children:
            try:
                c.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(c.pid, signal.SIGKILL)
                c.wait(timeout=10)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Slurm]:
    missing = _missing()
    if missing:
        if os.environ.get("CI"):
            pytest.fail(
                f"CI is set but the Slurm binaries {missing} are absent (.ci/run installs"
                " slurm-wlm)"
            )
        pytest.skip(
            f"Slurm is not installed here ({', '.join(missing)} absent; apt-get install slurm-wlm)"
        )
    s = Slurm(tmp_path_factory.mktemp("slurm"))
    try:
        s.start()
        yield s
    finally:
        s.stop()


def _daemons_of(marker: str) -> list[str]:
    """Command lines of live processes that mention ``marker`` (the run's cluster file)."""
    found = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit() or int(p.name) == os.getpid():
            continue
        try:
            cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (p / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker in cmd and state != "Z":
            found.append(f"{p.name}: {cmd}")
    return found


# vw0 pipelines n1-gpu0 -> n2-gpu0 (both device types), vw1 is n1-gpu1 alone; they meet at
# the shards on n0
TWO_TYPES = [(["n1-gpu0", "n2-gpu0"], [3, 3]), (["n1-gpu1"], [6])]


def _job_file(
    path: Path,
    minibatches: int,
    checkpoint_every: int | None = None,
    vws: list[tuple[list[str], list[int]]] = TWO_TYPES,
) -> Path:
    """The builtin mlp on digits over the virtual workers ``vws`` (devices, layers)."""
    extra = f"checkpoint_every = {checkpoint_every}\n" if checkpoint_every else ""
    split = "".join(
        f"\n[[vw]]\ndevices = {json.dumps(devices)}\nlayers = {json.dumps(layers)}\n"
        for devices, layers in vws
    )
    path.write_text(
        f"""name = "slurm-mlp"
model = {{ name = "mlp" }}
data = {{ name = "digits" }}
optimizer = {{ name = "sgd", lr = 0.05, momentum = 0.9 }}

[train]
minibatch = 32
nm = 2
minibatches = {minibatches}
staleness = 0
{extra}{split}"""
    )
    return path


HET = [
    *("-p", "debug", "-w", "n0", "-N1", "-n2", *ONE, ":"),
    *("-p", "debug", "-w", "n1", "-N1", "--ntasks-per-node=2", *ONE, ":"),
    *("-p", "debug", "-w", "n2", "-N1", "--ntasks-per-node=1", *ONE),
]


def _submit(
    slurm: Slurm,
    tmp: Path,
    job_file: Path | None,
    drain: bool = False,
    *,
    script: Path = SCRIPT,
    components: list[str] = HET,
    emulate: str = EMULATE,
    extra: dict[str, str] | None = None,
) -> tuple[str, Path, dict[str, str]]:
    run_dir = tmp / "run"
    env = {
        "HETPIPE_VENV": sys.prefix,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "HETPIPE_RUN_DIR": str(run_dir),
        "HETPIPE_PS_PORT": str(_free_run(2)),
        "HETPIPE_WORKER_PORT": "0",
        "HETPIPE_IFACE": "lo",
        "HETPIPE_SHARDS": "2",
        "HETPIPE_EMULATE": emulate,
        "HETPIPE_REGISTER_S": "150",
        "HETPIPE_JOB": str(job_file) if job_file else "",
        "HETPIPE_DRAIN": "1" if drain else "",
        **(extra or {}),
    }
    r = slurm.run(
        [
            "sbatch",
            "--parsable",
            f"--output={tmp}/slurm-%j.out",
            f"--chdir={tmp}",
            *components,
            str(script),
        ],
        env=env,
    )
    return r.stdout.strip().split(";")[0], run_dir, env


def _output(tmp: Path, job: str) -> str:
    f = tmp / f"slurm-{job}.out"
    return f.read_text(errors="replace") if f.exists() else "(no output)"


def _run_logs(run_dir: Path) -> str:
    return "\n".join(
        f"--- {f.name}\n{f.read_text(errors='replace')[-2000:]}"
        for f in sorted((run_dir / "logs").glob("*.log"))
    )


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_sbatch_trains_a_job_and_stops_every_daemon(slurm: Slurm, tmp_path: Path) -> None:
    job_file = _job_file(tmp_path / "job.toml", minibatches=60)
    job, run_dir, _ = _submit(slurm, tmp_path, job_file)
    state = slurm.wait_ended(job, 360)
    why = f"{state}\n{_output(tmp_path, job)}\n{_run_logs(run_dir)}\n{slurm.logs()}"
    assert state.get("JobState") == "COMPLETED" and state.get("ExitCode") == "0:0", why

    # the generated cluster file: both device types, the shards on the first component's node
    cluster = (run_dir / "cluster.toml").read_text()
    assert 'type = "fast"' in cluster and 'type = "slow"' in cluster, cluster
    (job_dir,) = [d for d in (run_dir / "jobs").iterdir() if d.is_dir()]
    result = json.loads((job_dir / "result.json").read_text())
    assert result["state"] == "done", result
    assert result["minibatches"] >= 60, result
    assert result["test_accuracy"] > 0.5, result
    assert (job_dir / "model.pt").stat().st_size > 0
    out = _output(tmp_path, job)
    assert "hetpipe: daemons stopped" in out, out
    assert "Killed" not in out, out  # stopped by SIGTERM, not killed
    # every daemon is gone once the Slurm job has ended
    _wait("the daemons to be gone", lambda: not _daemons_of(str(run_dir)), 30)


def _wait_checkpointed(slurm: Slurm, job: str, run_dir: Path, tmp_path: Path) -> None:
    """Until Slurm job ``job``'s run directory holds a checkpoint (failing, with its output
    and the daemons' logs, where the allocation ends first)."""

    def checkpointed() -> list[Path]:
        state = slurm.job_state(job).get("JobState")
        assert state in ("PENDING", "RUNNING", "CONFIGURING"), (
            f"{state}\n{_output(tmp_path, job)}\n{_run_logs(run_dir)}"
        )
        return list(run_dir.glob("jobs/*/checkpoints/*/MANIFEST.json"))

    _wait("a checkpoint of the running job", checkpointed, 240, every=1.0)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_scancel_midway_leaves_a_checkpoint_the_next_allocation_resumes(
    slurm: Slurm, tmp_path: Path
) -> None:
    job_file = _job_file(tmp_path / "job.toml", minibatches=1500, checkpoint_every=50)
    job, run_dir, _ = _submit(slurm, tmp_path, job_file)

    _wait_checkpointed(slurm, job, run_dir, tmp_path)
    slurm.run(["scancel", job])
    state = slurm.wait_ended(job, 120)
    assert state.get("JobState") == "CANCELLED", state
    _wait("the daemons to be gone", lambda: not _daemons_of(str(run_dir)), 60)

    (job_dir,) = [d for d in (run_dir / "jobs").iterdir() if d.is_dir()]
    record = json.loads((job_dir / "job.json").read_text())
    assert record["state"] == "interrupted", record  # a later head resumes it
    from hetpipe import checkpoint

    ck = checkpoint.latest(job_dir)
    assert ck is not None and ck.state, sorted(job_dir.rglob("*"))
    assert (job_dir / "records").is_dir()  # what streamed before the cancel is kept

    # the next allocation on the same run directory resumes it and stops once it is done
    again, _, _ = _submit(slurm, tmp_path, None, drain=True)
    state = slurm.wait_ended(again, 360)
    why = f"{state}\n{_output(tmp_path, again)}\n{_run_logs(run_dir)}"
    assert state.get("JobState") == "COMPLETED" and state.get("ExitCode") == "0:0", why
    results = [
        json.loads(p.read_text()) for p in run_dir.glob("jobs/*/result.json") if p.parent != job_dir
    ]
    (result,) = results
    assert result["state"] == "done", result
    assert result["resumed_from"]["job"] == record["id"], result
    assert result["resumed_from"]["minibatches_done"] > 0, result
    _wait("the daemons to be gone", lambda: not _daemons_of(str(run_dir)), 60)


@pytest.mark.slow
@pytest.mark.timeout(720)
def test_a_job_queued_at_scancel_runs_in_the_next_allocation_after_the_resumed_one(
    slurm: Slurm, tmp_path: Path
) -> None:
    """A job submitted to the allocation's head behind the running one and still queued when
    the allocation is cancelled: the next allocation (``HETPIPE_DRAIN=1``) resumes the
    running one from its checkpoint, then runs the queued one, under its own id, to done."""
    # long enough to be running still when the allocation is cancelled, the later job's
    # submit (a CLI start on a loaded host) included; the next allocation finishes it
    job_file = _job_file(tmp_path / "job.toml", minibatches=4000, checkpoint_every=50)
    job, run_dir, env = _submit(slurm, tmp_path, job_file)
    # the allocation's head took its job: the later one queues behind it from here on
    _wait("the allocation's job", lambda: list(run_dir.glob("jobs/*/job.json")), 240, every=1.0)
    later = _job_file(tmp_path / "later.toml", minibatches=60)
    plain = {k: v for k, v in os.environ.items() if not k.startswith("HETPIPE_")}
    cli = [sys.executable, "-m", "hetpipe.cli", "--cluster", str(run_dir / "cluster.toml")]
    sub = subprocess.run(
        [*cli, "submit", str(later)],
        capture_output=True,
        text=True,
        timeout=90,
        env={**plain, "PYTHONPATH": env["PYTHONPATH"]},
    )
    assert sub.returncode == 0, sub.stdout + sub.stderr
    queued = sub.stdout.strip()
    _wait_checkpointed(slurm, job, run_dir, tmp_path)
    slurm.run(["scancel", job])
    state = slurm.wait_ended(job, 120)
    assert state.get("JobState") == "CANCELLED", state
    _wait("the daemons to be gone", lambda: not _daemons_of(str(run_dir)), 60)
    record = json.loads((run_dir / "jobs" / queued / "job.json").read_text())
    assert record["state"] == "queued" and record["job"], record  # the next head runs it
    assert not (run_dir / "jobs" / queued / "result.json").exists()

    again, _, _ = _submit(slurm, tmp_path, None, drain=True)
    state = slurm.wait_ended(again, 480)
    why = f"{state}\n{_output(tmp_path, again)}\n{_run_logs(run_dir)}"
    assert state.get("JobState") == "COMPLETED" and state.get("ExitCode") == "0:0", why
    results = {p.parent.name: json.loads(p.read_text()) for p in run_dir.glob("jobs/*/result.json")}
    first = next(r for r in results.values() if (r.get("resumed_from") or {}).get("job"))
    assert first["state"] == "done", (first, why)
    assert results[queued]["state"] == "done", (results[queued], why)
    assert results[queued]["minibatches"] == results[queued]["total"], results[queued]
    assert (run_dir / "jobs" / queued / "model.pt").exists()
    _wait("the daemons to be gone", lambda: not _daemons_of(str(run_dir)), 60)


@pytest.mark.slow
@pytest.mark.timeout(720)
def test_a_requeued_allocation_resumes_its_job_instead_of_submitting_it_again(
    slurm: Slurm, tmp_path: Path
) -> None:
    """``scontrol requeue`` (as a node failure or a preemption would) stops the allocation and
    runs the script again under the same Slurm job id and run directory: the head resumes the
    job from its checkpoint, and the script follows it instead of submitting ``HETPIPE_JOB``
    a second time, so the job trains once, to done."""
    job_file = _job_file(tmp_path / "job.toml", minibatches=3000, checkpoint_every=50)
    # append: the requeued run's output follows the first's in one file
    job, run_dir, _ = _submit(slurm, tmp_path, job_file, extra={"SBATCH_OPEN_MODE": "append"})
    _wait_checkpointed(slurm, job, run_dir, tmp_path)
    slurm.run(["scontrol", "requeue", job])

    def running_again() -> bool:
        state = slurm.job_state(job)
        if int(state.get("Restarts", "0")) < 1:
            return False
        if state.get("JobState") == "PENDING":
            # Slurm holds a requeued job back a while (its begin time): let it start now
            slurm.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], check=False)
        return state.get("JobState") == "RUNNING"

    _wait("the requeued allocation to start", running_again, 240, every=2.0)
    state = slurm.wait_ended(job, 480)
    out = _output(tmp_path, job)
    why = f"{state}\n{out}\n{_run_logs(run_dir)}"
    assert state.get("JobState") == "COMPLETED" and state.get("ExitCode") == "0:0", why
    assert "requeued (restart 1): following the 1 job(s) the head resumed" in out, why
    # the first run's job and its resumption, and no second copy trained from scratch
    dirs = [d for d in (run_dir / "jobs").iterdir() if d.is_dir()]
    assert len(dirs) == 2, (sorted(d.name for d in dirs), why)
    results = {
        d.name: json.loads((d / "result.json").read_text())
        for d in dirs
        if (d / "result.json").exists()
    }
    (resumed,) = [name for name, r in results.items() if r.get("resumed_from")]
    (first,) = [d.name for d in dirs if d.name != resumed]
    result = results[resumed]
    assert result["state"] == "done", (result, why)
    assert result["resumed_from"]["job"] == first, (result, why)
    assert result["resumed_from"]["minibatches_done"] > 0, result
    assert (run_dir / "jobs" / resumed / "model.pt").exists()
    _wait("the daemons to be gone", lambda: not _daemons_of(str(run_dir)), 60)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_sbatch_as_a_plain_job(slurm: Slurm, tmp_path: Path) -> None:
    """The script without its heterogeneous components (as its header says: drop the
    ``hetjob`` lines and the first component's): shards and workers share one node."""
    keep = ("#SBATCH --job-name", "#SBATCH --output", "#SBATCH --time", "#SBATCH --signal")
    lines = SCRIPT.read_text().splitlines()
    plain = tmp_path / "hetpipe-plain.sbatch"
    plain.write_text(
        "\n".join(ln for ln in lines if not ln.startswith("#SBATCH") or ln.startswith(keep))
    )
    job_file = _job_file(
        tmp_path / "job.toml", minibatches=40, vws=[(["n1-gpu0", "n1-gpu1"], [3, 3])]
    )
    components = ["-p", "debug", "-w", "n1", "-N1", "--ntasks-per-node=2", *ONE]
    job, run_dir, _ = _submit(
        slurm, tmp_path, job_file, script=plain, components=components, emulate="fast:1:256MiB:2"
    )
    state = slurm.wait_ended(job, 360)
    why = f"{state}\n{_output(tmp_path, job)}\n{_run_logs(run_dir)}"
    assert state.get("JobState") == "COMPLETED" and state.get("ExitCode") == "0:0", why
    assert not [ln for ln in plain.read_text().splitlines() if ln.startswith("#SBATCH hetjob")]
    (result,) = [json.loads(p.read_text()) for p in run_dir.glob("jobs/*/result.json")]
    assert result["state"] == "done" and result["minibatches"] == 40, result
    _wait("the daemons to be gone", lambda: not _daemons_of(str(run_dir)), 30)


def _seconds(text: str) -> int:
    """Slurm's ``[days-]hours:minutes:seconds`` (``RunTime``) in seconds."""
    days, _, rest = text.rpartition("-")
    total = 0
    for part in rest.split(":"):
        total = total * 60 + int(part)
    return total + int(days or 0) * 86400


WARN_S = 30  # the time limit's warning (--signal=B:USR1@WARN_S on the shards' component)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_time_limit_checkpoints_stops_every_daemon_and_the_next_allocation_resumes(
    slurm: Slurm, tmp_path: Path
) -> None:
    """A job longer than its allocation: Slurm's warning before the limit makes the running
    job write its next checkpoint and every daemon stop; the job ends as ``TIMEOUT``, nothing
    is left running, and the next allocation resumes the job from that checkpoint.

    The devices are slowed (emulated speeds) and the job long, so that it cannot end in the
    first allocation; not so slowed that a wave outlasts the warning: a pass right after the
    pad's sleep costs a cold start of up to about 13 ms of CPU on an idle host, which the
    pad stretches by 1 / speed (a wave of the slow stage: four such passes). The limit is
    set once the job trains (``scontrol update TimeLimit``, in minutes, the smallest that
    still leaves the warning a time-limit check before the end): a limit given at submission
    would also count the daemons' start-up, whose length a loaded host does not bound."""
    job_file = _job_file(tmp_path / "job.toml", minibatches=4000, checkpoint_every=5)
    first = ["-p", "debug", "-w", "n0", "-N1", "-n2", *ONE, f"--signal=B:USR1@{WARN_S}"]
    components = [*first, *HET[HET.index(":") :]]
    job, run_dir, _ = _submit(
        slurm,
        tmp_path,
        job_file,
        components=components,
        emulate="fast:0.03:256MiB:2 slow:0.015:256MiB:1",
        extra={"HETPIPE_STOP_S": "15"},
    )

    _wait_checkpointed(slurm, job, run_dir, tmp_path)
    # the warning comes at slurmctld's first time-limit check (every 30 s) less than
    # WARN_S + 30 s before the end: an end at least 60 s away leaves it 30 s or more
    ran = _seconds(slurm.job_state(job)["RunTime"])
    minutes = -(-(ran + WARN_S + 30) // 60)
    slurm.run(["scontrol", "update", f"JobId={job}", f"TimeLimit={minutes}"])
    state = slurm.wait_ended(job, minutes * 60 - ran + 120)
    out = _output(tmp_path, job)
    why = f"{state}\n{out}\n{_run_logs(run_dir)}\n{slurm.logs()}"
    assert state.get("JobState") == "TIMEOUT", why
    assert "hetpipe: the time limit is near" in out, why
    assert "hetpipe: checkpoint before the time limit: slurm-mlp-1 at wave" in out, why
    assert "hetpipe: daemons stopped" in out, why
    assert "Killed" not in out, why  # stopped by SIGTERM, before the limit's kill
    _wait("the daemons to be gone", lambda: not _daemons_of(str(run_dir)), 60)

    (job_dir,) = [d for d in (run_dir / "jobs").iterdir() if d.is_dir()]
    record = json.loads((job_dir / "job.json").read_text())
    assert record["state"] == "interrupted", record  # a later head resumes it
    from hetpipe import checkpoint

    ck = checkpoint.latest(job_dir)
    assert ck is not None and ck.state, sorted(job_dir.rglob("*"))
    saved = ck.meta["minibatches_done"]
    assert 0 < saved < 8000, ck.meta  # of 2 VWs x 4000
    # the checkpoint the warning waited for (or one taken in the moment before the stop)
    waited = re.search(r"checkpoint before the time limit: slurm-mlp-1 at wave (\d+)", out)
    assert waited is not None and ck.meta["wave"] >= int(waited.group(1)), (out, ck.meta)

    # the next allocation (devices at full speed) resumes it and stops once it is done
    again, _, _ = _submit(slurm, tmp_path, None, drain=True)
    state = slurm.wait_ended(again, 360)
    why = f"{state}\n{_output(tmp_path, again)}\n{_run_logs(run_dir)}"
    assert state.get("JobState") == "COMPLETED" and state.get("ExitCode") == "0:0", why
    results = [
        json.loads(p.read_text()) for p in run_dir.glob("jobs/*/result.json") if p.parent != job_dir
    ]
    (result,) = results
    assert result["state"] == "done", result
    assert result["resumed_from"]["job"] == record["id"], result
    assert result["resumed_from"]["minibatches_done"] == saved, result
    _wait("the daemons to be gone", lambda: not _daemons_of(str(run_dir)), 60)


# -- the time limit's handler (hetpipe.launch), without Slurm ---------------------------------


def test_slurm_end_time_is_the_first_components_end() -> None:
    from hetpipe.launch import slurm_end_time

    lines = (
        "JobId=7 HetJobId=7 HetJobOffset=0 JobState=RUNNING EndTime=2026-11-27T18:02:00 X=1\n"
        "JobId=8 HetJobId=7 HetJobOffset=1 JobState=RUNNING EndTime=2026-11-27T18:01:00\n"
        "JobId=9 HetJobId=7 HetJobOffset=2 JobState=RUNNING EndTime=Unknown\n"
    )
    expect = time.mktime(time.strptime("2026-11-27T18:01:00", "%Y-%m-%dT%H:%M:%S"))
    assert slurm_end_time(lines) == expect
    assert slurm_end_time("JobId=7 EndTime=Unknown") is None
    assert slurm_end_time("") is None


def _jobs(*jobs: tuple[str, str, int]) -> dict[str, Any]:
    return {
        "jobs": [
            {"id": i, "state": st, "checkpoints": n, "last_checkpoint": {"wave": 5 * n}}
            for i, st, n in jobs
        ]
    }


def test_the_time_limit_waits_for_each_running_jobs_next_checkpoint() -> None:
    from hetpipe.launch import checkpoint_before_limit

    answers = iter(
        [
            None,  # the head did not answer this time
            _jobs(("a", "running", 2), ("b", "running", 0), ("c", "done", 3)),
            _jobs(("a", "running", 3), ("b", "running", 0), ("c", "done", 3)),
            _jobs(("a", "running", 3), ("b", "done", 0), ("c", "done", 3)),
        ]
    )
    now = [0.0]
    said: list[str] = []
    done = checkpoint_before_limit(
        lambda: next(answers),
        100.0,
        clock=lambda: now[0],
        sleep=lambda s: now.__setitem__(0, now[0] + s),
        say=said.append,
    )
    assert done == {"a": True, "b": True}  # a checkpointed, b ended; c was not running
    assert now[0] == 3.0
    assert "hetpipe: checkpoint before the time limit: a at wave 15" in said, said
    assert "hetpipe: b ended before the time limit (done)" in said, said


def test_the_time_limit_gives_up_a_checkpoint_that_does_not_come_in_time() -> None:
    from hetpipe.launch import checkpoint_before_limit

    now = [0.0]
    said: list[str] = []
    done = checkpoint_before_limit(
        lambda: _jobs(("a", "running", 1), ("b", "running", 4)),
        10.0,
        clock=lambda: now[0],
        sleep=lambda s: now.__setitem__(0, now[0] + s),
        every=2.0,
        say=said.append,
    )
    assert done == {"a": False, "b": False}
    assert now[0] <= 10.0
    assert "hetpipe: no new checkpoint before the time limit: a, b" in said, said


def test_the_time_limit_without_a_head_waits_for_nothing() -> None:
    from hetpipe.launch import checkpoint_before_limit

    now = [0.0]
    said: list[str] = []
    assert (
        checkpoint_before_limit(
            lambda: None,
            5.0,
            clock=lambda: now[0],
            sleep=lambda s: now.__setitem__(0, now[0] + s),
            say=said.append,
        )
        == {}
    )
    assert now[0] <= 5.0 and said == ["hetpipe: the head did not answer: no checkpoint to wait for"]
