"""A user's own data: ``data.name`` as a function, an entry point or the ``tensors`` builtin,
what it may return, the batch contract ``(inputs, target)``, and the one-line refusals."""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
import userdata

from hetpipe.data import (
    DataError,
    DataSource,
    MinibatchStream,
    TensorPairs,
    as_batch,
    evaluate,
    first_batch,
    load_data,
    load_dataset,
    rows_of,
)
from hetpipe.data.source import is_iterable
from hetpipe.models import build_model


def one_line(exc: pytest.ExceptionInfo, *parts: str, key: str | None = None) -> str:
    text = str(exc.value)
    assert "\n" not in text, text
    for part in parts:
        assert part in text, text
    if key is not None:
        assert exc.value.key == key, (exc.value.key, text)
    return text


# --------------------------------------------------------------- what a function returns


def test_a_mapping_pair_or_single_set() -> None:
    src = load_data("userdata:pairs", {"n": 40, "n_val": 8})
    assert isinstance(src, DataSource) and src.name == "userdata:pairs"
    assert src.train_len() == 40 and len(src.val) == 8 and not src.iterable
    train, val = load_data("userdata:pair").train, load_data("userdata:pair").val
    assert len(train) == 256 and len(val) == 32
    only = load_data("userdata:train_only", {"n": 10})
    assert only.val is None and only.train_len() == 10
    s = load_data("userdata:stream", {"n": 10})
    assert s.iterable and s.train_len() is None and s.val is None
    assert load_data("userdata:sized_stream", {"n": 12}).train_len() == 12
    # a plain list of samples is a map-style data set as well
    assert load_data("userdata:arrays").train_len() == 64
    # nothing is read by loading: the data set object only
    assert src.train.reads == 0
    assert src.without_train().train is None and src.without_train().val is src.val


def test_builtins_are_data_sets_of_the_same_kind() -> None:
    src = load_data("digits")
    legacy = load_dataset("digits")
    assert isinstance(src.train, TensorPairs) and len(src.train) == 1437 and len(src.val) == 360
    x, y = src.train[5]
    assert torch.equal(x, legacy.train_x[5]) and int(y) == int(legacy.train_y[5])
    syn = load_data("synthetic", {"n_train": 50, "n_test": 10, "kind": "tokens", "seq": 5})
    assert syn.train_len() == 50 and syn.train[0][0].shape == (5,)


@pytest.mark.parametrize(
    ("name", "args", "parts", "key"),
    [
        ("userdata:raises", {}, ["data 'userdata:raises': raised FileNotFoundError", "set8"], None),
        (
            "userdata:wrong_type",
            {},
            ["data 'userdata:wrong_type': returned int, not a torch"],
            None,
        ),
        ("userdata:empty", {}, ["data 'userdata:empty': the training set is empty"], None),
        ("userdata:nothing", {}, ["module userdata has no nothing"], "data.name"),
        ("nosuchmodule_xyz:f", {}, ["cannot import nosuchmodule_xyz"], "data.name"),
        ("userdata:pairs", {"bogus": 1}, ["bad args {'bogus': 1}", "bogus"], "data.args"),
        ("mnist", {}, ["data 'mnist': unknown; use one of digits, synthetic, tensors"], None),
        ("user data:x", {}, ["expected 'package.module:function'"], None),
    ],
)
def test_data_function_errors_are_one_line(
    name: str, args: dict, parts: list[str], key: str | None
) -> None:
    with pytest.raises(DataError) as info:
        load_data(name, args)
    one_line(info, *parts, key=key)


def test_a_mapping_with_other_keys_is_refused() -> None:
    with pytest.raises(DataError) as info:
        from hetpipe.data.source import _sets

        _sets({"training": userdata.Pairs(3)}, "m:f")
    one_line(info, "data 'm:f': returned a mapping of 'training'")


# --------------------------------------------------------------------------- the batch contract


def test_samples_become_inputs_and_target() -> None:
    x, y = first_batch(load_data("userdata:pairs"), 4)
    assert x.shape == (4, 1, 8, 8) and x.dtype == torch.float32
    assert y.dtype == torch.int64 and y.tolist() == [0, 1, 2, 3]
    assert userdata.ident(x) == [0, 1, 2, 3]
    # several inputs: a tuple of them, the last element is the target
    (a, b), t = first_batch(load_data("userdata:triples"), 3)
    assert a.shape == (3, 3) and b.shape == (3, 2) and t.tolist() == [0, 1, 0]
    # mappings: inputs are the mapping (its labels too, for a forward that takes them), the
    # target its labels
    inputs, target = first_batch(load_data("userdata:tokens"), 2)
    assert set(inputs) == {"input_ids", "attention_mask", "labels"}
    assert inputs["input_ids"].shape == (2, 6) and inputs["labels"] is target
    assert torch.equal(target, torch.stack([(torch.arange(i, i + 6) + 1) % 50 for i in (0, 1)]))
    inputs, target = first_batch(load_data("userdata:tokens", {"labels": False}), 2)
    assert target is None and set(inputs) == {"input_ids", "attention_mask"}
    # numpy arrays and ints are batched as torch's default_collate does
    x, y = first_batch(load_data("userdata:arrays"), 3)
    assert isinstance(x, torch.Tensor) and x.shape == (3, 1, 8, 8) and y.tolist() == [0, 1, 2]
    # an iterable data set's first samples
    x, y = first_batch(load_data("userdata:stream"), 2)
    assert userdata.ident(x) == [0, 1]


def test_a_users_collate() -> None:
    src = load_data("userdata:pairs", {"n": 8}, "userdata:pad_collate")
    inputs, target = first_batch(src, 3)
    assert set(inputs) == {"x", "labels"} and inputs["x"].shape == (3, 1, 8, 8)
    assert target.tolist() == [0, 1, 2]
    stream = MinibatchStream(src, 4, seed=0)
    got, _ = stream.batch(1)
    assert userdata.ident(got["x"]) == stream.indices(1).tolist()


def test_collate_errors_name_the_collate() -> None:
    with pytest.raises(DataError) as info:
        first_batch(load_data("userdata:pairs", collate="userdata:broken_collate"))
    one_line(
        info, "data.collate 'userdata:broken_collate': raised RuntimeError", key="data.collate"
    )
    with pytest.raises(DataError) as info:
        first_batch(load_data("userdata:pairs", collate="userdata:strings_collate"), 2)
    one_line(
        info,
        "data.collate 'userdata:strings_collate': the minibatch's target is a tuple of 2",
        key="data.collate",
    )
    with pytest.raises(DataError) as info:
        load_data("userdata:pairs", collate="userdata:no_such")
    one_line(info, "data.collate 'userdata:no_such'", "has no no_such", key="data.collate")


def test_as_batch_refuses_other_shapes_in_one_line() -> None:
    t = torch.zeros(2, 3)
    assert as_batch(t, "w") == (t, None)
    assert as_batch([t, t, t], "w")[0] == (t, t)
    cases = [
        (3, "a minibatch is int, not (inputs, target)"),
        ((["a"], t), "the minibatch's inputs[0] is str, not a Tensor"),
        ({"ids": [1], "labels": t}, "the minibatch's inputs['ids'] is a list of 1, not a Tensor"),
        ((t, "label"), "the minibatch's target is str, not a Tensor, a dict of Tensors or None"),
        ((t, (t, t)), "the minibatch's target is a tuple of 2, not a Tensor, a dict"),
    ]
    for made, text in cases:
        with pytest.raises(DataError) as info:
            as_batch(made, "data 'm:f'")
        one_line(info, "data 'm:f': ", text)


def test_rows_of_every_part() -> None:
    x = torch.arange(12).reshape(6, 2)
    inputs, target = rows_of(({"a": x, "b": x}, {"t": x[:, 0]}), 1, 3)
    assert torch.equal(inputs["a"], x[1:3]) and torch.equal(target["t"], x[1:3, 0])
    (_a, b), t = rows_of(((x, x + 1), None), 2, 4)
    assert torch.equal(b, x[2:4] + 1) and t is None


# --------------------------------------------------------------------------- entry points


def test_an_entry_point_by_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dist = tmp_path / "mydata-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: mydata\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        textwrap.dedent(
            """\
            [hetpipe.data]
            small-pairs = userdata:pairs
            broken = userdata_missing_xyz:f
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    src = load_data("small-pairs", {"n": 20})
    assert src.train_len() == 20 and src.name == "small-pairs"
    with pytest.raises(DataError) as info:
        load_data("broken")
    one_line(info, "data 'broken': entry point cannot load: ModuleNotFoundError")
    with pytest.raises(DataError) as info:
        load_data("not-published")
    one_line(info, "an installed 'hetpipe.data' entry point (broken, small-pairs)")


# --------------------------------------------------------------------------- tensors


def test_tensors_from_npy_memory_mapped(tmp_path: Path) -> None:
    x = np.random.default_rng(0).standard_normal((50, 1, 8, 8)).astype(np.float32)
    y = np.arange(50) % 10
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    np.savez(tmp_path / "val.npz", x=x[:10], y=y[:10])
    src = load_data(
        "tensors",
        {
            "x": str(tmp_path / "x.npy"),
            "y": str(tmp_path / "y.npy"),
            "val_path": str(tmp_path / "val.npz"),
        },
    )
    assert isinstance(src.train.x, np.memmap) and isinstance(src.train.y, np.memmap)
    assert src.train_len() == 50 and len(src.val) == 10
    stream = MinibatchStream(src, 8, seed=1)
    bx, by = stream.batch(2)
    idx = stream.indices(2).numpy()
    assert torch.equal(bx, torch.from_numpy(x[idx])) and by.tolist() == y[idx].tolist()
    bx[:] = 0  # a minibatch is its own memory, the file is untouched
    assert np.array_equal(np.load(tmp_path / "x.npy"), x)
    model = build_model("mlp")
    assert 0.0 <= evaluate(model, src) <= 1.0


def test_tensors_from_pt(tmp_path: Path) -> None:
    x, y = torch.randn(20, 4), torch.arange(20) % 3
    torch.save({"x": x, "y": y}, tmp_path / "d.pt")
    torch.save(x, tmp_path / "x.pt")
    torch.save(y, tmp_path / "y.pt")
    a = load_data("tensors", {"path": str(tmp_path / "d.pt")})
    b = load_data("tensors", {"x": str(tmp_path / "x.pt"), "y": str(tmp_path / "y.pt")})
    for src in (a, b):
        got = MinibatchStream(src, 5, seed=0).batch(1)
        want = MinibatchStream(src, 5, seed=0).indices(1)
        assert torch.equal(got[0], x[want]) and torch.equal(got[1], y[want])


def test_tensors_errors_name_the_file(tmp_path: Path) -> None:
    np.save(tmp_path / "x.npy", np.zeros((4, 2), np.float32))
    np.save(tmp_path / "y3.npy", np.zeros(3))
    (tmp_path / "x.csv").write_text("1,2\n")
    missing = tmp_path / "nope.npy"
    cases = [
        ({}, "data 'tensors': give args path, or x and y"),
        ({"x": str(missing), "y": str(missing)}, f"data 'tensors': {missing}: no such file"),
        ({"x": str(tmp_path / "x.npy")}, "x and y go together"),
        (
            {"x": str(tmp_path / "x.npy"), "y": str(tmp_path / "y3.npy")},
            "inputs hold 4 samples but targets 3",
        ),
        ({"path": str(tmp_path / "x.csv")}, "x.csv: expected a .npz or .pt file"),
        ({"path": str(tmp_path / "x.npy"), "x": "a"}, "give path or x and y, not both"),
        ({"paths": "a"}, "data 'tensors': unknown args ['paths']"),
    ]
    for args, text in cases:
        with pytest.raises(DataError) as info:
            load_data("tensors", args)
        one_line(info, text)


# --------------------------------------------------------------------------- evaluate


def test_evaluate_on_a_users_validation_set() -> None:
    torch.manual_seed(0)
    model = build_model("mlp")
    src = load_data("userdata:pairs", {"n": 16, "n_val": 40})
    acc = evaluate(model, src, batch=16)
    x, y = first_batch(src, 40, val=True)
    with torch.no_grad():
        want = (model(x).argmax(-1) == y).float().mean().item()
    assert acc == pytest.approx(want)
    assert evaluate(model, load_data("userdata:train_only")) is None
    # the digits accuracy through a source equals the in-memory one
    assert evaluate(model, load_data("digits")) == evaluate(model, load_dataset("digits"))
    assert is_iterable(load_data("userdata:stream").train)
