"""State layout (tied, frozen, local), per-layer seeding, and one stage's handling of them."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import job
from torch import nn

from hetpipe.config import DeviceSpec
from hetpipe.core.layout import StageLayout
from hetpipe.job import JobSpec
from hetpipe.jobplan import place_state
from hetpipe.models import build_model
from hetpipe.modelstate import LayoutError, StateLayout
from hetpipe.seeding import layer_seed
from hetpipe.stage import StageCompute, build_stage_module
from hetpipe.task import StageTask

CPU = DeviceSpec("gpu0", "cpu", "fast", 1 << 30, 1.0, 0, "node0", "127.0.0.1")


def stage(
    model: str,
    first: int,
    last: int,
    *,
    stage: int = 0,
    k: int = 1,
    seed: int = 0,
    local: dict[str, torch.Tensor] | None = None,
) -> StageCompute:
    """A stage of ``usermodels:<model>`` with the job's initial weights loaded."""
    spec = job("unit", model=f"usermodels:{model}", minibatches=10, seed=seed)
    task = StageTask.standalone(
        "unit",
        JobSpec.from_dict(spec).to_dict(),
        StageLayout(("gpu0",), first, last),
        stage=stage,
        k=k,
        minibatches=10,
    )
    compute = StageCompute(task, CPU, local)
    torch.manual_seed(seed)
    state = build_model(f"usermodels:{model}").state_dict()
    names = compute.state_names()
    compute.load({n: state[n] for n in names}, {n: [] for n in names})
    return compute


def test_layout_of_tied_frozen_and_local() -> None:
    model = build_model("usermodels:tied_lm")
    model[5].bias.requires_grad_(False)
    model[4].register_buffer("mask", torch.ones(3), persistent=False)
    layout = StateLayout.of(model)
    assert layout.params == ("1.weight", "2.fc.weight", "2.fc.bias", "5.weight", "5.bias")
    assert layout.aliases == {"3.weight": "1.weight"}
    assert layout.frozen == {"5.bias"}
    assert layout.trainable == ("1.weight", "2.fc.weight", "2.fc.bias", "5.weight")
    assert layout.local == ("4.mask",)
    # what goes on the shards, and back to every name state_dict() gives on export
    assert set(layout.shared) | set(layout.aliases) == set(model.state_dict())
    state = {n: t.detach() for n, t in model.state_dict().items() if n in layout.shared}
    full = layout.with_aliases(state)
    assert full["3.weight"] is full["1.weight"]
    build_model("usermodels:tied_lm").load_state_dict(full, strict=True)


def test_persistent_buffers_are_shared() -> None:
    layout = StateLayout.of(build_model("usermodels:local_buffer_mlp"))
    assert layout.buffers == ("2.running_mean", "2.running_var", "2.num_batches_tracked")
    assert layout.local == ("4.scale",)


def test_split_through_a_tie_is_refused_in_one_line() -> None:
    layout = StateLayout.of(build_model("usermodels:tied_mlp"))
    layout.check_split([(0, 3), (3, 8)], ["a", "b"])  # tie inside stage 1: fine
    with pytest.raises(LayoutError) as info:
        layout.check_split([(0, 4), (4, 8)], ["vw0/stage0 (gpu0)", "vw0/stage1 (gpu1)"])
    text = str(info.value)
    assert "\n" not in text
    assert text.startswith(
        "tied parameters 3.weight (vw0/stage0 (gpu0)), "
        "5.weight (vw0/stage1 (gpu1)) fall in 2 stages"
    )


def test_extra_state_is_refused() -> None:
    class Extra(nn.Linear):
        def get_extra_state(self) -> Any:
            return {"v": 1}

        def set_extra_state(self, state: Any) -> None:
            pass

    with pytest.raises(LayoutError, match=r"'0\._extra_state' is neither a parameter nor"):
        StateLayout.of(nn.Sequential(Extra(2, 2)))


def test_stage_module_keeps_ties_and_frozen_flags() -> None:
    spec = JobSpec.from_dict(job("unit", model="usermodels:tied_lm", minibatches=1))
    part = build_stage_module(spec, 1, 4, "cpu")
    assert part.get_submodule("3").weight is part.get_submodule("1").weight
    spec = JobSpec.from_dict(job("unit", model="usermodels:frozen_mlp", minibatches=1))
    part = build_stage_module(spec, 0, 6, "cpu")
    assert not part[1].weight.requires_grad and not part[5].bias.requires_grad


def batch(n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return torch.rand(n, 1, 8, 8, generator=gen), torch.randint(0, 10, (n,), generator=gen)


def test_frozen_parameters_get_no_gradient_state_or_push() -> None:
    c = stage("frozen_mlp", 0, 6)
    before = {n: t.clone() for n, t in c.params.items()}
    x, y = batch()
    for p in range(3):
        c.forward(p, x, y)
        c.backward(p, None)
        c.step(p)
    frozen = {"1.weight", "1.bias", "5.bias"}
    assert c.layout.frozen == frozen
    assert set(c.optimizer.state) == {"3.weight", "3.bias", "5.weight"}
    assert set(c.push_deltas(0).wait()) == {"3.weight", "3.bias", "5.weight"}
    for n in frozen:
        assert torch.equal(c.params[n], before[n]) and not c.params[n].requires_grad
    assert not torch.equal(c.params["3.weight"], before["3.weight"])


def test_tied_parameter_is_one_weight_with_one_state() -> None:
    c = stage("tied_mlp", 0, 8)
    assert "5.weight" not in c.params and "5.weight" not in c.state_names()
    x, y = batch()
    c.forward(0, x, y)
    c.backward(0, None)
    c.step(0)
    assert "3.weight" in c.optimizer.state and "5.weight" not in c.optimizer.state


def test_local_buffers_need_their_values() -> None:
    with pytest.raises(
        ValueError, match=r"vw0/stage0: no initial value for non-persistent buffer '4\.scale'"
    ):
        stage("local_buffer_mlp", 0, 6)
    scale = torch.full((32,), 2.0)
    c = stage("local_buffer_mlp", 0, 6, local={"4.scale": scale})
    assert "4.scale" not in c.state_names()
    assert torch.equal(c.local["4.scale"], scale)


def test_dropout_masks_depend_on_layer_and_minibatch_not_on_the_split() -> None:
    """One stage of 8 layers or two of 4: the same output, equal to a loop that seeds each
    layer with ``layer_seed``; another minibatch draws other masks."""
    x, y = batch()
    whole = stage("dropout_mlp", 0, 8, k=2, seed=7)
    out = whole.forward(3, x, y)
    front = stage("dropout_mlp", 0, 4, k=3, seed=7)
    back = stage("dropout_mlp", 4, 8, stage=1, k=3, seed=7)
    mid = front.forward(3, x, y)
    split = back.forward(3, mid, y)
    assert torch.equal(out, split)
    torch.manual_seed(7)
    model = build_model("usermodels:dropout_mlp")
    ref = x
    for i, layer in enumerate(model):
        torch.manual_seed(layer_seed(7, 0, i, 3))
        ref = layer(ref)
    assert torch.allclose(out, ref, atol=1e-6)
    other = whole.forward(4, x, y)
    assert not torch.allclose(out, other)


def test_layer_seed_is_a_fixed_function() -> None:
    assert layer_seed(0, 0, 0, 0) == layer_seed(0, 0, 0, 0)
    seeds = {
        layer_seed(s, v, layer, p)
        for s in range(2)
        for v in range(2)
        for layer in range(3)
        for p in range(3)
    }
    assert len(seeds) == 36 and all(0 <= s < 2**64 for s in seeds)


def test_no_shared_state_places_nothing() -> None:
    """A model whose only state is non-persistent buffers puts nothing on the shards."""
    assert place_state({}, [], {}, {0: "tcp://127.0.0.1:7100"}) == {}
