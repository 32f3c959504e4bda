"""Checkpoints after a re-form, on real daemons: a two-VW asynchronous job whose worker is
SIGKILLed re-forms that VW (``train.on_worker_loss = "reform"``) and goes on writing its
periodic and on-demand checkpoints; resumed from one (``submit --resume``, or by itself after a
lost shard came back), it trains every VW's rest once (:mod:`hetpipe.head.reform`,
:mod:`hetpipe.head.cuts`)."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import job, running_until, start_cluster, until_whole

from hetpipe import checkpoint
from hetpipe.localcluster import DeviceDef, LocalCluster

pytestmark = pytest.mark.slow

FOUR = tuple(DeviceDef(f"gpu{i}", "fast", "256MiB", 1.0) for i in range(4))
TOTAL, NM, EVERY = 600, 2, 4


@pytest.fixture(scope="module")
def four(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """Four uniform devices, two shards: each test restarts the daemons it killed."""
    c = start_cluster(tmp_path_factory.mktemp("reformcuts"), FOUR)
    yield c
    c.stop()


def _restart_killed(c: LocalCluster) -> None:
    for name in list(c.procs):
        if (name.startswith("worker-") or name.startswith("ps")) and not c.alive(name):
            c.restart(name)


def _spec(name: str, **train: Any) -> dict[str, Any]:
    split = [(["gpu0", "gpu1"], [3, 3]), (["gpu2", "gpu3"], [3, 3])]
    spec = job(name, split=split, minibatches=TOTAL, nm=NM, staleness=2, lr=0.02)
    spec["train"].update(on_worker_loss="reform", checkpoint_every=EVERY, **train)
    return spec


def _reformed_and_cut(info: dict[str, Any]) -> bool:
    """VW 1 re-formed, and a checkpoint written past its base (the first wave it trains)."""
    reforms = info.get("reforms") or []
    cut = info.get("last_checkpoint") or {}
    return bool(
        reforms
        and reforms[0].get("outcome") == "reformed"
        and "wave_base" in reforms[0]
        and int(cut.get("wave", 0)) > int(reforms[0]["wave_base"])
    )


async def _kill_then_cut(c: LocalCluster, head: Any, spec: dict[str, Any]) -> dict[str, Any]:
    """Submit ``spec``, SIGKILL gpu3 (VW 1's second stage) once the job trained 40
    minibatches; the job's status once a checkpoint past VW 1's re-form is written."""
    job_id = await head.submit(spec)
    await running_until(head, job_id, lambda i: i.get("minibatches", 0) >= 40, 120)
    c.kill("worker-gpu3", signal.SIGKILL)
    return await running_until(head, job_id, _reformed_and_cut, 120, every=0.05)


def _check_cut(ck: checkpoint.Checkpoint, reform: dict[str, Any]) -> None:
    """A checkpoint past the re-form is one cut of both VWs: the shards applied exactly
    the waves before it of every stage, VW 0 is at its own wave, the re-formed VW 1 at its
    restart position plus its own waves since its base."""
    wave, base = int(ck.meta["wave"]), int(reform["wave_base"])
    assert wave > base, (wave, reform)
    for shard in ck.meta["applied"].values():
        assert all(waves == [[0, wave]] for waves in shard.values()), shard
    assert ck.meta["bases"] == [0, base]
    assert ck.meta["positions"] == [wave * NM, reform["restart_at"] + (wave - base) * NM]
    assert sorted(ck.stages) == [checkpoint.stage_file(v, s) for v, s in ((0, 0), (0, 1), (1, 0))]
    assert ck.meta["stages"][checkpoint.stage_file(1, 0)]["meta"]["wave"] == wave - base


@pytest.mark.timeout(400)
def test_a_re_formed_job_checkpoints_on_and_resumes_from_a_later_cut(four: LocalCluster) -> None:
    """After VW 1's re-form the job writes its periodic checkpoints and takes one on demand;
    cancelled and resumed from its last one, it trains each VW's rest once, from its own
    place in the data."""
    c = four
    c.run(until_whole(c))
    try:

        async def go() -> tuple[str, dict[str, Any], dict[str, Any]]:
            async with c.client() as head:
                info = await _kill_then_cut(c, head, _spec("recut"))
                got = await head.checkpoint(info["id"], wait=True, timeout=120)
                await head.cancel(info["id"])
                stopped = await head.follow(info["id"], every_s=0.1, timeout=60)
                return info["id"], got, stopped

        job_id, got, stopped = c.run(go())
        assert stopped["state"] == "cancelled", stopped.get("error")
        (reform,) = stopped["reforms"]
        assert reform["outcome"] == "reformed" and reform["devices"] == [["gpu2"]], reform
        assert reform["wave_offsets"] == [reform["wave_base"]] * 2, reform  # one count
        asked = checkpoint.verify(Path(got["path"]))
        assert int(asked.meta["wave"]) >= got["wave"] > reform["wave_base"], (got, reform)
        _check_cut(asked, reform)
        ck = checkpoint.latest(c.run_dir / "jobs" / job_id)
        assert ck is not None
        _check_cut(ck, reform)
        positions = ck.meta["positions"]
        _restart_killed(c)  # the job file places VW 1 on gpu3 too
        c.run(until_whole(c))

        async def resume() -> dict[str, Any]:
            async with c.client() as head:
                new_id = await head.submit(None, resume=job_id)
                return await head.follow(new_id, every_s=0.2, timeout=240)

        info = c.run(resume())
        assert info["state"] == "done", info.get("error")
        assert info["resumed_from"]["positions"] == positions
        assert info["positions"] == [TOTAL, TOTAL], info["positions"]
        # VW 1 runs the job file's split again: its stages take their weights from the
        # cut and the optimizer state of each of their parameters from its one stage there
        assert [s["device"] for s in info["stages"] if s["vw"] == 1] == ["gpu2", "gpu3"]
        # each VW's rest, once: from its own place at the cut
        assert info["minibatches"] == info["total"] == 2 * TOTAL - sum(positions), info
    finally:
        _restart_killed(c)


@pytest.mark.timeout(400)
def test_a_shard_lost_after_a_re_form_resumes_from_a_cut_past_it(four: LocalCluster) -> None:
    """A shard lost after VW 1's re-form pauses the job, which resumes by itself from the
    checkpoint written after the re-form, not from its start: each VW from its own place."""
    c = four
    c.run(until_whole(c))
    try:

        async def go() -> tuple[dict[str, Any], dict[str, Any]]:
            async with c.client() as head:
                cut = await _kill_then_cut(c, head, _spec("recut-shard", shard_wait_s=120.0))
                c.kill("ps1", signal.SIGKILL)
                await running_until(head, cut["id"], lambda i: "waiting" in i, 60, every=0.1)
                c.restart("ps1")
                return cut, await head.follow(cut["id"], every_s=0.2, timeout=240)

        cut, info = c.run(go())
        assert info["state"] == "done", info.get("error")
        (reform,) = info["reforms"]
        (pause,) = info["shard_waits"]
        start = pause["checkpoint_positions"]
        assert pause["checkpoint"] is not None and start == pause["starts"], pause
        # a cut past the re-form (the checkpoint itself gave way to the resumed attempt's):
        # VW 0 at its wave, VW 1 at its restart position plus its own waves since its base
        wave, base = start[0] // NM, int(reform["wave_base"])
        assert wave >= int(cut["last_checkpoint"]["wave"]) > base, (start, cut, reform)
        assert start == [wave * NM, reform["restart_at"] + (wave - base) * NM], (start, reform)
        assert info["positions"] == [TOTAL, TOTAL], info["positions"]
        # the resumed attempt trained each VW's rest from the checkpoint on (what VW 1 had
        # pushed before its re-form is in the checkpoint's positions, not counted again)
        assert info["minibatches"] == info["total"] == 2 * TOTAL - sum(start), info
    finally:
        _restart_killed(c)
