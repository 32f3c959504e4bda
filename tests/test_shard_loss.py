"""A lost parameter-server shard pauses the job: the head waits (``train.shard_wait_s``) for
a shard of that index to register again, then resumes the job by itself from its last
checkpoint, as a new attempt of the same job; past the bound the job fails naming the shard.

Real daemons on loopback: shard 1 is SIGKILLed mid-job and (in the first test) started again
as its supervisor would, binding port 0, so it comes back on another address. The pure
parts (what a paused job's status says, how it fails) are tested without processes."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import UNIFORM, job, running_until, start_cluster, until_whole

from hetpipe.head.registry import Registry
from hetpipe.head.shardwait import gave_up, waiting_view
from hetpipe.jobstore import links, waiting_text
from hetpipe.localcluster import LocalCluster
from hetpipe.views import job_line, live_view

# -- pure -------------------------------------------------------------------------------------


def test_a_paused_jobs_status_says_what_it_waits_for_and_since_when() -> None:
    waiting = waiting_view({1}, {0: "tcp://h:1", 1: "tcp://h:2"}, 1000.0, 300.0, "shard 1 lost")
    assert waiting["shards"] == {"1": "tcp://h:2"}
    assert (waiting["since"], waiting["until"], waiting["wait_s"]) == (1000.0, 1300.0, 300.0)
    text = waiting_text(waiting, now=1030.0)
    assert text.startswith("waiting for shard 1 (tcp://h:2) to register again since ")
    assert text.endswith("(30 s; fails in 270 s)")
    line = job_line({"id": "j-1", "state": "running", "waiting": waiting})
    assert "waiting for shard 1" in line
    assert links({"id": "j-1", "state": "running"}) == []
    assert live_view({"waiting": waiting})[-1].startswith("paused: waiting for shard 1")


def test_a_job_that_waited_in_vain_fails_naming_the_shard() -> None:
    line = gave_up({2, 1}, {1: "tcp://h:2"}, 4.0)
    assert "\n" not in line
    assert line.startswith("shard 1 (tcp://h:2), shard 2 lost and not registered again within 4 s")
    assert "train.shard_wait_s" in line and "hetpipe-ps --shard 1" in line


def test_a_shard_saying_hello_from_another_process_is_a_restart(tmp_path: Path) -> None:
    from hetpipe.config import load_cluster
    from hetpipe.daemon import Owner
    from hetpipe.localcluster import cluster_toml

    path = tmp_path / "cluster.toml"
    path.write_text(cluster_toml(UNIFORM[:1], shards=2, curve=False))
    registry = Registry(load_cluster(path), Owner(), "tcp://127.0.0.1:1")

    async def go() -> list[list[str]]:
        hello = {"shard": 1, "address": "tcp://127.0.0.1:2", "pid": 10}
        return [
            await registry.shard_hello(hello),
            await registry.shard_hello(hello),
            await registry.shard_hello({**hello, "pid": 11, "address": "tcp://127.0.0.1:3"}),
        ]

    assert asyncio.run(go()) == [["registered"], [], ["restarted", "registered"]]


# -- real daemons -----------------------------------------------------------------------------

TOTAL, NM, EVERY = 600, 2, 5


def _job(name: str, wait_s: float) -> dict[str, Any]:
    return job(
        name,
        model="mlp",
        split=[(["gpu0", "gpu1"], [3, 3])],
        nm=NM,
        minibatches=TOTAL,
        train={"checkpoint_every": EVERY, "shard_wait_s": wait_s},
    )


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """Two workers and two shards on ephemeral ports: a restarted shard gets a new one."""
    c = start_cluster(tmp_path_factory.mktemp("shardloss"), UNIFORM[:2])
    try:
        yield c
    finally:
        c.stop()


async def _kill_mid_job(c: LocalCluster, head: Any, name: str, wait_s: float) -> str:
    """Submit a job and SIGKILL shard 1 once it has a checkpoint and is well under way."""
    job_id = await head.submit(_job(name, wait_s))
    await running_until(
        head,
        job_id,
        lambda i: i.get("checkpoints", 0) >= 1 and i.get("minibatches", 0) >= 60,
        120,
    )
    c.kill("ps1", signal.SIGKILL)
    return job_id


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_killed_shard_restarted_elsewhere_resumes_the_job(cluster: LocalCluster) -> None:
    c = cluster
    c.run(until_whole(c))
    before = c.status()["shards"]["1"]

    async def kill_and_wait() -> tuple[str, dict[str, Any]]:
        async with c.client() as head:
            job_id = await _kill_mid_job(c, head, "paused", 120.0)
            info = await running_until(head, job_id, lambda i: "waiting" in i, 60, every=0.2)
            return job_id, info

    job_id, paused = c.run(kill_and_wait())
    assert paused["state"] == "running"
    waiting = paused["waiting"]
    assert waiting["shards"] == {"1": before} and "shard 1" in waiting["reason"], waiting
    assert waiting["wait_s"] == 120.0 and waiting["since"] <= time.time()
    assert "waiting for shard 1" in job_line(paused)

    c.restart("ps1")  # its supervisor starts it again: port 0, another address

    async def follow() -> dict[str, Any]:
        async with c.client() as head:
            return await head.follow(job_id, every_s=0.2, timeout=180)

    info = c.run(follow())
    assert info["state"] == "done", info.get("error")
    assert info["id"] == job_id  # the same job: nobody resubmitted it
    after = c.status()["shards"]["1"]
    assert after != before, (before, after)
    (pause,) = info["shard_waits"]
    assert pause["lost"] == [1] and pause["shards"]["1"] == after
    assert pause["checkpoint"] is not None and pause["attempt"] == f"{job_id}.r1"
    start = pause["checkpoint_positions"]
    assert start == pause["starts"] and start[0] % (EVERY * NM) == 0
    assert pause["waited_s"] > 0
    assert "waiting" not in info
    # the resumed attempt trained the rest of the job from the checkpoint on
    assert info["positions"] == [TOTAL]
    assert info["minibatches"] == TOTAL - start[0]
    log = (c.run_dir / "logs" / "ps0.log").read_text()
    assert "shard lost: the job waits for it" in log and "shards back: the job resumes" in log


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_shard_nobody_restarts_fails_the_job_after_the_bound(cluster: LocalCluster) -> None:
    c = cluster
    c.run(until_whole(c))
    lost_after = c.cluster.runtime.lost_after_s
    wait_s = 4.0

    async def go() -> tuple[dict[str, Any], float]:
        async with c.client() as head:
            job_id = await _kill_mid_job(c, head, "abandoned", wait_s)
            killed = time.monotonic()
            final = await head.follow(job_id, every_s=0.2, timeout=90)
            return final, time.monotonic() - killed

    try:
        info, seconds = c.run(go())
    finally:
        if not c.alive("ps1"):
            c.restart("ps1")  # the cluster whole again for any later test
    assert info["state"] == "failed"
    error = info["error"]
    assert "\n" not in error
    assert error.startswith("shard 1 (tcp://") and "not registered again within 4 s" in error
    assert "train.shard_wait_s" in error, error
    assert lost_after + wait_s - 1 <= seconds <= lost_after + wait_s + 15, seconds


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_shard_restarted_at_once_still_resumes_the_job(cluster: LocalCluster) -> None:
    """A supervisor may restart the shard before the head has missed it: its hello from a
    new process ends the attempt all the same (the job's state there is gone)."""
    c = cluster
    c.run(until_whole(c))

    async def kill() -> str:
        async with c.client() as head:
            return await _kill_mid_job(c, head, "quick", 120.0)

    job_id = c.run(kill())
    c.restart("ps1")

    async def follow() -> dict[str, Any]:
        async with c.client() as head:
            return await head.follow(job_id, every_s=0.2, timeout=180)

    info = c.run(follow())
    assert info["state"] == "done", info.get("error")
    (pause,) = info["shard_waits"]
    assert pause["checkpoint"] is not None and "shard 1" in pause["reason"], pause
    assert info["positions"] == [TOTAL]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_paused_job_can_be_cancelled(cluster: LocalCluster) -> None:
    c = cluster
    c.run(until_whole(c))

    async def go() -> dict[str, Any]:
        async with c.client() as head:
            job_id = await _kill_mid_job(c, head, "given-up", 120.0)
            await running_until(head, job_id, lambda i: "waiting" in i, 60, every=0.2)
            await head.cancel(job_id)
            return await head.follow(job_id, every_s=0.2, timeout=30)

    try:
        info = c.run(go())
    finally:
        if not c.alive("ps1"):
            c.restart("ps1")
    assert info["state"] == "cancelled" and info["error"] == "cancelled by the user", info
    assert "waiting" not in info
