"""Any nn.Module captured into an nn.Sequential of blocks (hetpipe.capture, models.build_model).

Three models as people write them: a ResNet-style network with batch norm and a residual add
across its stack (two tensors cross a cut inside it), a decoder-only transformer with its
input embedding tied to its output head, a dict batch with an attention mask and its own
loss, and a model of two inputs. Each captured model applied block by block gives the same
outputs and gradients as the module itself.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import UNIFORM, job
from torch import Tensor, nn
from usermodels import Decoder, LMOutput

from hetpipe.capture import CaptureError, capture, capture_of, user_state
from hetpipe.config import load_cluster
from hetpipe.data import DataError
from hetpipe.data.check import check_batch
from hetpipe.job import JobSpec
from hetpipe.jobplan import plan_job
from hetpipe.localcluster import cluster_toml
from hetpipe.models import ModelError, build_model, cross_entropy, model_loss

HERE = __name__  # the factories below are named "<this module>:<function>"


# --------------------------------------------------------------------------- models


class ConvBN(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(c)

    def forward(self, x: Tensor) -> Tensor:
        return F.relu(self.bn(self.conv(x)))


class ResNetish(nn.Module):
    """Stem, three conv blocks with a residual add from the stem over blocks 0..1, pool, fc."""

    def __init__(self, c: int = 4, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, c, 3, padding=1), nn.BatchNorm2d(c))
        self.blocks = nn.ModuleList(ConvBN(c) for _ in range(3))
        self.fc = nn.Linear(c, classes)

    def forward(self, x: Tensor) -> Tensor:
        x = F.relu(self.stem(x))
        skip = x
        for i, block in enumerate(self.blocks):
            x = block(x)
            if i == 1:
                x = x + skip
        x = x.mean((2, 3))
        return self.fc(x.reshape(x.size(0), -1))


class TwoInputs(nn.Module):
    """Two inputs, joined after their own encoders; the second is used again at the end."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(3, 8)
        self.mix = nn.Linear(8, 8)
        self.out = nn.Linear(11, 2)

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        h = torch.tanh(self.a(x)) * torch.sigmoid(self.b(y))
        return self.out(torch.cat([self.mix(h), y], dim=-1))


def resnetish() -> nn.Module:
    return ResNetish()


def decoder(layers: int = 3) -> nn.Module:
    return Decoder(layers=layers)


def two_inputs() -> nn.Module:
    return TwoInputs()


def lm_batch(b: int = 3, s: int = 7, vocab: int = 32) -> dict[str, Tensor]:
    """A dict batch with padding at the end of the first sequence."""
    g = torch.Generator().manual_seed(1)
    mask = torch.ones(b, s, dtype=torch.long)
    mask[0, -2:] = 0
    return {
        "input_ids": torch.randint(vocab, (b, s), generator=g),
        "attention_mask": mask,
        "labels": torch.randint(vocab, (b, s), generator=g),
    }


CASES: dict[str, Any] = {
    "resnetish": lambda: torch.randn(4, 1, 8, 8, generator=torch.Generator().manual_seed(0)),
    "decoder": lm_batch,
    "two_inputs": lambda: (torch.randn(5, 6), torch.randn(5, 3)),
}


def _call(module: nn.Module, batch: Any) -> Any:
    if isinstance(batch, dict):
        return module(**batch)
    return module(*batch) if isinstance(batch, tuple) else module(batch)


def _scalar(out: Any) -> Tensor:
    if isinstance(out, LMOutput):
        return out.loss + out.logits.square().mean()
    return out.square().mean()


def _grads(module: nn.Module) -> dict[str, Tensor]:
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


# --------------------------------------------------------------------------- transparency


@pytest.mark.parametrize("name", list(CASES))
def test_blocks_one_by_one_equal_the_module(name: str) -> None:
    torch.manual_seed(0)
    seq = build_model(f"{HERE}:{name}")
    user = capture_of(seq).source
    batch = CASES[name]()
    expected = _call(user, batch)
    _scalar(expected).backward()
    want = _grads(user)
    user.zero_grad(set_to_none=True)
    carry: Any = batch
    for block in seq:
        carry = block(carry)
        if block is not seq[-1]:  # a carry: one tensor, or a tuple of tensors
            items = carry if isinstance(carry, tuple) else (carry,)
            assert all(isinstance(t, Tensor) for t in items)
    got = carry
    if isinstance(expected, LMOutput):
        assert isinstance(got, LMOutput)
        assert torch.equal(got.loss, expected.loss)
        assert torch.equal(got.logits, expected.logits)
    else:
        assert torch.equal(got, expected)
    _scalar(got).backward()
    have = _grads(user)
    assert have.keys() == want.keys() and want
    for n in want:
        torch.testing.assert_close(have[n], want[n], rtol=0, atol=1e-6)


def test_inputs_as_a_tuple_or_by_name() -> None:
    torch.manual_seed(0)
    seq = build_model(f"{HERE}:two_inputs")
    x, y = CASES["two_inputs"]()
    by_name = seq({"y": y, "x": x})
    assert torch.equal(seq((x, y)), by_name)
    assert torch.equal(by_name, capture_of(seq).source(x, y))
    assert capture_of(seq).carries[0] == ("x", "y")


# --------------------------------------------------------------------------- carries


def test_the_residual_stack_carries_two_tensors_exactly_where_live() -> None:
    seq = build_model(f"{HERE}:resnetish")
    cap = capture_of(seq)
    # a top-level Sequential's elements are units too
    assert cap.starts == ("stem.0", "stem.1", "blocks.0", "blocks.1", "blocks.2", "fc")
    # the stem's output is the skip: it crosses the cut inside the residual stack beside x
    assert cap.carries == (
        ("x",),
        ("stem_0",),
        ("relu",),
        ("relu", "blocks_0"),
        ("add",),
        ("reshape",),
    )
    x = CASES["resnetish"]()
    c1 = seq[1](seq[0](x))
    c2 = seq[2](c1)
    assert isinstance(c1, Tensor) and isinstance(c2, tuple) and len(c2) == 2
    assert c2[0] is c1  # the skip travels on unchanged


def test_the_decoder_carries_the_mask_and_labels_to_where_they_are_used() -> None:
    seq = build_model(f"{HERE}:decoder")
    cap = capture_of(seq)
    assert cap.starts == ("embed", "pos", "layers.0", "layers.1", "layers.2", "norm", "head")
    assert cap.carries[0] == ("input_ids", "attention_mask", "labels")
    # the padding mask and the labels travel to their users; the positions are carried
    # where the block lacks the tensor their size comes from, and the causal mask is made
    # once, in the block that joins it with the padding mask
    assert cap.carries[1:] == (
        ("attention_mask", "labels", "arange", "embed"),
        ("labels", "add", "and_"),
        ("labels", "and_", "layers_0"),
        ("labels", "and_", "layers_1"),
        ("labels", "layers_2"),
        ("labels", "norm"),
    )
    # every carried value is used by a later block: the last block's uses are its inputs
    for b in range(1, len(seq)):
        placeholder = next(n for n in seq[b].graph.nodes if n.op == "placeholder")
        uses = [u for u in placeholder.users]
        assert len(uses) == (1 if len(cap.carries[b]) == 1 else len(cap.carries[b]))
        for u in uses:
            assert u.users, f"block {b} takes {u} and does not use it"


def test_a_size_is_computed_again_where_it_is_used() -> None:
    seq = build_model(f"{HERE}:resnetish")
    # x.size(0) in the last block comes from the tensor that block has, not from a carry
    assert "size" in seq[-2].code or "size" in seq[-1].code
    assert all(isinstance(c, str) for c in capture_of(seq).carries[-1])


# --------------------------------------------------------------------------- meta, splits


@pytest.mark.parametrize("name", list(CASES))
def test_built_on_meta_then_materialised(name: str) -> None:
    torch.manual_seed(0)
    real = build_model(f"{HERE}:{name}")
    with torch.device("meta"):
        meta = build_model(f"{HERE}:{name}")
    assert all(p.is_meta for p in meta.parameters())
    assert list(meta.state_dict()) == list(real.state_dict())
    part = meta[1:]  # a stage's slice, as the runtime takes it
    meta.to_empty(device="cpu")
    meta.load_state_dict(real.state_dict(), strict=True)
    batch = CASES[name]()
    got, want = meta(batch), real(batch)
    if isinstance(want, LMOutput):
        got, want = got.logits, want.logits
    assert torch.equal(got, want)
    assert len(part) == len(real) - 1


def test_split_points_start_blocks() -> None:
    torch.manual_seed(0)
    seq = build_model(f"{HERE}:decoder", {"layers": 4}, ["layers.1", "layers.3"])
    cap = capture_of(seq)
    assert len(seq) == 3 and cap.starts == ("", "layers.1", "layers.3")
    assert cap.carries[1:] == (("labels", "and_", "layers_0"), ("labels", "and_", "layers_2"))
    batch = lm_batch()
    assert torch.equal(seq(batch).logits, cap.source(**batch).logits)
    # a split point deeper than a unit opens that unit
    deep = build_model(f"{HERE}:decoder", None, ["layers.0.mlp"])
    assert capture_of(deep).starts == ("", "layers.0.mlp")
    assert torch.equal(deep(batch).logits, capture_of(deep).source(**batch).logits)


def test_a_spec_carries_its_split_points() -> None:
    spec = SimpleNamespace(name=f"{HERE}:decoder", args={}, split_points=("layers.2",))
    assert capture_of(build_model(spec)).starts == ("", "layers.2")


def test_a_sequential_is_not_captured() -> None:
    seq = build_model("mlp", {"hidden": [8]})
    assert capture_of(seq) is None and type(seq) is nn.Sequential
    assert user_state(seq, seq.state_dict()).keys() == seq.state_dict().keys()


# --------------------------------------------------------------------------- export


@pytest.mark.parametrize("name", list(CASES))
def test_export_keys_load_strict_into_the_users_module(name: str) -> None:
    torch.manual_seed(0)
    seq = build_model(f"{HERE}:{name}")
    trained = {k: v + 1 if v.is_floating_point() else v for k, v in seq.state_dict().items()}
    fresh = globals()[name]()
    fresh.load_state_dict(user_state(seq, trained), strict=True)
    seq.load_state_dict(trained)
    batch = CASES[name]()
    got, want = _call(fresh, batch), seq(batch)
    if isinstance(want, LMOutput):
        got, want = got.logits, want.logits
    assert torch.equal(got, want)


def test_key_maps_hold_the_tie() -> None:
    seq = build_model(f"{HERE}:decoder")
    cap = capture_of(seq)
    assert cap.keys["2.layers.0.attn.q.weight"] == "layers.0.attn.q.weight"
    assert (
        cap.keys["6.head.weight"] == "head.weight" and cap.keys["0.embed.weight"] == "embed.weight"
    )
    assert cap.user_keys["embed.weight"] == "0.embed.weight"
    assert cap.user_keys["head.weight"] == "0.embed.weight"  # one tensor, two names
    assert seq[0].embed.weight is seq[-1].head.weight  # the tie spans the first and last block
    state = user_state(seq, seq.state_dict())
    assert state["embed.weight"] is state["head.weight"]
    fresh = Decoder()
    fresh.load_state_dict(state, strict=True)
    assert fresh.head.weight is fresh.embed.weight


def test_a_tensor_forward_never_uses_is_exported_as_built() -> None:
    class Unused(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(2, 2)
            self.spare = nn.Linear(2, 2)

        def forward(self, x: Tensor) -> Tensor:
            return self.a(x)

    seq = capture(Unused())
    cap = capture_of(seq)
    assert cap.user_keys["spare.weight"] is None
    state = user_state(seq, seq.state_dict())
    assert torch.equal(state["spare.weight"], cap.source.spare.weight)
    Unused().load_state_dict(state, strict=True)


def test_the_head_exports_the_users_keys(tmp_path: Path) -> None:
    """The head's model.pt of a captured model loads strict into the factory's module."""
    path = tmp_path / "c.toml"
    path.write_text(cluster_toml(UNIFORM[:2], shards=2))
    spec = JobSpec.from_dict(job("res", model=f"{HERE}:resnetish", split=[(["gpu0"], [6])]))
    workers = {d: SimpleNamespace(job=None) for d in ("gpu0", "gpu1")}
    plan = plan_job(spec, "res-1", load_cluster(path), workers, {0: "tcp://a:1", 1: "tcp://a:2"})
    assert set(plan.placement) == {k for k in build_model(spec.model).state_dict()}
    state = {k: v + 1 if v.is_floating_point() else v for k, v in plan.initial.items()}
    plan.export(state, tmp_path / "out")
    saved = torch.load(tmp_path / "out" / "model.pt")
    assert "stem.0.weight" in saved and "0.stem.0.weight" not in saved
    model = ResNetish()
    model.load_state_dict(saved, strict=True)
    assert torch.equal(model.fc.weight, state["5.fc.weight"])


def test_cli_exports_the_same_tensors_as_safetensors(tmp_path: Path) -> None:
    """``hetpipe export JOB --format safetensors``: the names and values of model.pt, ties
    written as equal tensors, and the file loads strict into the user's module."""
    safetensors = pytest.importorskip("safetensors.torch", reason="safetensors not installed")
    from click.testing import CliRunner

    from hetpipe import cli

    seq = build_model(f"{HERE}:decoder")
    state = user_state(seq, seq.state_dict())
    out = tmp_path / "run" / "jobs" / "lm-1"
    out.mkdir(parents=True)
    torch.save(state, out / "model.pt")
    args = ["--run-dir", str(tmp_path / "run"), "--head", "tcp://127.0.0.1:1", "export", "lm-1"]
    result = CliRunner().invoke(cli.main, args)
    assert result.exit_code == 0, result.output
    assert result.output.strip().endswith(f"-> {out / 'model.safetensors'}")
    loaded = safetensors.load_file(str(out / "model.safetensors"))
    assert loaded.keys() == state.keys()
    assert all(torch.equal(loaded[k], state[k]) for k in state)
    Decoder().load_state_dict(loaded, strict=True)
    missing = CliRunner().invoke(cli.main, [*args[:4], "export", "nosuch-1"])
    assert missing.exit_code == 1 and "nosuch-1" in missing.output


# --------------------------------------------------------------------------- loss


def test_the_loss_the_model_returns() -> None:
    torch.manual_seed(0)
    seq = build_model(f"{HERE}:decoder")
    out = seq(lm_batch())
    loss = model_loss(f"{HERE}:decoder")
    assert loss is cross_entropy
    assert loss(out, torch.zeros(1)) is out.loss
    assert loss({"loss": out.loss, "logits": out.logits}, torch.zeros(1)) is out.loss
    assert loss((out.loss, out.logits), torch.zeros(1)) is out.loss
    scalar = torch.tensor(2.0)
    assert loss(scalar, torch.zeros(1)) is scalar
    y = torch.randint(32, (3, 7))
    expected = F.cross_entropy(out.logits.reshape(-1, 32), y.reshape(-1))
    assert torch.equal(loss({"logits": out.logits}, y), expected)


def half_mse(out: Tensor, target: Tensor) -> Tensor:
    return 0.5 * F.mse_loss(out, target)


def test_model_loss_names_a_function() -> None:
    spec = SimpleNamespace(name=f"{HERE}:two_inputs", args={}, loss=f"{HERE}:half_mse")
    assert model_loss(spec) is half_mse
    plain = SimpleNamespace(name=f"{HERE}:two_inputs", args={}, loss=None)
    assert model_loss(plain) is cross_entropy


# --------------------------------------------------------------------------- errors


class TensorBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(2, 2)

    def forward(self, x: Tensor) -> Tensor:
        if x.sum() > 0:
            return self.a(x)
        return x


class LateSize(nn.Module):
    """Uses the batch size of its input in its last block, where the input no longer is."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        n = x.size(0)
        return self.b(self.a(x)).view(n, 2, 2)


class Varargs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(2, 2)

    def forward(self, *xs: Tensor) -> Tensor:
        return self.a(xs[0])


class TensorDefault(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(2, 2)

    def forward(self, x: Tensor, scale: Tensor = torch.tensor(2.0)) -> Tensor:  # noqa: B008
        return self.a(x) * scale


def tensor_default() -> nn.Module:
    return TensorDefault()


def tensor_branch() -> nn.Module:
    return TensorBranch()


def late_size() -> nn.Module:
    return LateSize()


def varargs() -> nn.Module:
    return Varargs()


def a_number() -> int:
    return 3


@pytest.mark.parametrize(
    ("name", "split", "key", "match"),
    [
        (
            "tensor_branch",
            (),
            "model.name",
            r"model '.*:tensor_branch': cannot capture TensorBranch: torch.fx cannot trace it "
            r"at test_capture.py:\d+ \(if x.sum\(\) > 0:\): TraceError: .*; name "
            r"model.split_points around it, or return an nn.Sequential",
        ),
        (
            "late_size",
            (),
            "model.name",
            r"size \(call_method size\), used in the block starting at b",
        ),
        ("varargs", (), "model.name", r"forward takes \*xs"),
        ("tensor_default", (), "model.name", r"parameter 'scale' defaults to a Tensor"),
        ("a_number", (), "model.name", r"returned int, not an nn.Module"),
        ("decoder", ("layers.9",), "model.split_points", r"has no submodule 'layers.9'"),
        ("decoder", ("layers.0", "layers.0"), "model.split_points", r"names a submodule twice"),
        ("decoder", ("layers.0.attn.kv.bias",), "model.split_points", r"has no submodule"),
    ],
)
def test_capture_errors_are_one_line(name: str, split: tuple, key: str, match: str) -> None:
    with pytest.raises(ModelError, match=match) as info:
        build_model(f"{HERE}:{name}", None, split)
    assert "\n" not in str(info.value)
    assert info.value.key == key


def test_a_split_point_forward_never_calls() -> None:
    class Spare(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(2, 2)
            self.spare = nn.Linear(2, 2)

        def forward(self, x: Tensor) -> Tensor:
            return self.a(x)

    with pytest.raises(CaptureError, match="forward never calls 'spare'"):
        capture(Spare(), ["spare"])


def test_split_points_on_a_sequential_are_refused() -> None:
    with pytest.raises(ModelError, match="split_points are for captured models") as info:
        build_model("mlp", None, ["1"])
    assert info.value.key == "model.split_points"


@pytest.mark.parametrize(
    ("batch", "match"),
    [
        ({"x": 1, "z": 2, "y": 3}, r"TwoInputs: the batch has 'z', which forward does not take"),
        ({"x": 1}, r"TwoInputs: the batch lacks input 'y'"),
        ((torch.ones(1, 6),), r"TwoInputs: forward takes 2..2 inputs \(x, y\), got tuple of 1"),
        ("text", r"forward takes 2..2 inputs \(x, y\), got str$"),
        (torch.ones(1, 6), r"forward takes 2..2 inputs \(x, y\), got Tensor$"),
    ],
)
def test_bad_batches_are_one_line(batch: Any, match: str) -> None:
    seq = build_model(f"{HERE}:two_inputs")
    with pytest.raises(CaptureError, match=match) as info:
        seq(batch)
    assert "\n" not in str(info.value)


def test_an_unknown_loss_is_refused() -> None:
    spec = SimpleNamespace(name=f"{HERE}:two_inputs", args={}, loss=f"{HERE}:no_such_loss")
    with pytest.raises(ModelError, match=r"loss '.*:no_such_loss': module .* has no no_such_loss"):
        model_loss(spec)


def test_this_module_is_importable_by_name() -> None:
    assert sys.modules[HERE].two_inputs is two_inputs


# --------------------------------------------------------------------------- data check


def test_a_model_that_does_not_fit_its_data_names_the_block_and_both_shapes() -> None:
    seq = build_model(f"{HERE}:two_inputs")
    x, y = torch.randn(2, 5), torch.randn(2, 3)  # the first input is 5 wide, not 6
    with pytest.raises(DataError) as info:
        check_batch("data 'd'", seq, (x, y), torch.zeros(2, dtype=torch.long), cross_entropy)
    text = str(info.value)
    assert text.startswith(
        "data 'd': a sample of ([2, 5] float32, [2, 3] float32) does not fit: block 0 (a) got"
    )
    assert "2x5 and 6x8" in text and "\n" not in text
    fits = CASES["two_inputs"]()
    check_batch("data 'd'", seq, fits, torch.zeros(5, dtype=torch.long), cross_entropy)
    seq = build_model(f"{HERE}:resnetish")  # three channels where the stem takes one
    with pytest.raises(DataError, match=r"block 0 \(stem.0\) got \[2, 3, 8, 8\] float32"):
        check_batch("data 'd'", seq, torch.randn(2, 3, 8, 8), torch.zeros(2).long(), cross_entropy)


def test_the_loss_is_checked_against_the_labels() -> None:
    seq = build_model("mlp", {"hidden": [8]})
    with pytest.raises(
        DataError,
        match=r"the target \[4\] int64 does not fit the loss of the model's output "
        r"\[3, 10\] float32",
    ):
        check_batch(
            "data 'd'", seq, torch.rand(3, 1, 8, 8), torch.zeros(4, dtype=torch.long), cross_entropy
        )


def test_the_check_moves_no_running_statistic_and_keeps_the_mode() -> None:
    seq = build_model(f"{HERE}:resnetish")
    before = {k: v.clone() for k, v in seq.state_dict().items()}
    check_batch("data 'd'", seq, torch.randn(2, 1, 8, 8), torch.zeros(2).long(), cross_entropy)
    assert seq.training
    assert all(torch.equal(before[k], v) for k, v in seq.state_dict().items())


# --------------------------------------------------------------------------- job keys


def test_model_keys_parse_round_trip_and_are_policed() -> None:
    from hetpipe.security import CodeError, check_code
    from hetpipe.usercode import named_code

    d = job("lm", model=f"{HERE}:decoder")
    d["model"].update(split_points=["layers.1"], loss="mylosses:half_mse")
    spec = JobSpec.from_dict(d)
    assert spec.model.split_points == ("layers.1",) and spec.model.loss == "mylosses:half_mse"
    assert JobSpec.from_dict(spec.to_dict()).model == spec.model
    assert [n.key for n in named_code(spec)] == ["model.name", "model.loss"]
    with pytest.raises(CodeError, match=r"^job: model.loss: module 'mylosses' is not allowed"):
        check_code(spec, [HERE])
    check_code(spec, [HERE, "mylosses"])
