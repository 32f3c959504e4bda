"""The key schema (hetpipe.core.keys): the parsers accept exactly the declared keys, read each
one, take its declared default; the references in docs/ are its rendering; it is pure."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hetpipe import config
from hetpipe.config import ConfigError, DeviceSpec, RuntimeSpec, load_cluster, parse_size
from hetpipe.core import keys
from hetpipe.core.keys import CLUSTER, JOB, Schema
from hetpipe.job import JobError, JobSpec, OptimizerSpec
from hetpipe.security import SecuritySpec

ROOT = Path(__file__).resolve().parent.parent

# every table present, each with only what it needs
JOB_DOC: dict[str, Any] = {
    "name": "k",
    "model": {"name": "mlp"},
    "data": {},
    "optimizer": {},
    "train": {"minibatch": 4, "minibatches": 9},
    "vw": [{"devices": ["g0"]}],
    "fault": [{"vw": 0, "stage": 0, "minibatch": 0, "seconds": 1.0}],
}
DEVICE = {"device": "cpu", "type": "t", "memory": "1GiB"}
CLUSTER_DOC: dict[str, Any] = {
    "ps": {"shards": ["127.0.0.1:0"]},
    "network": {"link": [{"a": "g0", "b": "g1", "gbps": 1.0}]},
    "runtime": {},
    "security": {},
    "node": [
        {
            "name": "n0",
            "host": "127.0.0.1",
            "device": [{"name": "g0", **DEVICE}, {"name": "g1", **DEVICE}],
        }
    ],
}


def at(doc: dict[str, Any], section: str) -> tuple[dict[str, Any], str]:
    """The table of ``section`` in ``doc`` (the first of an array) and its key path prefix."""
    table, prefix = doc, ""
    for part in section.split(".") if section else ():
        table = table.setdefault(part, {})
        prefix += part
        if isinstance(table, list):
            table, prefix = table[0], prefix + "[0]"
        prefix += "."
    return table, prefix


def load(schema: Schema, doc: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> object:
    """Parse ``doc`` as a job dict or as a cluster file (its TOML read stubbed)."""
    if schema is JOB:
        return JobSpec.from_dict(doc, source="f")
    monkeypatch.setattr(config, "read_toml", lambda path, error: (doc, str(path)))
    return load_cluster("f")


def error(schema: Schema, doc: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> str:
    with pytest.raises((JobError, ConfigError)) as info:
        load(schema, doc, monkeypatch)
    return str(info.value)


BASES = {"job": (JOB, JOB_DOC), "cluster": (CLUSTER, CLUSTER_DOC)}


@pytest.mark.parametrize("which", BASES)
def test_the_base_documents_load(which: str, monkeypatch: pytest.MonkeyPatch) -> None:
    schema, doc = BASES[which]
    load(schema, copy.deepcopy(doc), monkeypatch)


@pytest.mark.parametrize(
    ("which", "section"),
    [(w, s.path) for w, (schema, _) in BASES.items() for s in schema.sections],
)
def test_each_table_accepts_exactly_the_declared_keys(
    which: str, section: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The parser's list of allowed keys (what its refusal names) is the schema's."""
    schema, base = BASES[which]
    doc = copy.deepcopy(base)
    table, prefix = at(doc, section)
    table["zz_unknown"] = 1
    text = error(schema, doc, monkeypatch)
    head = f"f: {prefix}zz_unknown: unknown key (allowed: "
    assert text.startswith(head), text
    accepted = text.removeprefix(head).removesuffix(")").split(", ")
    assert accepted == sorted(schema.allowed(section))


@pytest.mark.parametrize(
    ("which", "path"),
    [(w, k.path) for w, (schema, _) in BASES.items() for k in schema.declared()],
)
def test_each_declared_key_is_read(which: str, path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A value of the wrong type is refused naming that key: the parser reads every key the
    schema declares (none is accepted and then ignored)."""
    schema, base = BASES[which]
    key = schema[path]
    doc = copy.deepcopy(base)
    table, prefix = at(doc, key.section)
    table[key.name] = "text" if key.type == "table" else {"x": 1}
    assert error(schema, doc, monkeypatch).startswith(f"f: {prefix}{key.name}: ")


def test_an_absent_job_key_takes_its_declared_default() -> None:
    doc = {k: v for k, v in copy.deepcopy(JOB_DOC).items() if k not in ("vw", "fault")}
    values = JobSpec.from_dict(doc).key_values()
    for key in JOB.declared():
        if key.required or key.section in ("vw", "fault") or key.name in at(doc, key.section)[0]:
            continue
        assert values[key.path] == key.default, key.path
    adamw = JobSpec.from_dict({**doc, "optimizer": {"name": "adamw"}}).optimizer
    assert adamw.weight_decay == keys.ADAMW_WEIGHT_DECAY  # its default_doc says so


def test_an_absent_cluster_key_takes_its_declared_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cluster = load(CLUSTER, copy.deepcopy(CLUSTER_DOC), monkeypatch)
    assert isinstance(cluster, config.ClusterConfig)
    device = cluster.devices[0]
    got = {
        "network.intra_node_gbps": cluster.network.intra_node_gbps,
        "network.inter_node_gbps": cluster.network.inter_node_gbps,
        "node.device.speed": device.speed,
        "node.device.port": device.port,
        "node.device.host_gbps": device.host_gbps,
        "security.curve": cluster.security.curve,
        "security.allowed_modules": list(cluster.security.allowed_modules),
    }
    for name, value in vars(cluster.runtime).items():
        got[f"runtime.{name}"] = value
    for path, value in got.items():
        want = CLUSTER[path].default
        if CLUSTER[path].type == "size":
            want = parse_size(want)
        assert value == want, path
    assert {k.path for k in CLUSTER.declared() if k.section == "runtime"} <= got.keys()


def test_the_spec_types_default_as_declared() -> None:
    """The dataclasses' own defaults (a spec made in code) are the declared ones."""
    opt = OptimizerSpec()
    for name in ("name", "lr", "momentum", "weight_decay", "nesterov", "betas", "eps"):
        assert getattr(opt, name) == JOB.default(f"optimizer.{name}"), name
    runtime = RuntimeSpec()
    for key in CLUSTER.section("runtime").keys:
        want = parse_size(key.default) if key.type == "size" else key.default
        assert getattr(runtime, key.name) == want, key.path
    assert SecuritySpec() == SecuritySpec(
        CLUSTER.default("security.curve"),
        CLUSTER.default("security.keys"),
        CLUSTER.default("security.allowed_modules"),
    )
    assert DeviceSpec("d", "cpu", "t", 1, 1.0, 0, "n", "h").host_gbps == CLUSTER.default(
        "node.device.host_gbps"
    )


def test_choices_and_bounds_kept_elsewhere_are_the_declared_ones() -> None:
    from hetpipe.core.memory import ACTIVATION_POLICIES
    from hetpipe.hostmem import MAX_RETAIN_MIB

    assert JOB["train.activations"].choices == ACTIVATION_POLICIES
    assert CLUSTER["runtime.retain_freed_mib"].high == MAX_RETAIN_MIB


def test_every_rule_reads_keys_a_job_has() -> None:
    """Each rule evaluates on a job's values (its predicate names no missing key), and holds
    for a plain async sgd job with no [[vw]] tables where it should."""
    doc = {k: v for k, v in copy.deepcopy(JOB_DOC).items() if k not in ("vw", "fault")}
    values = JobSpec.from_dict(doc).key_values()
    ruled = [k for k in JOB.declared() if k.applies is not None]
    assert {k.path for k in ruled} >= {
        "train.staleness",
        "optimizer.momentum",
        "optimizer.nesterov",
        "optimizer.betas",
        "optimizer.eps",
        "train.predict_variant",
        "train.policy",
        "train.in_flight",
    }
    for key in ruled:
        assert isinstance(key.applies.holds(values), bool), key.path
        assert not JOB.section(key.section).array  # no_effect reads plain tables only
    assert all(k.applies is None for k in CLUSTER.declared())


def test_no_effect_names_the_first_idle_key() -> None:
    values = {"train.schedule": "gpipe", "optimizer.name": "sgd", "vw": 0}
    assert keys.no_effect(JOB, values, ["optimizer.momentum"]) is None
    assert keys.no_effect(JOB, values, ["optimizer.momentum", "train.staleness"]) == (
        "train.staleness: has no effect with schedule 'gpipe' (synchronous)"
    )


def test_docs_are_the_schema_rendered() -> None:
    """docs/jobs.md and docs/cluster.md are generated; regenerate, never edit them."""
    for name, schema in keys.DOCS.items():
        path = ROOT / "docs" / name
        assert path.is_file() and path.read_text() == keys.render(schema), (
            f"{path} differs from hetpipe/core/keys.py: run `python -m hetpipe.core.keys "
            "--write docs`"
        )


def test_docs_list_every_key_with_its_default_and_where_it_applies() -> None:
    text = keys.render(JOB)
    for key in JOB.declared():
        assert f"| `{key.name}` |" in text
    assert (
        '| `staleness` | integer | 0 | >= 0, <= 2^16 | train.schedule is "async" or "auto" |'
        in text
    )
    assert (
        '| `policy` | string | "auto" | "auto", "np", "ed", "hd" | no [[vw]] tables, or '
        'train.on_worker_loss is "replan" |' in text
    )


def test_write_then_check(tmp_path: Path) -> None:
    assert keys.main(["--check", str(tmp_path)]) == 1
    assert keys.main(["--write", str(tmp_path)]) == 0
    assert keys.main(["--check", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cluster.md", "jobs.md"]


def test_the_schema_is_pure() -> None:
    """Importing the schema (as the job and cluster parsers do) pulls in no torch, asyncio
    or zmq."""
    code = (
        "import sys, hetpipe.core.keys\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'asyncio', 'zmq')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert out.stdout.strip() == "[]", out.stdout
