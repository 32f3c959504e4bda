"""The recipes under ``workers/`` agree with the code.

- The systemd units pass ``systemd-analyze verify`` where it is available, and always have
  the fields a supervised daemon needs (parsed).
- The Kubernetes manifest parses; its cluster file loads; replicas, shard addresses, the
  mounted cluster file, key folder and run directory agree with what the commands use.
- Every ``hetpipe``, ``hetpipe-ps`` and ``hetpipe-worker`` command line in the units, the
  manifest, the batch script and ``workers/README.md`` uses only subcommands and options the
  real CLI accepts (its ``--help`` lists them).
- The docs of ``workers/`` say what the main docs say about a head restart: a running job is
  resumed from its last checkpoint, not lost.
"""

from __future__ import annotations

import configparser
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner

from hetpipe.config import load_cluster

ROOT = Path(__file__).resolve().parents[1]
WORKERS = ROOT / "workers"
UNITS = sorted(WORKERS.glob("*.service"))
MANIFEST = WORKERS / "kubernetes" / "hetpipe.yaml"
SBATCH = WORKERS / "slurm" / "hetpipe.sbatch"
README = WORKERS / "README.md"
PROGRAMS = ("hetpipe-worker", "hetpipe-ps", "hetpipe")


def _programs() -> dict[str, click.Command]:
    from hetpipe.cli import main as cli
    from hetpipe.ps import main as ps
    from hetpipe.worker import main as worker

    return {"hetpipe": cli, "hetpipe-ps": ps, "hetpipe-worker": worker}


# -- command lines ---------------------------------------------------------------------------


# the word before a program name where it starts a shell command (else it is prose)
STARTERS = {"", "exec", "sudo", "env", "/usr/bin/env", "&&", "||", "|", ";", "--", "$", "-"}
# where a shell command ends: a pipe, ``;``, ``&``, a redirection, a closing quote or bracket
END = re.compile(r"[|;&)`']|\s\d?>|\s#")


def command_lines(text: str) -> list[list[str]]:
    """Every ``hetpipe*`` command line in ``text`` as words, from the program name to the end
    of its shell command; backslash continuations are joined, comment markers dropped. A
    program name counts where it starts a command (first word, after ``exec``, ``&&``, …, or
    as a path) and is followed by an option or one of its subcommands."""
    programs = _programs()
    text = re.sub(r"\\\n\s*#?", " ", text)
    out = []
    for line in text.splitlines():
        line = line.strip().lstrip("#").strip()
        for m in re.finditer(r"\S+", line):
            word = m.group().lstrip("\"'($`")
            name = word.rsplit("/", 1)[-1]
            if name not in PROGRAMS:
                continue
            before = line[: m.start()].split()
            prev = before[-1].lstrip("\"'($`") if before else ""
            if "/" not in word and prev not in STARTERS:
                continue
            rest = END.split(line[m.end() :])[0]
            try:
                words = shlex.split(rest)
            except ValueError:
                words = rest.split()
            cmd = programs[name]
            first = words[0] if words else ""
            if not (
                first.startswith("-") or (isinstance(cmd, click.Group) and first in cmd.commands)
            ):
                continue
            out.append([name, *words])
    return out


def _option_names(cmd: click.Command) -> dict[str, bool]:
    """Option name -> whether it takes a value."""
    names: dict[str, bool] = {}
    for p in cmd.params:
        if isinstance(p, click.Option):
            for n in (*p.opts, *p.secondary_opts):
                names[n] = not (p.is_flag or p.count)
    names["--help"] = False
    return names


def check_command(words: list[str], programs: dict[str, click.Command]) -> list[str]:
    """What ``words`` uses that the CLI does not accept (empty when all is accepted)."""
    cmd = programs[words[0]]
    path = [words[0]]
    problems = []
    i = 1
    while i < len(words):
        w = words[i].lstrip("[").rstrip("]")  # "[--opt" in a usage line
        if w.startswith("$") or w.startswith('"$'):
            i += 1  # a shell variable: options supplied at run time
            continue
        if w.startswith("--"):
            name = w.split("=", 1)[0]
            takes = _option_names(cmd)
            if name not in takes:
                problems.append(f"{' '.join(path)}: no option {name}")
            i += 2 if takes.get(name) and "=" not in w else 1
            continue
        if isinstance(cmd, click.Group):
            sub = cmd.commands.get(w)
            if sub is None:
                if w.isidentifier() or re.fullmatch(r"[a-z][a-z-]*", w):
                    problems.append(f"{' '.join(path)}: no subcommand {w}")
                break
            cmd = sub
            path.append(w)
        i += 1
    # its --help works at the level reached
    r = CliRunner().invoke(programs[words[0]], [*path[1:], "--help"])
    if r.exit_code != 0:
        problems.append(f"{' '.join(path)} --help: exit {r.exit_code}: {r.output}")
    return problems


@pytest.mark.parametrize(
    "path", [*UNITS, MANIFEST, SBATCH, README], ids=lambda p: str(p.relative_to(WORKERS))
)
def test_every_command_line_is_accepted_by_the_cli(path: Path) -> None:
    text = path.read_text()
    if path == MANIFEST:  # and the containers' commands as Kubernetes runs them (YAML folded)
        for obj in _manifest().values():
            for c in obj.get("spec", {}).get("template", {}).get("spec", {}).get("containers", []):
                text += "\n" + "\n".join([*c.get("command", []), *c.get("args", [])])
    lines = command_lines(text)
    assert lines, f"{path}: no hetpipe command found"
    programs = _programs()
    problems = [p for words in lines for p in check_command(words, programs)]
    assert not problems, "\n".join(problems)


def test_the_checker_catches_an_unknown_option_and_subcommand() -> None:
    programs = _programs()
    (ps,) = command_lines("exec hetpipe-ps --cluster c.toml --shard 0 --bogus 1")
    assert check_command(ps, programs) == ["hetpipe-ps: no option --bogus"]
    (cli,) = command_lines("  hetpipe --cluster x.toml stauts --json | python")
    assert check_command(cli, programs) == ["hetpipe: no subcommand stauts"]
    (ok,) = command_lines("hetpipe --cluster x.toml submit job.toml --wait")
    assert check_command(ok, programs) == []


def test_extra_options_the_docs_suggest_are_accepted() -> None:
    """The units' and the manifest's HETPIPE_*_ARGS examples."""
    programs = _programs()
    text = "\n".join(p.read_text() for p in (*UNITS, MANIFEST, README))
    for program, var in (("hetpipe-worker", "WORKER"), ("hetpipe-ps", "PS")):
        found = re.findall(rf'HETPIPE_{var}_ARGS[=:]\s*"?(--[^"\n]+)"?', text)
        found += [m for m in re.findall(r"value: \"(--[^\"]+)\"", text) if var == "WORKER"]
        assert found, f"no HETPIPE_{var}_ARGS example"
        for example in found:
            assert check_command([program, *shlex.split(example)], programs) == [], example


# -- systemd ---------------------------------------------------------------------------------


def _unit(path: Path) -> configparser.RawConfigParser:
    parser = configparser.RawConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string(path.read_text())
    return parser


@pytest.mark.parametrize("path", UNITS, ids=lambda p: p.name)
def test_unit_has_what_a_supervised_daemon_needs(path: Path) -> None:
    u = _unit(path)
    assert u["Unit"]["Description"]
    s = u["Service"]
    assert s["ExecStart"].startswith("/")  # systemd wants an absolute path
    assert s["KillSignal"] == "SIGTERM"  # the daemons stop cleanly on it
    assert s["Restart"] == "on-failure"
    assert s["StateDirectory"] == "hetpipe" and s["WorkingDirectory"] == "/var/lib/hetpipe"
    assert u["Install"]["WantedBy"] == "multi-user.target"
    assert "--cluster /etc/hetpipe/cluster.toml" in s["ExecStart"]
    assert "%i" in s["ExecStart"]  # a template: one instance per device or shard
    if "hetpipe-ps" in s["ExecStart"]:
        assert "--shard %i" in s["ExecStart"]
        assert "--run-dir /var/lib/hetpipe" in s["ExecStart"]  # = StateDirectory
    else:
        assert "--device %i" in s["ExecStart"]


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze here")
@pytest.mark.parametrize("path", UNITS, ids=lambda p: p.name)
def test_systemd_analyze_verify(path: Path, tmp_path: Path) -> None:
    unit = tmp_path / path.name
    shutil.copy(path, unit)
    r = subprocess.run(
        ["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60
    )
    said = [line for line in (r.stdout + r.stderr).splitlines() if path.name in line]
    assert r.returncode == 0 and not said, r.stdout + r.stderr


# -- Kubernetes ------------------------------------------------------------------------------


def _manifest() -> dict[str, dict[str, Any]]:
    yaml = pytest.importorskip("yaml")
    docs = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]
    return {d["kind"]: d for d in docs}


def _container(obj: dict[str, Any]) -> dict[str, Any]:
    (c,) = obj["spec"]["template"]["spec"]["containers"]
    return c


def test_manifest_agrees_with_its_cluster_file(tmp_path: Path) -> None:
    kinds = _manifest()
    assert set(kinds) == {"Namespace", "ConfigMap", "Service", "StatefulSet", "DaemonSet"}
    path = tmp_path / "cluster.toml"
    path.write_text(kinds["ConfigMap"]["data"]["cluster.toml"])
    cluster = load_cluster(path)

    ps, workers = kinds["StatefulSet"], kinds["DaemonSet"]
    assert ps["spec"]["replicas"] == len(cluster.ps)
    # the StatefulSet is pinned to the node whose address every shard has
    pinned = ps["spec"]["template"]["spec"]["nodeSelector"]["kubernetes.io/hostname"]
    (node,) = [n for n in cluster.nodes if n.name == pinned]
    assert {s.host for s in cluster.ps} == {node.host}
    for obj in (ps, workers):
        spec = obj["spec"]["template"]["spec"]
        assert spec["hostNetwork"] is True  # daemons bind the file's node addresses
        c = _container(obj)
        mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
        volumes = {v["name"]: v for v in spec["volumes"]}
        # the cluster file is mounted where the commands read it
        assert volumes["cluster"]["configMap"]["name"] == kinds["ConfigMap"]["metadata"]["name"]
        assert "--cluster /etc/hetpipe/cluster.toml" in " ".join(c["args"]) or (
            "cluster=/etc/hetpipe/cluster.toml" in " ".join(c["args"])
        )
        assert mounts["cluster"] == "/etc/hetpipe"
        # the key folder of [security] keys is the mounted Secret
        assert mounts["keys"] == str(cluster.security.keys)
        assert volumes["keys"]["secret"]["secretName"] == "hetpipe-keys"
    ps_c = _container(ps)
    assert "--run-dir /var/lib/hetpipe" in " ".join(ps_c["args"])
    assert {m["mountPath"] for m in ps_c["volumeMounts"]} >= {str(cluster.runtime.run_dir)}
    # the worker pod asks for every GPU the file lists on a node
    per_node = {n.name: len(n.devices) for n in cluster.nodes}
    limit = _container(workers)["resources"]["limits"]["nvidia.com/gpu"]
    assert limit == max(per_node.values())
    for n in cluster.nodes:  # the naming convention the worker pod relies on
        assert [d.name for d in n.devices] == [f"{n.name}-gpu{i}" for i in range(len(n.devices))]
        assert [d.device for d in n.devices] == [f"cuda:{i}" for i in range(len(n.devices))]


# -- the docs --------------------------------------------------------------------------------

LOST = re.compile(
    r"(a |the )?(running )?job[^.]*\b(is|are) lost\b|running at that moment fails"
    r"|the next one starts afresh",
    re.IGNORECASE,
)


@pytest.mark.parametrize("path", [*UNITS, README, MANIFEST, SBATCH], ids=lambda p: p.name)
def test_workers_docs_say_a_head_restart_resumes_the_running_job(path: Path) -> None:
    text = path.read_text()
    assert not LOST.search(text), LOST.search(text)


def test_workers_readme_and_ps_unit_tell_of_the_resume() -> None:
    for path in (README, WORKERS / "hetpipe-ps@.service"):
        text = " ".join(path.read_text().split())
        assert re.search(r"resumed? (it )?from its last checkpoint", text), path
