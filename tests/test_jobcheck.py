"""Job checks that need only the job file and the cluster file: one line, before any send."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import edited, one_line_error
from helpers import example_files

from hetpipe.config import load_cluster
from hetpipe.job import JobError, load_job
from hetpipe.jobcheck import JobFacts, check_job
from hetpipe.localcluster import DeviceDef, cluster_toml

JOB = """\
name = "t"
[model]
name = "mlp"
[data]
name = "digits"
[train]
minibatch = 32
minibatches = 10

[[vw]]
devices = ["gpu0", "gpu1"]
layers = [3, 3]
"""


@pytest.fixture
def check(tmp_path: Path) -> Callable[[Path], JobFacts]:
    """``check(path)``: load the job file and check it against a two-device cluster."""
    cpath = tmp_path / "cluster.toml"
    cpath.write_text(cluster_toml((DeviceDef("gpu0"), DeviceDef("gpu1"))))
    cluster = load_cluster(cpath)
    return lambda path: check_job(load_job(path), cluster, str(path))


CASES = [
    (
        "layers-sum",
        "layers = [3, 3]",
        "layers = [3, 4]",
        "vw[0].layers",
        "[3, 4] sums to 7, the model has 6 layers",
    ),
    (
        "unknown-device",
        '"gpu0", "gpu1"',
        '"gpu0", "gpu7"',
        "vw[0].devices[1]",
        "'gpu7' is not a device of",
    ),
    ("model-name", 'name = "mlp"', 'name = "nosuch"', "model.name", "model 'nosuch': unknown"),
    ("model-args", 'name = "mlp"', 'name = "mlp"\nargs = { colour = 1 }', "model.args", "bad args"),
    ("data-name", 'name = "digits"', 'name = "imagenet"', "data.name", "data 'imagenet': unknown"),
    (
        "data-args",
        'name = "digits"',
        'name = "digits"\nargs = { size = 3 }',
        "data.args",
        "unknown args ['size']",
    ),
    (
        "minibatch-too-big",
        "minibatch = 32",
        "minibatch = 100000",
        "train.minibatch",
        "leaves no full minibatch",
    ),
    (
        "vws-too-many",
        '[[vw]]\ndevices = ["gpu0", "gpu1"]\nlayers = [3, 3]\n',
        "",
        "train.vws",
        "3 virtual workers need at least as many devices",
    ),
    (
        "fault-vw",
        "",
        "[[fault]]\nvw = 1\nstage = 0\nminibatch = 2\nseconds = 1.0\n",
        "fault[0].vw",
        "1: the job has 1 virtual workers",
    ),
    (
        "fault-stage",
        "",
        "[[fault]]\nvw = 0\nstage = 2\nminibatch = 2\nseconds = 1.0\n",
        "fault[0].stage",
        "2: vw 0 has 2 stages",
    ),
    (
        "fault-minibatch",
        "",
        "[[fault]]\nvw = 0\nstage = 1\nminibatch = 10\nseconds = 1.0\n",
        "fault[0].minibatch",
        "each virtual worker trains 10 minibatches",
    ),
]


@pytest.mark.parametrize(
    ("old", "new", "key", "problem"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_rejects(
    tmp_path: Path, check: Callable[[Path], JobFacts], old: str, new: str, key: str, problem: str
) -> None:
    text = edited(JOB, old, new)
    if key == "train.vws":
        text = text.replace("minibatches = 10", "minibatches = 10\nvws = 3")
    path = tmp_path / "job.toml"
    path.write_text(text)
    one_line_error(check, JobError, path, key, problem)


def test_more_stages_than_layers(tmp_path: Path) -> None:
    cpath = tmp_path / "cluster.toml"
    cpath.write_text(cluster_toml(tuple(DeviceDef(f"gpu{i}") for i in range(7))))
    cluster = load_cluster(cpath)
    devices = ", ".join(f'"gpu{i}"' for i in range(7))
    path = tmp_path / "job.toml"
    path.write_text(edited(JOB, '"gpu0", "gpu1"', devices).replace("layers = [3, 3]\n", ""))
    one_line_error(
        lambda p: check_job(load_job(p), cluster, str(p)),
        JobError,
        path,
        "vw[0].devices",
        "7 stages for a model of 6 layers",
    )


def test_a_good_job_passes(tmp_path: Path, check: Callable[[Path], JobFacts]) -> None:
    path = tmp_path / "job.toml"
    path.write_text(JOB)
    facts = check(path)
    assert facts.layers == 6
    assert facts.per_epoch >= 10


def test_the_examples_pass_against_the_repository_cluster() -> None:
    """Every example job passes the job check against the repository's cluster file, and
    every example cluster file loads."""
    root = Path(__file__).resolve().parent.parent
    cluster = load_cluster(root / "cluster.toml")
    jobs, clusters = example_files()
    for path in jobs:
        check_job(load_job(path), cluster, str(path))
    assert clusters  # examples/paper_testbed.toml
    for path in clusters:
        assert load_cluster(path).devices, path


def test_a_key_without_effect_is_refused_before_the_model_is_built(
    tmp_path: Path, check: Callable[[Path], JobFacts]
) -> None:
    """The checks the CLI runs begin with loading the file: a key set where it has no effect
    is one line there, even in a job whose model could not be built."""
    path = tmp_path / "job.toml"
    path.write_text(
        edited(JOB, 'name = "mlp"', 'name = "nosuch"').replace(
            "minibatches = 10", 'minibatches = 10\nschedule = "gpipe"\nstaleness = 2'
        )
    )
    with pytest.raises(JobError) as info:
        check(path)
    assert str(info.value) == (
        f"{path}: train.staleness: has no effect with schedule 'gpipe' (synchronous)"
    )
