"""``hetpipe checkpoint JOB``: a cut asked for on demand, between (or without) the periodic
ones: the cut points, the shards' and the stages' consent, the wait, the Slurm time-limit
handler that uses it, and a real job without ``checkpoint_every`` checkpointed, stopped and
resumed to the uninterrupted job's weights."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner, Result
from conftest import UNIFORM, assert_same_weights, job, running_until

from hetpipe import checkpoint, cli, launch
from hetpipe.client import checkpoint_reached
from hetpipe.head.cuts import propose_cut, ready_cuts
from hetpipe.jobplan import JobPlan
from hetpipe.localcluster import LocalCluster, cluster_toml
from hetpipe.shard import ShardStore

# -- pure parts ------------------------------------------------------------------------------


def test_cut_points_with_cuts_asked_for() -> None:
    """An asked cut sits between the periodic ones; without periodic cuts it is the only one
    (no cut at the end then); one past the last wave is none."""
    assert checkpoint.cut_after(0, 0, 10, {4}) == 4
    assert checkpoint.cut_after(4, 0, 10, {4}) is None
    assert checkpoint.cut_after(0, 5, 12, {3}) == 3
    assert checkpoint.cut_after(3, 5, 12, {3}) == 5
    assert checkpoint.cut_after(10, 5, 12, {11}) == 11
    assert checkpoint.cut_after(0, 0, 10, {11}) is None
    assert checkpoint.is_cut(4, 0, 10, {4}) and not checkpoint.is_cut(10, 0, 10, {4})
    assert checkpoint.is_cut(10, 5, 12) and checkpoint.is_cut(12, 5, 12)
    assert not checkpoint.is_cut(11, 0, 10, {11})


def test_the_proposed_cut_is_past_what_every_first_stage_admitted() -> None:
    plan = JobPlan.__new__(JobPlan)
    object.__setattr__(plan, "vws", [_VW(2), _VW(1)])
    assert propose_cut(plan, [0, 0]) == 1
    assert propose_cut(plan, [5, 2]) == 4  # VW 0 admitted into wave 2 (of Nm = 2)
    assert propose_cut(plan, [5, 2], at_least=9) == 9


class _VW:
    def __init__(self, nm: int) -> None:
        self.nm = nm


def test_a_shard_keeps_an_asked_cut_only_before_any_push_of_its_wave() -> None:
    """A cut takes the weights before any push of its wave lands: asked for in time, it holds
    exactly the waves before it; asked too late, the shard names the earliest it could."""
    store: ShardStore[Any] = ShardStore()
    members = {"0": {"waves": 6, "stages": {"0": ["w"]}}, "1": {"waves": 6, "stages": {"0": ["w"]}}}
    js = store.init("j", members, 1, {"w": torch.zeros(1)})  # no periodic cuts

    def push(vw: int, wave: int) -> None:
        assert js.push(vw, 0, wave, {"w": torch.tensor([10.0**vw * (wave + 1)])})

    push(0, 0)
    push(0, 1)
    push(1, 0)
    assert js.ask_cut(1) == 2  # VW 0's wave 1 is in: cut 1 cannot be had any more
    assert js.ask_cut(3) is None
    push(0, 2)
    push(0, 3)  # past the cut: it keeps the weights before this push
    assert js.cut(3) is None  # VW 1 has not pushed waves 1 and 2 yet
    push(1, 1)
    push(1, 2)
    weights, info = js.cut(3)  # type: ignore[misc]
    assert float(weights["w"]) == 1 + 2 + 3 + 10 + 20 + 30
    assert info["applied"] == {"0/0": [[0, 3]], "1/0": [[0, 3]]}
    with pytest.raises(ValueError, match="no wave 9"):
        js.ask_cut(9)


def test_an_asked_cut_whose_pushes_are_all_in_is_complete_at_once() -> None:
    store: ShardStore[Any] = ShardStore()
    js = store.init("j", {"0": {"waves": 4, "stages": {"0": ["w"]}}}, 0, {"w": torch.zeros(1)})
    js.push(0, 0, 0, {"w": torch.ones(1)})
    assert js.ask_cut(1) is None
    weights, info = js.cut(1)  # type: ignore[misc]
    assert float(weights["w"]) == 1 and info["applied"] == {"0/0": [[0, 1]]}


def test_the_head_takes_an_asked_cut_between_the_periodic_ones() -> None:
    plan = _Plan([4, 4])
    states: dict[tuple[int, int], dict[int, Any]] = {
        (0, 0): {3: ({"wave": 3}, {})},
        (1, 0): {3: ({"wave": 3}, {})},
    }
    cuts, nxt = ready_cuts(plan, states, 3, 0, {3})  # type: ignore[arg-type]
    assert [c for c, _ in cuts] == [3] and nxt is None
    cuts, nxt = ready_cuts(plan, {}, 2, 2, {3})  # type: ignore[arg-type]
    assert cuts == [] and nxt == 2


class _Plan:
    """What :func:`ready_cuts` reads of a plan: one stage per VW, holding ``w``."""

    def __init__(self, waves: list[int]) -> None:
        self.counts = waves
        self.vws = [_VW(1) for _ in waves]
        for vw in self.vws:
            vw.stages = [None]  # type: ignore[attr-defined]

    def waves(self, v: int) -> int:
        return self.counts[v]

    def stage_names(self, v: int, s: int) -> list[str]:
        return ["w"]


def test_waiting_for_the_checkpoint_of_a_wave() -> None:
    running = {"state": "running", "last_checkpoint": {"wave": 3}}
    assert checkpoint_reached("j", running, 3) == (True, None)
    assert checkpoint_reached("j", running, 4) == (False, None)
    assert checkpoint_reached("j", {"state": "running"}, 1) == (False, None)
    done, why = checkpoint_reached("j", {"state": "done", "last_checkpoint": None}, 4)
    assert not done and why == "checkpoint: job j ended (done) before its checkpoint at wave 4"


def test_the_time_limit_asks_each_running_job_for_a_checkpoint_then_waits() -> None:
    """The Slurm time-limit handler asks every running job for a checkpoint now (a job
    without checkpoint_every has no periodic one to wait for), then waits for the count."""
    views = [
        {"jobs": [{"id": "a", "state": "running", "checkpoints": 0}]},
        {"jobs": [{"id": "a", "state": "running", "checkpoints": 0}]},
        {
            "jobs": [
                {"id": "a", "state": "running", "checkpoints": 1, "last_checkpoint": {"wave": 7}}
            ]
        },
    ]
    asked: list[str] = []
    said: list[str] = []
    t = [0.0]

    def ask(job_id: str) -> str | None:
        asked.append(job_id)
        return None

    done = launch.checkpoint_before_limit(
        lambda: views.pop(0) if len(views) > 1 else views[0],
        100.0,
        ask=ask,
        clock=lambda: t[0],
        sleep=lambda s: t.__setitem__(0, t[0] + s),
        say=said.append,
    )
    assert asked == ["a"] and done == {"a": True}
    assert said[-1] == "hetpipe: checkpoint before the time limit: a at wave 7"


def test_the_time_limit_says_why_a_job_could_not_be_asked() -> None:
    said: list[str] = []
    t = [0.0]
    done = launch.checkpoint_before_limit(
        lambda: {"jobs": [{"id": "a", "state": "running", "checkpoints": 0}]},
        3.0,
        ask=lambda j: f"checkpoint: job {j} ends (wave 9) before a cut can be taken",
        clock=lambda: t[0],
        sleep=lambda s: t.__setitem__(0, t[0] + s),
        say=said.append,
    )
    assert done == {"a": False}
    assert "hetpipe: checkpoint: job a ends (wave 9) before a cut can be taken" in said


# -- the real thing --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    root = tmp_path_factory.mktemp("cutnow")
    path = root / "cluster.toml"
    path.write_text(cluster_toml(UNIFORM, shards=2))
    with LocalCluster(path, root / "run", timeout=60) as c:
        yield c


def invoke(c: LocalCluster, *args: str) -> Result:
    env = {"HETPIPE_CLUSTER": None, "HETPIPE_RUN_DIR": None, "HETPIPE_HEAD": None}
    return CliRunner().invoke(
        cli.main,
        ["--cluster", c.cluster_path, "--run-dir", str(c.run_dir), "--head", c.head, *args],
        env=env,
    )


TOTAL, NM = 400, 2
GUARD_S = 30.0  # the stall that keeps a job from ending before the test cancels it


def _guarded(spec: dict[str, Any], vws: int, stages: int, each: int) -> dict[str, Any]:
    """``spec`` with each VW's last stage stalled ``GUARD_S`` seconds a few minibatches
    before its end (``each``: the minibatches a VW trains). On a busy machine the job would
    otherwise end between its checkpoint and the cancel that stops it. A job cancelled in
    time never reaches the stall; the resumed job and the uninterrupted one run without it."""
    stall = {"stage": stages - 1, "minibatch": each - 8, "seconds": GUARD_S}
    return {**spec, "fault": [{"vw": v, **stall} for v in range(vws)]}


def _sync_job(name: str) -> dict[str, Any]:
    """A synchronous job of two stages without periodic checkpoints (checkpoint_every = 0)."""
    return job(
        name,
        split=[(["gpu0", "gpu1"], [3, 3])],
        nm=NM,
        minibatches=TOTAL,
        train={"schedule": "1f1b", "checkpoint_every": 0},
    )


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_job_without_periodic_cuts_checkpointed_now_resumes_to_the_same_weights(
    cluster: LocalCluster,
) -> None:
    """``hetpipe checkpoint JOB --wait`` on a job without checkpoint_every: a checkpoint at
    the wave it names, whole (every stage, the shards' cut of that wave); the job stopped
    and resumed from it ends with the uninterrupted job's weights (<= 1e-6)."""
    spec = _sync_job("cutnow-sync")

    async def started() -> str:
        async with cluster.client() as head:
            job_id = await head.submit(_guarded(spec, 1, 2, TOTAL))
            await running_until(
                head, job_id, lambda i: min(i.get("positions") or [0]) >= 4, 120, every=0.02
            )
            return job_id

    job_id = cluster.run(started())
    out = invoke(cluster, "checkpoint", job_id, "--wait", "--timeout", "120")
    assert out.exit_code == 0, out.output
    wave = int(out.output.split(" at wave ")[1].split(":")[0])
    assert 0 < wave < TOTAL // NM, out.output

    async def stop_then_resume() -> tuple[dict[str, Any], dict[str, Any]]:
        async with cluster.client() as head:
            await head.cancel(job_id)
            stopped = await head.follow(job_id, every_s=0.1, timeout=60)
            assert stopped["state"] == "cancelled", stopped.get("error")
            new_id = await head.submit(spec, resume=job_id)
            return stopped, await head.follow(new_id, every_s=0.2, timeout=200)

    stopped, info = cluster.run(stop_then_resume())
    assert stopped["checkpoints"] >= 1 and stopped["last_checkpoint"]["wave"] == wave, stopped
    ck = checkpoint.verify(Path(stopped["last_checkpoint"]["path"]))
    assert ck.meta["wave"] == wave and ck.meta["positions"] == [wave * NM]
    for shard in ck.meta["applied"].values():
        assert all(waves == [[0, wave]] for waves in shard.values()), shard
    assert sorted(ck.stages) == [checkpoint.stage_file(0, s) for s in (0, 1)]
    assert info["state"] == "done", info.get("error")
    assert info["resumed_from"]["positions"] == [wave * NM]
    whole = cluster.submit(_sync_job("cutnow-whole"), timeout=200)
    assert whole["state"] == "done", whole.get("error")
    assert_same_weights(torch.load(info["model_path"]), torch.load(whole["model_path"]), tol=1e-6)

    # the error cases, one line each
    unknown = invoke(cluster, "checkpoint", "no-such-job")
    (line,) = unknown.output.strip().splitlines()
    assert unknown.exit_code == 1 and line.endswith("checkpoint: no job 'no-such-job'"), line
    ended = invoke(cluster, "checkpoint", whole["id"])
    (line,) = ended.output.strip().splitlines()
    assert ended.exit_code == 1
    assert line.endswith(f"checkpoint: job {whole['id']} is not running (done)"), line


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_async_job_of_two_vws_checkpointed_now_resumes_from_that_wave(
    cluster: LocalCluster,
) -> None:
    """Two asynchronous VWs (WSP), no periodic checkpoints: the cut asked for holds every
    stage of both at the wave the command names (each shard applied exactly the waves before
    it) and the job resumed from it runs to its end."""
    total = 600
    spec = job(
        "cutnow-async",
        split=[(["gpu0", "gpu1"], [3, 3]), (["gpu2", "gpu3"], [2, 4])],
        minibatches=total,
        lr=0.02,
        train={"checkpoint_every": 0},
    )

    async def checkpointed() -> tuple[str, dict[str, Any]]:
        async with cluster.client() as head:
            job_id = await head.submit(_guarded(spec, 2, 2, total // 2))
            await running_until(
                head, job_id, lambda i: min(i.get("positions") or [0]) >= 4, 120, every=0.02
            )
            return job_id, await head.checkpoint(job_id, wait=True, timeout=120)

    job_id, got = cluster.run(checkpointed())
    wave = got["wave"]
    ck = checkpoint.verify(Path(got["path"]))
    assert ck.meta["wave"] == wave and 0 < wave < total // 2, ck.meta
    assert sorted(ck.stages) == [checkpoint.stage_file(v, s) for v in (0, 1) for s in (0, 1)]
    for shard in ck.meta["applied"].values():
        assert all(waves == [[0, wave]] for waves in shard.values()), shard
    assert ck.meta["positions"] == [wave, wave]  # Nm = 1; each VW from its own start

    async def stop_then_resume() -> dict[str, Any]:
        async with cluster.client() as head:
            await head.cancel(job_id)
            stopped = await head.follow(job_id, every_s=0.1, timeout=60)
            assert stopped["state"] == "cancelled", stopped.get("error")
            new_id = await head.submit(spec, resume=job_id)
            return await head.follow(new_id, every_s=0.2, timeout=200)

    info = cluster.run(stop_then_resume())
    assert info["state"] == "done", info.get("error")
    assert info["resumed_from"]["positions"] == ck.meta["positions"]


def test_a_stage_takes_an_asked_cut_only_before_it_decided_the_push_before_it() -> None:
    """A stage sends its state at cut c right after its push of wave c - 1: it takes c while
    that push is still to be decided, else names the earliest cut it could; past its last
    wave it is cut at its end; a pending migration's boundary is no cut."""
    import threading
    from types import SimpleNamespace

    from hetpipe.pipeline import StageRunner

    runner: Any = SimpleNamespace(
        cut_lock=threading.Lock(),
        copying=4,
        asked=set(),
        schedule=SimpleNamespace(waves=10),
        task=SimpleNamespace(nm=2),
        migration=SimpleNamespace(orders=[SimpleNamespace(at=16)]),
    )
    assert StageRunner.ask_cut(runner, 5) == 6  # its push of wave 4 is decided
    assert StageRunner.ask_cut(runner, 6) is None and runner.asked == {6}
    assert StageRunner.ask_cut(runner, 8) == 9  # minibatch 16 opens wave 8: a migration
    assert StageRunner.ask_cut(runner, 40) is None and runner.asked == {6, 10}
