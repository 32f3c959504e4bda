"""``train.on_worker_loss = "reform"`` on real daemons: a SIGKILLed worker stops only its own
virtual worker; the others never wait for it (:mod:`hetpipe.head.reform`)."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import job, running_until, start_cluster, until_whole
from helpers import check_invariants, records_by_index

from hetpipe.localcluster import DeviceDef, LocalCluster

pytestmark = pytest.mark.slow

SIX = tuple(DeviceDef(f"gpu{i}", "fast", "256MiB", 1.0) for i in range(6))


@pytest.fixture(scope="module")
def six(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """Six uniform devices, two shards: each test restarts the workers it killed."""
    c = start_cluster(tmp_path_factory.mktemp("failover"), SIX)
    yield c
    c.stop()


def _restart_killed(c: LocalCluster) -> None:
    for name in list(c.procs):
        if name.startswith("worker-") and not c.alive(name):
            c.restart(name)


async def _kill_and_watch(
    c: LocalCluster, spec: dict[str, Any], victim: str, at: int, timeout: float = 240
) -> tuple[dict[str, Any], dict[int, float], float]:
    """Submit ``spec``, SIGKILL worker ``victim`` once the job trained ``at`` minibatches,
    follow it to its end; returns its final status, each VW's longest gap between two
    progress reports after the kill (while it still had minibatches to run), and when the
    kill was (monotonic)."""
    async with c.client() as head:
        job_id = await head.submit(spec)
        info = await running_until(head, job_id, lambda i: i.get("minibatches", 0) >= at, 120)
        assert info["state"] == "running", f"{job_id} ended before the kill: {info}"
        c.kill(f"worker-{victim}", signal.SIGKILL)
        killed = time.monotonic()
        last: dict[int, tuple[int, float]] = {}
        gaps: dict[int, float] = {}
        deadline = killed + timeout
        while True:
            info = await head.job(job_id)
            now = time.monotonic()
            if info["state"] not in ("queued", "planning", "running"):
                break
            assert now < deadline, info
            for vw in info.get("vws", []):
                v, done = vw["vw"], vw["done"]
                if v not in last or done != last[v][0]:
                    if v in last and done > last[v][0]:
                        gaps[v] = max(gaps.get(v, 0.0), now - last[v][1])
                    last[v] = (done, now)
                    continue
                finished = info["positions"][v] >= info["total"] // len(info["vws"])
                if not finished:
                    gaps[v] = max(gaps.get(v, 0.0), now - last[v][1])
            await asyncio.sleep(0.1)
        return info, gaps, killed


def _check_wsp(info: dict[str, Any], reform: dict[str, Any], staleness: int, nm: int) -> None:
    """DESIGN.md's WSP invariant over every minibatch of the job: VW 0 and VW 2 as they ran,
    the re-formed VW 1 from its first minibatch on, its waves counted on the shards' clock
    (its own wave c is the shards' offset + c; the smallest offset binds both ways)."""
    records = records_by_index(info)
    offset = min(reform["wave_offsets"])
    new = sorted(
        (r for r in records[(1, 0)] if r["t_fwd"] > reform["detected_at"]), key=lambda r: r["p"]
    )
    assert [r["p"] for r in new] == list(range(len(new))), "the re-formed VW's minibatches"
    assert len(new) == reform["minibatches_left"]
    runs = {k: rows for k, rows in records.items() if k[0] != 1}
    runs[(1, 0)] = [{**r, "wave": r["wave"] + offset} for r in new]
    # its own minibatches count from 0: p - Nm is the row Nm before (check_invariants' rule)
    assert check_invariants(runs, {0: nm, 1: nm, 2: nm}, staleness) > 0


@pytest.mark.timeout(400)
def test_a_killed_worker_stops_only_its_own_virtual_worker(six: LocalCluster) -> None:
    """Three VWs of two devices; SIGKILL one worker of VW 1: VW 0 and VW 2 keep training
    (no gap in their progress near the time a loss takes to detect), VW 1 is re-formed on
    its surviving device from the shards' weights and runs its minibatches to the end, the
    WSP clocks stay consistent, and the job reaches a good accuracy."""
    c = six
    c.run(until_whole(c))
    try:
        split = [(["gpu0", "gpu1"], [3, 3]), (["gpu2", "gpu3"], [3, 3]), (["gpu4", "gpu5"], [3, 3])]
        spec = job("failover", split=split, minibatches=240, nm=2, staleness=4, lr=0.02)
        spec["train"].update(on_worker_loss="reform")
        info, gaps, _ = c.run(_kill_and_watch(c, spec, "gpu3", 60))
        assert info["state"] == "done", info.get("error")
        (reform,) = info["reforms"]
        assert reform["outcome"] == "reformed" and reform["lost"] == ["gpu3"], reform
        assert reform["devices"] == [["gpu2"]], reform
        assert "replans" not in info  # the job's attempt went on: nothing re-planned whole
        assert info["positions"] == [240, 240, 240], info["positions"]
        assert 0 < reform["restart_at"] <= reform["trained_to"], reform
        # what VW 1 pushed before the loss counts once, its re-trained minibatches once
        assert reform["pushed"] == reform["restart_at"], reform
        assert info["minibatches"] == info["total"] == 3 * 240, info
        # the re-formed VW's clock restarted at the global clock: its offset is past its
        # own waves before the loss, and every shard ends with every VW at its last wave
        assert all(o >= reform["restart_at"] // 2 for o in reform["wave_offsets"]), reform
        for clocks in info["shard_clocks"].values():
            assert sorted(clocks["done"]) == [0, 1, 2], clocks
        _check_wsp(info, reform, staleness=4, nm=2)
        lost_after = c.cluster.runtime.lost_after_s
        others = max(gaps.get(0, 0.0), gaps.get(2, 0.0))
        print(f"others' longest gap {others:.2f} s, lost_after_s {lost_after}, {reform}")
        assert others < lost_after + 2.0, gaps  # measured on a loaded host: generous
        assert reform["started_s"] < 10.0 + lost_after, reform
        assert info["test_accuracy"] >= 0.8, info["test_accuracy"]
    finally:
        _restart_killed(c)


@pytest.mark.timeout(400)
def test_a_vw_whose_survivors_cannot_hold_the_model_is_left_out(six: LocalCluster) -> None:
    """A VW of one device loses it: nothing survives to hold the model, so the VW is left
    out, the job finishes with the others, and its status names the lost worker."""
    c = six
    c.run(until_whole(c))
    try:
        split = [(["gpu0", "gpu1"], [3, 3]), (["gpu2"], [6])]
        spec = job("leftout", split=split, minibatches=200, nm=2, staleness=2, lr=0.02)
        spec["train"].update(on_worker_loss="reform")
        info, _, _ = c.run(_kill_and_watch(c, spec, "gpu2", 40))
        assert info["state"] == "done", info.get("error")
        (reform,) = info["reforms"]
        assert reform["outcome"] == "dropped", reform
        assert "gpu2" in reform["why"] and "left out" in reform["why"], reform
        assert info["positions"][0] == 200
        # the job trained VW 0's minibatches and what VW 1 pushed before it was left out
        assert reform["pushed"] == reform["restart_at"], reform
        assert info["minibatches"] == 200 + reform["pushed"], info
    finally:
        _restart_killed(c)


@pytest.mark.timeout(300)
def test_a_one_vw_job_with_no_survivor_fails_naming_the_worker(six: LocalCluster) -> None:
    """The only VW, on one device, is lost: the job fails with one line naming it."""
    c = six
    c.run(until_whole(c))
    try:
        # far more minibatches than it can run before the loss is detected: the job can
        # only end by failing, however fast the host
        spec = job("alone", split=[(["gpu4"], [6])], minibatches=100_000, nm=2, lr=0.05)
        spec["train"].update(on_worker_loss="reform")
        info, _, _ = c.run(_kill_and_watch(c, spec, "gpu4", 20))
        assert info["state"] == "failed", info
        assert "worker gpu4 lost" in info["error"] and "cannot hold" in info["error"], info
    finally:
        _restart_killed(c)


@pytest.mark.timeout(400)
def test_a_worker_lost_at_a_migration_ends_reformed_or_failed_naming_it(
    six: LocalCluster,
) -> None:
    """VW 1 migrates layers at minibatch 40; its second stage's worker is SIGKILLed as the
    VW reaches that boundary: the migration's meeting is given up with the VW, which is
    re-formed (or the job fails naming the worker); nothing hangs."""
    c = six
    c.run(until_whole(c))
    try:
        split = [(["gpu0", "gpu1"], [3, 3]), (["gpu2", "gpu3"], [3, 3])]
        spec = job("migrating", split=split, minibatches=200, nm=2, staleness=2, lr=0.02)
        spec["train"].update(on_worker_loss="reform")
        spec["replan"] = {"migrate_at": 40, "migrate_to": [2, 4], "migrate_vw": 1}

        async def go() -> dict[str, Any]:
            async with c.client() as head:
                job_id = await head.submit(spec)
                await running_until(
                    head,
                    job_id,
                    lambda i: len(i.get("vws", [])) > 1 and i["vws"][1]["done"] >= 36,
                    120,
                )
                c.kill("worker-gpu3", signal.SIGKILL)
                return await head.follow(job_id, every_s=0.2, timeout=240)

        info = c.run(go())
        if info["state"] == "done":
            (reform,) = info["reforms"]
            assert reform["outcome"] == "reformed" and reform["lost"] == ["gpu3"], reform
            assert info["positions"] == [200, 200], info["positions"]
        else:
            assert info["state"] == "failed" and "gpu3" in info["error"], info
    finally:
        _restart_killed(c)
