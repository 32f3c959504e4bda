"""A tie spanning stages (GPT's input embedding on the first stage, its output head on the
last): each stage that uses it holds a copy, the shards one entry, and the export the tie.

Synchronous schedules sum the tie's gradient over its copies before each steps (Megatron's
way), so training is exactly plain PyTorch's; the asynchronous one lets each copy step on its
own use's gradient and push to the one entry, which with Nm = 1 on a lone virtual worker and
an optimizer linear in the gradient is again plain PyTorch's (docs/own-models.md).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from conftest import UNIFORM, assert_same_weights, job, user_code_cluster
from helpers import plain_training

from hetpipe.checkpoint import Checkpoint, stage_file
from hetpipe.config import load_cluster
from hetpipe.head.recovery import stage_restores
from hetpipe.job import JobSpec
from hetpipe.jobplan import JobPlanError, plan_job
from hetpipe.localcluster import LocalCluster, cluster_toml
from hetpipe.models import build_model
from hetpipe.modelstate import StateLayout
from hetpipe.pipeline import TieRoute

HERE = Path(__file__).resolve().parent
SHARDS = {0: "tcp://127.0.0.1:7100", 1: "tcp://127.0.0.1:7101"}
M = 4
ITERATIONS = 8
TIE = "0.weight"  # the embedding's name: canonical; "4.weight" (the head) is its alias


def tied_job(name: str, splits: list[list[int]], **kw: Any) -> dict[str, Any]:
    """``usermodels:tied_gpt`` with one virtual worker per entry of ``splits`` (its layers per
    stage), on consecutive devices from gpu0, over the synthetic token data."""
    devices = iter(f"gpu{i}" for i in range(8))
    split = [([next(devices) for _ in layers], layers) for layers in splits]
    spec = job(name, model="usermodels:tied_gpt", split=split, minibatch=8, **kw)
    spec["data"] = {
        "name": "synthetic",
        "args": {"kind": "tokens", "seq": 8, "vocab": 17, "n_train": 64, "n_test": 16},
    }
    return spec


def sync_job(name: str, kind: str, splits: list[list[int]], **kw: Any) -> dict[str, Any]:
    return tied_job(name, splits, nm=M, minibatches=M * ITERATIONS, train={"schedule": kind}, **kw)


def assert_tie_exported(got: dict[str, torch.Tensor]) -> None:
    """The export has the tie as the user's model has it: both names, one storage, and a
    strict load makes them one parameter again."""
    assert got["4.weight"].untyped_storage().data_ptr() == got[TIE].untyped_storage().data_ptr()
    model = build_model("usermodels:tied_gpt")
    model.load_state_dict(got, strict=True)
    assert model[4].weight is model[0].weight


# -- pure parts ------------------------------------------------------------------------------


def test_layout_gives_each_stage_a_copy_under_the_canonical_name() -> None:
    with torch.device("meta"):
        layout = StateLayout.of(build_model("usermodels:tied_gpt"))
    assert layout.spanning([(0, 2), (2, 5)]) == {TIE: [0, 1]}
    assert layout.spanning([(0, 1), (1, 2), (2, 4), (4, 5)]) == {TIE: [0, 3]}
    assert layout.spanning([(0, 5)]) == {}  # kept together: nothing to do
    last = layout.on_stage(2, 5)
    assert last.params == (TIE, "2.weight", "2.bias")
    assert last.aliases == {"4.weight": TIE}
    first = layout.on_stage(0, 2)
    assert first.params == (TIE, "1.weight", "1.bias") and first.aliases == {}
    assert layout.on_stage(1, 4).params == ("1.weight", "1.bias", "2.weight", "2.bias")
    assert layout.holds(TIE, 4, 5) and layout.holds(TIE, 0, 1) and not layout.holds(TIE, 1, 4)


def test_tie_route_relays_along_the_pipeline() -> None:
    """k = 4, the tie on stages 0 and 3: each copy's sum goes towards the other, and the
    stages between pass both on."""
    ties = {TIE: [0, 3]}
    r0, r1, r2, r3 = (TieRoute(ties, s) for s in range(4))
    assert (r0.up, r0.down, r0.used) == ({(0, TIE)}, set(), {(0, TIE), (3, TIE)})
    assert (r1.up, r1.down, r1.used) == ({(0, TIE)}, {(3, TIE)}, set())
    assert r1.wanted == r2.wanted == {(0, TIE), (3, TIE)}
    assert (r3.up, r3.down, r3.wanted) == (set(), {(3, TIE)}, {(0, TIE)})
    assert all(r.takes_part for r in (r0, r1, r2, r3))
    assert not TieRoute({TIE: [0, 1]}, 2).takes_part


def test_plan_keeps_one_entry_and_tells_every_copy(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(cluster_toml(UNIFORM, shards=2))
    spec = JobSpec.from_dict(tied_job("tied-plan", [[1, 1, 2, 1]]))
    workers = {f"gpu{i}": SimpleNamespace(job=None, address=f"tcp://h:{i}") for i in range(4)}
    plan = plan_job(spec, "tied-plan-1", load_cluster(path), workers, SHARDS)
    assert set(plan.placement) == {TIE, "1.weight", "1.bias", "2.weight", "2.bias"}
    assert plan.stage_names(0, 3) == [TIE]
    tasks = plan.tasks(SHARDS, workers)
    assert [t.ties for t in tasks] == [{TIE: [0, 3]}] * 4
    assert [t.tied for t in tasks] == [(TIE,), (), (), (TIE,)]
    assert [t.copies for t in tasks] == [set(), set(), set(), {TIE}]
    assert TIE in tasks[3].placement
    contents = plan.shard_contents()
    shard = plan.placement[TIE]
    members = contents[shard][0]["0"]["stages"]
    assert TIE in members["0"] and TIE in members["3"]
    assert plan.predicted["state_bytes"]["0/3"] == 17 * 16 * 4  # its copy


# -- on real daemons -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """Four devices, two shards; the daemons can (and may) import ``usermodels``."""
    c = user_code_cluster(tmp_path_factory, "usermodels")
    yield c
    c.stop()


def run(cluster: LocalCluster, spec: dict[str, Any]) -> dict[str, torch.Tensor]:
    info = cluster.submit(spec, timeout=200)
    assert info["state"] == "done", info.get("error")
    return torch.load(info["model_path"])


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("kind", "layers"),
    [
        ("1f1b", [2, 3]),
        ("gpipe", [2, 3]),
        ("1f1b", [1, 1, 2, 1]),
        ("gpipe", [1, 2, 1, 1]),
    ],
)
def test_sync_tie_across_first_and_last_stage_is_plain_pytorch(cluster, kind, layers) -> None:
    """The tie's gradient summed over its copies before each step: the weights are plain
    PyTorch's (where the tied weight's gradient is the sum of both uses)."""
    spec = sync_job(f"tied-{kind}-{len(layers)}", kind, [layers])
    got = run(cluster, spec)
    assert_same_weights(got, plain_training(spec, ITERATIONS, m=M))
    assert_tie_exported(got)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sync_tie_with_clipping_counts_the_tie_once(cluster) -> None:
    """With ``clip_norm`` the stages agree on the global norm: the tie counts once in it."""
    spec = sync_job("tied-clip", "1f1b", [[2, 3]], lr=0.5)
    spec["optimizer"]["clip_norm"] = 0.05
    got = run(cluster, spec)
    assert_same_weights(got, plain_training(spec, ITERATIONS, m=M, clip_norm=0.05))


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sync_tie_with_two_virtual_workers(cluster) -> None:
    """Two synchronous VWs, each with the tie across its stages (cut differently): the
    shards count the tie's summed gradient once per VW, and hold one entry of it."""
    spec = sync_job("tied-2vw", "1f1b", [[2, 3], [1, 4]])
    got = run(cluster, spec)
    assert_same_weights(got, plain_training(spec, ITERATIONS, m=M, vws=2))
    assert_tie_exported(got)


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("layers", [[2, 3], [1, 1, 2, 1]])
def test_async_copies_push_to_one_entry(cluster, layers) -> None:
    """WSP, Nm = 1, one VW: each copy steps on its own use's gradient and pushes it to the
    one entry; every copy pulls every wave after all of the wave before. With SGD (momentum
    is linear in the gradient; no weight decay, which each copy would add once) that is
    exactly the tied model's step on the sum of both uses."""
    steps = 12
    spec = tied_job(f"tied-async-{len(layers)}", [layers], nm=1, minibatches=steps, weight_decay=0)
    got = run(cluster, spec)
    assert_same_weights(got, plain_training(spec, steps))
    assert_tie_exported(got)


def test_a_replicated_stage_holding_a_copy_is_refused_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(cluster_toml(UNIFORM, shards=2))
    spec = tied_job("tied-replicated", [[2, 3]], nm=1, minibatches=4)
    spec["vw"][0]["devices"] = ["gpu0", ["gpu1", "gpu2"]]
    workers = {f"gpu{i}": SimpleNamespace(job=None, address=f"tcp://h:{i}") for i in range(4)}
    with pytest.raises(JobPlanError) as info:
        plan_job(JobSpec.from_dict(spec), "tied-r-1", load_cluster(path), workers, SHARDS)
    text = str(info.value)
    assert "\n" not in text
    assert text.startswith("vw[0].layers: tied parameters 0.weight (vw0/stage0 (gpu0))")
    assert text.endswith("(a replicated stage holds no copy of a tie)")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_async_tie_with_two_virtual_workers(cluster) -> None:
    """WSP with two VWs, Adam (not linear in the gradient, so the rule is not the tied
    model's step): every copy pushes to the one entry and the job trains and exports the
    tie."""
    spec = tied_job("tied-async-2vw", [[2, 3], [3, 2]], nm=2, minibatches=12, staleness=1)
    spec["optimizer"] = {"name": "adam", "lr": 0.01}
    info = cluster.submit(spec, timeout=200)
    assert info["state"] == "done", info.get("error")
    got = torch.load(info["model_path"])
    assert_tie_exported(got)
    torch.manual_seed(spec["train"]["seed"])
    initial = build_model("usermodels:tied_gpt").state_dict()
    assert not torch.equal(got[TIE], initial[TIE])


def test_a_moved_copy_takes_the_ties_optimizer_state(tmp_path: Path) -> None:
    """Re-planned with the layers moved (2 + 3 stages -> 1 + 3 + 1): the tie's new copy takes
    the tie's optimizer state by name, as every parameter does, and its value from the one
    entry of the shards' cut."""
    path = tmp_path / "c.toml"
    path.write_text(cluster_toml(UNIFORM, shards=2))
    cluster = load_cluster(path)
    workers = {f"gpu{i}": SimpleNamespace(job=None, address=f"tcp://h:{i}") for i in range(4)}

    def plan_of(layers: list[int]) -> Any:
        spec = JobSpec.from_dict(tied_job("tied-moved", [layers], nm=1, minibatches=8))
        return plan_job(spec, "tied-moved-1", cluster, workers, SHARDS)

    old = plan_of([2, 3])
    stages, files = {}, {}
    for s, st in enumerate(old.vws[0].stages):
        names = old.stage_names(0, s)
        tensors = {f"opt/momentum/{n}": torch.full((2,), float(s)) for n in names}
        files[stage_file(0, s)] = {"vw": 0, "stage": s, "first": st.first, "last": st.last}
        files[stage_file(0, s)]["meta"] = {"optimizer": "sgd", "opt_steps": dict.fromkeys(names, 4)}
        stages[stage_file(0, s)] = tensors
    state = {n: torch.zeros(1) for n in old.placement}
    meta = {"positions": [4], "totals": [8], "minibatches_done": 4, "stages": files}
    ck = Checkpoint(Path("ck"), 0, state, meta, stages)
    new = plan_of([1, 3, 1])
    restores = stage_restores(new, ck, same_vws=True)
    assert f"opt/momentum/{TIE}" in restores[(0, 0)][1]
    assert f"opt/momentum/{TIE}" in restores[(0, 2)][1]
    assert restores[(0, 2)][0]["opt_steps"] == {TIE: 4}
    assert restores[(0, 2)][0]["weights"] is False  # its value: the shards' one entry
