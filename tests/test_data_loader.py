"""Each virtual worker's share of the data read through a ``DataLoader``: disjoint seeded
shards, the same minibatches with loader workers as without, resuming at any minibatch with
every sample of the epoch seen once across the stop, and streams (``IterableDataset``)."""

from __future__ import annotations

import itertools
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
import userdata

from hetpipe.data import DataError, MinibatchStream, first_batch, load_data
from hetpipe.jobplan import data_shares


def samples_of(batch: tuple) -> list[int]:
    return userdata.ident(batch[0])


def test_a_users_dataset_shards_like_the_builtins() -> None:
    """A user's map-style set follows the same order as digits: the epoch's permutation cut
    into full minibatches, VW v taking v, v + n, ..."""
    src = load_data("userdata:pairs", {"n": 100})
    streams = [MinibatchStream(src, 8, seed=4, vw=v, num_vws=3) for v in range(3)]
    assert [s.per_epoch for s in streams] == [4, 4, 4]  # 12 full minibatches, 4 each
    for epoch in range(2):
        perm = torch.randperm(100, generator=torch.Generator().manual_seed(4 * 1_000_003 + epoch))
        seen: list[int] = []
        for v, s in enumerate(streams):
            for i in range(s.per_epoch):
                got = samples_of(s.batch(epoch * s.per_epoch + i))
                j = v + 3 * i
                assert got == perm[j * 8 : (j + 1) * 8].tolist()
                seen += got
        assert len(seen) == len(set(seen)) == 96


@pytest.mark.parametrize("workers", [0, 2])
def test_the_loader_reads_the_streams_minibatches(workers: int) -> None:
    """In order through the DataLoader (workers or none) = random access, from any start."""
    src = load_data("userdata:pairs", {"n": 64})
    stream = MinibatchStream(src, 8, seed=2, vw=1, num_vws=2, workers=workers, prefetch=3)
    with stream.reader(3) as reader:
        for p in range(3, 3 + 2 * stream.per_epoch):
            x, y = reader.get(p)
            want = stream.indices(p).tolist()
            assert samples_of((x, y)) == want and y.tolist() == [i % 10 for i in want]
        assert reader.read == 2 * stream.per_epoch and reader.waited_s >= 0.0
        # asked for another minibatch than the next, it reopens there
        assert samples_of(reader.get(1)) == stream.indices(1).tolist()
        assert samples_of(reader.get(2)) == stream.indices(2).tolist()
    stream.close()


def test_only_the_minibatches_read_are_read() -> None:
    """Nothing gathers the data set: the samples read are the minibatches' own."""
    src = load_data("userdata:pairs", {"n": 10_000})
    stream = MinibatchStream(src, 16, seed=0)
    with stream.reader(0) as reader:
        for p in range(5):
            reader.get(p)
    assert src.train.reads == 5 * 16


def test_shares_deal_in_proportion_and_stay_disjoint() -> None:
    """VWs that run different amounts (shares 1:2) get shards in that proportion."""
    src = load_data("userdata:pairs", {"n": 96})
    a = MinibatchStream(src, 4, seed=0, vw=0, num_vws=2, shares=(1, 2))
    b = MinibatchStream(src, 4, seed=0, vw=1, num_vws=2, shares=(1, 2))
    assert (a.per_epoch, b.per_epoch) == (8, 16)  # 24 full minibatches: blocks of 3
    for epoch in range(2):
        got = [
            i
            for s in (a, b)
            for p in range(s.per_epoch)
            for i in s.indices(epoch * s.per_epoch + p).tolist()
        ]
        assert sorted(got) == sorted(set(got)) and len(got) == 96
    with pytest.raises(DataError, match="shares: 1 given for 2 VWs"):
        MinibatchStream(src, 4, seed=0, vw=0, num_vws=2, shares=(1,))


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_sees_every_sample_of_the_epoch_once(workers: int) -> None:
    """Two VWs stop after k minibatches and restart at k (the checkpoint's data position):
    across the stop each VW reads the epoch's samples it would have read, each once."""
    src = load_data("userdata:pairs", {"n": 120})
    counts: Counter[int] = Counter()
    uninterrupted: list[list[int]] = []
    for v in range(2):
        stream = MinibatchStream(src, 5, seed=9, vw=v, num_vws=2, workers=workers)
        per = stream.per_epoch
        stop = per // 2 + v  # the VWs stop at different positions
        with stream.reader(0) as first:
            before = [samples_of(first.get(p)) for p in range(stop)]
        restarted = MinibatchStream(src, 5, seed=9, vw=v, num_vws=2, workers=workers)
        with restarted.reader(stop) as second:
            after = [samples_of(second.get(p)) for p in range(stop, per)]
        for batch in before + after:
            counts.update(batch)
        uninterrupted.append([i for p in range(per) for i in stream.indices(p).tolist()])
        assert [i for b in before + after for i in b] == uninterrupted[-1]
        assert restarted.state_dict(stop) == {"minibatch": stop, "epoch": 0, "in_epoch": stop}
    assert set(counts.values()) == {1} and len(counts) == 120  # 24 minibatches of 5: all


def test_a_stream_shards_by_vw_and_by_loader_worker() -> None:
    n = 48  # a VW's 24 per pass: 12 per loader worker, 3 minibatches each
    for workers in (0, 2):
        seen: list[int] = []
        for v in range(2):
            stream = MinibatchStream(
                load_data("userdata:stream", {"n": n}), 4, seed=0, vw=v, num_vws=2, workers=workers
            )
            assert stream.iterable and stream.per_epoch is None
            with stream.reader(0) as reader:
                got = [samples_of(reader.get(p)) for p in range(6)]  # one pass: 24 samples
            mine = [i for b in got for i in b]
            assert all(i % 2 == v for i in mine)
            seen += mine
        assert sorted(seen) == list(range(n)), workers


def test_a_stream_runs_on_across_epochs_and_resumes_by_skipping() -> None:
    src = load_data("userdata:stream", {"n": 10})
    stream = MinibatchStream(src, 4, seed=0)
    with stream.reader(0) as reader:
        got = [samples_of(reader.get(p)) for p in range(5)]  # 20 samples: two passes
    flat = [i for b in got for i in b]
    assert flat == list(range(10)) * 2
    # resumed at minibatch 3: the same minibatches from there on
    with stream.reader(3) as reader:
        assert samples_of(reader.get(3)) == got[3] and samples_of(reader.get(4)) == got[4]
    assert samples_of(stream.batch(2)) == got[2]
    with pytest.raises(DataError, match="an IterableDataset has no indices"):
        stream.indices(0)


def test_a_sized_streams_epoch() -> None:
    stream = MinibatchStream(load_data("userdata:sized_stream", {"n": 40}), 4, seed=0, num_vws=2)
    assert stream.per_epoch == 5 and stream.epoch(11) == 2


def test_the_builtin_digits_stream_is_unchanged_by_the_loader() -> None:
    """digits through the DataLoader with 2 workers = the in-process gather, bit for bit."""
    src = load_data("digits")
    a = MinibatchStream(src, 32, seed=3, vw=0, num_vws=2)
    b = MinibatchStream(src, 32, seed=3, vw=0, num_vws=2, workers=2)
    with b.reader(0) as reader:
        for p, want in zip(range(30), itertools.islice(iter(a), 30), strict=False):
            got = reader.get(p)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_loader_settings_are_checked() -> None:
    src = load_data("userdata:pairs", {"n": 8})
    with pytest.raises(DataError, match=r"data.workers must be an int >= 0"):
        MinibatchStream(src, 2, seed=0, workers=-1)
    with pytest.raises(DataError, match=r"data.prefetch must be an int >= 1"):
        MinibatchStream(src, 2, seed=0, prefetch=0)
    with pytest.raises(DataError, match="no training set"):
        MinibatchStream(src.without_train(), 2, seed=0)


def _anon_bytes() -> int:
    """This process's own resident memory (``RssAnon``): memory-mapped file pages it maps
    are the file's page cache (``RssFile``), shared and reclaimable, not its own."""
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith("RssAnon:"))
    return int(line.split()[1]) << 10


def test_a_memory_mapped_set_is_read_by_the_minibatch(tmp_path: Path) -> None:
    """A 256 MiB array file: loading it, checking a sample and reading 40 minibatches (40 MiB)
    leave this process's own memory where it was: only the samples read are copied in."""
    n, shape = 8192, (8, 32, 32)  # 32 KiB per sample
    x = np.lib.format.open_memmap(tmp_path / "x.npy", "w+", np.float32, (n, *shape))
    for start in range(0, n, 1024):
        x[start : start + 1024] = start
    x.flush()
    del x
    np.save(tmp_path / "y.npy", np.arange(n) % 10)
    src = load_data("tensors", {"x": str(tmp_path / "x.npy"), "y": str(tmp_path / "y.npy")})
    first_batch(src)
    stream = MinibatchStream(src, 32, seed=0)
    stream.batch(0)  # the first gather's allocations
    before = _anon_bytes()
    with stream.reader(1) as reader:
        for p in range(1, 41):
            bx, _ = reader.get(p)
            assert bx.shape == (32, *shape)
    grown = _anon_bytes() - before
    assert grown < 16 << 20, f"own memory grew {grown >> 20} MiB reading 40 MiB of 256 MiB"


def test_random_augmentation_in_loader_workers_is_reproducible() -> None:
    """Loader workers draw from seeds of the job's seed and the VW: the same job augments
    the same way, another VW otherwise."""

    def read(vw: int, seed: int) -> list[torch.Tensor]:
        stream = MinibatchStream(
            load_data("userdata:noisy"), 4, seed=seed, vw=vw, num_vws=2, workers=2
        )
        with stream.reader(0) as reader:
            return [reader.get(p)[0] for p in range(4)]

    a, b = read(0, 1), read(0, 1)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    c = read(1, 1)
    assert not any(torch.equal(x, y) for x, y in zip(a, c, strict=True))


# -- a stateful stream's position in checkpoints ----------------------------------------------


def _read(stream: MinibatchStream, start: int, stop: int, state: dict | None = None) -> list:
    with stream.reader(start, state=state) as reader:
        return [samples_of(reader.get(p)) for p in range(start, stop)]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_stateful_stream_resumes_from_its_state_and_reads_nothing_twice(workers: int) -> None:
    """Two VWs of a stream that keeps its own position (torchdata's Stateful) stop mid-pass
    and at a pass's end, and resume from the state their readers recorded: together they read
    what the uninterrupted VWs read, every sample of each pass once, and the resumed data set
    reads on from the state instead of from its start."""
    n, b = 40, 4  # a VW's 20 samples a pass: 5 minibatches
    counts: Counter[tuple[int, int]] = Counter()
    for v in range(2):
        stream = MinibatchStream(
            load_data("userdata:stateful_stream", {"n": n}), b, 0, v, 2, workers=workers
        )
        assert stream.stateful
        whole = _read(stream, 0, 10)  # two passes
        alone = MinibatchStream(load_data("userdata:stateful_stream", {"n": n}), b, 0, v, 2)
        assert _read(alone, 0, 10) == whole  # the same minibatches without loader workers
        reads = alone.source.train.reads  # what reading them yields in process
        for stop in (3, 5):  # mid-pass; a pass's end
            with stream.reader(0) as first:
                before = [samples_of(first.get(p)) for p in range(stop)]
                state = first.state(stop)
            assert state is not None and state["position"] == stop
            assert state["data"] == {"epoch": 0, "i": 2 * b * stop - (1 - v)}
            resumed = MinibatchStream(
                load_data("userdata:stateful_stream", {"n": n}), b, 0, v, 2, workers=0
            )
            after = _read(resumed, stop, 10, state)
            assert before + after == whole
            # in process: what the resumed data set yielded starts at its state
            assert resumed.source.train.reads == reads - state["data"]["i"]
        stream.close()
        for p, batch in enumerate(whole):
            counts.update((p // 5, i) for i in batch)  # (pass, sample)
    assert len(counts) == 2 * n and set(counts.values()) == {1}


def test_a_streams_order_does_not_depend_on_loader_workers() -> None:
    got = [
        _read(MinibatchStream(load_data("userdata:stream", {"n": 30}), 4, 0, 1, 2, workers=w), 0, 8)
        for w in (0, 1, 2)
    ]
    assert got[0] == got[1] == got[2]
    flat = [i for batch in got[0] for i in batch]
    assert flat == [i for i in range(1, 30, 2)] * 2 + [1, 3]  # VW 1's samples, across passes


def test_a_state_of_another_place_or_vw_count_resumes_by_skipping() -> None:
    src = load_data("userdata:stateful_stream", {"n": 40})
    stream = MinibatchStream(src, 4, 0, 0, 2)
    whole = _read(stream, 0, 8)
    with stream.reader(0) as reader:
        for p in range(3):
            reader.get(p)
        state = reader.state(3)
    assert state is not None
    for other in (MinibatchStream(src, 4, 0, 0, 1), MinibatchStream(src, 2, 0, 0, 2)):
        assert not other.resumable(state, 3)
    assert not stream.resumable(state, 4) and stream.resumable(state, 3)
    assert _read(stream, 4, 8, state) == whole[4:]  # the state is not of 4: skipped to it
    plain = MinibatchStream(load_data("userdata:stream", {"n": 40}), 4, 0, 0, 2)
    assert not plain.stateful and plain.reader(0).state(0) is None


def test_a_state_a_checkpoint_cannot_store_is_one_line_naming_the_data() -> None:
    stream = MinibatchStream(
        load_data("userdata:stateful_stream", {"n": 16, "bad_state": True}), 4, 0
    )
    with stream.reader(0) as reader:
        reader.get(0)
        with pytest.raises(DataError, match=r"data 'userdata:stateful_stream': state_dict\(\)"):
            reader.state(1)


def test_synchronous_vws_of_different_m_read_one_block_of_the_epoch_an_iteration() -> None:
    """VWs of M = 2 and M = 4 (a synchronous job's shares, hetpipe.jobplan.data_shares): each
    iteration reads the next 6 minibatches of the epoch's permutation, 2 to the first VW and 4
    to the second, and an epoch ends for both at the same iteration."""
    assert data_shares(True, [2, 4]) == [2, 4]
    assert data_shares(True, [3, 3]) == [] and data_shares(False, [1, 2]) == []
    src = load_data("userdata:pairs", {"n": 100})
    shares = data_shares(True, [2, 4])
    a, b = (MinibatchStream(src, 4, seed=5, vw=v, num_vws=2, shares=shares) for v in range(2))
    assert (a.per_epoch, b.per_epoch) == (8, 16)  # 25 minibatches: 4 blocks of 6, 1 dropped
    perm = torch.randperm(100, generator=torch.Generator().manual_seed(5 * 1_000_003)).tolist()
    for i in range(4):
        got = [j for p in (2 * i, 2 * i + 1) for j in a.indices(p).tolist()]
        got += [j for p in range(4 * i, 4 * i + 4) for j in b.indices(p).tolist()]
        assert got == perm[24 * i : 24 * (i + 1)]
    assert a.epoch(8) == b.epoch(16) == 1
