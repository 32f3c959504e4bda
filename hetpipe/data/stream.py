"""The minibatches one virtual worker reads, and the ``DataLoader`` its first stage reads
them through.

**Order (map-style data sets).** Epoch ``e`` shuffles the training set with
``randperm(N)`` seeded by ``seed * 1_000_003 + e`` and cuts it into ``F = N // minibatch`` full
minibatches (the rest of the epoch is dropped). The VWs deal them out as the
``DistributedSampler`` contract says: disjoint within an epoch, every VW the same number
(``F // num_vws``), VW ``v`` of ``n`` taking the epoch's minibatches ``v, v + n, v + 2n, ...``.
Where VWs run different amounts (``shares``: VW ``v`` runs ``shares[v]`` minibatches for each
``sum(shares)``), each block of ``sum(shares)`` consecutive minibatches gives VW ``v`` its
``shares[v]`` of them, so shards stay disjoint and in proportion.

Minibatch ``q`` of a VW is a pure function of (seed, q, vw, shares): a stage restarted at
``task.start`` (a resumed job) reads on from exactly where the stopped one was, and over the
stop every sample of the epoch is read once. That number ``q`` (minibatches done, which the
checkpoint records per VW) is the sampler's whole state; :meth:`MinibatchStream.state_dict`
says it as epoch and place.

**Iterable data sets** (``torch.utils.data.IterableDataset``) have no index: VW ``v`` of
``n`` keeps the samples ``i`` with ``i % n == v`` of each pass over the data set, and loader
worker ``w`` of ``W`` the ones of those with ``(i // n) % W == w`` (each worker reads the whole
stream and keeps its share). A pass that ends starts the next epoch (``set_epoch(e)`` is
called where the data set has it) and minibatches run on across it (each loader worker runs
its own passes, so a minibatch near a pass's end may hold samples of two). Resuming at ``q``
reads the VW's stream from its start again and drops the first ``q`` minibatches: every sample
is still seen once across a stop when the data set yields the same samples in the same order
each time (shuffle inside it by ``set_epoch``), at the cost of reading the skipped ones again.
The order depends on ``data.workers`` (loader workers take turns by minibatch).

**Loading.** :meth:`MinibatchStream.reader` opens one ``torch.utils.data.DataLoader`` over
the VW's minibatches from ``q`` on: ``data.workers`` processes (0: in the stage's own
process), ``data.prefetch`` minibatches prefetched per worker, pinned memory where the stage
runs on CUDA, workers kept for the whole run (one endless pass over the sampler). Only the
samples of a minibatch are read when it is made; the data set itself is never gathered.
Random augmentation in loader workers draws from seeds of (job seed, VW, start): reproducible
for a run; a run resumed at ``q`` draws afresh.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.utils import data as tud

from hetpipe.data.builtin import DataError, Dataset, TensorPairs
from hetpipe.data.source import Batch, Batcher, DataSource, is_iterable

__all__ = ["MinibatchStream", "Reader"]


def _positive(name: str, value: Any, least: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise DataError(f"{name} must be an int >= {least}, got {value!r}")


class MinibatchStream:
    """The minibatches virtual worker ``vw`` of ``num_vws`` reads, p = 0, 1, 2, ... across
    epochs (see the module's docstring for the order). ``data`` is a :class:`DataSource` or
    an in-memory :class:`~hetpipe.data.builtin.Dataset`.

    ``batch(p)`` is random access (map-style data sets); :meth:`reader` reads in order
    through a ``DataLoader`` with ``workers`` processes and ``prefetch`` minibatches each.
    """

    def __init__(
        self,
        data: DataSource | Dataset,
        minibatch: int,
        seed: int,
        vw: int = 0,
        num_vws: int = 1,
        *,
        workers: int = 0,
        prefetch: int = 2,
        pin_memory: bool = False,
        shares: Sequence[int] | None = None,
    ) -> None:
        if isinstance(minibatch, bool) or not isinstance(minibatch, int) or minibatch < 1:
            raise DataError(f"minibatch must be a positive int, got {minibatch!r}")
        if isinstance(num_vws, bool) or not isinstance(num_vws, int) or num_vws < 1:
            raise DataError(f"num_vws must be a positive int, got {num_vws!r}")
        if isinstance(vw, bool) or not isinstance(vw, int) or not 0 <= vw < num_vws:
            raise DataError(f"vw must be in [0, {num_vws}), got {vw!r}")
        _positive("data.workers", workers, 0)
        _positive("data.prefetch", prefetch)
        if shares is None:
            shares = (1,) * num_vws
        if len(shares) != num_vws:
            raise DataError(f"shares: {len(shares)} given for {num_vws} VWs")
        for s in shares:
            _positive("shares", s)
        source = (
            data
            if isinstance(data, DataSource)
            else DataSource(data.name, data.train, data.val, Batcher(data.name))
        )
        if source.train is None:
            raise DataError(f"data '{source.name}': this process holds no training set")
        self.dataset = data
        self.source = source
        self.minibatch = minibatch
        self.seed = seed
        self.vw = vw
        self.num_vws = num_vws
        self.workers = workers
        self.prefetch = prefetch
        self.pin_memory = pin_memory
        self.shares = tuple(shares)
        self._block = sum(self.shares)
        self._offset = sum(self.shares[:vw])
        self.iterable = is_iterable(source.train)
        n = source.train_len()
        # minibatches per epoch of this VW; None for a stream of unknown length
        self.per_epoch: int | None = None
        if not self.iterable:
            assert n is not None
            self.per_epoch = (n // minibatch) // self._block * self.shares[vw]
            if self.per_epoch < 1:
                raise DataError(
                    f"data '{source.name}': {n} training samples give no minibatch of "
                    f"{minibatch} to each of {num_vws} VWs"
                )
        elif n is not None:
            self.per_epoch = (n // num_vws) // minibatch or None
        self._epoch = -1
        self._perm = torch.empty(0, dtype=torch.int64)
        self._readers: list[Reader] = []

    # ------------------------------------------------------------------ order

    def epoch(self, p: int) -> int:
        """The epoch minibatch ``p`` belongs to (0 for a stream of unknown length)."""
        return p // self.per_epoch if self.per_epoch else 0

    def _order(self, epoch: int) -> Tensor:
        if epoch != self._epoch:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm = torch.randperm(len(self.source.train), generator=gen)
            self._epoch = epoch
        return self._perm

    def indices(self, p: int) -> Tensor:
        """The training-set indices of minibatch ``p`` (map-style data sets)."""
        if isinstance(p, bool) or not isinstance(p, int) or p < 0:
            raise DataError(f"minibatch index must be an int >= 0, got {p!r}")
        if self.iterable or self.per_epoch is None:
            raise DataError(f"data '{self.source.name}': an IterableDataset has no indices")
        epoch, i = divmod(p, self.per_epoch)
        share = self.shares[self.vw]
        j = (i // share) * self._block + self._offset + i % share
        return self._order(epoch)[j * self.minibatch : (j + 1) * self.minibatch]

    def state_dict(self, p: int) -> dict[str, int]:
        """Where minibatch ``p`` is: its epoch and its place in the VW's share of it (what a
        sampler's state would hold; ``p`` alone determines it)."""
        return {
            "minibatch": p,
            "epoch": self.epoch(p),
            "in_epoch": p - self.epoch(p) * (self.per_epoch or 0),
        }

    # ------------------------------------------------------------------ read

    def batch(self, p: int) -> Batch:
        """Minibatch ``p`` as ``(inputs, target)``; new tensors, safe to modify. Random access
        for map-style data sets; a stream reads up to ``p`` from its start."""
        if self.iterable:
            if isinstance(p, bool) or not isinstance(p, int) or p < 0:
                raise DataError(f"minibatch index must be an int >= 0, got {p!r}")
            with self.reader(p, workers=0) as reader:
                return reader.get(p)
        idx = self.indices(p).tolist()
        train = self.source.train
        if isinstance(train, TensorPairs) and self.source.batcher.collate is None:
            got = train.rows(idx)
            if got is not None:
                return got
        return self.source.batcher([train[i] for i in idx])

    def reader(self, start: int = 0, *, workers: int | None = None) -> Reader:
        """Minibatches ``start``, ``start + 1``, ... in order, through a ``DataLoader``;
        :meth:`close` (or the reader's own) stops its worker processes."""
        reader = Reader(self, start, self.workers if workers is None else workers)
        self._readers.append(reader)
        return reader

    def close(self) -> None:
        """Stop the loader worker processes of every reader this stream opened."""
        for reader in self._readers:
            reader.close()
        self._readers.clear()

    def __iter__(self) -> Iterator[Batch]:
        """Minibatches 0, 1, 2, ... without end; the caller decides when to stop."""
        return (self.batch(p) for p in itertools.count())

    # ------------------------------------------------------------------ loader

    def loader(self, start: int, workers: int) -> tud.DataLoader:
        """The ``DataLoader`` over this VW's minibatches from ``start`` on (endless; a stream
        skips its first ``start`` minibatches when read)."""
        gen = torch.Generator().manual_seed(
            (self.seed * 1_000_003 + 7_919 * self.vw + start) % (2**63)
        )
        common: dict[str, Any] = {
            "collate_fn": self.source.batcher,
            "num_workers": workers,
            "pin_memory": self.pin_memory,
            "generator": gen,
        }
        if workers:
            common.update(prefetch_factor=self.prefetch, persistent_workers=True)
        if self.iterable:
            shard = _IterableShard(self.source.train, self.source.name, self.vw, self.num_vws)
            return tud.DataLoader(shard, batch_size=self.minibatch, **common)
        return tud.DataLoader(self.source.train, batch_sampler=_ShardBatches(self, start), **common)


class _ShardBatches:
    """The batch sampler of one VW: the index lists of minibatches ``start``, ``start + 1``, ...
    without end (the stream's order)."""

    def __init__(self, stream: MinibatchStream, start: int) -> None:
        self.stream = stream
        self.start = start

    def __iter__(self) -> Iterator[list[int]]:
        for p in itertools.count(self.start):
            yield self.stream.indices(p).tolist()


class _IterableShard(tud.IterableDataset):
    """VW ``vw``'s share of an iterable data set, split again among loader workers, endless
    across epochs (see :mod:`hetpipe.data.stream`)."""

    def __init__(self, data: Any, name: str, vw: int, num_vws: int) -> None:
        self.data, self.name, self.vw, self.num_vws = data, name, vw, num_vws

    def __iter__(self) -> Iterator[Any]:
        info = tud.get_worker_info()
        w, n_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        for epoch in itertools.count():
            if hasattr(self.data, "set_epoch"):
                self.data.set_epoch(epoch)
            got = False
            for i, sample in enumerate(self.data):
                if i % self.num_vws == self.vw and (i // self.num_vws) % n_workers == w:
                    got = True
                    yield sample
            if not got:
                raise DataError(
                    f"data '{self.name}': a pass gave no sample to VW {self.vw} "
                    f"(loader worker {w} of {n_workers})"
                )


class Reader:
    """Reads a stream's minibatches in order through one ``DataLoader``; :meth:`get` of any
    other minibatch than the next reopens it there. ``waited_s``: time spent waiting for a
    minibatch (the input wait a first stage sees)."""

    def __init__(self, stream: MinibatchStream, start: int, workers: int) -> None:
        self.stream = stream
        self.workers = workers
        self.next = start
        self.waited_s = 0.0
        self.read = 0
        self._loader_it: Any = None
        self._it: Iterator[Batch] | None = None
        # minibatches gathered in this process by index: no loader needed
        self._direct = not stream.iterable and workers == 0 and not stream.pin_memory

    def _open(self, start: int) -> None:
        self.close()
        self._loader_it = iter(self.stream.loader(start, self.workers))
        self._it = (
            itertools.islice(self._loader_it, start, None)
            if self.stream.iterable
            else self._loader_it
        )
        self.next = start

    def get(self, p: int) -> Batch:
        """Minibatch ``p`` of the stream."""
        t0 = time.perf_counter()
        if self._direct:
            got = self.stream.batch(p)
        else:
            if self._it is None or p != self.next:
                self._open(p)
            assert self._it is not None
            got = next(self._it)
        self.waited_s += time.perf_counter() - t0
        self.next = p + 1
        self.read += 1
        return got

    def close(self) -> None:
        """Stop the loader's worker processes (a reader opened again starts new ones)."""
        it, self._loader_it, self._it = self._loader_it, None, None
        shutdown = getattr(it, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
