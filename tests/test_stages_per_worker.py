"""Several stages per worker: a device named several times in a ``[[vw]]`` runs each of those
stages in its one worker process (``train.several_stages``), on real daemons."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import assert_same_weights, job, running_until, start_cluster, until_whole
from helpers import plain_training, stage_records, stages_json

from hetpipe import checkpoint
from hetpipe.localcluster import DeviceDef, LocalCluster

pytestmark = pytest.mark.slow

DEVICES = (
    DeviceDef("a", "fast", "256MiB", 1.0),
    DeviceDef("b", "fast", "256MiB", 1.0),
    DeviceDef("c", "fast", "256MiB", 1.0),
    DeviceDef("d", "fast", "256MiB", 1.0),
    DeviceDef("half", "slow", "256MiB", 0.5),
    DeviceDef("small", "small", "1536KiB", 1.0),
)
FOUR_ON_A = [(["a", "a", "a", "a"], [1, 2, 2, 1])]
ABAB = [(["a", "b", "a", "b"], [1, 2, 2, 1])]
ABBA = [(["a", "b", "b", "a"], [1, 2, 2, 1])]  # a V: the first and last stage on one device


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = start_cluster(tmp_path_factory.mktemp("stages"), DEVICES)
    yield c
    c.stop()


def several(name: str, split: list, **kw: Any) -> dict[str, Any]:
    """A job of the builtin mlp on ``split`` whose devices may run several stages."""
    train = {"several_stages": True, **kw.pop("train", {})}
    return job(name, model="mlp", split=split, train=train, **kw)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("split", [FOUR_ON_A, ABAB], ids=["four-on-one", "abab"])
def test_async_nm1_is_transparent(cluster: LocalCluster, split: list) -> None:
    """Nm = 1: the weights of plain PyTorch training after 40 minibatches, within 1e-5."""
    spec = several(f"async-{len(set(split[0][0]))}", split, nm=1, minibatches=40)
    info = cluster.submit(spec, timeout=200)
    assert info["state"] == "done", info.get("error")
    assert_same_weights(torch.load(info["model_path"]), plain_training(spec, 40))
    stages = stages_json(info)
    assert sorted(stages) == [f"vw0/stage{s}" for s in range(4)]  # every stage reported
    assert all(st["stats"]["done"] == 40 for st in stages.values())


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", ["1f1b", "gpipe", "zb-h1"])
@pytest.mark.parametrize(
    "split",
    [FOUR_ON_A, ABAB, ABBA, [*ABAB, (["c", "d", "c", "d"], [1, 2, 2, 1])]],
    ids=["four-on-one", "abab", "abba", "two-vws-abab-cdcd"],
)
def test_sync_is_transparent(cluster: LocalCluster, kind: str, split: list) -> None:
    """Synchronous, M = 4 (zb-h1: the backward split, its input gradient handed over before
    its weight gradient runs): minibatch SGD on each iteration's union, within 1e-5."""
    m, iterations = 4, 8
    spec = several(
        f"sync-{kind}", split, nm=m, minibatches=m * iterations, train={"schedule": kind}
    )
    info = cluster.submit(spec, timeout=200)
    assert info["state"] == "done", info.get("error")
    assert_same_weights(
        torch.load(info["model_path"]), plain_training(spec, iterations, m=m, vws=len(split))
    )


@pytest.mark.timeout(300)
@pytest.mark.parametrize("split", [FOUR_ON_A, ABAB], ids=["four-on-one", "abab"])
def test_async_nm2_stashes_weights(cluster: LocalCluster, split: list) -> None:
    """Nm = 2 (no plain reference: weights are stale by design, in an order timing picks):
    every stage runs every minibatch, and each backward differentiates exactly the weights
    its forward used (train.verify's fingerprints), as on one stage per device."""
    spec = several(f"async-nm2-{len(set(split[0][0]))}", split, nm=2, minibatches=40)
    spec["train"]["verify"] = True
    info = cluster.submit(spec, timeout=200)
    assert info["state"] == "done", info.get("error")
    records = stage_records(info)
    assert sorted(records) == [f"vw0/stage{s}" for s in range(4)]
    for where, rows in records.items():
        assert [r["p"] for r in rows] == list(range(40)), where
        for r in rows:
            if where != "vw0/stage0":  # its one layer (Flatten) has no weights
                assert r["fwd_fingerprint"] != 0.0, (where, r["p"])
            assert r["bwd_fingerprint"] == r["fwd_fingerprint"], (where, r["p"])


@pytest.mark.timeout(240)
def test_stages_share_their_devices_speed(cluster: LocalCluster) -> None:
    """Two stages on a half-speed device compute one after the other on its one compute
    thread, each padded to half speed: with Nm = 4 they could overlap, yet their compute
    times add up within the job's training time (two stages that each slept out their own
    pad side by side would take the device twice over)."""
    spec = several("speed", [(["half", "half"], [3, 3])], nm=4, minibatches=40)
    info = cluster.submit(spec, timeout=200)
    assert info["state"] == "done", info.get("error")
    stats = [s["stats"] for s in stages_json(info).values()]
    assert len(stats) == 2 and all(s["forward_s"] > 0 and s["backward_s"] > 0 for s in stats)
    compute = sum(s["forward_s"] + s["backward_s"] for s in stats)
    assert compute <= info["seconds"], (compute, info["seconds"])


@pytest.mark.timeout(120)
def test_memory_cap_holds_for_the_stages_together(cluster: LocalCluster) -> None:
    """Each stage fits the 1.5 MiB device alone; together they do not: the job is refused
    before it starts, with one line naming the device, the stages' predicted peaks and the
    cap (the run-time count of the stages together is the unit tests')."""
    spec = several("too-much", [(["small"] * 4, [1, 2, 2, 1])], nm=1, minibatches=10)
    info = cluster.submit(spec, timeout=100)
    assert info["state"] == "failed"
    error = info["error"]
    assert "device small: its 4 stages need" in error, error
    assert "together > memory cap 1.5MiB (predicted peaks: vw0/stage0 " in error, error
    assert "\n" not in error
    # and the device is free for the next job
    ok = cluster.submit(several("after", FOUR_ON_A, minibatches=10), timeout=100)
    assert ok["state"] == "done", ok.get("error")


@pytest.mark.timeout(300)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
def test_four_stages_on_one_gpu_in_one_worker(tmp_path) -> None:
    """Four stages on cuda:0 in one worker, each on its own CUDA stream, tensors handed over
    in process: the weights of plain (CPU) training within 1e-4 (GPU kernels reduce in
    another order than the CPU's), under async Nm = 1 and synchronous 1f1b."""
    c = start_cluster(tmp_path, (DeviceDef("gpu0", "cuda", "8GiB", 1.0, "cuda:0"),))
    try:
        for name, kw, steps, m in (
            ("cuda-async", {"nm": 1, "minibatches": 50}, 50, 1),
            ("cuda-1f1b", {"nm": 4, "minibatches": 40, "train": {"schedule": "1f1b"}}, 10, 4),
        ):
            spec = several(name, [(["gpu0"] * 4, [1, 2, 2, 1])], **kw)
            info = c.submit(spec, timeout=250)
            assert info["state"] == "done", info.get("error")
            got = torch.load(info["model_path"], map_location="cpu")
            for n, w in plain_training(spec, steps, m=m).items():
                assert (got[n] - w).abs().max().item() <= 1e-4, (name, n)
    finally:
        c.stop()


@pytest.mark.timeout(400)
def test_a_lost_device_loses_all_its_stages_and_the_job_resumes(cluster: LocalCluster) -> None:
    """The worker running stages 0 and 2 is killed: the job fails with one line naming it
    (its stages go with it); restarted, ``submit --resume`` goes on from the last checkpoint,
    which holds every stage's state, and finishes."""
    total = 600
    spec = several("lost", ABAB, nm=2, minibatches=total, train={"checkpoint_every": 20})

    async def kill_after_a_checkpoint() -> tuple[str, dict[str, Any]]:
        async with cluster.client() as head:
            job_id = await head.submit(spec)
            info = await running_until(
                head,
                job_id,
                lambda i: i.get("checkpoints", 0) >= 1 and i.get("minibatches", 0) >= 100,
                120,
            )
            assert info["minibatches"] < total, "the job ended before the kill"
            cluster.kill("worker-a", signal.SIGKILL)
            return job_id, await head.follow(job_id, timeout=120)

    try:
        job_id, info = cluster.run(kill_after_a_checkpoint())
        assert info["state"] == "failed", info
        assert "worker a " in info["error"] and "lost" in info["error"], info["error"]
    finally:
        cluster.restart("worker-a")
    cluster.run(until_whole(cluster))

    async def resume() -> dict[str, Any]:
        async with cluster.client() as head:
            return await head.follow(await head.submit(None, resume=job_id), timeout=300)

    info = cluster.run(resume())
    assert info["state"] == "done", info.get("error")
    ck = checkpoint.verify(Path(info["resumed_from"]["checkpoint"]))
    # every stage that holds state (stage 0, a Flatten, holds none: no file, as on four devices)
    assert sorted(ck.stages) == [checkpoint.stage_file(0, s) for s in (1, 2, 3)]
    assert info["positions"] == [total]


@pytest.mark.timeout(240)
def test_a_checkpoint_now_takes_every_stage_of_a_device(cluster: LocalCluster) -> None:
    """``hetpipe checkpoint`` of a running job whose devices run two stages each: the
    checkpoint is written with every stage's state, and the job goes on to its end."""
    spec = several("now", ABAB, nm=2, minibatches=400, train={"checkpoint_every": 0})

    async def ask() -> tuple[list[str], dict[str, Any]]:
        async with cluster.client() as head:
            job_id = await head.submit(spec)
            await running_until(head, job_id, lambda i: i.get("minibatches", 0) >= 20, 120)
            taken = await head.checkpoint(job_id, wait=True, timeout=120)
            stages = sorted(checkpoint.verify(Path(taken["path"])).stages)
            return stages, await head.follow(job_id, timeout=200)

    stages, info = cluster.run(ask())
    assert info["state"] == "done", info.get("error")
    assert stages == [checkpoint.stage_file(0, s) for s in (1, 2, 3)]
