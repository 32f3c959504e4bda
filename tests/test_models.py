"""Model builders: shapes, determinism, meta-device construction, user models, errors."""

from __future__ import annotations

import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hetpipe.models import (
    BUILTIN,
    Bottleneck,
    ModelError,
    TransformerBlock,
    build_model,
    cnn,
    cross_entropy,
    model_loss,
)

# name -> (small args, input maker, expected output shape)
SMALL = {
    "mlp": ({}, lambda: torch.rand(3, 1, 8, 8), (3, 10)),
    "cnn": ({}, lambda: torch.rand(3, 1, 8, 8), (3, 10)),
    "vgg19": ({"width": 8, "classes": 7}, lambda: torch.rand(2, 3, 32, 32), (2, 7)),
    "resnet152": ({"width": 4, "classes": 5}, lambda: torch.rand(2, 3, 16, 16), (2, 5)),
    "paper_vgg19": ({"width": 2, "hidden": 32}, lambda: torch.rand(2, 3, 32, 32), (2, 10)),
    "paper_resnet152": ({"classes": 5}, lambda: torch.rand(2, 3, 8, 8), (2, 5)),
    "gpt": (
        {"vocab": 32, "seq": 16, "dim": 32, "heads": 4, "blocks": 2},
        lambda: torch.randint(32, (2, 16)),
        (2, 16, 32),
    ),
}


def test_small_covers_every_builtin() -> None:
    assert set(SMALL) == set(BUILTIN)


@pytest.mark.parametrize("name", sorted(SMALL))
def test_builtin_forward_shape(name: str) -> None:
    args, make_input, shape = SMALL[name]
    model = build_model(name, args)
    assert isinstance(model, nn.Sequential)
    model.eval()
    with torch.no_grad():
        assert tuple(model(make_input()).shape) == shape


@pytest.mark.parametrize("name", sorted(SMALL))
def test_construction_is_deterministic(name: str) -> None:
    args = SMALL[name][0]
    torch.manual_seed(7)
    a = build_model(name, args).state_dict()
    torch.manual_seed(7)
    b = build_model(name, args).state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("name", sorted(SMALL))
def test_meta_construction_then_load(name: str) -> None:
    """The runtime's path: build on meta, slice, to_empty, load the real weights."""
    args, make_input, _ = SMALL[name]
    torch.manual_seed(0)
    real = build_model(name, args).eval()
    with torch.device("meta"):
        meta = build_model(name, args)
    tensors = [*meta.parameters(), *meta.buffers()]
    assert tensors and all(t.is_meta for t in tensors)
    meta.to_empty(device="cpu")
    meta.load_state_dict(real.state_dict())
    meta.eval()
    x = make_input()
    with torch.no_grad():
        assert torch.equal(meta(x), real(x))


def test_meta_slice_to_empty() -> None:
    with torch.device("meta"):
        model = cnn()
    stage = model[3:7]
    stage.to_empty(device="cpu")
    stage.load_state_dict(cnn()[3:7].state_dict())
    assert not any(p.is_meta for p in stage.parameters())
    assert stage(torch.rand(2, 32, 8, 8)).shape == (2, 64, 4, 4)


def test_mlp_layout() -> None:
    model = build_model("mlp", {"hidden": [32, 16, 8]})
    kinds = [type(m) for m in model]
    assert kinds == [nn.Flatten] + [nn.Linear, nn.ReLU] * 3 + [nn.Linear]
    assert model[-1].out_features == 10


def test_cnn_has_16_elements_and_known_size() -> None:
    model = cnn()
    assert len(model) == 16
    assert sum(isinstance(m, nn.Conv2d) for m in model) == 3
    assert sum(isinstance(m, nn.BatchNorm2d) for m in model) == 3
    assert sum(isinstance(m, nn.MaxPool2d) for m in model) == 2
    assert [m.out_features for m in model if isinstance(m, nn.Linear)] == [128, 10]
    assert sum(p.numel() for p in model.parameters()) == 160_074
    # a larger image than it was built for still fits the head
    assert model.eval()(torch.rand(1, 1, 12, 12)).shape == (1, 10)


def test_vgg19_layout() -> None:
    model = build_model("vgg19", {"width": 8})
    assert sum(isinstance(m, nn.Conv2d) for m in model) == 16
    assert sum(isinstance(m, nn.MaxPool2d) for m in model) == 5
    assert sum(isinstance(m, nn.Linear) for m in model) == 3
    assert all(not isinstance(m, nn.Sequential) for m in model)  # flat


def test_resnet152_layout() -> None:
    with torch.device("meta"):
        small = build_model("resnet152")
        imagenet = build_model("resnet152", {"image": 224, "classes": 1000})
    assert [isinstance(m, Bottleneck) for m in small].count(True) == 3 + 8 + 36 + 3
    assert len(small) == 3 + 50 + 3
    assert len(imagenet) == 4 + 50 + 3
    # the standard ImageNet ResNet-152 size
    assert sum(p.numel() for p in imagenet.parameters()) == 60_192_808


def test_gpt_layout_and_causality() -> None:
    torch.manual_seed(0)
    model = build_model("gpt", SMALL["gpt"][0]).eval()
    assert len(model) == 1 + 2 + 2
    assert sum(isinstance(m, TransformerBlock) for m in model) == 2
    x = torch.randint(32, (1, 16))
    y = x.clone()
    y[0, 10:] = (y[0, 10:] + 1) % 32
    with torch.no_grad():
        a, b = model(x), model(y)
        # later tokens do not change earlier outputs; shorter inputs work too
        assert torch.allclose(a[:, :10], b[:, :10], atol=1e-6)
        assert torch.allclose(model(x[:, :5]), a[:, :5], atol=1e-5)
    with_classes = build_model("gpt", {**SMALL["gpt"][0], "classes": 3})
    assert with_classes(x).shape == (1, 16, 3)


def test_custom_model_by_path() -> None:
    model = build_model("hetpipe.models:mlp", {"hidden": [32]})
    assert [type(m) for m in model] == [nn.Flatten, nn.Linear, nn.ReLU, nn.Linear]


@pytest.fixture
def user_module(tmp_path, monkeypatch) -> str:
    """A user module on sys.path with good and bad model functions."""
    (tmp_path / "hp_user_models.py").write_text(
        textwrap.dedent(
            """
            import torch
            from torch import nn

            NOT_CALLABLE = 3

            def good(width=4):
                return nn.Sequential(nn.Flatten(), nn.Linear(64, width))

            def with_loss():
                return nn.Sequential(nn.Linear(2, 2))

            with_loss.loss = lambda out, y: out.sum() * 0

            def not_sequential():
                return nn.Linear(2, 2)

            def not_a_module():
                return 3

            def empty():
                return nn.Sequential()

            def broken():
                raise RuntimeError("boom")
            """
        )
    )
    (tmp_path / "hp_user_broken.py").write_text("raise RuntimeError('import boom')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return "hp_user_models"


def test_user_module(user_module: str) -> None:
    assert build_model(f"{user_module}:good", {"width": 3})(torch.rand(2, 64)).shape == (2, 3)
    loss = model_loss(f"{user_module}:with_loss")
    assert float(loss(torch.ones(2, 2), torch.zeros(2, dtype=torch.long))) == 0.0
    assert model_loss(f"{user_module}:good") is cross_entropy


@pytest.mark.parametrize(
    ("name", "args", "match"),
    [
        ("nope", None, "unknown"),
        ("a:b:c", None, "package.module:function"),
        ("pkg.mod:", None, "package.module:function"),
        (":fn", None, "package.module:function"),
        ("1pkg:fn", None, "package.module:function"),
        ("no_such_pkg_hetpipe_test.mod:fn", None, "cannot import"),
        ("hp_user_broken:fn", None, "cannot import.*import boom"),
        ("hetpipe.models:no_such_fn", None, "has no no_such_fn"),
        ("hp_user_models:NOT_CALLABLE", None, "not callable"),
        ("hp_user_models:not_a_module", None, "returned int, not an nn.Module"),
        ("hp_user_models:empty", None, "empty"),
        ("hp_user_models:broken", None, "build failed: RuntimeError: boom"),
        ("hp_user_models:good", {"nope": 1}, "bad args"),
        ("mlp", {"nope": 1}, "bad args"),
        ("mlp", [1, 2], "args must be"),
        ("mlp", {"in_features": 10}, "in_shape"),
        ("mlp", {"hidden": [0]}, "hidden"),
        ("cnn", {"width": 0}, "width"),
        ("cnn", {"image": 2}, "image"),
        ("vgg19", {"image": 16}, "image"),
        ("gpt", {"dim": 30, "heads": 4}, "divisible"),
        ("resnet152", {"classes": -1}, "classes"),
    ],
)
def test_model_errors(user_module: str, name: str, args: dict | None, match: str) -> None:
    with pytest.raises(ModelError, match=match) as info:
        build_model(name, args)
    assert "\n" not in str(info.value)


def test_model_loss_flattens_sequences() -> None:
    out = torch.randn(2, 5, 7)
    y = torch.randint(7, (2, 5))
    expected = F.cross_entropy(out.reshape(10, 7), y.reshape(10))
    assert torch.allclose(model_loss("gpt")(out, y), expected)
    out2, y2 = torch.randn(4, 3), torch.randint(3, (4,))
    assert torch.allclose(model_loss("cnn")(out2, y2), F.cross_entropy(out2, y2))
    with pytest.raises(ModelError):
        model_loss("nope")
