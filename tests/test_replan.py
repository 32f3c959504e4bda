"""``train.on_worker_loss = "replan"``: a job goes on without a worker that died."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import UNIFORM, job, running_until, start_cluster, until_whole

from hetpipe.localcluster import LocalCluster

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def replan_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """Four devices, two shards, shared by the parameters: each test starts the worker it
    killed again, and the next waits until the cluster is whole (a cluster per test spent
    its start-up and the model's profiling again)."""
    c = start_cluster(tmp_path_factory.mktemp("replan"), UNIFORM)
    yield c
    c.stop()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("every", [0, 5])
def test_a_job_goes_on_without_a_killed_worker(replan_cluster: LocalCluster, every: int) -> None:
    """SIGKILL one worker of a 4-device job: the head re-plans on the 3 others, starts them
    from the job's last checkpoint (``every`` > 0: the shards' cut, each stage's optimizer
    state put together per parameter, the data position; the work since it is reported
    lost) or, without checkpoints, from the shards' global weights, and the job finishes
    with a good accuracy."""
    c = replan_cluster
    c.run(until_whole(c))
    try:
        spec = job("keepgoing", model="cnn", minibatches=300, nm=4, lr=0.05)
        # Batch-norm statistics re-estimated before the evaluation: those accumulated while
        # training lag the pipeline's moving weights, and after a re-plan more so. Measured
        # with two busy loops beside it, statistics as trained: 61 runs, 7 below 0.92 (0.817
        # and 0.842 among them, the latter a CI failure; 12 runs were of the code before the
        # mapped shared-memory files, and had the 0.817); 12 runs of the same job without the
        # kill all >= 0.95. Re-estimated over 20 minibatches: 32 runs, all >= 0.936.
        spec["train"].update(
            vws=1, on_worker_loss="replan", checkpoint_every=every, bn_recalibrate=20
        )

        async def go() -> tuple[dict[str, Any], str, float]:
            async with c.client() as head:
                job_id = await head.submit(spec)
                info = await running_until(
                    head, job_id, lambda i: i.get("minibatches", 0) >= 60, 120, every=0.2
                )
                devices = info["vws"][0]["devices"]
                assert len(devices) == 4, devices
                victim = devices[1]
                c.kill(f"worker-{victim}", signal.SIGKILL)
                killed = time.monotonic()
                while True:  # training again: the new attempt's stages report progress
                    now = await head.job(job_id)
                    if (
                        now.get("replans")
                        and now["state"] == "running"
                        and now.get("minibatches", 0) > 0
                    ):
                        break
                    assert now["state"] == "running", now.get("error")
                    assert time.monotonic() - killed < 60, now
                    await asyncio.sleep(0.1)
                back = time.monotonic() - killed
                final = await head.follow(job_id, every_s=0.2, timeout=180)
                return final, victim, back

        info, victim, back = c.run(go())
        assert info["state"] == "done", info.get("error")
        (replan,) = info["replans"]
        assert replan["lost"] == victim
        devices = {d for vw in replan["vws"] for d in vw}
        assert victim not in devices and len(devices) == 3, replan
        assert info["test_accuracy"] >= 0.85, info["test_accuracy"]
        assert info["positions"] == [300]
        if every:  # restored from the last checkpoint: at most its interval is done again
            assert replan["checkpoint"] is not None
            assert replan["starts"] == replan["checkpoint_positions"]
            assert replan["starts"][0] % (every * 4) == 0
            assert 0 <= replan["lost_minibatches"][0] <= (every + 1) * 4, replan
        else:
            assert replan["checkpoint"] is None
        lost_after = c.cluster.runtime.lost_after_s
        print(
            f"kill -> training again: {back:.1f} s (lost_after_s {lost_after:g}), "
            f"re-plan {replan['planned_s']} s, {replan}"
        )
        assert back < lost_after + 15.0, back
    finally:  # the next test runs on all four again
        for name in list(c.procs):
            if name.startswith("worker-") and not c.alive(name):
                c.restart(name)
