"""The ``hetpipe`` command line: user errors are one line, output is what a person reads.

The fast tests drive the click group in-process with ``CliRunner`` and start no daemon. One
slow test runs the real ``hetpipe up`` / ``status`` / ``down`` as subprocesses on a cluster
file with free fixed ports, and always stops what it started.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result
from helpers import hetpipe_cli, stop_up_daemons

from hetpipe import cli, config, launch, security
from hetpipe.client import HeadClient
from hetpipe.localcluster import DeviceDef, cluster_toml, free_ports

pytestmark = pytest.mark.timeout(30)


def good_cluster(p0: int = 7100, p1: int = 7101, p2: int = 7200, p3: int = 7201) -> str:
    """Two shards and two devices (a fast one and a whimpy one) on this host."""
    return cluster_toml(
        (
            DeviceDef("gpu0", "fast", "64MiB", 1.0, port=p2),
            DeviceDef("gpu1", "whimpy", "3MiB", 0.25, port=p3),
        ),
        shard_ports=(p0, p1),
    )


GOOD_JOB = """\
name = "t"
[model]
name = "mlp"
[data]
name = "digits"
[train]
minibatch = 32
nm = 2
minibatches = 10
"""


def invoke(*args: str) -> Result:
    """Run the CLI in-process with a clean environment for its own variables."""
    env = {"HETPIPE_CLUSTER": None, "HETPIPE_RUN_DIR": None, "HETPIPE_HEAD": None}
    return CliRunner().invoke(cli.main, list(args), env=env)


def error_lines(result: Result) -> list[str]:
    return result.stderr.strip().splitlines()


def write_cluster(path: Path, ports: list[int] | None = None) -> Path:
    p = ports or [7100, 7101, 7200, 7201]
    path.write_text(good_cluster(*p))
    return path


# -- malformed cluster files ----------------------------------------------------------------

BAD_CLUSTERS = {
    "unknown-key": (
        lambda text: 'colour = "red"\n' + text,
        "colour",
        "unknown key",
    ),
    "bad-size": (
        lambda text: text.replace('memory = "3MiB"', 'memory = "lots"'),
        "node[0].device[1].memory",
        "cannot parse size 'lots'",
    ),
}


@pytest.mark.parametrize("command", ["status", "up"])
@pytest.mark.parametrize("case", sorted(BAD_CLUSTERS))
def test_malformed_cluster_file_is_one_line_naming_file_and_key(
    tmp_path: Path, command: str, case: str
) -> None:
    edit, key, problem = BAD_CLUSTERS[case]
    path = tmp_path / "cluster.toml"
    path.write_text(edit(good_cluster()))
    run_dir = tmp_path / "run"
    result = invoke("--cluster", str(path), "--run-dir", str(run_dir), command)
    assert result.exit_code == 1, result.output
    lines = error_lines(result)
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"Error: {path}: {key}: "), lines[0]
    assert problem in lines[0]
    assert "Traceback" not in result.output
    assert not run_dir.exists()  # nothing was started


def test_missing_cluster_file_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "nope.toml"
    result = invoke("--cluster", str(path), "status")
    assert result.exit_code == 1
    assert error_lines(result) == [f"Error: {path}: file: cannot read (No such file or directory)"]


def test_up_refuses_a_cluster_with_nothing_on_this_host(tmp_path: Path) -> None:
    text = good_cluster()
    path = tmp_path / "remote.toml"
    path.write_text(text.replace("127.0.0.1", "192.0.2.1"))  # TEST-NET-1: never this host
    result = invoke("--cluster", str(path), "--run-dir", str(tmp_path / "run"), "up")
    assert result.exit_code == 1
    assert error_lines(result) == [f"Error: {path}: no shard or device lives on this host"]


def test_up_on_one_host_of_several_never_makes_a_new_key_set(tmp_path: Path) -> None:
    """A cluster spread over hosts shares the key set made once by ``hetpipe keys``: a host
    without it refuses in one line naming what it lacks, and writes no keys of its own."""
    text = good_cluster().replace(
        '[[node.device]]\nname = "gpu1"',
        '[[node]]\nname = "node1"\nhost = "192.0.2.1"\n\n[[node.device]]\nname = "gpu1"',
    )
    path = tmp_path / "two-hosts.toml"
    path.write_text(text)
    keys = tmp_path / ".hetpipe" / "keys"
    result = invoke("--cluster", str(path), "--run-dir", str(tmp_path / "run"), "up")
    assert result.exit_code == 1
    (line,) = error_lines(result)
    assert line.startswith(f"Error: {path}: this host lacks the cluster's keys server.key, ")
    assert f"in {keys}; the cluster spans several hosts" in line
    assert not keys.exists() or not any(keys.iterdir())
    assert not (tmp_path / "run" / "pids.json").exists()  # nothing was started
    # with the set made once (and, on a real cluster, copied here) the check passes: what
    # follows is starting this host's daemons (not run here)
    assert invoke("--cluster", str(path), "keys").exit_code == 0
    ctx = cli.Ctx(str(path), None, None)
    cluster = config.load_cluster(path)
    daemons = launch.local_daemons(cluster, str(path), run_dir=tmp_path / "run")
    assert {d.name for d in daemons} == {"ps0", "ps1", "worker-gpu0"}
    names = security.key_names(2, ["gpu0", "gpu1"])
    assert security.missing_keys(keys, names, {"server", "ps0", "ps1", "worker-gpu0"}) == []
    ctx.ensure_keys(daemons)  # no error: the set is there


def test_down_with_nothing_running_says_so(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    result = invoke("--run-dir", str(run_dir), "down")
    assert result.exit_code == 0
    assert result.stdout == f"down: nothing running in {run_dir}\n"


# -- submit ---------------------------------------------------------------------------------


def test_submit_missing_job_file_is_one_line(tmp_path: Path) -> None:
    job = tmp_path / "missing.toml"
    result = invoke("--cluster", str(write_cluster(tmp_path / "c.toml")), "submit", str(job))
    assert result.exit_code == 1
    assert error_lines(result) == [f"Error: {job}: file: cannot read (No such file or directory)"]


@pytest.mark.parametrize(
    ("text", "where"),
    [
        (GOOD_JOB.replace("nm = 2", 'nm = "two"'), "train.nm: expected an integer"),
        (GOOD_JOB + "colour = 1\n", "train.colour: unknown key"),
        (GOOD_JOB.replace("minibatches = 10\n", ""), "train.epochs: missing"),
        ("name = [unclosed\n", "line 1, column"),
    ],
    ids=["wrong-type", "unknown-key", "missing", "bad-toml"],
)
def test_submit_malformed_job_file_is_one_line(tmp_path: Path, text: str, where: str) -> None:
    job = tmp_path / "job.toml"
    job.write_text(text)
    result = invoke("--cluster", str(write_cluster(tmp_path / "c.toml")), "submit", str(job))
    assert result.exit_code == 1
    lines = error_lines(result)
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"Error: {job}: {where}"), lines[0]
    assert "Traceback" not in result.output


@pytest.mark.parametrize("command", ["submit", "plan", "profile"])
def test_job_checked_against_the_cluster_before_anything_is_sent(
    tmp_path: Path, command: str
) -> None:
    """A wrong split is refused at once, naming the job file (no head is running here)."""
    job = tmp_path / "job.toml"
    job.write_text(GOOD_JOB + '[[vw]]\ndevices = ["gpu0", "gpu1"]\nlayers = [3, 4]\n')
    args = [command, str(job)] if command == "submit" else [command, "--job", str(job)]
    result = invoke("--cluster", str(write_cluster(tmp_path / "c.toml")), *args)
    assert result.exit_code == 1, result.output
    assert error_lines(result) == [
        f"Error: {job}: vw[0].layers: [3, 4] sums to 7, the model has 6 layers"
    ]


def test_submit_out_of_range_integer_is_one_line(tmp_path: Path) -> None:
    job = tmp_path / "job.toml"
    job.write_text(GOOD_JOB.replace("minibatches = 10", "minibatches = 99999999999999999999"))
    result = invoke("--cluster", str(write_cluster(tmp_path / "c.toml")), "submit", str(job))
    assert result.exit_code == 1
    assert error_lines(result) == [
        f"Error: {job}: train.minibatches: integer "
        f"99999999999999999999 is out of range (must fit in 64 bits)"
    ]


@pytest.mark.parametrize("head", ["not-a-url", "tcp://127.0.0.1:99999", "tcp://h:1:2"])
def test_bad_head_address_is_one_line(tmp_path: Path, head: str) -> None:
    result = invoke("--cluster", str(write_cluster(tmp_path / "c.toml")), "--head", head, "status")
    assert result.exit_code == 1, result.output
    lines = error_lines(result)
    assert len(lines) == 1 and lines[0].startswith("Error: --head: "), lines
    assert "Traceback" not in result.output


@pytest.mark.parametrize(
    ("argv", "edit", "expected"),
    [
        (
            ["hetpipe.ps", "--shard", "0"],
            ("[runtime]", "[runtime]\nhwm = 99999999999"),
            "runtime.hwm: must be <= 1048576",
        ),
        (
            ["hetpipe.worker", "--device", "gpu0"],
            ('host = "127.0.0.1"', 'host = "127.0.0.1:7000"'),
            "node[0].host: '127.0.0.1:7000'",
        ),
        (
            ["hetpipe.ps", "--shard", "0", "--head", "not-a-url"],
            ("", ""),
            "--head: 'not-a-url' is not an address",
        ),
        (
            ["hetpipe.worker", "--device", "gpu0", "--head", "tcp://x"],
            ("", ""),
            "--head: 'tcp://x' is not an address",
        ),
        (["hetpipe.ps", "--shard", "7"], ("", ""), "--shard 7: "),
        (["hetpipe.worker", "--device", "gpu9"], ("", ""), "device: unknown device 'gpu9'"),
    ],
    ids=["ps-hwm", "worker-host", "ps-head", "worker-head", "ps-shard", "worker-device"],
)
def test_daemon_config_errors_are_one_line(
    tmp_path: Path, argv: list[str], edit: tuple[str, str], expected: str
) -> None:
    """The daemons refuse a bad file or --head at start-up with one line, no traceback."""
    path = tmp_path / "c.toml"
    text = good_cluster(0, 0, 0, 0)
    path.write_text(text.replace(*edit) if edit[0] else text)
    proc = subprocess.run(
        [sys.executable, "-m", *argv, "--cluster", str(path)],
        capture_output=True,
        text=True,
        timeout=25,
    )
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert expected in lines[0], lines[0]


class QuickHeadClient(HeadClient):
    """The CLI's client with a short request timeout (the CLI has no option for it)."""

    def __init__(self, address: str, *, timeout: float = 0.5, curve: Any = None) -> None:
        super().__init__(address, timeout=timeout, curve=curve)


@pytest.mark.parametrize("command", ["submit", "status", "plan", "profile"])
def test_commands_fail_fast_when_the_head_is_not_running(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: str
) -> None:
    """Every request says within seconds that no head answers. Planning and profiling may
    take minutes, so their requests wait long, but first ask the head's status within
    REACH_S."""
    monkeypatch.setattr(cli, "HeadClient", QuickHeadClient)
    monkeypatch.setattr(cli, "REACH_S", 0.5)
    head = f"tcp://127.0.0.1:{free_ports(1)[0]}"
    job = tmp_path / "job.toml"
    job.write_text(GOOD_JOB)
    args = {
        "submit": ["submit", str(job)],
        "status": ["status"],
        "plan": ["plan", "--job", str(job)],
        "profile": ["profile", "--job", str(job)],
    }
    cluster = str(write_cluster(tmp_path / "c.toml"))
    assert invoke("--cluster", cluster, "keys").exit_code == 0
    start = time.monotonic()
    result = invoke("--cluster", cluster, "--head", head, *args[command])
    elapsed = time.monotonic() - start
    assert result.exit_code == 1, result.output
    assert error_lines(result) == [
        f"Error: the head at {head} did not answer within 0.5 s: is the cluster up (`hetpipe up`), "
        "and with these keys (a head refuses keys not its own)?"
    ]
    assert elapsed < 5.0, elapsed


# -- logs -----------------------------------------------------------------------------------


def test_logs_unknown_daemon_is_a_usage_error_listing_the_known_ones(tmp_path: Path) -> None:
    logs = tmp_path / "run" / "logs"
    logs.mkdir(parents=True)
    (logs / "ps0.log").write_text("")
    (logs / "worker-gpu0.log").write_text("")
    result = invoke("--run-dir", str(tmp_path / "run"), "logs", "worker-gpu9")
    assert result.exit_code == 2
    assert "Traceback" not in result.output
    assert f"no log for 'worker-gpu9' in {logs} (have: ps0, worker-gpu0)" in result.stderr
    assert "DAEMON" in result.stderr


def test_logs_with_no_logs_at_all_says_none(tmp_path: Path) -> None:
    result = invoke("--run-dir", str(tmp_path / "run"), "logs", "ps0")
    assert result.exit_code == 2
    assert "(have: none)" in result.stderr


def test_logs_renders_the_tail_of_each_daemon(tmp_path: Path) -> None:
    logs = tmp_path / "run" / "logs"
    logs.mkdir(parents=True)
    records = [
        {
            "event": f"step {i}",
            "level": "info",
            "timestamp": f"2025-01-02T03:04:0{i}.123456",
            "process": "ps0",
        }
        for i in range(5)
    ]
    (logs / "ps0.log").write_text("\n".join(json.dumps(r) for r in records) + "\nplain text\n")
    (logs / "ps1.log").write_text("")
    result = invoke("--run-dir", str(tmp_path / "run"), "logs", "ps0", "-n", "3")
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines() == [
        "== ps0",
        "03:04:03.123 INFO    step 3",
        "03:04:04.123 INFO    step 4",
        "plain text",
    ]
    both = invoke("--run-dir", str(tmp_path / "run"), "logs", "-n", "1")
    assert both.stdout.splitlines() == ["== ps0", "plain text", "== ps1"]


def test_help_lists_the_commands() -> None:
    result = invoke("--help")
    assert result.exit_code == 0
    for name in ("up", "down", "status", "submit", "logs", "demo", "cancel", "jobs", "trace"):
        assert f"  {name} " in result.stdout


# -- the real thing: up / status / down ------------------------------------------------------


def _gone(pid: int) -> bool:
    """The process is gone (a zombie nobody reaped yet counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state == "Z"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_up_status_down_on_real_daemons(tmp_path: Path) -> None:
    cluster = write_cluster(tmp_path / "cluster.toml", free_ports(4))
    run_dir = tmp_path / "run"
    pids: dict[str, int] = {}
    try:
        up = hetpipe_cli(cluster, run_dir, "up", "--timeout", "60")
        with contextlib.suppress(OSError, ValueError):
            pids = json.loads((run_dir / "pids.json").read_text())
        assert up.returncode == 0, up.stdout + up.stderr
        assert up.stdout.startswith("up: 4 daemons (ps0, ps1, worker-gpu0, worker-gpu1)")
        assert set(pids) == {"ps0", "ps1", "worker-gpu0", "worker-gpu1"}

        status = hetpipe_cli(cluster, run_dir, "status")
        assert status.returncode == 0, status.stderr
        rows = {line.split()[0]: line.split() for line in status.stdout.splitlines() if line}
        assert rows["DEVICE"][:5] == ["DEVICE", "TYPE", "SPEED", "MEMORY", "STATE"]
        assert rows["gpu0"][:5] == ["gpu0", "fast", "1", "64.0MiB", "idle"]
        assert rows["gpu1"][:5] == ["gpu1", "whimpy", "0.25", "3.0MiB", "idle"]

        again = hetpipe_cli(cluster, run_dir, "up")
        assert again.returncode == 1
        lines = again.stderr.strip().splitlines()
        assert len(lines) == 1, again.stderr
        assert "already running" in lines[0] and "hetpipe down" in lines[0]
        assert all(not _gone(pid) for pid in pids.values())  # the refusal touched nothing

        down = hetpipe_cli(cluster, run_dir, "down")
        assert down.returncode == 0, down.stderr
        assert down.stdout.strip() == "down: stopped 4 daemons"
        deadline = time.monotonic() + 5
        while not all(_gone(pid) for pid in pids.values()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [n for n, pid in pids.items() if not _gone(pid)] == []
        assert not (run_dir / "pids.json").exists()
    finally:  # a test that failed before its own down leaves pids.json: stop them then
        stop_up_daemons(cluster, run_dir, pids)


@pytest.mark.parametrize(
    ("args", "problem"),
    [
        (["--png", "g.png", "--minibatches", "3"], "expected A:B, got '3'"),
        (["--png", "g.png", "--seconds", "5:1"], "expected 0 <= A < B, got '5:1'"),
        (["--png", "g.png", "--minibatches", "0:4", "--seconds", "0:1"], "not both"),
        (["--minibatches", "0:4"], "choose the window of --png"),
    ],
    ids=["not-a-range", "backwards", "both", "without-png"],
)
def test_trace_window_options_are_usage_errors(
    tmp_path: Path, args: list[str], problem: str
) -> None:
    result = invoke(
        "--cluster",
        str(write_cluster(tmp_path / "c.toml")),
        "trace",
        "j-1",
        "-o",
        str(tmp_path / "t.json"),
        *args,
    )
    assert result.exit_code == 2, result.output
    assert problem in result.stderr


def test_trace_of_an_unknown_job_on_disk_asks_the_head(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cli, "QUICK_S", 0.2)
    head = f"tcp://127.0.0.1:{free_ports(1)[0]}"
    cluster = str(write_cluster(tmp_path / "c.toml"))
    assert invoke("--cluster", cluster, "keys").exit_code == 0
    result = invoke(
        "--cluster",
        cluster,
        "--run-dir",
        str(tmp_path / "run"),
        "--head",
        head,
        "trace",
        "nosuch-1",
        "-o",
        str(tmp_path / "t.json"),
    )
    assert result.exit_code == 1
    assert "did not answer" in result.stderr


def test_commands_that_send_no_tensor_do_not_import_torch(tmp_path: Path) -> None:
    """Importing torch takes over a second: ``hetpipe down``, ``keys``, ``status`` and the
    rest must not pay it (checking a job, which builds its model, imports it when asked)."""
    (tmp_path / "cluster.toml").write_text(good_cluster())
    probe = (
        "import sys\n"
        "from hetpipe import cli\n"
        "for args in (['down'], ['keys']):\n"
        "    cli.main(['--cluster', 'cluster.toml', *args], standalone_mode=False)\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))[:3])\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().splitlines()[-1] == "[]", run.stdout
    assert "down: nothing running" in run.stdout and "keys: " in run.stdout, run.stdout
    assert any((tmp_path / ".hetpipe" / "keys").iterdir())  # the commands did their work


# -- a job by the name it was submitted as ---------------------------------------------------


@pytest.mark.parametrize(
    ("query", "ids", "expected"),
    [
        ("demo-2", ["demo-1", "demo-2"], ("demo-2", [])),
        ("demo", ["demo-1", "other-2"], ("demo-1", [])),
        ("demo", ["demo-10", "demo-9", "demox-3"], (None, ["demo-9", "demo-10"])),
        # job "run-2", number 5: not a job named "run", but close to it
        ("run", ["run-2-5"], (None, ["run-2-5"])),
        ("run-2", ["run-2-5"], ("run-2-5", [])),
        ("dmeo-1", ["demo-1", "demo-12", "zzz-3"], (None, ["demo-1", "demo-12"])),
        ("nosuch-9", ["long-1", "short-2"], (None, [])),
        ("demo", [], (None, [])),
    ],
    ids=[
        "exact",
        "one-named",
        "several-named",
        "longer-name",
        "name-with-digits",
        "close",
        "far",
        "no-jobs",
    ],
)
def test_match_job(query: str, ids: list[str], expected: tuple[str | None, list[str]]) -> None:
    assert cli.match_job(query, ids) == expected


def test_no_job_names_the_candidates_on_one_line() -> None:
    assert cli.no_job("x", []) == "no job 'x'"
    assert cli.no_job("demo", ["demo-1", "demo-2"]) == (
        "no job 'demo': 2 jobs are named 'demo' (demo-1, demo-2); give one id"
    )
    assert cli.no_job("dmeo-1", ["demo-1"]) == "no job 'dmeo-1' (closest: demo-1)"
    assert cli.no_job("t", ["t-1", "t-2"], "trace of job", " in run/jobs") == (
        "no trace of job 't' in run/jobs: 2 jobs are named 't' (t-1, t-2); give one id"
    )


class FakeHead:
    """What the head answers, without a head: its jobs by id (and their traces), "no job"
    otherwise, as :func:`hetpipe.cli._ask` raises it."""

    def __init__(self, jobs: dict[str, dict[str, Any]], traces: dict[str, Any] | None = None):
        self.jobs = jobs
        self.traces = traces or {}
        self.asked: list[tuple[str, str | None]] = []

    def __call__(self, obj: Any, kind: Any, fields: dict[str, Any], timeout: float) -> Any:
        import click

        from hetpipe.wire import Kind

        job = fields.get("job")
        self.asked.append((kind, job))
        if kind == Kind.CLUSTER_STATUS:
            return {"workers": [], "jobs": list(self.jobs.values())}
        known = self.traces if kind == Kind.TRACE else self.jobs
        if job not in known:
            raise click.ClickException(f"no job {job!r}")
        return json.loads(json.dumps(known[job]))


def running(job_id: str) -> dict[str, Any]:
    return {"id": job_id, "state": "running", "total": 10, "minibatches": 3}


def test_status_of_a_job_by_the_name_it_was_submitted_as(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    head = FakeHead({"demo-3": running("demo-3"), "other-4": running("other-4")})
    monkeypatch.setattr(cli, "_ask", head)
    cluster = str(write_cluster(tmp_path / "c.toml"))
    run = ["--cluster", cluster, "--run-dir", str(tmp_path / "run")]
    result = invoke(*run, "status", "demo", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["id"] == "demo-3"
    result = invoke(*run, "status", "demo")
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("demo-3 ")


def test_status_of_an_ambiguous_or_unknown_name_names_the_candidates(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    head = FakeHead({"demo-3": running("demo-3"), "demo-5": running("demo-5")})
    monkeypatch.setattr(cli, "_ask", head)
    run_dir = tmp_path / "run"
    finished = run_dir / "jobs" / "demo-1"
    finished.mkdir(parents=True)  # a finished job the head has forgotten, on disk
    (finished / "result.json").write_text(json.dumps({"id": "demo-1", "state": "done"}))
    cluster = str(write_cluster(tmp_path / "c.toml"))
    run = ["--cluster", cluster, "--run-dir", str(run_dir)]
    result = invoke(*run, "status", "demo")
    assert result.exit_code == 1
    assert error_lines(result) == [
        "Error: no job 'demo': 3 jobs are named 'demo' (demo-1, demo-3, demo-5); give one id"
    ]
    result = invoke(*run, "status", "demo-4")
    assert result.exit_code == 1
    assert error_lines(result) == ["Error: no job 'demo-4' (closest: demo-1, demo-3, demo-5)"]
    result = invoke(*run, "status", "nosuch-9")
    assert error_lines(result) == ["Error: no job 'nosuch-9'"]


def test_status_by_name_reads_the_disk_when_the_head_does_not_answer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import click

    def unreachable(*_args: Any, **_kw: Any) -> Any:
        raise click.ClickException("the head at tcp://127.0.0.1:9 did not answer within 5 s")

    monkeypatch.setattr(cli, "_ask", unreachable)
    run_dir = tmp_path / "run"
    for job_id in ("short-2", "long-1", "long-3"):
        d = run_dir / "jobs" / job_id
        d.mkdir(parents=True)
        (d / "result.json").write_text(json.dumps({"id": job_id, "state": "cancelled"}))
    cluster = str(write_cluster(tmp_path / "c.toml"))
    run = ["--cluster", cluster, "--run-dir", str(run_dir)]
    result = invoke(*run, "status", "short")
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines() == [
        f"{'short-2':<20} cancelled",
        f"(from {run_dir / 'jobs' / 'short-2' / 'result.json'})",
    ]
    result = invoke(*run, "status", "long")
    assert result.exit_code == 1
    assert error_lines(result) == [
        f"Error: no job 'long' in {run_dir / 'jobs'}: 2 jobs are named 'long' (long-1, long-3); "
        "give one id, and the head at tcp://127.0.0.1:9 did not answer within 5 s"
    ]


# -- trace: -o, --png, or both ---------------------------------------------------------------


def small_trace(job: str) -> dict[str, Any]:
    """The trace of one stage that ran four minibatches (10 ms forward, 20 ms backward)."""
    from hetpipe.trace import chrome_trace

    spans = []
    for p in range(4):
        t = 100.0 + 0.03 * p
        spans += [["forward", t, t + 0.01, p, p // 2], ["backward", t + 0.01, t + 0.03, p, p // 2]]
    return chrome_trace({"vw0/stage0": {"spans": spans}}, {"vw0/stage0": "gpu0"}, job)


def test_trace_needs_an_output_or_a_picture(tmp_path: Path) -> None:
    result = invoke("--cluster", str(write_cluster(tmp_path / "c.toml")), "trace", "j-1")
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines()[-1] == (
        "Error: give -o FILE (the trace JSON), --png FILE (its Gantt chart), or both"
    )


def test_trace_draws_the_picture_without_writing_the_json(tmp_path: Path) -> None:
    import os

    if not os.environ.get("CI"):  # the test extra installs it: CI must not skip
        pytest.importorskip("matplotlib")
    run_dir = tmp_path / "run"
    (run_dir / "jobs" / "t-1").mkdir(parents=True)
    (run_dir / "jobs" / "t-1" / "trace.json").write_text(json.dumps(small_trace("t-1")))
    png = tmp_path / "g.png"
    cluster = str(write_cluster(tmp_path / "c.toml"))
    result = invoke(
        "--cluster", cluster, "--run-dir", str(run_dir), "trace", "t-1", "--png", str(png)
    )
    assert result.exit_code == 0, result.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.toml", "g.png", "run"]
    lines = result.stdout.splitlines()
    assert (
        lines[0] == f"trace: 8 events of job t-1 (from {run_dir / 'jobs' / 't-1' / 'trace.json'})"
    )
    assert lines[1].startswith("gantt chart of ") and lines[1].endswith(f" -> {png}")


def test_trace_of_a_job_by_its_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    head = FakeHead({"t-7": running("t-7")}, traces={"t-7": small_trace("t-7")})
    monkeypatch.setattr(cli, "_ask", head)
    out = tmp_path / "t.json"
    cluster = str(write_cluster(tmp_path / "c.toml"))
    run = ["--cluster", cluster, "--run-dir", str(tmp_path / "run")]
    result = invoke(*run, "trace", "t", "-o", str(out))
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("trace: 8 events of job t-7 (from the head at ")
    assert json.loads(out.read_text())["otherData"]["job"] == "t-7"
    result = invoke(*run, "trace", "u", "-o", str(out))
    assert result.exit_code == 1
    assert error_lines(result) == ["Error: no job 'u'"]
