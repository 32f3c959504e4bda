"""Data sets, per-VW minibatch streams, evaluation, and a digits training sanity check."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch

from hetpipe.data import (
    DataError,
    MinibatchStream,
    _digits_arrays,
    evaluate,
    load_dataset,
    recalibrate_bn,
)
from hetpipe.models import build_model, model_loss
from hetpipe.optim import StageOptimizer

# --------------------------------------------------------------------------- digits


def test_digits_shapes_and_values() -> None:
    ds = load_dataset("digits")
    assert ds.name == "digits" and ds.input_shape == (1, 8, 8) and ds.classes == 10
    assert ds.train_x.shape == (1437, 1, 8, 8) and ds.test_x.shape == (360, 1, 8, 8)
    assert ds.train_y.shape == (1437,) and ds.test_y.shape == (360,)
    assert ds.train_x.dtype == torch.float32 and ds.train_y.dtype == torch.int64
    assert len(ds.train_x) + len(ds.test_x) == 1797
    for x in (ds.train_x, ds.test_x):
        assert float(x.min()) == 0.0 and float(x.max()) == 1.0
    for y in (ds.train_y, ds.test_y):
        assert set(y.tolist()) == set(range(10))


def test_digits_fixed_split() -> None:
    a, b = load_dataset("digits"), load_dataset("digits", {})
    assert torch.equal(a.train_x, b.train_x) and torch.equal(a.test_y, b.test_y)
    x, y = _digits_arrays()
    perm = torch.randperm(1797, generator=torch.Generator().manual_seed(20200715))
    assert torch.equal(a.train_x, x[perm[:1437]]) and torch.equal(a.train_y, y[perm[:1437]])
    assert torch.equal(a.test_x, x[perm[1437:]]) and torch.equal(a.test_y, y[perm[1437:]])
    # the packaged file's first row is a 0 whose first pixels are 0, 0, 5, 13
    assert y[0] == 0 and (x[0, 0, 0, :4] * 16).tolist() == [0, 0, 5, 13]


def test_dataset_errors() -> None:
    with pytest.raises(DataError, match="unknown"):
        load_dataset("mnist")
    with pytest.raises(DataError, match="unknown args"):
        load_dataset("digits", {"n_train": 3})
    bad = [
        {"kind": "audio"},
        {"n_train": 0},
        {"classes": 1},
        {"input_shape": 8},
        {"input_shape": [8, 0]},
        {"kind": "tokens", "input_shape": [4]},
        {"kind": "image", "vocab": 4},
        {"kind": "tokens", "vocab": 1},
        {"bogus": 1},
    ]
    for args in bad:
        with pytest.raises(DataError) as info:
            load_dataset("synthetic", args)
        assert "\n" not in str(info.value)


# --------------------------------------------------------------------------- synthetic


def test_synthetic_image() -> None:
    ds = load_dataset("synthetic", {"n_train": 100, "n_test": 20, "input_shape": [3, 4, 4]})
    assert ds.train_x.shape == (100, 3, 4, 4) and ds.test_x.shape == (20, 3, 4, 4)
    assert ds.train_x.dtype == torch.float32 and ds.train_y.dtype == torch.int64
    assert ds.input_shape == (3, 4, 4) and ds.classes == 10 and ds.name == "synthetic"
    assert int(ds.train_y.min()) >= 0 and int(ds.train_y.max()) < 10
    assert len(set(ds.train_y.tolist())) >= 5
    again = load_dataset("synthetic", {"n_train": 100, "n_test": 20, "input_shape": (3, 4, 4)})
    assert torch.equal(ds.train_x, again.train_x) and torch.equal(ds.test_y, again.test_y)
    other = load_dataset("synthetic", {"n_train": 100, "n_test": 20, "seed": 1})
    assert not torch.equal(load_dataset("synthetic", {"n_train": 100}).train_y[:100], other.train_y)


def test_synthetic_tokens() -> None:
    ds = load_dataset("synthetic", {"kind": "tokens", "n_train": 64, "n_test": 8, "seq": 12})
    assert ds.train_x.shape == (64, 12) and ds.train_y.shape == (64, 12)
    assert ds.train_x.dtype == torch.int64 and ds.train_y.dtype == torch.int64
    assert ds.input_shape == (12,) and ds.classes == 256
    assert int(ds.train_x.max()) < 256 and int(ds.train_x.min()) >= 0
    # labels are the next tokens
    assert torch.equal(ds.train_y[:, :-1], ds.train_x[:, 1:])
    assert torch.equal(ds.test_y[:, :-1], ds.test_x[:, 1:])
    again = load_dataset("synthetic", {"kind": "tokens", "n_train": 64, "n_test": 8, "seq": 12})
    assert torch.equal(ds.train_x, again.train_x)
    model = build_model("gpt", {"vocab": 256, "seq": 12, "dim": 16, "heads": 2, "blocks": 1})
    loss = model_loss("gpt")(model(ds.train_x[:4]), ds.train_y[:4])
    assert loss.ndim == 0 and torch.isfinite(loss)
    assert 0.0 <= evaluate(model, ds) <= 1.0


# --------------------------------------------------------------------------- streams


def test_stream_shards_are_disjoint_and_even() -> None:
    ds = load_dataset("digits")
    full = 1437 // 32  # 44 full minibatches, 3 VWs -> 14 each, 2 unused
    streams = [MinibatchStream(ds, 32, seed=5, vw=v, num_vws=3) for v in range(3)]
    assert all(s.per_epoch == full // 3 for s in streams)
    for epoch in range(2):
        seen: list[int] = []
        for s in streams:
            for p in range(epoch * s.per_epoch, (epoch + 1) * s.per_epoch):
                idx = s.indices(p)
                assert len(idx) == 32 and s.epoch(p) == epoch
                seen += idx.tolist()
        assert len(seen) == len(set(seen)) == 3 * 14 * 32
    # the VWs' minibatches are the epoch's full minibatches v, v+3, ...
    perm = torch.randperm(1437, generator=torch.Generator().manual_seed(5 * 1_000_003 + 1))
    for v, s in enumerate(streams):
        for i in range(s.per_epoch):
            j = v + 3 * i
            assert torch.equal(s.indices(s.per_epoch + i), perm[j * 32 : (j + 1) * 32])


def test_stream_single_vw_follows_epoch_permutation() -> None:
    ds = load_dataset("synthetic", {"n_train": 100, "n_test": 10})
    s = MinibatchStream(ds, 10, seed=3)
    assert s.per_epoch == 10
    for epoch in range(3):
        perm = torch.randperm(100, generator=torch.Generator().manual_seed(3 * 1_000_003 + epoch))
        got = torch.cat([s.indices(p) for p in range(epoch * 10, epoch * 10 + 10)])
        assert torch.equal(got, perm)
    assert not torch.equal(s.indices(0), s.indices(10))


def test_stream_deterministic_random_access_matches_iteration() -> None:
    ds = load_dataset("digits")
    a = MinibatchStream(ds, 64, seed=1, vw=1, num_vws=2)
    b = MinibatchStream(ds, 64, seed=1, vw=1, num_vws=2)
    batches = list(itertools.islice(iter(a), 3 * a.per_epoch))
    for p in reversed(range(len(batches))):  # random access, out of order
        x, y = b.batch(p)
        assert torch.equal(x, batches[p][0]) and torch.equal(y, batches[p][1])
        assert x.shape == (64, 1, 8, 8) and y.shape == (64,)
    other_seed = MinibatchStream(ds, 64, seed=2, vw=1, num_vws=2)
    assert not torch.equal(other_seed.batch(0)[1], batches[0][1])


def test_stream_errors() -> None:
    ds = load_dataset("synthetic", {"n_train": 10, "n_test": 2})
    with pytest.raises(DataError, match="no minibatch"):
        MinibatchStream(ds, 4, seed=0, vw=0, num_vws=3)
    with pytest.raises(DataError, match="vw"):
        MinibatchStream(ds, 2, seed=0, vw=2, num_vws=2)
    with pytest.raises(DataError, match="minibatch"):
        MinibatchStream(ds, 0, seed=0)
    with pytest.raises(DataError, match="index"):
        MinibatchStream(ds, 2, seed=0).batch(-1)


# --------------------------------------------------------------------------- training


def test_mlp_trains_on_digits() -> None:
    """Sanity: the pieces together (stream, out-of-place SGD, evaluate) learn digits."""
    torch.manual_seed(0)
    ds = load_dataset("digits")
    model = build_model("mlp", {"hidden": [128]})
    loss_fn = model_loss("mlp")
    spec = SimpleNamespace(
        name="sgd",
        lr=0.1,
        momentum=0.9,
        weight_decay=1e-4,
        nesterov=False,
        betas=(0.9, 0.99),
        eps=0.0,
    )
    opt = StageOptimizer(spec)
    stream = MinibatchStream(ds, 32, seed=0)
    params = dict(model.named_parameters())
    model.train()
    for x, y in itertools.islice(stream, 8 * stream.per_epoch):
        model.zero_grad()
        loss_fn(model(x), y).backward()
        weights = {k: p.detach() for k, p in params.items()}
        new = opt.step(weights, {k: p.grad for k, p in params.items()})
        with torch.no_grad():
            for k, w in new.items():
                params[k].copy_(w)
    assert model.training
    accuracy = evaluate(model, ds)
    assert model.training  # evaluate puts the mode back
    assert accuracy >= 0.90, accuracy


def test_recalibrate_bn_re_estimates_lagging_statistics() -> None:
    """Running statistics that lag the weights (here: wrecked) are re-estimated from training
    minibatches; the weights, the momentum and the mode are left as they were."""
    torch.manual_seed(0)
    data = load_dataset("digits")
    model = build_model("cnn")
    stream = MinibatchStream(data, 32, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loss_fn = model_loss("cnn")
    for p in range(30):
        x, y = stream.batch(p)
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    good = evaluate(model, data)
    norms = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    for m in norms:
        m.running_mean.fill_(3.0)
        m.running_var.fill_(0.01)
    weights = {n: p.clone() for n, p in model.named_parameters()}
    assert evaluate(model, data) < good - 0.3
    model.eval()
    assert recalibrate_bn(model, stream, 20)
    assert evaluate(model, data) > good - 0.05
    assert not model.training and all(m.momentum == 0.1 for m in norms)
    assert all(torch.equal(p, weights[n]) for n, p in model.named_parameters())
    assert not recalibrate_bn(build_model("mlp"), stream, 20)  # no batch norm: nothing to do
