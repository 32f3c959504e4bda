"""Never stale code, on real daemons: a running cluster trains the user's module as it is
when the job is submitted, refuses a job where the head's or a worker's copy differs from the
one submitted, and says where it looked for a module it cannot import; with `[security]
ship_code` a job runs its shipped module on hosts that do not have it. And GPT's tied head,
run as one stage.

The daemons import user modules from a folder on their ``PYTHONPATH`` that the tests edit
between jobs; a job's ``code`` holds the hash ``hetpipe submit`` would send (the CLI's side is
tests/test_usercode.py)."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import UNIFORM, job, start_cluster

from hetpipe import cli
from hetpipe.localcluster import LocalCluster, cluster_toml

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
MODULE = "hp_stale"
WIDTH = (
    "    return nn.Sequential(nn.Flatten(), nn.Linear(64, {w}), nn.ReLU(), nn.Linear({w}, 10))\n"
)


def source(width: int, extra: str = "") -> str:
    """The user's module: ``build`` makes an MLP whose hidden layer has ``width`` units."""
    return "from torch import nn\n\n\ndef build():\n" + WIDTH.format(w=width) + extra


@pytest.fixture(scope="module")
def code_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("usercode")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, code_dir: Path) -> Iterator[LocalCluster]:
    """Two devices, one shard; the daemons import from ``code_dir`` (and ``usermodels``)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(
            "PYTHONPATH",
            os.pathsep.join(
                p for p in (str(code_dir), str(HERE), os.environ.get("PYTHONPATH", "")) if p
            ),
        )
        c = start_cluster(
            tmp_path_factory.mktemp("stale"),
            UNIFORM[:2],
            shards=1,
            allowed_modules=(MODULE, "hp_stale_nowhere", "usermodels"),
        )
    yield c
    c.stop()


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def user_job(name: str, function: str = "build", code: dict[str, str] | None = None) -> dict:
    spec = job(
        name, model=f"{MODULE}:{function}", split=[(["gpu0", "gpu1"], [2, 2])], minibatches=4
    )
    if code is not None:
        spec["code"] = code
    return spec


def run(cluster: LocalCluster, spec: dict[str, Any]) -> dict[str, torch.Tensor]:
    info = cluster.submit(spec, timeout=150)
    assert info["state"] == "done", info.get("error")
    return torch.load(info["model_path"])


@pytest.mark.timeout(400)
def test_an_edited_module_trains_as_edited_without_restarting(
    cluster: LocalCluster, code_dir: Path
) -> None:
    """Widened between two jobs: the second trains the wider model; a function added to the
    file runs at once (here from a client that sends no hashes)."""
    path = code_dir / f"{MODULE}.py"
    path.write_text(source(8))
    first = run(cluster, user_job("stale-8", code={MODULE: sha(path)}))
    assert first["1.weight"].shape == (8, 64)
    path.write_text(source(12, "\n\ndef build_v2():\n" + WIDTH.format(w=20)))
    second = run(cluster, user_job("stale-12", code={MODULE: sha(path)}))
    assert second["1.weight"].shape == (12, 64)
    third = run(cluster, user_job("stale-v2", "build_v2"))
    assert third["1.weight"].shape == (20, 64)


@pytest.mark.timeout(120)
def test_a_copy_that_differs_from_the_submitted_one_is_refused(
    cluster: LocalCluster, code_dir: Path
) -> None:
    path = code_dir / f"{MODULE}.py"
    if not path.exists():
        path.write_text(source(8))
    theirs = hashlib.sha256(source(16).encode()).hexdigest()
    info = cluster.submit(user_job("stale-differs", code={MODULE: theirs}), timeout=100)
    assert info["state"] == "failed"
    error = info["error"]
    assert "\n" not in error
    assert f"head: {path}: this host's copy of module '{MODULE}' has sha256 " in error
    assert f"{sha(path)[:12]}, the job was submitted with {theirs[:12]}" in error


@pytest.mark.timeout(120)
def test_a_module_the_cluster_cannot_import_says_where_it_looked(
    cluster: LocalCluster, code_dir: Path
) -> None:
    spec = job("nowhere", model="hp_stale_nowhere:build", split=[(["gpu0"], [4])])
    info = cluster.submit(spec, timeout=100)
    assert info["state"] == "failed"
    error = info["error"]
    assert "\n" not in error
    assert "head: cannot import module 'hp_stale_nowhere' (ModuleNotFoundError" in error
    assert "; looked in " in error and f"{code_dir}, " in error  # its sys.path
    assert "PYTHONPATH" in error
    assert "not allowed" not in error


@pytest.mark.timeout(200)
def test_a_tied_head_ending_the_model_runs_as_one_stage(cluster: LocalCluster) -> None:
    """``Embedding, LayerNorm, Linear, GELU, Linear`` with the head tied to the embedding, one
    stage: it plans, trains, and the file keeps the tie."""
    spec = job(
        "tied-gpt",
        model="usermodels:tied_gpt",
        split=[(["gpu0"], [5])],
        minibatch=8,
        minibatches=6,
    )
    spec["data"] = {
        "name": "synthetic",
        "args": {"kind": "tokens", "seq": 8, "vocab": 17, "n_train": 256, "n_test": 64},
    }
    got = run(cluster, spec)
    assert sorted(got) == ["0.weight", "1.bias", "1.weight", "2.bias", "2.weight", "4.weight"]
    assert (
        got["0.weight"].untyped_storage().data_ptr() == got["4.weight"].untyped_storage().data_ptr()
    )


@pytest.mark.timeout(300)
def test_a_workers_copy_that_differs_refuses_the_job_naming_that_worker(
    cluster: LocalCluster, code_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The head and gpu0 have the submitted copy; gpu1 (restarted with another folder first
    on its PYTHONPATH) has another: the job is refused in one line naming gpu1's file and
    both hashes. gpu1 gets its old folder back afterwards."""
    path = code_dir / f"{MODULE}.py"
    path.write_text(source(8))
    other = tmp_path / "other"
    other.mkdir()
    (other / f"{MODULE}.py").write_text(source(24))
    before = os.environ.get("PYTHONPATH", "")
    try:
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(other), before) if p))
        cluster.kill("worker-gpu1")
        cluster.restart("worker-gpu1")
        info = cluster.submit(user_job("stale-worker", code={MODULE: sha(path)}), timeout=150)
    finally:
        monkeypatch.setenv("PYTHONPATH", before)
        cluster.kill("worker-gpu1")
        cluster.restart("worker-gpu1")
    assert info["state"] == "failed"
    error = info["error"]
    assert "\n" not in error
    assert f"gpu1: {other / f'{MODULE}.py'}: this host's copy of module '{MODULE}'" in error
    assert f"{sha(other / f'{MODULE}.py')[:12]}, the job was submitted with " in error
    assert sha(path)[:12] in error


@pytest.mark.timeout(300)
def test_a_shipped_module_trains_on_hosts_that_do_not_have_it(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``ship_code = true``: the module exists only where the job is submitted from; the CLI
    ships it, the head and both workers run it, and model.pt has its shapes."""
    here = tmp_path_factory.mktemp("submitter")
    (here / "hp_shipped.py").write_text(source(20))
    monkeypatch.syspath_prepend(str(here))  # the submitting side only
    root = tmp_path_factory.mktemp("ship")
    path = root / "cluster.toml"
    path.write_text(
        cluster_toml(UNIFORM[:2], shards=1, allowed_modules=["hp_shipped"], ship_code=True)
    )
    job_file = root / "job.toml"
    job_file.write_text(
        'name = "shipped"\n[model]\nname = "hp_shipped:build"\n[train]\nminibatch = 8\n'
        'minibatches = 4\n[[vw]]\ndevices = ["gpu0", "gpu1"]\nlayers = [2, 2]\n'
    )
    spec = cli._load_job_or_fail(cli.Ctx(str(path), None, None), str(job_file))
    assert set(spec.sources) == {"hp_shipped"}
    with LocalCluster(path, root / "run", timeout=60) as c:
        info = c.submit(spec.to_dict(), timeout=150)
    assert info["state"] == "done", info.get("error")
    assert torch.load(info["model_path"])["1.weight"].shape == (20, 64)
