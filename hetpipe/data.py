"""Data sets and the minibatch order each virtual worker reads.

Everything here is a pure function of its arguments and seeds: every process of a job
(each stage 0 of each VW, the head evaluating accuracy) rebuilds the same data set and
the same minibatch order on its own, so no data travels between processes.

Sharding across VWs is per epoch: the epoch's permutation is cut into full minibatches
and VW ``v`` of ``n`` takes minibatches ``v, v + n, v + 2n, ...``. Within an epoch the VWs
read disjoint samples, and all get the same number of minibatches, so waves stay aligned.
"""

from __future__ import annotations

import gzip
import importlib.resources
import itertools
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

__all__ = ["DataError", "Dataset", "MinibatchStream", "evaluate", "load_dataset", "recalibrate_bn"]

DIGITS_SEED = 20200715
DIGITS_TRAIN = 1437
DIGITS_FILE = "assets/digits.csv.gz"


class DataError(ValueError):
    """A data set or stream cannot be made; ``str(e)`` is one line naming the problem."""


@dataclass(frozen=True, eq=False)
class Dataset:
    """A data set held in memory: ``x`` float32 images or int64 tokens, ``y`` int64 labels.

    ``input_shape`` is the shape of one sample of ``x``; ``classes`` the number of label
    values (the vocabulary for token data). ``eq=False``: tensors have no single truth value.
    """

    train_x: Tensor
    train_y: Tensor
    test_x: Tensor
    test_y: Tensor
    input_shape: tuple[int, ...]
    classes: int
    name: str


# --------------------------------------------------------------------------- digits


@lru_cache(maxsize=1)
def _digits_arrays() -> tuple[Tensor, Tensor]:
    """All 1797 digits in file order, parsed once per process (x float32 [N,1,8,8], y int64)."""
    resource = importlib.resources.files("hetpipe").joinpath(DIGITS_FILE)
    with resource.open("rb") as raw, gzip.open(raw, "rt") as text:
        table = np.loadtxt(text, delimiter=",", dtype=np.int64, ndmin=2)
    if table.shape[1] != 65:
        raise DataError(f"{DIGITS_FILE}: expected 65 columns, got {table.shape[1]}")
    x = torch.from_numpy(table[:, :64].astype(np.float32) / 16.0).reshape(-1, 1, 8, 8)
    y = torch.from_numpy(table[:, 64].copy())
    return x, y


def _digits(args: Mapping[str, Any]) -> Dataset:
    """UCI optical digits (test set), split 1437/360 by a fixed permutation."""
    _reject_unknown("digits", args, ())
    x, y = _digits_arrays()
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(DIGITS_SEED))
    train, test = perm[:DIGITS_TRAIN], perm[DIGITS_TRAIN:]
    return Dataset(x[train], y[train], x[test], y[test], (1, 8, 8), 10, "digits")


# --------------------------------------------------------------------------- synthetic

_SYNTHETIC_COMMON = {"n_train": 2048, "n_test": 512, "seed": 0, "kind": "image"}
_SYNTHETIC_IMAGE = {"input_shape": (1, 8, 8), "classes": 10}
_SYNTHETIC_TOKENS = {"seq": 64, "vocab": 256}


def _synthetic(args: Mapping[str, Any]) -> Dataset:
    """Random data with a hidden teacher, so the task is learnable and any size is cheap.

    ``kind="image"``: x ~ N(0, 1) of ``input_shape``; y = argmax of a fixed random linear
    map of x. ``kind="tokens"``: sequences of a fixed random Markov chain in which each
    token has 4 equally likely successors; x is ``seq`` tokens, y the next token of each
    position (x shifted by one), for next-token models like ``gpt``.
    """
    kind = args.get("kind", "image")
    if kind not in ("image", "tokens"):
        raise DataError(f"data 'synthetic': kind must be 'image' or 'tokens', got {kind!r}")
    extra = _SYNTHETIC_IMAGE if kind == "image" else _SYNTHETIC_TOKENS
    _reject_unknown(f"synthetic ({kind})", args, (*_SYNTHETIC_COMMON, *extra))
    opts = {**_SYNTHETIC_COMMON, **extra, **args}
    n_train, n_test, seed = opts["n_train"], opts["n_test"], opts["seed"]
    _check_int("n_train", n_train, 1)
    _check_int("n_test", n_test, 1)
    _check_int("seed", seed, 0)
    gen = torch.Generator().manual_seed(seed)
    n = n_train + n_test
    if kind == "image":
        shape = opts["input_shape"]
        if isinstance(shape, int) or not isinstance(shape, (list, tuple)) or not shape:
            raise DataError(f"data 'synthetic': input_shape must be a list of ints, got {shape!r}")
        shape = tuple(shape)
        for dim in shape:
            _check_int("input_shape", dim, 1)
        classes = opts["classes"]
        _check_int("classes", classes, 2)
        teacher = torch.randn(math.prod(shape), classes, generator=gen)
        x = torch.randn(n, *shape, generator=gen)
        y = (x.reshape(n, -1) @ teacher).argmax(dim=1)
    else:
        seq, vocab = opts["seq"], opts["vocab"]
        _check_int("seq", seq, 1)
        _check_int("vocab", vocab, 2)
        successors = torch.randint(vocab, (vocab, 4), generator=gen)
        tokens = torch.empty(n, seq + 1, dtype=torch.int64)
        tokens[:, 0] = torch.randint(vocab, (n,), generator=gen)
        for t in range(seq):
            pick = torch.randint(4, (n,), generator=gen)
            tokens[:, t + 1] = successors[tokens[:, t], pick]
        x, y = tokens[:, :-1].clone(), tokens[:, 1:].clone()
        shape, classes = (seq,), vocab
    return Dataset(x[:n_train], y[:n_train], x[n_train:], y[n_train:], shape, classes, "synthetic")


def _check_int(key: str, value: Any, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise DataError(f"data 'synthetic': {key} must be an int >= {least}, got {value!r}")


def _reject_unknown(name: str, args: Mapping[str, Any], known: tuple[str, ...]) -> None:
    unknown = sorted(set(args) - set(known))
    if unknown:
        allowed = ", ".join(known) if known else "none"
        raise DataError(f"data '{name}': unknown args {unknown} (allowed: {allowed})")


_LOADERS = {"digits": _digits, "synthetic": _synthetic}


def load_dataset(name: str, args: Mapping[str, Any] | None = None) -> Dataset:
    """Data set ``name`` (``"digits"`` or ``"synthetic"``) made with keyword ``args``."""
    if name not in _LOADERS:
        raise DataError(f"data '{name}': unknown; use one of {', '.join(_LOADERS)}")
    args = {} if args is None else args
    if not isinstance(args, Mapping):
        raise DataError(f"data '{name}': args must be a table, got {args!r}")
    return _LOADERS[name](args)


# --------------------------------------------------------------------------- streams


class MinibatchStream:
    """The minibatches one virtual worker reads, in order p = 0, 1, 2, ... across epochs.

    Epoch ``e`` shuffles the training set with ``randperm(N)`` seeded by
    ``seed * 1_000_003 + e``, cuts it into ``N // minibatch`` full minibatches (the rest is
    dropped), and VW ``vw`` takes every ``num_vws``-th of them starting at ``vw``; each VW gets
    ``per_epoch = (N // minibatch) // num_vws`` per epoch. ``batch(p)`` is random access, so
    a restarted stage can resume at any p.
    """

    def __init__(
        self, dataset: Dataset, minibatch: int, seed: int, vw: int = 0, num_vws: int = 1
    ) -> None:
        if isinstance(minibatch, bool) or not isinstance(minibatch, int) or minibatch < 1:
            raise DataError(f"minibatch must be a positive int, got {minibatch!r}")
        if isinstance(num_vws, bool) or not isinstance(num_vws, int) or num_vws < 1:
            raise DataError(f"num_vws must be a positive int, got {num_vws!r}")
        if isinstance(vw, bool) or not isinstance(vw, int) or not 0 <= vw < num_vws:
            raise DataError(f"vw must be in [0, {num_vws}), got {vw!r}")
        self.dataset = dataset
        self.minibatch = minibatch
        self.seed = seed
        self.vw = vw
        self.num_vws = num_vws
        n = len(dataset.train_x)
        self.per_epoch = (n // minibatch) // num_vws
        if self.per_epoch < 1:
            raise DataError(
                f"data '{dataset.name}': {n} training samples give no minibatch of "
                f"{minibatch} to each of {num_vws} VWs"
            )
        self._epoch = -1
        self._perm = torch.empty(0, dtype=torch.int64)

    def epoch(self, p: int) -> int:
        """The epoch minibatch ``p`` belongs to."""
        return p // self.per_epoch

    def _order(self, epoch: int) -> Tensor:
        if epoch != self._epoch:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm = torch.randperm(len(self.dataset.train_x), generator=gen)
            self._epoch = epoch
        return self._perm

    def indices(self, p: int) -> Tensor:
        """The training-set indices of minibatch ``p``."""
        if isinstance(p, bool) or not isinstance(p, int) or p < 0:
            raise DataError(f"minibatch index must be an int >= 0, got {p!r}")
        epoch, i = divmod(p, self.per_epoch)
        j = self.vw + i * self.num_vws
        return self._order(epoch)[j * self.minibatch : (j + 1) * self.minibatch]

    def batch(self, p: int) -> tuple[Tensor, Tensor]:
        """Minibatch ``p`` as ``(x, y)``; new tensors, safe to modify."""
        idx = self.indices(p)
        return self.dataset.train_x[idx], self.dataset.train_y[idx]

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        """Minibatches 0, 1, 2, ... without end; the caller decides when to stop."""
        return (self.batch(p) for p in itertools.count())


# --------------------------------------------------------------------------- evaluate


@torch.no_grad()
def evaluate(model: nn.Module, dataset: Dataset, batch: int = 512) -> float:
    """Accuracy of ``model`` on the test set (per token for sequence outputs).

    Runs in eval mode under ``no_grad`` on the device of the model's first parameter, and
    puts the model back in the mode it was in.
    """
    first = next(itertools.chain(model.parameters(), model.buffers()), None)
    device = first.device if first is not None else torch.device("cpu")
    was_training = model.training
    model.eval()
    try:
        correct = total = 0
        for start in range(0, len(dataset.test_x), batch):
            x = dataset.test_x[start : start + batch].to(device)
            y = dataset.test_y[start : start + batch].to(device)
            pred = model(x).argmax(dim=-1)
            correct += int((pred == y).sum())
            total += y.numel()
    finally:
        model.train(was_training)
    return correct / total if total else 0.0


def recalibrate_bn(model: nn.Module, stream: MinibatchStream, n: int) -> bool:
    """Re-estimate every batch-norm layer's running statistics on ``n`` training minibatches
    with the model's current weights (``train.bn_recalibrate``); False if it has none.

    Running statistics accumulated during asynchronous training follow weights that kept
    moving (and stale ones): they lag the final weights. Here they are reset and recomputed
    as a plain average over the ``n`` minibatches (momentum None), in train mode under
    ``no_grad``; the weights are not touched.
    """
    norms = [
        m
        for m in model.modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats
    ]
    if not norms or n < 1:
        return False
    first = next(itertools.chain(model.parameters(), model.buffers()))
    momenta = [m.momentum for m in norms]
    was_training = model.training
    for m in norms:
        m.reset_running_stats()
        m.momentum = None
    model.train()
    try:
        with torch.no_grad():
            for p in range(n):
                x, _y = stream.batch(p)
                model(x.to(first.device))
    finally:
        for m, momentum in zip(norms, momenta, strict=True):
            m.momentum = momentum
        model.train(was_training)
    return True
