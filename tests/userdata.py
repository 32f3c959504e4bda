"""Data sets as users write them, named by jobs as ``userdata:<function>`` (a module the tests
put on the path; not a test module).

Every sample is a pure function of its index, so a test can say which samples a minibatch
holds: sample ``i``'s input carries ``i / 1000`` in its first element (``ident``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset


def _image(i: int, shape: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(1_000 + i)
    x = torch.randn(shape, generator=g)
    x.view(-1)[0] = i / 1000  # the sample's identity, read back by ident()
    return x


def ident(x: torch.Tensor) -> list[int]:
    """The sample indices of a minibatch of inputs made here."""
    return [int(v) for v in (x.reshape(len(x), -1)[:, 0].double() * 1000).round().tolist()]


class Pairs(Dataset):
    """``(x, y)`` with x ``[1, 8, 8]`` float32 and y an int label; counts the samples read."""

    def __init__(self, n: int, classes: int = 10, shape: tuple[int, ...] = (1, 8, 8)) -> None:
        self.n, self.classes, self.shape = n, classes, tuple(shape)
        self.reads = 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        if not 0 <= i < self.n:
            raise IndexError(i)
        self.reads += 1
        return _image(i, self.shape), i % self.classes


class Stream(IterableDataset):
    """The same samples as :class:`Pairs`, as a stream; ``set_epoch`` is recorded."""

    def __init__(self, n: int) -> None:
        self.n, self.epochs = n, []

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)

    def __iter__(self) -> Any:
        for i in range(self.n):
            yield _image(i, (1, 8, 8)), i % 10


class SizedStream(Stream):
    """A stream that knows its length."""

    def __len__(self) -> int:
        return self.n


class StatefulStream(IterableDataset):
    """The samples of :class:`Pairs` as a stream shuffled by ``set_epoch``, keeping its own
    position (torchdata's ``Stateful``: ``state_dict`` and ``load_state_dict``). ``reads``
    counts the samples it yielded (in this process), so a test can see a resume re-reads
    nothing; ``bad_state``: its state is not plain values."""

    def __init__(self, n: int, bad_state: bool = False) -> None:
        self.n, self.bad_state = n, bad_state
        self.epoch, self.i, self.reads = 0, 0, 0
        self._from: int | None = None

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def state_dict(self) -> dict[str, Any]:
        if self.bad_state:
            return {"i": torch.tensor(self.i)}
        return {"epoch": self.epoch, "i": self.i}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self._from = int(state["epoch"]), int(state["i"])

    def __iter__(self) -> Any:
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.epoch))
        start, self._from = self._from or 0, None
        for k in range(start, self.n):
            self.i = k + 1
            self.reads += 1
            i = int(order[k])
            yield _image(i, (1, 8, 8)), i % 10


def stateful_stream(n: int = 256, n_val: int = 0, bad_state: bool = False) -> Any:
    """:class:`StatefulStream` for training (with a map-style validation set of ``n_val``)."""
    train = StatefulStream(n, bad_state)
    return {"train": train, "val": Pairs(n_val)} if n_val else train


def pairs(n: int = 256, n_val: int = 64, shape: list[int] | None = None) -> dict[str, Any]:
    """Map-style training and validation sets, as a mapping."""
    s = tuple(shape or (1, 8, 8))
    return {"train": Pairs(n, shape=s), "val": Pairs(n_val, shape=s)}


def train_only(n: int = 256) -> Pairs:
    return Pairs(n)


def pair(n: int = 256) -> tuple[Pairs, Pairs]:
    return Pairs(n), Pairs(32)


def stream(n: int = 256) -> Stream:
    return Stream(n)


def sized_stream(n: int = 256) -> SizedStream:
    return SizedStream(n)


class Triples(Dataset):
    """``(a, b, y)``: two inputs and the target."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return torch.full((3,), float(i)), torch.full((2,), -float(i)), i % 2


def triples() -> Triples:
    return Triples()


class Tokens(Dataset):
    """Mappings of ``input_ids``, ``attention_mask`` and ``labels`` (a tokenizer's output)."""

    def __init__(self, labels: bool = True) -> None:
        self.labels = labels

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> dict[str, Any]:
        out = {
            "input_ids": torch.arange(i, i + 6) % 50,
            "attention_mask": torch.ones(6, dtype=torch.int64),
        }
        if self.labels:
            out["labels"] = (torch.arange(i, i + 6) + 1) % 50
        return out


def tokens(labels: bool = True) -> Tokens:
    return Tokens(labels)


class Generated(Dataset):
    """``gib`` GiB of ``[3, 64, 64]`` float32 images made on the fly from their index (never
    held anywhere): what a data set far larger than any process's memory looks like."""

    SHAPE = (3, 64, 64)

    def __init__(self, gib: float, n: int | None = None) -> None:
        sample = 4 * int(np.prod(self.SHAPE))
        self.n = n if n is not None else int(gib * (1 << 30)) // sample

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        if not 0 <= i < self.n:
            raise IndexError(i)
        return _image(i, self.SHAPE), i % 10


def generated(gib: float = 10.0) -> dict[str, Dataset]:
    """:class:`Generated` for training, a small validation set beside it."""
    return {"train": Generated(gib), "val": Generated(0, n=32)}


def arrays(n: int = 64) -> list[tuple[np.ndarray, int]]:
    """A plain list of (numpy array, int) samples: a map-style data set too."""
    return [(np.full((1, 8, 8), i, dtype=np.float32), i % 10) for i in range(n)]


def pad_collate(samples: list[tuple[torch.Tensor, int]]) -> dict[str, torch.Tensor]:
    """A user's collate: a mapping with the labels under ``labels``."""
    return {
        "x": torch.stack([s[0] for s in samples]),
        "labels": torch.tensor([s[1] for s in samples]),
    }


def broken_collate(samples: list[Any]) -> Any:
    raise RuntimeError("collate broke")


def strings_collate(samples: list[Any]) -> Any:
    return [s[0] for s in samples], ["a"] * len(samples)


# -- what the job check refuses ---------------------------------------------------------------


def raises(n: int = 8) -> Pairs:
    raise FileNotFoundError(f"/data/set{n} is missing")


def wrong_type() -> int:
    return 42


def wrong_shape() -> Pairs:
    return Pairs(64, shape=(3, 4, 4))


class Doubles(Pairs):
    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        x, y = super().__getitem__(i)
        return x.double(), y


def wrong_dtype() -> Doubles:
    return Doubles(64)


class FloatTargets(Pairs):
    def __getitem__(self, i: int) -> tuple[torch.Tensor, float]:  # type: ignore[override]
        x, _ = super().__getitem__(i)
        return x, 0.5


def wrong_target() -> FloatTargets:
    return FloatTargets(64)


class Broken(Pairs):
    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        raise KeyError(f"sample {i} unreadable")


def broken_sample() -> Broken:
    return Broken(64)


def empty() -> Pairs:
    return Pairs(0)


class Noisy(Pairs):
    """Pairs with random augmentation: noise drawn from torch's generator per sample."""

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        x, y = super().__getitem__(i)
        return x + torch.rand(x.shape), y


def noisy(n: int = 64) -> Noisy:
    return Noisy(n)
