"""A job's own data checked at submit, before anything runs: the data function raising,
returning the wrong type, or yielding samples the model cannot take is refused in one line
``<file>: <key>: <problem>`` naming the function (for a shape: the layer and both shapes), by
one forward of one sample on the CPU; a collate outside the allowlist is refused first."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import edited, one_line_error

from hetpipe.config import load_cluster
from hetpipe.data import DataError, load_data
from hetpipe.data.check import check_fit, describe
from hetpipe.job import JobError, load_job
from hetpipe.jobcheck import JobFacts, check_job
from hetpipe.localcluster import DeviceDef, cluster_toml
from hetpipe.models import build_model, model_loss

JOB = """\
name = "t"
[model]
name = "mlp"
[data]
name = "userdata:pairs"
[train]
minibatch = 8
minibatches = 10

[[vw]]
devices = ["gpu0", "gpu1"]
layers = [3, 3]
"""


@pytest.fixture
def check(tmp_path: Path) -> Callable[[Path], JobFacts]:
    """``check(path)``: the job file checked against two devices that allow ``userdata``."""
    cpath = tmp_path / "cluster.toml"
    devices = (DeviceDef("gpu0"), DeviceDef("gpu1"))
    cpath.write_text(cluster_toml(devices, allowed_modules=("userdata",)))
    cluster = load_cluster(cpath)
    return lambda path: check_job(load_job(path), cluster, str(path))


CASES = [
    (
        "raises",
        'name = "userdata:raises"',
        "data.name",
        "data 'userdata:raises': raised FileNotFoundError: /data/set8 is missing",
    ),
    (
        "wrong-type",
        'name = "userdata:wrong_type"',
        "data.name",
        "data 'userdata:wrong_type': returned int, not a torch.utils.data.Dataset",
    ),
    (
        "shape",
        'name = "userdata:wrong_shape"',
        "data.name",
        "data 'userdata:wrong_shape': a sample of [1, 3, 4, 4] float32 does not fit: layer 1 "
        "(Linear taking [*, 64] float) got [1, 48] float32",
    ),
    (
        "dtype",
        'name = "userdata:wrong_dtype"',
        "data.name",
        "data 'userdata:wrong_dtype': a sample of [1, 1, 8, 8] float64 does not fit: layer 1 "
        "(Linear taking [*, 64] float) got [1, 64] float64",
    ),
    (
        "target",
        'name = "userdata:wrong_target"',
        "data.name",
        "data 'userdata:wrong_target': the target [1] float64 does not fit the loss of the "
        "model's output [1, 10] float32",
    ),
    (
        "sample",
        'name = "userdata:broken_sample"',
        "data.name",
        "data 'userdata:broken_sample': reading a sample raised KeyError: 'sample 0 unreadable'",
    ),
    (
        "args",
        'name = "userdata:pairs"\nargs = { colour = 1 }',
        "data.args",
        "data 'userdata:pairs': bad args {'colour': 1}",
    ),
    (
        "missing-function",
        'name = "userdata:nothing"',
        "data.name",
        "module 'userdata'",
    ),
    (
        "collate-raises",
        'name = "userdata:pairs"\ncollate = "userdata:broken_collate"',
        "data.collate",
        "data.collate 'userdata:broken_collate': raised RuntimeError: collate broke",
    ),
    (
        "collate-not-allowed",
        'name = "userdata:pairs"\ncollate = "json:loads"',
        "data.collate",
        "module 'json' is not allowed",
    ),
    (
        "workers",
        'name = "userdata:pairs"\nworkers = -1',
        "data.workers",
        "",
    ),
]


@pytest.mark.parametrize(
    ("new", "key", "problem"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_refused_in_one_line(
    check: Callable[[Path], JobFacts], tmp_path: Path, new: str, key: str, problem: str
) -> None:
    path = tmp_path / "job.toml"
    path.write_text(edited(JOB, 'name = "userdata:pairs"', new))
    one_line_error(check, JobError, path, key, problem)


def test_a_stream_of_unknown_length_needs_minibatches(
    check: Callable[[Path], JobFacts], tmp_path: Path
) -> None:
    path = tmp_path / "job.toml"
    text = edited(JOB, 'name = "userdata:pairs"', 'name = "userdata:stream"')
    path.write_text(edited(text, "minibatches = 10", "epochs = 1"))
    one_line_error(check, JobError, path, "train.minibatches", "a stream of unknown length")
    path.write_text(text)
    facts = check(path)
    assert facts.n_train is None and facts.per_epoch == 10


def test_the_facts_keep_only_the_validation_set(
    check: Callable[[Path], JobFacts], tmp_path: Path
) -> None:
    path = tmp_path / "job.toml"
    path.write_text(
        edited(JOB, 'name = "userdata:pairs"', 'name = "userdata:pairs"\nargs = { n = 200 }')
    )
    facts = check(path)
    assert facts.data.train is None and len(facts.data.val) == 64
    assert facts.n_train == 200 and facts.per_epoch == 200 // 8 // 1
    path.write_text(JOB.replace('name = "userdata:pairs"', 'name = "digits"'))
    assert check(path).n_train == 1437


def test_check_fit_names_the_layer_and_leaves_the_model_as_it_was() -> None:
    torch.manual_seed(0)
    model = build_model("cnn")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.train()
    check_fit(load_data("digits"), model, model_loss("cnn"))  # fits: nothing raised
    assert model.training
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    with pytest.raises(DataError) as info:
        check_fit(load_data("userdata:wrong_shape"), model)
    text = str(info.value)
    assert "\n" not in text and text.startswith(
        "data 'userdata:wrong_shape': a sample of [1, 3, 4, 4] float32 does not fit: layer 0 "
        "(Conv2d taking [N, 1, *, *] float) got [1, 3, 4, 4] float32: RuntimeError"
    ), text
    gpt = build_model("gpt", {"vocab": 50, "seq": 6, "dim": 8, "heads": 2, "blocks": 1})
    check_fit(load_data("userdata:tokens"), torch.nn.Sequential(_Ids(), *gpt))
    assert describe({"a": torch.zeros(2, dtype=torch.int64)}) == "{a: [2] int64}"


class _Ids(torch.nn.Module):
    """A first block taking a tokenizer's mapping (the minibatch's inputs, as one argument)
    and giving its ``input_ids``."""

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return batch["input_ids"] * batch["attention_mask"]


def test_the_guides_own_data_example_passes_the_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/own-data.md's few lines of Python and job file are a job the check accepts."""
    guide = (Path(__file__).resolve().parents[1] / "docs" / "own-data.md").read_text()
    python = guide.split("```python\n", 1)[1].split("```", 1)[0]
    toml = guide.split("```toml\n", 1)[1].split("```", 1)[0]
    assert len(python.splitlines()) + len(toml.splitlines()) <= 15
    (tmp_path / "mydata.py").write_text(python)
    (tmp_path / "job.toml").write_text(toml)
    monkeypatch.syspath_prepend(str(tmp_path))
    cpath = tmp_path / "cluster.toml"
    cpath.write_text(cluster_toml((DeviceDef("gpu0"),), allowed_modules=("mydata",)))
    facts = check_job(load_job(tmp_path / "job.toml"), load_cluster(cpath), "job.toml")
    assert facts.n_train == 8192 and len(facts.data.val) == 512
