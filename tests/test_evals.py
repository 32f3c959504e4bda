"""Validation and metrics: ``train.eval_every``, ``metrics``, ``keep_best`` and
``stop_after_no_gain``; the rules of :mod:`hetpipe.metrics` without a process, and jobs on
real daemons whose figures equal plain PyTorch's on the exported weights."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import edited, job, one_line_error, user_code_cluster

from hetpipe.config import DeviceSpec
from hetpipe.core.layout import StageLayout
from hetpipe.data import load_data
from hetpipe.job import JobError, JobSpec, load_job
from hetpipe.localcluster import LocalCluster
from hetpipe.metrics import (
    LOSS,
    Best,
    MetricError,
    Tally,
    best_rule,
    check_metrics,
    parse_every,
    resolve,
)
from hetpipe.models import build_model
from hetpipe.security import CodeError, check_code
from hetpipe.stage import StageCompute
from hetpipe.task import StageTask
from hetpipe.usercode import named_code

HERE = Path(__file__).resolve().parent

BASE = """\
name = "t"

[model]
name = "mlp"

[data]
name = "digits"

[optimizer]
name = "sgd"
lr = 0.1

[train]
minibatch = 16
minibatches = 4
"""

# -- the rules, no process ------------------------------------------------------------------


def test_eval_every_reads_waves_or_seconds() -> None:
    assert parse_every(0) == (0, None)
    assert parse_every(3) == (3, None)
    assert parse_every("30s") == (0, 30.0)
    assert parse_every("0.5s") == (0, 0.5)
    for bad in ("3m", "s", -1, True, 1.5, "0.01s"):
        with pytest.raises(ValueError):
            parse_every(bad)


def test_best_direction_by_name_or_sign() -> None:
    names = ("accuracy", "perplexity", "mod:score")
    assert best_rule(None, names) == (LOSS, False)
    assert best_rule("val_loss", names) == (LOSS, False)
    assert best_rule("accuracy", names) == ("accuracy", True)
    assert best_rule("perplexity", names) == ("perplexity", False)
    assert best_rule("-score", names) == ("score", False)
    assert best_rule("+score", names) == ("score", True)
    assert best_rule("+score.part", names) == ("score.part", True)  # a mapping's entry
    with pytest.raises(ValueError, match='"-score" \\(lower\\) or "\\+score"'):
        best_rule("score", names)
    with pytest.raises(ValueError, match="not evaluated"):
        best_rule("accuracy", ("perplexity",))


def test_metric_names_checked() -> None:
    check_metrics(("accuracy", "perplexity", "pkg.mod:fn"))
    with pytest.raises(ValueError, match="unknown metric 'f1'"):
        check_metrics(("f1",))
    with pytest.raises(ValueError, match="named twice"):
        check_metrics(("a:fn", "b:fn"))


def test_best_counts_evaluations_without_gain() -> None:
    b = Best("val_loss", higher=False)
    assert b.offer({"val_loss": 1.0})
    assert not b.offer({"val_loss": 1.0})  # equal is no gain
    assert not b.offer({"val_loss": 2.0})
    assert b.since == 2
    assert b.offer({"val_loss": 0.5}) and b.since == 0 and b.value == 0.5
    assert not b.offer({"val_loss": float("nan")}) and b.since == 1
    a = Best("accuracy", higher=True)
    assert a.offer({"accuracy": 0.2}) and a.offer({"accuracy": 0.3})
    assert not a.offer({"accuracy": 0.25})


def test_tally_weights_minibatches_by_rows() -> None:
    """A short last minibatch counts by its rows: the figures equal one pass over all."""
    torch.manual_seed(0)
    out, y = torch.randn(10, 4), torch.randint(0, 4, (10,))
    tally = Tally(resolve(["accuracy", "perplexity"]))
    for lo, hi in ((0, 4), (4, 8), (8, 10)):
        tally.add(out[lo:hi], y[lo:hi], float(F.cross_entropy(out[lo:hi], y[lo:hi])), hi - lo)
    got = tally.result()
    loss = float(F.cross_entropy(out, y))
    assert got[LOSS] == pytest.approx(loss, abs=1e-6)
    assert got["perplexity"] == pytest.approx(math.exp(loss), rel=1e-6)
    assert got["accuracy"] == float((out.argmax(-1) == y).double().mean())


def test_user_metric_number_mapping_and_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(HERE))
    tally = Tally(resolve(["usermetrics:top_logit", "usermetrics:pair"]))
    out, y = torch.tensor([[1.0, 3.0], [2.0, 0.0]]), torch.tensor([0, 1])
    tally.add(out, y, 0.0, 2)
    assert tally.result() == {LOSS: 0.0, "top_logit": 2.5, "pair.zeros": 0.5, "pair.top": 2.5}
    broken = Tally(resolve(["usermetrics:broken"]))
    with pytest.raises(MetricError) as info:
        broken.add(out, y, 0.0, 2)
    assert str(info.value) == "metric 'broken' raised RuntimeError: metric bug on purpose"
    with pytest.raises(MetricError) as info:
        resolve(["usermetrics:nope"])
    assert str(info.value).startswith("train.metrics: metric 'usermetrics:nope'")


def test_a_metric_function_goes_through_the_allowlist_and_hashes() -> None:
    d = job("m", train={"metrics": ["accuracy", "mymetrics.sub:score"]})
    assert [(n.key, n.module, n.function) for n in named_code(d)] == [
        ("train.metrics", "mymetrics.sub", "score")
    ]
    check_code(d, ["mymetrics"])
    with pytest.raises(CodeError) as info:
        check_code(d, [])
    assert str(info.value).startswith("job: train.metrics: module 'mymetrics.sub' is not allowed")


@pytest.mark.parametrize(
    ("line", "key", "problem"),
    [
        ('eval_every = "3m"', "train.eval_every", 'a duration is "<seconds>s"'),
        ("eval_every = -2", "train.eval_every", "must be >= 0"),
        ("eval_every = 1.5", "train.eval_every", "must be an integer >= 0"),
        ('metrics = ["f1"]', "train.metrics", "unknown metric 'f1'"),
        ('metrics = "accuracy"', "train.metrics", "expected an array"),
        ('keep_best = "perplexity"', "train.keep_best", "'perplexity' is not evaluated"),
        (
            'metrics = ["m:score"]\nkeep_best = "score"',
            "train.keep_best",
            "better lower or higher",
        ),
        ("stop_after_no_gain = 2", "train.stop_after_no_gain", "has no effect without"),
        ("eval_every = 2\nstop_after_no_gain = -1", "train.stop_after_no_gain", "must be >= 0"),
        ("eval_every = 2\neval_every_s = 3.0", "train.eval_every", "not both"),
    ],
)
def test_bad_values_refused_in_one_line(tmp_path: Path, line: str, key: str, problem: str) -> None:
    path = tmp_path / "job.toml"
    path.write_text(edited(BASE, "", line + "\n"))
    one_line_error(load_job, JobError, path, key, problem)


def test_keys_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "job.toml"
    text = 'eval_every = "2s"\nmetrics = ["accuracy", "perplexity"]\nkeep_best = "accuracy"\n'
    path.write_text(edited(BASE, "", text + "stop_after_no_gain = 3\n"))
    spec = load_job(path)
    assert (spec.eval_every, spec.metrics, spec.keep_best, spec.stop_after_no_gain) == (
        "2s",
        ("accuracy", "perplexity"),
        "accuracy",
        3,
    )
    assert type(spec).from_dict(spec.to_dict()) == spec


# -- a stage's validation forward, in process -------------------------------------------------

CPU = DeviceSpec("gpu0", "cpu", "fast", 1 << 30, 1.0, 0, "node0", "127.0.0.1")


def test_eval_forward_of_two_stages_is_the_model_in_eval_mode() -> None:
    """The cnn (batch norm) cut in two: each stage's eval forward, chained, gives the plain
    model's eval-mode output; no running statistic and no weight moves; a snapshot taken
    before a training step keeps the weights it held."""
    spec = JobSpec.from_dict(job("unit", model="cnn", minibatches=4))
    n = len(build_model("cnn"))
    cut = 5
    stages = [
        StageCompute(
            StageTask.standalone(
                "unit", spec.to_dict(), StageLayout(("gpu0",), lo, hi), stage=s, k=2
            ),
            CPU,
        )
        for s, (lo, hi) in enumerate(((0, cut), (cut, n)))
    ]
    torch.manual_seed(spec.seed)
    plain = build_model("cnn")
    init = plain.state_dict()
    for st in stages:  # the shards' initial weights, as a first pull gives them
        names = st.state_names()
        st.load({k: init[k] for k in names}, {k: [] for k in names})
    x = load_data("digits", {}, None).val[0][0].unsqueeze(0).repeat(4, 1, 1, 1)
    before = [dict(st.state_dict()) for st in stages]
    snaps = [st.eval_state() for st in stages]
    got = stages[1].eval_forward(stages[0].eval_forward(x, snaps[0]), snaps[1])
    plain.eval()
    with torch.no_grad():
        want = plain(x)
    assert torch.allclose(got, want, atol=1e-6)
    for st, b in zip(stages, before, strict=True):
        after = st.state_dict()
        assert all(torch.equal(after[k], v) for k, v in b.items())
        assert st.module.training  # back in train mode for training
    assert not got.requires_grad


# -- jobs on real daemons ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """Four devices, two shards; the daemons can (and may) import ``usermetrics``."""
    c = user_code_cluster(tmp_path_factory, "usermetrics")
    yield c
    c.stop()


def plain_figures(path: str | Path) -> dict[str, float]:
    """val_loss, accuracy and perplexity of the exported weights ``path``, by plain PyTorch
    over the whole digits validation set at once."""
    model = build_model("mlp")
    model.load_state_dict(torch.load(path), strict=True)
    model.eval()
    val = load_data("digits", {}, None).val
    x = torch.stack([val[i][0] for i in range(len(val))])
    y = torch.stack([torch.as_tensor(val[i][1]) for i in range(len(val))])
    with torch.no_grad():
        out = model(x)
    loss = float(F.cross_entropy(out, y))
    return {
        LOSS: loss,
        "accuracy": float((out.argmax(-1) == y).double().mean()),
        "perplexity": math.exp(loss),
        "top_logit": float(out.max(dim=-1).values.mean()),
    }


def validation_lines(info: dict[str, Any]) -> list[dict[str, Any]]:
    lines = Path(info["metrics_path"]).read_text().splitlines()
    return [json.loads(line)["validation"] for line in lines if '"validation"' in line]


SPLIT = [(["gpu0", "gpu1"], [3, 3])]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_figures_of_a_two_stage_job_equal_plain_pytorch(cluster: LocalCluster) -> None:
    """Every 50 waves and at the end; the end's figures are those of model.pt."""
    spec = job(
        "evals",
        split=SPLIT,
        minibatches=300,
        train={
            "eval_every": 50,
            "metrics": ["accuracy", "perplexity", "usermetrics:top_logit"],
        },
    )
    info = cluster.submit(spec, timeout=200)
    assert info["state"] == "done", info.get("error")
    want = plain_figures(info["model_path"])
    for name, value in want.items():
        assert info[name] == pytest.approx(value, abs=1e-5), name
    assert info["test_accuracy"] == info["accuracy"]  # kept for its readers
    lines = validation_lines(info)
    assert len(lines) >= 2  # at least one while training, and the end
    assert lines[-1]["on"] == "workers"  # the validation pass through the pipeline
    assert all(v["on"] == "workers" for v in lines[:-1])  # while training: VW 0's pipeline
    assert lines[-1][LOSS] == info[LOSS] and lines[-1]["minibatches"] == 300
    last = json.loads(Path(info["metrics_path"]).read_text().splitlines()[-1])
    assert last["validation"] == lines[-1] and "stages" in last  # a telemetry line's shape
    assert lines[-1]["wave"] == 300
    assert all(v["wave"] >= 50 for v in lines)
    assert info["validation"] == lines


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_synchronous_job_of_two_vws_is_scored_on_the_workers(cluster: LocalCluster) -> None:
    """1f1b, two virtual workers: VW 0's final weights are the global ones, so its pipeline
    runs the validation pass; the figures are model.pt's."""
    split = [(["gpu0", "gpu1"], [3, 3]), (["gpu2", "gpu3"], [2, 4])]
    spec = job(
        "evals-sync",
        split=split,
        nm=2,
        minibatches=8,
        train={"schedule": "1f1b", "metrics": ["accuracy", "perplexity"]},
    )
    info = cluster.submit(spec, timeout=200)
    assert info["state"] == "done", info.get("error")
    assert info["validation"][-1]["on"] == "workers"
    want = plain_figures(info["model_path"])
    for name in (LOSS, "accuracy", "perplexity"):
        assert info[name] == pytest.approx(want[name], abs=1e-5), name


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_keep_best_writes_the_best_model(cluster: LocalCluster) -> None:
    spec = job(
        "best",
        split=SPLIT,
        minibatches=300,
        lr=0.5,
        train={"eval_every": 30, "metrics": ["accuracy"], "keep_best": "val_loss"},
    )
    info = cluster.submit(spec, timeout=200)
    assert info["state"] == "done", info.get("error")
    best = info["best"]
    assert len(info["validation"]) >= 2
    assert best["metric"] == LOSS
    assert best["value"] == min(v[LOSS] for v in info["validation"])
    assert Path(info["best_model_path"]).name == "model_best.pt"
    got = plain_figures(info["best_model_path"])
    assert got[LOSS] == pytest.approx(best["value"], abs=1e-5)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_stop_after_no_gain_ends_the_job_early(cluster: LocalCluster) -> None:
    """A learning rate too small to move a weight: nothing improves after the first
    evaluation."""
    spec = job(
        "nogain",
        split=SPLIT,
        minibatches=4000,
        lr=1e-30,  # below every weight's ulp: no update changes a weight
        momentum=0.0,
        weight_decay=0.0,
        train={"eval_every": 1, "stop_after_no_gain": 2},
    )
    info = cluster.submit(spec, timeout=200)
    assert info["state"] == "done", info.get("error")
    assert "no gain in val_loss for 2 evaluations" in info["stopped"]
    assert info["minibatches"] < 4000
    assert Path(info["model_path"]).exists()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_metric_that_raises_fails_the_job_in_one_line(cluster: LocalCluster) -> None:
    spec = job("broken", split=SPLIT, minibatches=4, train={"metrics": ["usermetrics:broken"]})
    info = cluster.submit(spec, timeout=200)
    assert info["state"] == "failed"
    assert "\n" not in info["error"]
    assert "metric 'broken' raised RuntimeError: metric bug on purpose" in info["error"]
    after = cluster.submit(job("after", split=SPLIT, minibatches=2), timeout=200)
    assert after["state"] == "done", after.get("error")  # the daemons keep serving
