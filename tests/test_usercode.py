"""The user's own code a job names (hetpipe.usercode), in one process: its hash, a fresh
import after an edit, the refusal of a copy that differs from the submitted one, and import
failures that say where this host looked. The daemons' side is tests/test_stale_code_e2e.py."""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import UNIFORM, job
from helpers import worker_errors

from hetpipe import cli, usercode
from hetpipe.config import ConfigError, load_cluster
from hetpipe.core.layout import StageLayout
from hetpipe.job import JobError, JobSpec
from hetpipe.jobcheck import check_job
from hetpipe.localcluster import cluster_toml
from hetpipe.models import build_model
from hetpipe.profiling import model_key
from hetpipe.usercode import UserCodeError, check_user_code, named_code

WIDTH = (
    "    return nn.Sequential(nn.Flatten(), nn.Linear(64, {w}), nn.ReLU(), nn.Linear({w}, 10))\n"
)


def source(width: int, extra: str = "") -> str:
    """A user module whose ``build`` makes an MLP with a hidden layer of ``width``."""
    return "from torch import nn\n\n\ndef build():\n" + WIDTH.format(w=width) + extra


@pytest.fixture
def folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A folder on ``sys.path`` for user modules; they are forgotten afterwards."""
    monkeypatch.syspath_prepend(str(tmp_path))
    before = set(sys.modules)
    yield tmp_path
    for name in [m for m in sys.modules if m not in before and m.startswith("hp_uc_")]:
        del sys.modules[name]
        usercode._LOADED.pop(name, None)


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def width_of(model_name: str) -> int:
    return build_model(model_name)[1].out_features


# -- which code a job names ---------------------------------------------------------------


def test_only_module_function_names_are_user_code() -> None:
    assert named_code(job("j", model="mlp")) == []
    spec = JobSpec.from_dict(job("j", model="mypkg.models:build"))
    assert [(n.key, n.module, n.function) for n in named_code(spec)] == [
        ("model.name", "mypkg.models", "build")
    ]


# -- fresh imports ------------------------------------------------------------------------


def test_an_edited_module_is_imported_again(folder: Path) -> None:
    """A module edited after this process imported it: the next check runs the new file,
    even edited within the same second to the same size (no cached bytecode is used)."""
    path = folder / "hp_uc_edit.py"
    path.write_text(source(8))
    spec = job("j", model="hp_uc_edit:build")
    assert check_user_code(spec) == {"hp_uc_edit": sha(path)}
    assert width_of("hp_uc_edit:build") == 8
    path.write_text(source(9))  # same size, same second
    assert check_user_code(spec) == {"hp_uc_edit": sha(path)}
    assert width_of("hp_uc_edit:build") == 9
    module = sys.modules["hp_uc_edit"]
    check_user_code(spec)  # unchanged: not executed again
    assert sys.modules["hp_uc_edit"] is module


def test_a_function_added_to_the_file_is_found(folder: Path) -> None:
    path = folder / "hp_uc_added.py"
    path.write_text(source(8))
    check_user_code(job("j", model="hp_uc_added:build"))
    path.write_text(source(8, "\n\ndef build_v2():\n" + WIDTH.format(w=16)))
    check_user_code(job("j", model="hp_uc_added:build_v2"))
    assert width_of("hp_uc_added:build_v2") == 16


def test_a_module_imported_elsewhere_first_is_checked_too(folder: Path) -> None:
    """Imported by plain ``import`` (not through the check), then edited: the check cannot
    know what the import ran, so it runs the file as it is now."""
    path = folder / "hp_uc_plain.py"
    path.write_text(source(8))
    assert width_of("hp_uc_plain:build") == 8  # build_model imports it the usual way
    path.write_text(source(12))
    check_user_code(job("j", model="hp_uc_plain:build"))
    assert width_of("hp_uc_plain:build") == 12


def test_a_module_in_a_package(folder: Path) -> None:
    (folder / "hp_uc_pkg").mkdir()
    (folder / "hp_uc_pkg" / "__init__.py").write_text("")
    path = folder / "hp_uc_pkg" / "models.py"
    path.write_text(source(8))
    spec = job("j", model="hp_uc_pkg.models:build")
    assert check_user_code(spec) == {"hp_uc_pkg.models": sha(path)}
    path.write_text(source(24))
    check_user_code(spec)
    assert width_of("hp_uc_pkg.models:build") == 24
    assert sys.modules["hp_uc_pkg"].models is sys.modules["hp_uc_pkg.models"]


# -- the submitted copy -------------------------------------------------------------------


def test_a_copy_that_differs_from_the_submitted_one_is_refused(folder: Path) -> None:
    path = folder / "hp_uc_differs.py"
    path.write_text(source(8))
    theirs = hashlib.sha256(source(12).encode()).hexdigest()
    spec = {**job("j", model="hp_uc_differs:build"), "code": {"hp_uc_differs": theirs}}
    with pytest.raises(UserCodeError) as info:
        check_user_code(spec, "gpu3")
    text = str(info.value)
    assert "\n" not in text
    assert text.startswith(f"gpu3: {path}: ")
    assert f"sha256 {sha(path)[:12]}, the job was submitted with {theirs[:12]}" in text
    assert info.value.key == "model.name"
    check_user_code({**spec, "code": {"hp_uc_differs": sha(path)}}, "gpu3")  # the same: fine


# -- import failures ----------------------------------------------------------------------


def test_a_module_this_host_cannot_find_says_where_it_looked(folder: Path) -> None:
    with pytest.raises(UserCodeError) as info:
        check_user_code(job("j", model="hp_uc_nowhere:build"), "head")
    text = str(info.value)
    assert "\n" not in text
    assert text.startswith("head: cannot import module 'hp_uc_nowhere' (ModuleNotFoundError")
    assert f"looked in {folder}" in text and "the Python installation" in text
    assert "PYTHONPATH" in text
    assert "not allowed" not in text


def test_a_broken_module_and_a_missing_factory_name_the_file(folder: Path) -> None:
    broken = folder / "hp_uc_broken.py"
    broken.write_text("def build(:\n")
    with pytest.raises(
        UserCodeError,
        match=rf"^cannot import module 'hp_uc_broken' "
        rf"\(SyntaxError: .*\); from {broken}: fix the file$",
    ):
        check_user_code(job("j", model="hp_uc_broken:build"))
    assert "hp_uc_broken" not in sys.modules
    good = folder / "hp_uc_nofactory.py"
    good.write_text(source(8))
    with pytest.raises(UserCodeError) as info:
        check_user_code(job("j", model="hp_uc_nofactory:build_v2"), "gpu1")
    assert str(info.value) == f"gpu1: module 'hp_uc_nofactory' ({good}) has no build_v2"


def test_a_failed_reimport_keeps_the_module_that_ran(folder: Path) -> None:
    path = folder / "hp_uc_keep.py"
    path.write_text(source(8))
    spec = job("j", model="hp_uc_keep:build")
    check_user_code(spec)
    module = sys.modules["hp_uc_keep"]
    path.write_text("raise RuntimeError('half saved')\n")
    with pytest.raises(UserCodeError, match="RuntimeError: half saved"):
        check_user_code(spec)
    assert sys.modules["hp_uc_keep"] is module


# -- the job key and the CLI --------------------------------------------------------------


def test_the_code_key_travels_with_the_job() -> None:
    digest = "ab" * 32
    spec = JobSpec.from_dict({**job("j", model="m:f"), "code": {"m": digest}}, strict=True)
    assert spec.code == {"m": digest}
    assert JobSpec.from_dict(spec.to_dict(), strict=True).code == {"m": digest}
    assert "code" not in JobSpec.from_dict(job("j")).to_dict()  # absent: as before
    for bad, where in (({"m": "x"}, "code.m"), ({"1m": digest}, "code"), ("x", "code")):
        with pytest.raises(JobError, match=rf"^f: {where}: "):
            JobSpec.from_dict({**job("j"), "code": bad}, source="f")


def test_the_profile_key_names_the_code() -> None:
    plain = JobSpec.from_dict(job("j", model="m:f"))
    a = JobSpec.from_dict({**job("j", model="m:f"), "code": {"m": "ab" * 32}})
    b = JobSpec.from_dict({**job("j", model="m:f"), "code": {"m": "cd" * 32}})
    assert len({model_key(plain), model_key(a), model_key(b)}) == 3


def test_the_cli_sends_the_hash_of_the_module_it_checked(folder: Path, tmp_path: Path) -> None:
    path = folder / "hp_uc_cli.py"
    path.write_text(source(8))
    cluster = tmp_path / "c.toml"
    cluster.write_text(cluster_toml(UNIFORM[:1], shards=1, allowed_modules=["hp_uc_cli"]))
    job_file = tmp_path / "job.toml"
    job_file.write_text(
        'name = "j"\n[model]\nname = "hp_uc_cli:build"\n[train]\nminibatch = 8\nminibatches = 1\n'
    )
    spec = cli._load_job_or_fail(cli.Ctx(str(cluster), None, None), str(job_file))
    assert spec.code == {"hp_uc_cli": sha(path)}
    assert spec.to_dict()["code"] == {"hp_uc_cli": sha(path)}


def test_the_head_check_names_the_head_and_the_key(folder: Path, tmp_path: Path) -> None:
    cluster = tmp_path / "c.toml"
    cluster.write_text(cluster_toml(UNIFORM[:1], shards=1, allowed_modules=["hp_uc_gone"]))
    spec = JobSpec.from_dict(job("j", model="hp_uc_gone:build", minibatch=8))
    with pytest.raises(JobError) as info:
        check_job(spec, load_cluster(cluster), "job", host="head")
    assert str(info.value).startswith(
        "job: model.name: head: cannot import module 'hp_uc_gone' (ModuleNotFoundError"
    )


def test_the_cli_names_a_module_it_cannot_import_without_a_policy_word(
    folder: Path, tmp_path: Path
) -> None:
    cluster = tmp_path / "c.toml"
    cluster.write_text(cluster_toml(UNIFORM[:1], shards=1, allowed_modules=["hp_uc_absent"]))
    job_file = tmp_path / "job.toml"
    job_file.write_text(
        'name = "j"\n[model]\nname = "hp_uc_absent:build"\n[train]\nminibatch = 8\n'
        "minibatches = 1\n"
    )
    result = CliRunner().invoke(
        cli.main,
        ["--cluster", str(cluster), "--head", "tcp://127.0.0.1:9", "submit", str(job_file)],
    )
    assert result.exit_code == 1, result.output
    assert result.output.startswith(
        f"Error: {job_file}: model.name: cannot import module 'hp_uc_absent'"
    ), result.output
    assert "not allowed" not in result.output


# -- a worker, before it builds anything ---------------------------------------------------


def test_a_worker_refuses_a_copy_that_differs_and_names_a_module_it_cannot_import(
    folder: Path, tmp_path: Path
) -> None:
    path = folder / "hp_uc_worker.py"
    path.write_text(source(8))
    cluster = tmp_path / "c.toml"
    cluster.write_text(
        cluster_toml(UNIFORM[:1], shards=1, allowed_modules=["hp_uc_worker", "hp_uc_lost"])
    )
    theirs = "0" * 64
    tampered = {**job("j", model="hp_uc_worker:build"), "code": {"hp_uc_worker": theirs}}
    errors = worker_errors(cluster, tampered, "j-1", StageLayout(("gpu0",), 0, 4))
    assert len(errors) == 2, errors
    for error in errors:
        assert "\n" not in error
        assert error.startswith("gpu0: ")
        assert f"{path}: this host's copy of module 'hp_uc_worker' has sha256 " in error
        assert f"{sha(path)[:12]}, the job was submitted with {theirs[:12]}" in error
    errors = worker_errors(
        cluster, job("j", model="hp_uc_lost:build"), "j-1", StageLayout(("gpu0",), 0, 4)
    )
    assert len(errors) == 2, errors
    for error in errors:
        assert "gpu0: " in error and "cannot import module 'hp_uc_lost'" in error
        assert f"looked in {folder}" in error
        assert "not allowed" not in error


# -- code shipped with the job ([security] ship_code) -------------------------------------


def test_a_shipped_source_runs_instead_of_this_hosts_copy(folder: Path) -> None:
    """The host has another copy (width 8), or none: the shipped bytes (width 12) run, from a
    content-addressed file of this host's, and the job's hash is theirs."""
    shipped = source(12)
    code = {"hp_uc_ship": hashlib.sha256(shipped.encode()).hexdigest()}
    spec = JobSpec.from_dict(
        {**job("j", model="hp_uc_ship:build"), "code": code, "sources": {"hp_uc_ship": shipped}}
    )
    assert check_user_code(spec, "gpu1") == code  # no copy on this host at all
    assert width_of("hp_uc_ship:build") == 12
    (folder / "hp_uc_ship.py").write_text(source(8))  # a copy that differs appears
    assert check_user_code(spec, "gpu1") == code
    assert width_of("hp_uc_ship:build") == 12
    ran = Path(sys.modules["hp_uc_ship"].__file__)
    assert ran.read_text() == shipped and code["hp_uc_ship"] in str(ran)


def test_a_shipped_source_must_match_its_hash(folder: Path) -> None:
    bad = {
        **job("j", model="hp_uc_ship2:build"),
        "code": {"hp_uc_ship2": "0" * 64},
        "sources": {"hp_uc_ship2": source(8)},
    }
    with pytest.raises(JobError, match=r"sources\.hp_uc_ship2: does not match the module's hash"):
        JobSpec.from_dict(bad)
    with pytest.raises(JobError, match=r"sources\.hp_uc_ship2: does not match"):
        JobSpec.from_dict({**bad, "code": {}})  # a source without its hash
    with pytest.raises(JobError, match=r"sources: expected a table of module = source text"):
        JobSpec.from_dict({**bad, "sources": "x"})


def test_a_shipped_module_that_fails_names_the_shipped_file(folder: Path) -> None:
    broken = "raise RuntimeError('boom')\n"
    spec = {
        **job("j", model="hp_uc_ship3:build"),
        "code": {"hp_uc_ship3": hashlib.sha256(broken.encode()).hexdigest()},
        "sources": {"hp_uc_ship3": broken},
    }
    with pytest.raises(UserCodeError) as info:
        check_user_code(JobSpec.from_dict(spec), "gpu2")
    text = str(info.value)
    assert "\n" not in text and text.startswith("gpu2: cannot import module 'hp_uc_ship3'")
    assert "RuntimeError: boom" in text and "(shipped with the job)" in text


def test_the_cli_ships_sources_where_the_cluster_says_so(folder: Path, tmp_path: Path) -> None:
    path = folder / "hp_uc_cliship.py"
    path.write_text(source(8))
    cluster = tmp_path / "c.toml"
    cluster.write_text(
        cluster_toml(UNIFORM[:1], shards=1, allowed_modules=["hp_uc_cliship"], ship_code=True)
    )
    job_file = tmp_path / "job.toml"
    job_file.write_text(
        'name = "j"\n[model]\nname = "hp_uc_cliship:build"\n[train]\nminibatch = 8\n'
        "minibatches = 1\n"
    )
    spec = cli._load_job_or_fail(cli.Ctx(str(cluster), None, None), str(job_file))
    assert spec.sources == {"hp_uc_cliship": source(8)}
    assert spec.code == {"hp_uc_cliship": sha(path)}
    assert JobSpec.from_dict(spec.to_dict()).sources == spec.sources  # travels on the wire


def test_shipping_code_needs_curve(tmp_path: Path) -> None:
    cluster = tmp_path / "c.toml"
    cluster.write_text(cluster_toml(UNIFORM[:1], shards=1, curve=False, ship_code=True))
    with pytest.raises(ConfigError, match=r"ship_code: needs curve = true"):
        load_cluster(cluster)
