"""Models as users write them, for the tests: tied weights, frozen layers, local buffers, dropout.

Jobs name them ``usermodels:<function>``; the tests put this directory on the daemons'
``PYTHONPATH``. Every model takes the 8x8 digits (``[B, 1, 8, 8]``, values in [0, 1]), but
``tied_gpt``, which takes tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
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


# -- several tensors crossing a cut (hetpipe.carry) ---------------------------------------


class Stem(nn.Module):
    """The digits flattened and projected: ``[B, 1, 8, 8]`` -> ``[B, dim]``."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(64, dim)

    def forward(self, x: Tensor) -> Tensor:
        return torch.relu(self.fc(x.flatten(1)))


class Branch(nn.Module):
    """Opens a residual block: ``h`` -> ``(branch(h), h)``, the skip travelling beside."""

    def __init__(self, dim: int, norm: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.norm = nn.BatchNorm1d(dim) if norm else nn.Identity()

    def forward(self, h: Tensor) -> tuple[Tensor, Tensor]:
        return torch.relu(self.norm(self.fc(h))), h


class BranchMore(nn.Module):
    """The residual branch's second layer: ``(a, skip)`` -> ``(fc(a), skip)``."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, carry: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        a, skip = carry
        return self.fc(a), skip


class Join(nn.Module):
    """Closes a residual block: ``(a, skip)`` -> ``relu(a + skip)``."""

    def forward(self, carry: tuple[Tensor, Tensor]) -> Tensor:
        a, skip = carry
        return torch.relu(a + skip)


def residual_net(dim: int = 32, blocks: int = 2, norm: bool = True) -> nn.Sequential:
    """A residual MLP whose blocks are split into elements, so that a cut inside a block has
    two tensors cross it: the branch's activation and the skip.

    Layers: 0 Stem, then per block ``Branch`` (a BatchNorm1d inside with ``norm``),
    ``BranchMore``, ``Join`` (layers 1-3, 4-6, ...), then the Linear head to 10 classes.
    A cut after a ``Branch`` or a ``BranchMore`` carries ``(a, skip)``.
    """
    layers: list[nn.Module] = [Stem(dim)]
    for _ in range(blocks):
        layers += [Branch(dim, norm), BranchMore(dim), Join()]
    return nn.Sequential(*layers, nn.Linear(dim, 10))


class Tokenize(nn.Module):
    """Pixel intensities as tokens, with their position ids and a mask of the lit pixels:
    ``[B, 1, 8, 8]`` -> ``(int64 [B, 64] tokens, int64 [B, 64] positions, bool [B, 64])``.

    Takes the batch as a tensor, a tuple (its first tensor) or a dict (``"x"``), so that the
    same model serves every shape a first stage's input may have. Without ``per_row`` the
    position ids are one ``[64]`` row for the whole minibatch (not split by replica rows)."""

    def __init__(self, per_row: bool = True) -> None:
        super().__init__()
        self.per_row = per_row

    def forward(self, x: Any) -> tuple[Tensor, Tensor, Tensor]:
        if isinstance(x, dict):
            x = x["x"]
        elif isinstance(x, tuple):
            x = x[0]
        tokens = (x.flatten(1) * 16).round().long()
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        if self.per_row:
            positions = positions.expand_as(tokens)
        return tokens, positions, tokens > 0


class Embed(nn.Module):
    """Tokens to vectors; the position ids and mask travel on:
    ``(tokens, pos, mask)`` -> ``(h [B, S, dim], pos, mask)``."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(17, dim)

    def forward(self, carry: tuple[Tensor, Tensor, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        tokens, pos, mask = carry
        return self.tokens(tokens), pos, mask


class PosMix(nn.Module):
    """A residual mixing layer that reads the position ids and masks its update:
    ``(h, pos, mask)`` -> ``(h + mask * gelu(fc(h + pos_emb(pos))), pos, mask)``."""

    def __init__(self, dim: int, seq: int = 64) -> None:
        super().__init__()
        self.pos = nn.Embedding(seq, dim)
        self.fc = nn.Linear(dim, dim)

    def forward(self, carry: tuple[Tensor, Tensor, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        h, pos, mask = carry
        update = torch.nn.functional.gelu(self.fc(h + self.pos(pos)))
        return h + update * mask.unsqueeze(-1).to(h.dtype), pos, mask


class MaskedPool(nn.Module):
    """The mean over the masked positions: ``(h, pos, mask)`` -> ``[B, dim]``."""

    def forward(self, carry: tuple[Tensor, Tensor, Tensor]) -> Tensor:
        h, _pos, mask = carry
        m = mask.unsqueeze(-1).to(h.dtype)
        return (h * m).sum(1) / m.sum(1).clamp(min=1.0)


def masked_seq(dim: int = 16, mixes: int = 2, per_row: bool = True) -> nn.Sequential:
    """A sequence model whose elements pass a hidden state with integer position ids and a
    boolean mask: layers 0 Tokenize (no parameters; its output is integer and boolean only),
    1 Embed, 2.. PosMix (``mixes`` of them), then MaskedPool and a Linear to 10 classes.

    Its loss (:func:`masked_seq_loss`) takes a target as a tensor of labels, a dict
    (``"labels"``) or None (then the output's own mean square: a model that makes its loss).
    ``per_row = False``: the position ids are one row for the whole minibatch.
    """
    return nn.Sequential(
        Tokenize(per_row),
        Embed(dim),
        *(PosMix(dim) for _ in range(mixes)),
        MaskedPool(),
        nn.Linear(dim, 10),
    )


def masked_seq_loss(output: Tensor, target: Any) -> Tensor:
    """Cross entropy against the labels (a tensor, or ``target["labels"]``); with no target,
    the output's mean square."""
    if target is None:
        return output.pow(2).mean()
    if isinstance(target, dict):
        target = target["labels"]
    return torch.nn.functional.cross_entropy(output, target)


masked_seq.loss = masked_seq_loss  # type: ignore[attr-defined]


# -- an nn.Module subclass as people write it (captured by hetpipe.capture) ---------------


class BasicBlock(nn.Module):
    """A ResNet basic block: two 3x3 convolutions with batch norm and the identity skip."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)

    def forward(self, x: Tensor) -> Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + x)


class SmallResNet(nn.Module):
    """A ResNet for the 8x8 digits, written as an ``nn.Module`` subclass (not a Sequential):
    a convolutional stem, a residual stack (an ``nn.ModuleList`` of :class:`BasicBlock`) and
    a pooled linear head. Its natural units are ``stem.0`` .. ``stem.2``, ``layers.0`` ..
    and ``head``; a split point inside a block (``layers.1.conv2``) has two tensors cross
    the cut: the branch's activation and the skip ``x``."""

    def __init__(self, width: int = 8, blocks: int = 3, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU()
        )
        self.layers = nn.ModuleList(BasicBlock(width) for _ in range(blocks))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(width, classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.stem(x)
        for block in self.layers:
            x = block(x)
        return self.head(torch.flatten(self.pool(x), 1))


def small_resnet(width: int = 8, blocks: int = 3) -> nn.Module:
    """:class:`SmallResNet` as its factory: the only user code a job names."""
    return SmallResNet(width, blocks)


# -- a decoder-only language model as people write it ---------------------------------------


@dataclass
class LMOutput:
    """A ``ModelOutput``-style result: the loss and the logits."""

    loss: Tensor
    logits: Tensor


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        b, s, d = x.shape
        k, v = self.kv(x).split(d, dim=-1)
        q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2) for t in (self.q(x), k, v))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(y.transpose(1, 2).reshape(b, s, d))


class Layer(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x), mask)
        return x + self.mlp(self.ln2(x))


class Decoder(nn.Module):
    """Decoder-only LM: token + position embeddings, layers, norm, head tied to the embedding;
    takes ``input_ids``, ``attention_mask`` and ``labels`` and returns its own loss."""

    def __init__(self, vocab: int = 32, dim: int = 16, heads: int = 2, layers: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(64, dim)
        self.layers = nn.ModuleList(Layer(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(
        self, input_ids: Tensor, attention_mask: Tensor, labels: Tensor | None = None
    ) -> LMOutput:
        s = input_ids.size(1)
        positions = torch.arange(s, device=input_ids.device)
        x = self.embed(input_ids) + self.pos(positions)
        causal = positions[None, :] <= positions[:, None]
        mask = causal[None, None] & attention_mask[:, None, None, :].bool()
        for layer in self.layers:
            x = layer(x, mask)
        logits = self.head(self.norm(x))
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return LMOutput(loss, logits)


def decoder(vocab: int = 32, layers: int = 3) -> nn.Module:
    """:class:`Decoder`: its blocks are ``embed``, ``pos``, ``layers.<i>``, ``norm``, ``head``,
    the head tied to the embedding (the tie spans the first and last block)."""
    return Decoder(vocab=vocab, layers=layers)
