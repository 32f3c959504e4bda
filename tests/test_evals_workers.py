"""Evaluations while training run through virtual worker 0's pipeline on the workers
(:mod:`hetpipe.evalpass`, :mod:`hetpipe.head.evals`): the rules without a process, and jobs on
real daemons whose training is not disturbed by them."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_same_weights, job, user_code_cluster
from helpers import InlineExecutor, StandInCompute, stand_in_stream

from hetpipe.data import load_data
from hetpipe.evalpass import Passes, on_workers
from hetpipe.head.evals import WorkerEvals
from hetpipe.localcluster import LocalCluster
from hetpipe.metrics import LOSS
from hetpipe.models import build_model
from hetpipe.pipeline import StageRunner

# -- the rules, no process ------------------------------------------------------------------


def test_where_the_passes_run() -> None:
    assert on_workers(sync=False, num_vws=1, ties=False, bn_recalibrate=0)
    assert on_workers(sync=True, num_vws=3, ties=True, bn_recalibrate=0)
    # several async VWs: no VW's weights are the global ones; the head scores the shards'
    assert not on_workers(sync=False, num_vws=2, ties=False, bn_recalibrate=0)
    assert not on_workers(sync=False, num_vws=1, ties=True, bn_recalibrate=0)
    assert not on_workers(sync=True, num_vws=1, ties=False, bn_recalibrate=8)


def test_stage_zero_decides_every_n_waves_before_the_last() -> None:
    ps = Passes(3, None, total=10)
    assert [c for c in range(12) if ps.decide(c, 0.0)] == [3, 6, 9]
    assert ps.pending == [3, 6, 9] and ps.passing_on() == [3, 6, 9] and ps.passing_on() == []
    assert not ps.decide(3, 0.0)  # decided once


def test_stage_zero_decides_by_seconds() -> None:
    ps = Passes(0, 2.0, total=100, last_t=0.0)
    got = [c for c, t in enumerate([0.5, 1.0, 2.1, 2.5, 3.9, 4.2, 9.0]) if ps.decide(c, t)]
    assert got == [2, 5, 6]


def test_a_pass_is_due_once_the_waves_before_are_stepped() -> None:
    ps = Passes(2, None, total=10)
    ps.announce(2)
    ps.announce(4)
    ps.announce(2)  # announced twice: one pass
    assert ps.pending == [2, 4]
    assert ps.due(steps=5, per_boundary=3) is None  # async Nm = 3: 6 steps reach wave 2
    assert ps.due(steps=6, per_boundary=3) == 2
    ps.ran(2)
    assert ps.due(steps=6, per_boundary=3) is None
    assert ps.due(steps=4, per_boundary=1) == 4  # synchronous: a step per iteration


def test_the_last_stage_keeps_the_best_as_the_head_does() -> None:
    ps = Passes(1, None, total=10, keep_best="accuracy", metrics=("accuracy",))
    assert ps.offer({"accuracy": 0.5}) and not ps.offer({"accuracy": 0.4})
    assert ps.offer({"accuracy": 0.6})
    assert Passes(1, None, total=10).best is None


def test_the_head_takes_figures_and_assembles_the_best_weights() -> None:
    async def go() -> None:
        ev = WorkerEvals(2)
        ev.took(1, {"wave": 3, "figures": {LOSS: 1.5, "accuracy": 0.5}, "seconds": 0.1}, {})
        item = ev.queue.get_nowait()
        assert (item["wave"], item["figures"], item["seconds"]) == (
            3,
            {LOSS: 1.5, "accuracy": 0.5},
            0.1,
        )
        with pytest.raises(ValueError, match="malformed"):
            ev.took(1, {"figures": {}}, {})
        with pytest.raises(ValueError, match="not expected"):
            ev.took(2, {"wave": 3, "stage": 2}, {"w": torch.zeros(1)})
        ev.took(0, {"wave": 1, "stage": 0}, {"a": torch.zeros(1)})
        ev.took(0, {"wave": 2, "stage": 0}, {"a": torch.zeros(1)})
        ev.took(1, {"wave": 2, "stage": 1}, {"b": torch.zeros(2)})
        assert sorted(ev.weights) == [2]  # wave 2 is whole: wave 1's are dropped
        ev.took(0, {"wave": 3, "stage": 0}, {"a": torch.ones(1)})
        assert await ev.state(2) is None  # wave 3's come: the head writes that one instead
        waiting = asyncio.ensure_future(ev.state(3))
        await asyncio.sleep(0)
        assert not waiting.done()  # stage 1's weights are not in yet
        ev.took(1, {"wave": 3, "stage": 1}, {"b": torch.ones(2)})
        state = await waiting
        assert state is not None and sorted(state) == ["a", "b"] and ev.weights == {}
        with pytest.raises(TimeoutError, match=r"stage\(s\) \[0, 1\] of vw0"):
            await ev.state(5, timeout=0.01)
        ev.took(1, {"wave": 6, "figures": {}}, {})
        assert [i["wave"] for i in await ev.drain()] == [6]

    asyncio.run(go())


@pytest.mark.parametrize(
    ("every", "stop", "workers", "want"),
    [
        (0, 0, True, 0),  # no evaluation: pushes at checkpoints and the end
        (2, 0, True, 0),  # passes on the workers read the stages' own weights
        (2, 3, True, 1),  # a stop for lack of gain exports the shards' weights
        ("1s", 0, False, 1),  # the head scores the shards' weights while training
    ],
)
def test_a_lone_vw_pushes_every_wave_only_where_the_shards_are_read(
    monkeypatch: pytest.MonkeyPatch, every: int | str, stop: int, workers: bool, want: int
) -> None:
    compute = StandInCompute("async", 2, 0, 1, 8)
    spec = compute.spec
    spec.push_every, spec.eval_every, spec.stop_after_no_gain = 0, every, stop
    spec.bn_recalibrate = 0 if workers else 4

    async def nothing(*_a: Any) -> None:
        pass

    runner = StageRunner(
        compute,  # type: ignore[arg-type]
        InlineExecutor(),
        send=nothing,
        shards={},
        report=nothing,
        stream=stand_in_stream((torch.zeros(1), torch.zeros(1))),
    )
    assert runner.push_every == want
    assert (runner.passes is not None) == (workers and every != 0)


# -- jobs on real daemons ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """Four devices, two shards; the daemons can (and may) import ``usermetrics``."""
    c = user_code_cluster(tmp_path_factory, "usermetrics")
    yield c
    c.stop()


def validation_lines(info: dict[str, Any]) -> list[dict[str, Any]]:
    lines = map(json.loads, Path(info["metrics_path"]).read_text().splitlines())
    return [d["validation"] for d in lines if "validation" in d]


def stage_stats(info: dict[str, Any], where: str) -> dict[str, Any]:
    return json.loads(Path(info["stages_path"]).read_text())[where]["stats"]


def weights(info: dict[str, Any]) -> dict[str, torch.Tensor]:
    return torch.load(info["model_path"])


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("kind", "split", "nm", "minibatches"),
    [
        ("async", [(["gpu0", "gpu1"], [3, 3])], 1, 40),
        ("1f1b", [(["gpu0", "gpu1"], [3, 3]), (["gpu2", "gpu3"], [2, 4])], 2, 24),
        # the last stage replicated: its leader takes part, its replica trains on meanwhile
        ("async", [(["gpu0", ["gpu1", "gpu2"]], [3, 3])], 1, 30),
    ],
    ids=["async", "sync-2vw", "async-replicas"],
)
def test_passes_while_training_leave_the_weights_as_they_were(
    cluster: LocalCluster, kind: str, split: list, nm: int, minibatches: int
) -> None:
    """A pass at every wave boundary, on the workers: the final weights equal those of the
    same job without evaluations (within 1e-6); every boundary before the last has its
    line, on the workers, and the passes' time is reported."""
    train: dict[str, Any] = {"schedule": kind, "metrics": ["accuracy"]}
    plain = cluster.submit(
        job(f"plain-{kind}", split=split, nm=nm, minibatches=minibatches, train=train),
        timeout=240,
    )
    assert plain["state"] == "done", plain.get("error")
    evald = cluster.submit(
        job(
            f"evald-{kind}",
            split=split,
            nm=nm,
            minibatches=minibatches,
            train={**train, "eval_every": 1, "keep_best": "val_loss"},
        ),
        timeout=240,
    )
    assert evald["state"] == "done", evald.get("error")
    assert_same_weights(weights(evald), weights(plain), tol=1e-6)
    waves = minibatches // nm
    lines = validation_lines(evald)
    assert [v["wave"] for v in lines] == [*range(1, waves), waves]
    assert all(v["on"] == "workers" for v in lines)
    assert all(v["validation_s"] >= 0 for v in lines[:-1])
    # the minibatches every VW had trained at the boundary
    assert [v["minibatches"] for v in lines[:3]] == [c * nm * len(split) for c in (1, 2, 3)]
    first = stage_stats(evald, "vw0/stage0")
    assert first["validations"] == waves - 1 and first["validation_s"] > 0
    assert "validations" not in stage_stats(evald, "vw1/stage0") if len(split) > 1 else True
    best = evald["best"]
    assert best["value"] == min(v[LOSS] for v in lines)
    # model_best.pt holds the weights the best pass scored
    assert best_loss(evald["best_model_path"]) == pytest.approx(best["value"], abs=1e-5)


def best_loss(path: str) -> float:
    """val_loss of the weights in ``path``, by plain PyTorch over the digits validation
    set."""
    model = build_model("mlp")
    model.load_state_dict(torch.load(path), strict=True)
    model.eval()
    val = load_data("digits", {}, None).val
    x = torch.stack([val[i][0] for i in range(len(val))])
    y = torch.stack([torch.as_tensor(val[i][1]) for i in range(len(val))])
    with torch.no_grad():
        return float(F.cross_entropy(model(x), y))


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_passes_every_few_seconds_run_on_the_workers(cluster: LocalCluster) -> None:
    spec = job(
        "evals-s",
        split=[(["gpu0", "gpu1"], [3, 3])],
        minibatches=600,
        train={"eval_every": "0.3s"},
    )
    info = cluster.submit(spec, timeout=200)
    assert info["state"] == "done", info.get("error")
    lines = validation_lines(info)
    assert len(lines) >= 2
    assert all(v["on"] == "workers" for v in lines)
    waves = [v["wave"] for v in lines]
    assert waves == sorted(set(waves)) and waves[-1] == 600


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_several_async_vws_are_scored_on_the_head(cluster: LocalCluster) -> None:
    """No virtual worker's weights are the global ones: the head scores the shards'."""
    split = [(["gpu0", "gpu1"], [3, 3]), (["gpu2", "gpu3"], [3, 3])]
    info = cluster.submit(
        job("evals-2async", split=split, minibatches=60, train={"eval_every": 10}), timeout=200
    )
    assert info["state"] == "done", info.get("error")
    lines = validation_lines(info)
    assert len(lines) >= 2 and all(v["on"] == "head" for v in lines)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_metric_that_raises_in_a_pass_while_training_fails_the_job(
    cluster: LocalCluster,
) -> None:
    spec = job(
        "broken-w",
        split=[(["gpu0", "gpu1"], [3, 3])],
        minibatches=400,
        train={"metrics": ["usermetrics:broken"], "eval_every": 2},
    )
    info = cluster.submit(spec, timeout=200)
    assert info["state"] == "failed"
    assert "\n" not in info["error"]
    assert "metric 'broken' raised RuntimeError: metric bug on purpose" in info["error"]
