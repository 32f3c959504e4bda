"""The HetPipe paper's two models, narrowed to train on a CPU, and a generated image task.

HetPipe (USENIX ATC 2020) measures VGG-19 and ResNet-152. Their shapes matter to its result
more than their widths: VGG-19 keeps most of its parameters in three large fully connected
layers after 16 convolutions, so the parameter server's traffic dominates; ResNet-152 is
deep (50 bottleneck blocks in the 3-8-36-3 pattern) with few parameters per block, so the
pipeline's compute dominates. The builders here keep those shapes at widths a CPU trains in
minutes:

- :func:`paper_vgg19`: VGG-19's 16 convolutions (5 blocks, channels ``width / 64`` of the
  original) and three fully connected layers of ``hidden`` units, which hold most of the
  parameters as in the original (at the defaults, over 90 %). Batch norm after each
  convolution (torchvision's VGG-19-BN) and He (fan-out) initialisation: the plain deep
  stack stays on its initial plateau for long, the longer the staler its weights.
- :func:`paper_resnet152`: :func:`hetpipe.models.resnet152` at a narrow width and a small
  image (one pipeline element per bottleneck block).

:func:`paper_images` makes the task both train on: ten classes, each a smooth random colour
pattern, seen through Gaussian noise (``noise`` sets how hard it is). A convolutional
network learns it in a few hundred minibatches; a model that only memorised samples would
not generalise, so the test accuracy means something. :func:`write_paper_images` saves it as
an ``.npz`` that the builtin ``tensors`` data set reads (``x``, ``y``, ``val_x``/``val_y``
through ``path`` and ``val_path``), so every process of a job trains on the same arrays.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["paper_images", "paper_resnet152", "paper_vgg19", "write_paper_images"]

TEMPLATE_SEED = 20200715  # the classes' patterns: alike for every split and every seed


def _positive(model: str, **values: int) -> None:
    from hetpipe.models import _check_positive  # models imports this module

    _check_positive(model, **values)


def paper_vgg19(
    width: int = 4,
    hidden: int = 1024,
    image: int = 32,
    classes: int = 10,
    in_channels: int = 3,
    batch_norm: bool = True,
) -> nn.Sequential:
    """VGG-19 shaped: 16 conv(+BatchNorm)+ReLU in 5 blocks of max pooling, then three fully
    connected layers (``hidden``, ``hidden``, ``classes``) holding most of the parameters;
    flat, no dropout (a pipelined run and a plain run compute the same thing). With
    ``batch_norm`` (torchvision's VGG-19-BN; 59 elements, else 43) the deep plain stack leaves
    its initial plateau within a few hundred minibatches also under stale weights."""
    _positive(
        "paper_vgg19",
        width=width,
        hidden=hidden,
        image=image,
        classes=classes,
        in_channels=in_channels,
    )
    from hetpipe.models import vgg_layers  # models imports this module

    return vgg_layers(
        "paper_vgg19", image, classes, in_channels, width, hidden, batch_norm, kaiming=True
    )


def paper_resnet152(
    width: int = 2, image: int = 8, classes: int = 10, in_channels: int = 3
) -> nn.Sequential:
    """ResNet-152 shaped: a stem, 3+8+36+3 bottleneck blocks (one element each), pool, fc:
    :func:`hetpipe.models.resnet152` at a width and image size a CPU trains quickly."""
    from hetpipe.models import resnet152

    _positive("paper_resnet152", width=width, image=image, classes=classes)
    return resnet152(image=image, classes=classes, in_channels=in_channels, width=width)


def paper_images(
    n: int, image: int = 32, classes: int = 10, noise: float = 1.5, seed: int = 0
) -> tuple[Tensor, Tensor]:
    """``n`` samples of the task: ``x`` float32 ``[n, 3, image, image]``, ``y`` int64 ``[n]``.

    Class ``c``'s pattern is a random 4x4 colour image scaled up to ``image`` (bilinear), the
    same for every ``seed``; a sample is its class's pattern plus N(0, ``noise``²) per pixel.
    ``seed`` draws the labels and the noise, so two seeds give disjoint-looking splits.
    """
    gen = torch.Generator().manual_seed(TEMPLATE_SEED)
    base = torch.randn(classes, 3, 4, 4, generator=gen)
    patterns = F.interpolate(base, size=image, mode="bilinear", align_corners=False)
    gen = torch.Generator().manual_seed(seed)
    y = torch.randint(classes, (n,), generator=gen)
    x = patterns[y] + noise * torch.randn(n, 3, image, image, generator=gen)
    return x.contiguous(), y


def write_paper_images(
    folder: str | Path,
    *,
    image: int = 32,
    n_train: int = 8192,
    n_test: int = 1024,
    noise: float = 1.5,
) -> dict[str, str]:
    """Write the task's training and test splits as ``train.npz`` and ``test.npz`` (arrays
    ``x`` and ``y``) under ``folder``; return the ``tensors`` data set's args for them."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    out = {}
    for split, n, seed in (("train", n_train, 1), ("test", n_test, 2)):
        x, y = paper_images(n, image, noise=noise, seed=seed)
        path = folder / f"{split}.npz"
        np.savez(path, x=x.numpy(), y=y.numpy())
        out["path" if split == "train" else "val_path"] = str(path.resolve())
    return out
