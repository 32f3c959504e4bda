"""Models as users write them, for the tests: tied weights, frozen layers, local buffers, dropout.

Jobs name them ``usermodels:<function>``; the tests put this directory on the daemons'
``PYTHONPATH``. Every model takes the 8x8 digits (``[B, 1, 8, 8]``, values in [0, 1]), but
``tied_gpt``, which takes tokens.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


def tied_mlp() -> nn.Sequential:
    """Two hidden layers sharing one weight (``b.weight = a.weight``), each with its own bias.

    Layers: 0 Flatten, 1 Linear, 2 ReLU, 3 Linear (tied), 4 ReLU, 5 Linear (tied), 6 ReLU,
    7 Linear: the tie spans layers 3..5.
    """
    model = nn.Sequential(
        nn.Flatten(),
        nn.Linear(64, 32),
        nn.ReLU(),
        nn.Linear(32, 32),
        nn.ReLU(),
        nn.Linear(32, 32),
        nn.ReLU(),
        nn.Linear(32, 10),
    )
    model[5].weight = model[3].weight
    return model


class Tokens(nn.Module):
    """Pixel intensities as tokens: ``[B, 1, 8, 8]`` in [0, 1] -> int64 ``[B, 64]`` in 0..16."""

    def forward(self, x: Tensor) -> Tensor:
        return (x.flatten(1) * 16).round().long()


class Mix(nn.Module):
    """A residual GELU mixing layer over the embedding dimension."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        return x + torch.nn.functional.gelu(self.fc(x))


class MeanPool(nn.Module):
    """Mean over the sequence: ``[B, S, C]`` -> ``[B, C]``."""

    def forward(self, x: Tensor) -> Tensor:
        return x.mean(dim=1)


def tied_lm(dim: int = 16) -> nn.Sequential:
    """A language-model shape: the output head is tied to the token embedding (as in GPT-2).

    Layers: 0 Tokens, 1 Embedding (tied), 2 Mix, 3 head Linear (tied, no bias), 4 MeanPool,
    5 Linear to the 10 classes.
    """
    model = nn.Sequential(
        Tokens(),
        nn.Embedding(17, dim),
        Mix(dim),
        nn.Linear(dim, 17, bias=False),
        MeanPool(),
        nn.Linear(17, 10),
    )
    model[3].weight = model[1].weight
    return model


def frozen_mlp() -> nn.Sequential:
    """A fine-tuning shape: the first layer frozen whole, and the last layer's bias frozen."""
    model = nn.Sequential(
        nn.Flatten(),
        nn.Linear(64, 32),
        nn.ReLU(),
        nn.Linear(32, 32),
        nn.ReLU(),
        nn.Linear(32, 10),
    )
    model[1].requires_grad_(False)
    model[5].bias.requires_grad_(False)
    return model


class Scale(nn.Module):
    """Multiplies by a fixed per-feature scale held in a non-persistent buffer."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.register_buffer("scale", torch.linspace(0.5, 1.5, n), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        return x * self.scale


def local_buffer_mlp() -> nn.Sequential:
    """A non-persistent buffer (layer 4) beside a batch norm's persistent ones (layer 2)."""
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(64, 32),
        nn.BatchNorm1d(32),
        nn.ReLU(),
        Scale(32),
        nn.Linear(32, 10),
    )


def dropout_mlp(p: float = 0.3) -> nn.Sequential:
    """Dropout after each hidden layer (layers 3 and 6)."""
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(64, 64),
        nn.ReLU(),
        nn.Dropout(p),
        nn.Linear(64, 64),
        nn.ReLU(),
        nn.Dropout(p),
        nn.Linear(64, 10),
    )


def everything() -> nn.Sequential:
    """All of the above in one model: a frozen layer, a non-persistent buffer, a tie, dropout.

    Layers: 0 Flatten, 1 Linear (frozen), 2 ReLU, 3 Scale, 4 Linear (tied), 5 ReLU,
    6 Dropout, 7 Linear (tied), 8 ReLU, 9 Linear.
    """
    model = nn.Sequential(
        nn.Flatten(),
        nn.Linear(64, 32),
        nn.ReLU(),
        Scale(32),
        nn.Linear(32, 32),
        nn.ReLU(),
        nn.Dropout(0.1),
        nn.Linear(32, 32),
        nn.ReLU(),
        nn.Linear(32, 10),
    )
    model[1].requires_grad_(False)
    model[7].weight = model[4].weight
    return model


def tied_gpt(vocab: int = 17, dim: int = 16) -> nn.Sequential:
    """GPT's tie in its plainest shape: the output head shares the input embedding's weight.

    Layers: 0 Embedding (tied), 1 LayerNorm, 2 Linear, 3 GELU, 4 head Linear (tied, no bias).
    The last two layers hold no state of their own. Input int64 tokens ``[B, S]`` (the
    ``synthetic`` data set's ``kind = "tokens"``), output logits ``[B, S, vocab]``.
    """
    model = nn.Sequential(
        nn.Embedding(vocab, dim),
        nn.LayerNorm(dim),
        nn.Linear(dim, dim),
        nn.GELU(),
        nn.Linear(dim, vocab, bias=False),
    )
    model[4].weight = model[0].weight
    return model
