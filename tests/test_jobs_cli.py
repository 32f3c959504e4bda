"""``hetpipe cancel``, ``jobs``, ``status JOB`` and ``trace`` on real daemons, then without them.

One small cluster (two devices, one shard, the head keeping one finished job in memory) runs
a long job that is cancelled, then a short one; then the cluster stops and the finished
job's status and trace still come from its directory, saying so.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result
from conftest import job

from hetpipe import cli
from hetpipe.client import HeadClient
from hetpipe.localcluster import DeviceDef, LocalCluster, cluster_toml

pytestmark = pytest.mark.timeout(240)

SPLIT = [(["gpu0", "gpu1"], [3, 3])]
# The cancelled job only has to be running when ``cancel`` comes (a second after it is seen
# running): 20 000 minibatches run a minute or more here.
LONG = 20_000


class QuickHeadClient(HeadClient):
    """The CLI's client with a short request timeout, so a stopped head is noticed fast.

    The CLI passes its own timeout (``QUICK_S``, 5 s); it is capped here, else each of the
    three commands that ask the stopped head first waits it out."""

    def __init__(self, address: str, *, timeout: float = 1.0, curve: Any = None) -> None:
        super().__init__(address, timeout=min(timeout, 1.0), curve=curve)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    root = tmp_path_factory.mktemp("jobs")
    path = root / "cluster.toml"
    text = cluster_toml((DeviceDef("gpu0"), DeviceDef("gpu1")), shards=1)
    path.write_text(text.replace("[runtime]\n", "[runtime]\njobs_kept = 1\n", 1))
    with LocalCluster(path, root / "run", timeout=60) as c:
        yield c


def invoke(c: LocalCluster, *args: str, head: str | None = None) -> Result:
    env = {"HETPIPE_CLUSTER": None, "HETPIPE_RUN_DIR": None, "HETPIPE_HEAD": None}
    return CliRunner().invoke(
        cli.main,
        ["--cluster", c.cluster_path, "--run-dir", str(c.run_dir), "--head", head or c.head, *args],
        env=env,
    )


def wait_state(c: LocalCluster, job_id: str, states: set[str], timeout: float) -> dict[str, Any]:
    async def go() -> dict[str, Any]:
        async with c.client() as client:
            deadline = time.monotonic() + timeout
            while True:
                info = await client.job(job_id)
                if info["state"] in states:
                    return info
                # a job that ended otherwise will not get there: say how it ended, at once
                assert info["state"] not in ("done", "failed", "cancelled"), (
                    f"{job_id} {info['state']}: {info.get('error')}"
                )
                assert time.monotonic() < deadline, f"{job_id} still {info['state']}"
                await asyncio.sleep(0.2)

    return asyncio.run(go())


def submit(c: LocalCluster, spec: dict[str, Any]) -> str:
    async def go() -> str:
        async with c.client() as client:
            return await client.submit(spec)

    return asyncio.run(go())


@pytest.fixture(scope="module")
def ran(cluster: LocalCluster) -> dict[str, Any]:
    """A cancelled long job, then a short job that runs to its end on the freed workers."""
    out: dict[str, Any] = {}
    long_id = submit(cluster, job("long", split=SPLIT, minibatches=LONG, nm=2))
    wait_state(cluster, long_id, {"running"}, 120)
    out["cancel"] = invoke(cluster, "cancel", long_id)
    out["cancelled"] = wait_state(cluster, long_id, {"done", "failed", "cancelled"}, 60)
    short_id = submit(cluster, job("short", split=SPLIT, minibatches=12, nm=2))
    out["short"] = wait_state(cluster, short_id, {"done", "failed", "cancelled"}, 120)
    out["long_id"], out["short_id"] = long_id, short_id
    return out


def test_cancel_ends_a_running_job_and_frees_its_workers(ran: dict[str, Any]) -> None:
    assert ran["cancel"].exit_code == 0, ran["cancel"].output
    assert ran["cancel"].stdout.startswith(f"cancel: {ran['long_id']} ")
    assert ran["cancelled"]["state"] == "cancelled", ran["cancelled"]
    assert ran["short"]["state"] == "done", ran["short"]  # the workers were freed


def test_cancel_of_an_ended_or_unknown_job_says_so(
    cluster: LocalCluster, ran: dict[str, Any]
) -> None:
    result = invoke(cluster, "cancel", ran["short_id"])
    assert result.exit_code == 1
    assert f"job {ran['short_id']} has already ended (done)" in result.stderr
    result = invoke(cluster, "cancel", "nosuch-9")
    assert result.exit_code == 1
    assert "no job 'nosuch-9'" in result.stderr


def test_jobs_lists_the_head_and_the_disk(cluster: LocalCluster, ran: dict[str, Any]) -> None:
    result = invoke(cluster, "jobs", "--json")
    assert result.exit_code == 0, result.output
    rows = {r["id"]: r for r in json.loads(result.stdout)}
    assert rows[ran["short_id"]]["state"] == "done"
    assert rows[ran["short_id"]]["source"] == "head"
    # jobs_kept = 1: the cancelled job left the head's memory, its record is on disk
    assert rows[ran["long_id"]] == {**rows[ran["long_id"]], "state": "cancelled", "source": "disk"}
    text = invoke(cluster, "jobs")
    assert text.exit_code == 0 and ran["short_id"] in text.stdout


def test_a_forgotten_job_is_read_from_disk_by_the_head(
    cluster: LocalCluster, ran: dict[str, Any]
) -> None:
    result = invoke(cluster, "status", ran["long_id"], "--json")
    assert result.exit_code == 0, result.output
    info = json.loads(result.stdout)
    assert info["state"] == "cancelled"
    assert info["source"].startswith(f"jobs/{ran['long_id']}/result.json via the head")
    result = invoke(cluster, "status", "nosuch-9")
    assert result.exit_code == 1
    assert result.stderr.strip() == "Error: no job 'nosuch-9'"


def test_status_of_a_job_by_the_name_it_was_submitted_as(
    cluster: LocalCluster, ran: dict[str, Any]
) -> None:
    """``short`` is ``short-<n>`` (the head's); ``long`` the cancelled job the head forgot,
    found on disk; a name no job has gets the plain one-line refusal."""
    for name, job_id, state in (
        ("short", ran["short_id"], "done"),
        ("long", ran["long_id"], "cancelled"),
    ):
        result = invoke(cluster, "status", name, "--json")
        assert result.exit_code == 0, result.output
        info = json.loads(result.stdout)
        assert (info["id"], info["state"]) == (job_id, state)
    result = invoke(cluster, "status", "medium")
    assert result.exit_code == 1
    assert result.stderr.strip() == "Error: no job 'medium'"


def test_status_and_trace_of_a_finished_job_without_a_head(
    cluster: LocalCluster,
    ran: dict[str, Any],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cluster.stop()
    monkeypatch.setattr(cli, "HeadClient", QuickHeadClient)
    short = ran["short_id"]
    out = tmp_path / "t.json"
    result = invoke(cluster, "trace", short, "-o", str(out))
    assert result.exit_code == 0, result.output
    trace_path = cluster.run_dir / "jobs" / short / "trace.json"
    assert f"(from {trace_path})" in result.stdout
    assert json.loads(out.read_text())["traceEvents"]

    result = invoke(cluster, "status", short)
    assert result.exit_code == 0, result.output
    assert f"{short}: done in" in result.stdout
    assert f"(from {cluster.run_dir / 'jobs' / short / 'result.json'})" in result.stdout

    result = invoke(cluster, "status", "nosuch-9")
    assert result.exit_code == 1
    assert result.stderr.startswith("Error: no job 'nosuch-9' in ")
    assert "did not answer" in result.stderr

    result = invoke(cluster, "jobs", "--json")
    assert result.exit_code == 0, result.output
    assert {r["source"] for r in json.loads(result.stdout)} == {"disk"}
    assert "head not reachable" in result.stderr
