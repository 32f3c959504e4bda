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
``n`` keeps the samples ``i`` with ``i % n == v`` of each pass over the data set. A pass that
ends starts the next epoch (``set_epoch(e)`` is called where the data set has it) and the
VW's samples run on across it: minibatch ``q`` is the VW's samples ``q * B .. (q + 1) * B - 1``
counted over all passes (a minibatch near a pass's end may hold samples of two). Loader
worker ``w`` of ``W`` makes the minibatches ``q`` with ``q % W == w`` (each worker reads the
whole stream and keeps its minibatches' samples), so the order does not depend on
``data.workers``.

**Resuming a stream.** Where the data set is *stateful* (``state_dict()`` and
``load_state_dict(state)``, as torchdata's ``Stateful`` protocol: after ``load_state_dict``
the next ``iter()`` goes on from where ``state_dict()`` was taken), every minibatch comes
with the data set's state right after its last sample, and the position the checkpoint
records at minibatch ``q`` holds that state (:meth:`Reader.state`): a resumed reader loads it
into each loader worker's copy of the data set and reads on from there, reading nothing
twice. The state must be plain values (numbers, strings, lists, dicts): it is stored in the
checkpoint's JSON. Without one (or where the state is of another VW count, minibatch or
position), resuming at ``q`` reads the VW's stream from its start again and drops the first
``q`` minibatches unread by the batcher: every sample is still seen once across a stop when
the data set yields the same samples in the same order each time (shuffle inside it by
``set_epoch``), at the cost of reading the skipped ones again.

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
import json
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

    def reader(
        self,
        start: int = 0,
        *,
        workers: int | None = None,
        state: dict[str, Any] | None = None,
    ) -> Reader:
        """Minibatches ``start``, ``start + 1``, ... in order, through a ``DataLoader``;
        :meth:`close` (or the reader's own) stops its worker processes. ``state``: the
        position a checkpoint recorded at ``start`` (:meth:`Reader.state`), which a stateful
        stream resumes from (see the module's docstring)."""
        reader = Reader(self, start, self.workers if workers is None else workers)
        if state is not None and self.resumable(state, start):
            reader.states[start] = state
        self._readers.append(reader)
        return reader

    @property
    def stateful(self) -> bool:
        """Whether this is a stream whose data set keeps its own position (``state_dict``
        and ``load_state_dict``), which a checkpoint records."""
        data = self.source.train
        return self.iterable and all(
            callable(getattr(data, m, None)) for m in ("state_dict", "load_state_dict")
        )

    def resumable(self, state: Any, start: int) -> bool:
        """Whether ``state`` is this VW's position at minibatch ``start`` (a state of another
        VW count, minibatch or place is not: such a resume reads on by skipping)."""
        return (
            self.stateful
            and isinstance(state, dict)
            and state.get("position") == start
            and state.get("vw") == self.vw
            and state.get("num_vws") == self.num_vws
            and state.get("minibatch") == self.minibatch
        )

    def close(self) -> None:
        """Stop the loader worker processes of every reader this stream opened."""
        for reader in self._readers:
            reader.close()
        self._readers.clear()

    def __iter__(self) -> Iterator[Batch]:
        """Minibatches 0, 1, 2, ... without end; the caller decides when to stop."""
        return (self.batch(p) for p in itertools.count())

    # ------------------------------------------------------------------ loader

    def loader(
        self, start: int, workers: int, state: dict[str, Any] | None = None
    ) -> tud.DataLoader:
        """The ``DataLoader`` over this VW's minibatches from ``start`` on (endless). A stream
        yields ``(minibatch, position after it)`` and goes on from ``state`` (its position at
        ``start``), or else skips its first ``start`` minibatches unbatched."""
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
            shard = _IterableShard(self, start, state)
            common["collate_fn"] = _as_is  # the shard batches: a minibatch and its position
            return tud.DataLoader(shard, batch_size=None, **common)
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


def _as_is(item: Any) -> Any:
    return item


class _IterableShard(tud.IterableDataset):
    """VW ``vw``'s minibatches of an iterable data set from ``start`` on, each loader worker
    making its own (see :mod:`hetpipe.data.stream`), endless across epochs. Yields
    ``(minibatch, position)``: the position after the minibatch (:meth:`Reader.state`) for a
    stateful data set, else None. ``state``: the position at ``start`` to go on from."""

    def __init__(self, stream: MinibatchStream, start: int, state: dict[str, Any] | None) -> None:
        self.data = stream.source.train
        self.batcher = stream.source.batcher
        self.name = stream.source.name
        self.vw, self.num_vws, self.minibatch = stream.vw, stream.num_vws, stream.minibatch
        self.start, self.state = start, state
        self.stateful = stream.stateful

    def _position(self, q: int, epoch: int, index: int) -> dict[str, Any] | None:
        """The position after minibatch ``q - 1``, whose last sample was ``index`` of the
        pass of ``epoch``."""
        if not self.stateful:
            return None
        return {
            "position": q,
            "epoch": epoch,
            "index": index,
            "vw": self.vw,
            "num_vws": self.num_vws,
            "minibatch": self.minibatch,
            "data": self.data.state_dict(),
        }

    def __iter__(self) -> Iterator[tuple[Batch, dict[str, Any] | None]]:
        info = tud.get_worker_info()
        w, n_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        b, n, data = self.minibatch, self.num_vws, self.data
        state = self.state
        # the VW's samples so far (over all passes), where this reader's first pass begins
        if state is not None:
            epoch, first, taken = int(state["epoch"]), int(state["index"]) + 1, self.start * b
        else:
            epoch, first, taken = 0, 0, 0
        samples: list[Any] = []
        while True:
            if hasattr(data, "set_epoch"):
                data.set_epoch(epoch)
            if state is not None:
                data.load_state_dict(state["data"])
            got = False
            for i, sample in enumerate(data, first):
                if i % n != self.vw:
                    continue
                got = True
                q, j = divmod(taken, b)
                taken += 1
                if q < self.start or (q - self.start) % n_workers != w:
                    continue
                samples.append(sample)
                if j == b - 1:
                    position = self._position(q + 1, epoch, i)
                    yield self.batcher(samples), position
                    samples = []
            if not got and state is None:
                raise DataError(f"data '{self.name}': a pass gave no sample to VW {self.vw} of {n}")
            epoch, first, state = epoch + 1, 0, None


class Reader:
    """Reads a stream's minibatches in order through one ``DataLoader``; :meth:`get` of any
    other minibatch than the next reopens it there. ``waited_s``: time spent waiting for a
    minibatch (the input wait a first stage sees)."""

    KEEP = 4096  # positions of a stateful stream kept behind the next minibatch

    def __init__(self, stream: MinibatchStream, start: int, workers: int) -> None:
        self.stream = stream
        self.workers = workers
        self.next = start
        self.waited_s = 0.0
        self.read = 0
        self._loader_it: Any = None
        self._it: Iterator[Any] | None = None
        # minibatches gathered in this process by index: no loader needed
        self._direct = not stream.iterable and workers == 0 and not stream.pin_memory
        # a stateful stream's position at each minibatch read up to (see state())
        self.states: dict[int, dict[str, Any]] = {}

    def _open(self, start: int) -> None:
        self.close()
        self._loader_it = iter(self.stream.loader(start, self.workers, self.states.get(start)))
        self._it = self._loader_it
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
            if self.stream.iterable:
                got, position = got
                if position is not None:
                    self.states[p + 1] = position
                    for old in [q for q in self.states if q < p + 1 - self.KEEP]:
                        del self.states[old]
        self.waited_s += time.perf_counter() - t0
        self.next = p + 1
        self.read += 1
        return got

    def state(self, q: int) -> dict[str, Any] | None:
        """The position a checkpoint records at minibatch ``q`` (this reader has read up to
        it): a stateful stream's data set state after minibatch ``q - 1``, which
        :meth:`MinibatchStream.reader` resumes from; None for a map-style data set (``q``
        is its whole state) or a stream without state. Positions before ``q`` are dropped.
        Raises :class:`DataError` where the data set's state is not plain values."""
        for old in [k for k in self.states if k < q]:
            del self.states[old]
        got = self.states.get(q)
        if got is None:
            return None
        try:
            json.dumps(got)
        except (TypeError, ValueError) as exc:
            raise DataError(
                f"data '{self.stream.source.name}': state_dict() gave what a checkpoint "
                f"cannot store ({exc}); return numbers, strings, lists and dicts"
            ) from None
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
