"""The models hetpipe trains, all as one flat ``nn.Sequential``.

The runtime cuts a model into contiguous stages by element index, so every builder here
returns a flat ``nn.Sequential`` whose elements are the units the planner may cut between.
Where a structure cannot be cut (a residual block, a transformer block), it is one element
that owns its own skip connection.

Builders only create modules, so they work under ``with torch.device("meta"):``: the
runtime builds on meta, slices out its stage, then ``to_empty`` and loads the weights.
Construction draws from torch's global generator only, so ``torch.manual_seed`` makes it
deterministic.

A user model is named ``"package.module:function"``; ``function(**args)`` returns a non-empty
``nn.Sequential`` (cut between its elements, as today) or any other ``nn.Module``, which
:mod:`hetpipe.capture` turns into an ``nn.Sequential`` of blocks (at ``model.split_points``,
or at its natural units). The loss: ``model.loss``, else the loss the model returns, else the
function's ``loss`` attribute, else cross entropy (:func:`model_loss`). The module is taken
from ``sys.modules`` as imported: the CLI, the head and each worker make it current with its
file (and compare it with the submitted copy) before a job starts, in :mod:`hetpipe.usercode`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hetpipe.capture import CaptureError, capture
from hetpipe.papermodels import paper_resnet152, paper_vgg19
from hetpipe.usercode import FunctionError, load_function

__all__ = [
    "BUILTIN",
    "Bottleneck",
    "ModelError",
    "TokenEmbedding",
    "TransformerBlock",
    "build_model",
    "cnn",
    "cross_entropy",
    "gpt",
    "mlp",
    "model_loss",
    "resnet152",
    "vgg19",
]

LossFn = Callable[[Tensor, Tensor], Tensor]


class ModelError(ValueError):
    """A model cannot be built; ``str(e)`` is one line naming the model and the problem.

    ``key``: the job key the problem is about (``"model.name"``, ...), where the text alone
    does not say it; ``None`` lets the caller tell from the text.
    """

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


def _check_positive(model: str, **values: int) -> None:
    """Reject non-positive sizes here, where the message can name the argument."""
    for key, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ModelError(f"model '{model}': {key} must be a positive int, got {value!r}")


# --------------------------------------------------------------------------- mlp


def mlp(
    in_features: int = 64,
    hidden: Sequence[int] = (256, 256),
    classes: int = 10,
    in_shape: Sequence[int] = (1, 8, 8),
) -> nn.Sequential:
    """Flatten, then ``Linear``/``ReLU`` pairs, then a last ``Linear`` to ``classes``.

    ``in_shape`` is the shape of one input sample; it must hold ``in_features`` values
    (it is checked so that a wrong pairing of model and data fails here, not mid-run).
    """
    hidden = tuple(hidden)
    in_shape = tuple(in_shape)
    _check_positive("mlp", in_features=in_features, classes=classes)
    for i, h in enumerate(hidden):
        _check_positive("mlp", **{f"hidden[{i}]": h})
    if math.prod(in_shape) != in_features:
        raise ModelError(
            f"model 'mlp': in_shape {in_shape} holds {math.prod(in_shape)} values "
            f"but in_features is {in_features}"
        )
    layers: list[nn.Module] = [nn.Flatten()]
    width = in_features
    for h in hidden:
        layers += [nn.Linear(width, h), nn.ReLU()]
        width = h
    layers.append(nn.Linear(width, classes))
    return nn.Sequential(*layers)


# --------------------------------------------------------------------------- cnn


def cnn(width: int = 32, classes: int = 10, in_channels: int = 1, image: int = 8) -> nn.Sequential:
    """A small 3-conv network for 8x8 digits; 16 elements, the planner's everyday test model.

    The ``AdaptiveAvgPool2d`` before ``Flatten`` is a no-op for ``image``-sized inputs (the
    two max pools already leave ``image // 4``); it pins the head's input size, so the
    model also accepts larger images than it was built for.
    """
    _check_positive("cnn", width=width, classes=classes, in_channels=in_channels, image=image)
    if image < 4:
        raise ModelError(f"model 'cnn': image must be >= 4 (two 2x2 pools), got {image}")
    w = width
    side = image // 4
    return nn.Sequential(
        nn.Conv2d(in_channels, w, 3, padding=1),
        nn.BatchNorm2d(w),
        nn.ReLU(),
        nn.Conv2d(w, 2 * w, 3, padding=1),
        nn.BatchNorm2d(2 * w),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(2 * w, 4 * w, 3, padding=1),
        nn.BatchNorm2d(4 * w),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.AdaptiveAvgPool2d(side),
        nn.Flatten(),
        nn.Linear(4 * w * side * side, 128),
        nn.ReLU(),
        nn.Linear(128, classes),
    )


# --------------------------------------------------------------------------- vgg19

# Channels of VGG-19's 16 convolutions at width 64; "M" is a 2x2 max pool.
_VGG19 = (64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M")
_VGG19 += (512, 512, 512, 512, "M", 512, 512, 512, 512, "M")


def vgg19(
    image: int = 32, classes: int = 10, in_channels: int = 3, width: int = 64
) -> nn.Sequential:
    """VGG-19 (16 conv+ReLU, 5 max pools, 3 fully connected layers), flat, without dropout.

    Channels scale with ``width`` (64 is the original); the hidden FC width is
    ``64 * width`` (4096 at width 64). Dropout is left out so that a pipelined run and a
    plain run of the same model compute the same thing.
    """
    _check_positive("vgg19", image=image, classes=classes, in_channels=in_channels, width=width)
    return vgg_layers("vgg19", image, classes, in_channels, width, 64 * width)


def vgg_layers(
    model: str,
    image: int,
    classes: int,
    in_channels: int,
    width: int,
    hidden: int,
    batch_norm: bool = False,
    kaiming: bool = False,
) -> nn.Sequential:
    """VGG-19's layers, flat: one builder for ``vgg19`` and the paper's ``paper_vgg19``
    (:mod:`hetpipe.papermodels`), which adds batch norm after each convolution and He
    initialisation. ``model`` names the builtin in errors."""
    if image < 32:
        raise ModelError(f"model '{model}': image must be >= 32 (five 2x2 pools), got {image}")
    layers: list[nn.Module] = []
    channels = in_channels
    for item in _VGG19:
        if item == "M":
            layers.append(nn.MaxPool2d(2))
            continue
        out = max(1, int(item) * width // 64)
        conv = nn.Conv2d(channels, out, 3, padding=1)
        if kaiming:
            nn.init.kaiming_normal_(conv.weight, mode="fan_out", nonlinearity="relu")
            nn.init.zeros_(conv.bias)
        layers += [conv, nn.BatchNorm2d(out), nn.ReLU()] if batch_norm else [conv, nn.ReLU()]
        channels = out
    side = image // 32
    layers += [
        nn.Flatten(),
        nn.Linear(channels * side * side, hidden),
        nn.ReLU(),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Linear(hidden, classes),
    ]
    return nn.Sequential(*layers)


# --------------------------------------------------------------------------- resnet152


class Bottleneck(nn.Module):
    """ResNet bottleneck (1x1, 3x3, 1x1 convs, 4x expansion) with its own shortcut.

    One block is one pipeline element, because its skip connection cannot be cut.
    """

    expansion = 4

    def __init__(self, in_channels: int, mid: int, stride: int = 1) -> None:
        super().__init__()
        out = mid * self.expansion
        self.conv1 = nn.Conv2d(in_channels, mid, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(mid)
        self.conv2 = nn.Conv2d(mid, mid, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(mid)
        self.conv3 = nn.Conv2d(mid, out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out, 1, stride=stride, bias=False), nn.BatchNorm2d(out)
            )

    def forward(self, x: Tensor) -> Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return F.relu(y + self.shortcut(x))


def resnet152(
    image: int = 32, classes: int = 10, in_channels: int = 3, width: int = 64
) -> nn.Sequential:
    """ResNet-152: stem, 3+8+36+3 bottleneck blocks (one element each), pool, flatten, fc.

    Images under 64 pixels get the small-image stem (3x3 conv, stride 1: Conv, BN, ReLU);
    larger ones the ImageNet stem (7x7 conv stride 2, BN, ReLU, 3x3 max pool stride 2).
    So the model has 56 elements for small images and 57 for large ones.
    """
    _check_positive("resnet152", image=image, classes=classes, in_channels=in_channels, width=width)
    layers: list[nn.Module]
    if image >= 64:
        layers = [
            nn.Conv2d(in_channels, width, 7, stride=2, padding=3, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(),
            nn.MaxPool2d(3, stride=2, padding=1),
        ]
    else:
        layers = [
            nn.Conv2d(in_channels, width, 3, padding=1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(),
        ]
    channels = width
    for stage, blocks in enumerate((3, 8, 36, 3)):
        mid = width * 2**stage
        for b in range(blocks):
            stride = 2 if stage > 0 and b == 0 else 1
            layers.append(Bottleneck(channels, mid, stride))
            channels = mid * Bottleneck.expansion
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, classes)]
    return nn.Sequential(*layers)


# --------------------------------------------------------------------------- gpt


class TokenEmbedding(nn.Module):
    """Token embedding plus learned position embedding: int64 ``[B, S]`` -> ``[B, S, dim]``."""

    def __init__(self, vocab: int, seq: int, dim: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        nn.init.normal_(self.tok.weight, std=0.02)
        nn.init.normal_(self.pos.weight, std=0.02)

    def forward(self, x: Tensor) -> Tensor:
        positions = torch.arange(x.shape[1], device=x.device)
        return self.tok(x) + self.pos(positions)


class TransformerBlock(nn.Module):
    """Pre-LayerNorm decoder block: causal self-attention, then a 4x GELU MLP, each residual."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, s, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


def gpt(
    vocab: int = 256,
    seq: int = 64,
    dim: int = 128,
    heads: int = 4,
    blocks: int = 4,
    classes: int | None = None,
) -> nn.Sequential:
    """A small GPT: embeddings, ``blocks`` decoder blocks, final LayerNorm, head.

    Input int64 tokens ``[B, S]`` with ``S <= seq``; output logits ``[B, S, classes]``
    where ``classes`` defaults to ``vocab`` (next-token prediction).
    """
    classes = vocab if classes is None else classes
    _check_positive("gpt", vocab=vocab, seq=seq, dim=dim, heads=heads, blocks=blocks)
    _check_positive("gpt", classes=classes)
    if dim % heads:
        raise ModelError(f"model 'gpt': dim {dim} is not divisible by heads {heads}")
    layers: list[nn.Module] = [TokenEmbedding(vocab, seq, dim)]
    layers += [TransformerBlock(dim, heads) for _ in range(blocks)]
    layers += [nn.LayerNorm(dim), nn.Linear(dim, classes)]
    return nn.Sequential(*layers)


# --------------------------------------------------------------------------- lookup

BUILTIN: dict[str, Callable[..., nn.Sequential]] = {
    "mlp": mlp,
    "cnn": cnn,
    "vgg19": vgg19,
    "resnet152": resnet152,
    "gpt": gpt,
    # the HetPipe paper's two models, narrowed for a CPU (hetpipe.papermodels)
    "paper_vgg19": paper_vgg19,
    "paper_resnet152": paper_resnet152,
}


def _resolve(name: str, what: str = "model") -> Callable[..., Any]:
    """The builder a model name stands for: a builtin, or an imported ``module:function``;
    ``what`` names the kind of name in the errors (``"loss"``: no builtins)."""
    if not isinstance(name, str):
        raise ModelError(f"{what} name must be a string, got {name!r}")
    if what == "model" and name in BUILTIN:
        return BUILTIN[name]
    if ":" not in name:
        builtins = f"use one of {', '.join(BUILTIN)} or " if what == "model" else "use "
        raise ModelError(f"{what} '{name}': unknown; {builtins}'package.module:function'")
    try:
        return load_function(name, what)
    except FunctionError as e:
        raise ModelError(str(e)) from None


def build_model(
    name: Any, args: Mapping[str, Any] | None = None, split_points: Sequence[str] = ()
) -> nn.Sequential:
    """Build model ``name`` with keyword ``args``; any failure is one :class:`ModelError`.

    ``name`` may also be a job's model spec (:class:`hetpipe.job.ModelSpec`: its name, args
    and split points). A builder's ``nn.Sequential`` comes back as it is; any other module
    comes back captured (:func:`hetpipe.capture.capture`), cut at ``split_points`` or at its
    natural units. Construction runs no forward, so this works under ``torch.device("meta")``.
    """
    if not isinstance(name, str) and hasattr(name, "args"):  # a ModelSpec
        name, args, split_points = name.name, name.args, getattr(name, "split_points", ())
    func = _resolve(name)
    args = {} if args is None else args
    if not isinstance(args, Mapping) or not all(isinstance(k, str) for k in args):
        raise ModelError(f"model '{name}': args must be a table of named values, got {args!r}")
    try:
        model = func(**args)
    except ModelError:
        raise
    except TypeError as e:
        raise ModelError(f"model '{name}': bad args {dict(args)!r}: {e}") from e
    except Exception as e:
        raise ModelError(f"model '{name}': build failed: {type(e).__name__}: {e}") from e
    if isinstance(model, nn.Sequential):
        if len(model) == 0:
            raise ModelError(f"model '{name}': returned an empty nn.Sequential")
        if split_points:
            raise ModelError(
                f"model '{name}': split_points are for captured models; an nn.Sequential is "
                "cut between its elements ([[vw]] layers)",
                key="model.split_points",
            )
        return model
    if not isinstance(model, nn.Module):
        raise ModelError(
            f"model '{name}': returned {type(model).__name__}, not an nn.Module",
            key="model.name",
        )
    try:
        return capture(model, tuple(split_points))
    except CaptureError as e:
        key = "model.split_points" if str(e).startswith("split_points") else "model.name"
        raise ModelError(
            f"model '{name}': cannot capture {type(model).__name__}: {e}; name model.split_points"
            " around it, or return an nn.Sequential of one-tensor layers",
            key=key,
        ) from None


def cross_entropy(output: Any, labels: Tensor) -> Tensor:
    """Mean cross entropy; ``[B, S, C]`` outputs against ``[B, S]`` labels are flattened first.

    An output that carries its own loss is taken as it is: a scalar Tensor, an object with a
    ``loss`` attribute or a mapping with a ``"loss"`` key (a ``ModelOutput``), or a tuple
    whose first element is a scalar (``return_dict=False``). Another mapping or object is
    scored on its ``logits``, a tuple on its first element.
    """
    own = _own_loss(output)
    if own is not None:
        return own
    if isinstance(output, Mapping) and "logits" in output:
        output = output["logits"]
    elif not isinstance(output, Tensor) and isinstance(getattr(output, "logits", None), Tensor):
        output = output.logits
    elif isinstance(output, (tuple, list)) and output:
        output = output[0]
    if output.dim() > 2:
        output = output.reshape(-1, output.shape[-1])
        labels = labels.reshape(-1)
    return F.cross_entropy(output, labels)


def _own_loss(output: Any) -> Tensor | None:
    """The loss a model's output carries, else ``None``."""
    if isinstance(output, Tensor):
        return output if output.dim() == 0 else None
    if isinstance(output, Mapping):
        loss = output.get("loss")
    elif isinstance(output, (tuple, list)):
        loss = output[0] if output and isinstance(output[0], Tensor) else None
    else:
        loss = getattr(output, "loss", None)
    return loss if isinstance(loss, Tensor) and loss.dim() == 0 else None


def model_loss(model: Any) -> LossFn:
    """The loss the last stage applies to (output, labels): ``model.loss`` where the job
    names one, else the builder's ``loss`` attribute, else :func:`cross_entropy` (which takes
    the loss a model returns itself). ``model``: a model name, or a job's model spec."""
    name, named = (model, None) if isinstance(model, str) else (model.name, model.loss)
    if named is not None:
        loss = _resolve(named, "loss")
        if isinstance(loss, type):
            raise ModelError(f"loss '{named}': is a class; name a function", key="model.loss")
        return loss
    func = _resolve(name)
    loss = getattr(func, "loss", None)
    if name not in BUILTIN and loss is not None:
        if not callable(loss):
            raise ModelError(f"model '{name}': its loss attribute is not callable")
        return loss
    return cross_entropy
