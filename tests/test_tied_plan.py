"""A model whose last layers hold no state of their own plans: GPT's tied output head.

``Embedding, LayerNorm, Linear, GELU, Linear`` with the head's weight tied to the embedding
leaves the last two layers without a tensor of their own on the shards (the tie has one
entry, under the embedding's name); the placement counts the layers from the stages. The
worker's profile names the tie, and the head keeps it with the profile the planner reads
(what the planner does with it: tests/test_tie_costs.py)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from conftest import UNIFORM, job, user_code_cluster

from hetpipe.config import DeviceSpec, load_cluster
from hetpipe.job import JobSpec
from hetpipe.jobplan import place_state, plan_job, requested_layouts
from hetpipe.localcluster import cluster_toml
from hetpipe.measure import measure
from hetpipe.models import build_model
from hetpipe.modelstate import StateLayout
from hetpipe.planner import ProfileStore, place_stages
from hetpipe.profiling import model_key

SHARDS = {0: "tcp://127.0.0.1:7100", 1: "tcp://127.0.0.1:7101"}


def tied_job(layers: list[int]) -> dict[str, Any]:
    """``usermodels:tied_gpt`` on gpu0.. with one stage per entry of ``layers``."""
    spec = job(
        "tied-gpt",
        model="usermodels:tied_gpt",
        split=[([f"gpu{i}" for i in range(len(layers))], layers)],
        minibatch=8,
        minibatches=4,
    )
    spec["data"] = {
        "name": "synthetic",
        "args": {"kind": "tokens", "seq": 8, "vocab": 17, "n_train": 64, "n_test": 16},
    }
    return spec


def shared_state(spec: JobSpec) -> dict[str, torch.Tensor]:
    torch.manual_seed(spec.seed)
    model = build_model(spec.model.name, spec.model.args)
    everything = model.state_dict()
    return {n: everything[n] for n in StateLayout.of(model).shared}


def test_place_state_counts_layers_without_state_of_their_own() -> None:
    spec = JobSpec.from_dict(tied_job([5]))
    state = shared_state(spec)
    assert "4.weight" not in state and max(int(n.split(".")[0]) for n in state) == 2
    hosts = {"gpu0": "127.0.0.1"}
    placement = place_state(state, requested_layouts(spec), hosts, SHARDS)
    assert set(placement) == set(state)
    assert len(set(placement.values())) == 1  # one stage: one shard of its host


def test_a_tied_one_stage_job_plans(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(cluster_toml(UNIFORM[:2], shards=2))
    spec = JobSpec.from_dict(tied_job([5]))
    workers = {d: SimpleNamespace(job=None) for d in ("gpu0", "gpu1")}
    plan = plan_job(spec, "tied-gpt-1", load_cluster(path), workers, SHARDS)
    assert set(plan.placement) == {"0.weight", "1.weight", "1.bias", "2.weight", "2.bias"}
    assert plan.predicted["state_bytes"]["0/0"] == sum(
        t.numel() * t.element_size() for t in shared_state(spec).values()
    )


def test_place_stages_says_when_stages_outrun_the_layers() -> None:
    shard = SimpleNamespace(index=0, host="h")
    with pytest.raises(ValueError, match=r"stage layers 3\.\.4 lie outside the 3 layers"):
        place_stages([shard], [[("h", (0, 3)), ("h", (3, 5))]], [4, 4, 4])


def test_the_workers_profile_names_the_tie() -> None:
    """Both layers using the tie count it (each is measured alone); the tie says which and
    how many bytes, so the planner counts it once on a stage holding both."""
    spec = JobSpec.from_dict(tied_job([5]))
    cpu = DeviceSpec("gpu0", "cpu", "fast", 1 << 30, 1.0, 0, "node0", "127.0.0.1")
    info = measure(spec, cpu)
    tie = 17 * 16 * 4
    assert info["ties"] == [{"name": "0.weight", "layers": [0, 4], "nbytes": tie}]
    assert info["layers"][0]["param_bytes"] == info["layers"][4]["param_bytes"] == tie


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_planned_tied_job_keeps_the_tie_in_the_profile(tmp_path_factory) -> None:
    """Without a split, the workers profile the tied model for the head's planner: the stored
    profile holds the tie, and the planned job trains."""
    cluster = user_code_cluster(tmp_path_factory, "usermodels")
    try:
        spec = tied_job([5])
        spec.pop("vw", None)
        spec["train"].pop("nm", None)
        spec["train"]["vws"] = 1
        info = cluster.submit(spec, timeout=280)
        assert info["state"] == "done", info.get("error")
        store = ProfileStore(cluster.run_dir / "profiles.json")
        prof = store.model_profile(model_key(JobSpec.from_dict(spec)), 8)
        assert prof is not None
        assert [(t.name, t.layers, t.nbytes) for t in prof.ties] == [
            ("0.weight", (0, 4), 17 * 16 * 4)
        ]
    finally:
        cluster.stop()
