"""The builtin data sets: ``digits`` and ``synthetic`` (small, made in memory from a seed) and
``tensors`` (arrays a user saved, read from files, memory-mapped where the format allows).

Each is a map-style ``torch.utils.data.Dataset`` of ``(input, target)`` samples, read through
the same loader as a user's own data (:mod:`hetpipe.data.source`). ``digits`` and
``synthetic`` are also kept as a :class:`Dataset` of four tensors, the shape the tests and
the scripts compare against.
"""

from __future__ import annotations

import gzip
import importlib.resources
import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils import data as tud

__all__ = ["DataError", "Dataset", "TensorPairs", "load_dataset", "load_tensors"]

DIGITS_SEED = 20200715
DIGITS_TRAIN = 1437
DIGITS_FILE = "assets/digits.csv.gz"


class DataError(ValueError):
    """A data set or stream cannot be made; ``str(e)`` is one line naming the problem, and
    ``key`` the job key it is about (``data.name``, ``data.args``, ``data.collate``, ...)."""

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key or ("data.args" if "args" in message else "data.name")


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

    @property
    def train(self) -> TensorPairs:
        """The training set as a map-style ``torch.utils.data.Dataset`` of ``(x, y)``."""
        return TensorPairs(self.train_x, self.train_y)

    @property
    def val(self) -> TensorPairs:
        """The test set as a map-style ``torch.utils.data.Dataset`` of ``(x, y)``."""
        return TensorPairs(self.test_x, self.test_y)


class TensorPairs(tud.Dataset):
    """Samples ``(x[i], y[i])`` of two equally long indexables: tensors, or numpy arrays
    (memory-mapped ones stay on disk: a sample is copied out when it is read)."""

    def __init__(self, x: Any, y: Any) -> None:
        if len(x) != len(y):
            raise DataError(f"inputs hold {len(x)} samples but targets {len(y)}")
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        return _tensor(self.x[i]), _tensor(self.y[i])

    def rows(self, idx: list[int]) -> tuple[Tensor, Tensor] | None:
        """Samples ``idx`` stacked, as the default collate would stack them, in one gather
        (None where the data are not tensors)."""
        if isinstance(self.x, Tensor) and isinstance(self.y, Tensor):
            at = torch.as_tensor(idx, dtype=torch.int64)
            return self.x[at], self.y[at]
        return None


def _tensor(value: Any) -> Tensor:
    if isinstance(value, Tensor):
        return value
    return torch.from_numpy(np.array(value))  # a copy: memory-mapped rows are read-only


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
    # the test split copied out: a process that keeps only it (the head) holds no training set
    test_x, test_y = x[n_train:].clone(), y[n_train:].clone()
    return Dataset(x[:n_train], y[:n_train], test_x, test_y, shape, classes, "synthetic")


def _check_int(key: str, value: Any, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise DataError(f"data 'synthetic': {key} must be an int >= {least}, got {value!r}")


def _reject_unknown(name: str, args: Mapping[str, Any], known: tuple[str, ...]) -> None:
    unknown = sorted(set(args) - set(known))
    if unknown:
        allowed = ", ".join(known) if known else "none"
        raise DataError(f"data '{name}': unknown args {unknown} (allowed: {allowed})")


# --------------------------------------------------------------------------- tensors

_TENSOR_ARGS = ("path", "x", "y", "val_path", "val_x", "val_y")


def load_tensors(args: Mapping[str, Any]) -> tuple[TensorPairs, TensorPairs | None]:
    """Builtin ``tensors``: the training set (and a validation set) from files.

    ``path`` names one file holding both arrays (``.npz`` with arrays ``x`` and ``y``, or a
    ``.pt`` of ``{"x": ..., "y": ...}`` or ``(x, y)``), or ``x`` and ``y`` name one file each
    (``.npy`` or ``.pt``); ``val_path`` or ``val_x``/``val_y`` the same for validation.
    ``.npy`` files are memory-mapped (``np.load(mmap_mode="r")``) and ``.pt`` files too
    (``torch.load(mmap=True)``), so a process reads only the samples it takes; ``.npz``
    arrays are read whole when first used. Paths are the same on every host (absolute, or
    relative to each process's working directory).
    """
    _reject_unknown("tensors", args, _TENSOR_ARGS)
    train = _pair(args, "")
    if train is None:
        raise DataError("data 'tensors': give args path, or x and y")
    return train, _pair(args, "val_")


def _pair(args: Mapping[str, Any], prefix: str) -> TensorPairs | None:
    path, x, y = (args.get(f"{prefix}{k}") for k in ("path", "x", "y"))
    if path is not None and (x is not None or y is not None):
        raise DataError(f"data 'tensors': give {prefix}path or {prefix}x and {prefix}y, not both")
    try:
        if path is not None:
            both = _read_file(str(path), both=True)
            return TensorPairs(*both)
        if x is None and y is None:
            return None
        if x is None or y is None:
            raise DataError(f"data 'tensors': {prefix}x and {prefix}y go together")
        return TensorPairs(_read_file(str(x)), _read_file(str(y)))
    except DataError as exc:
        text = str(exc)
        raise DataError(text if text.startswith("data ") else f"data 'tensors': {text}") from None


def _read_file(path: str, *, both: bool = False) -> Any:
    file = Path(path)
    if not file.is_file():
        raise DataError(f"{path}: no such file (cwd {Path.cwd()})")
    suffix = file.suffix.lower()
    try:
        if suffix == ".npy" and not both:
            return np.load(file, mmap_mode="r", allow_pickle=False)
        if suffix == ".npz":
            arrays = np.load(file, allow_pickle=False)
            if not both:
                if len(arrays.files) != 1:
                    raise DataError(f"{path}: holds {arrays.files}; name it with path instead")
                return arrays[arrays.files[0]]
            missing = [k for k in ("x", "y") if k not in arrays.files]
            if missing:
                raise DataError(f"{path}: no array {missing[0]!r} (it holds {arrays.files})")
            return arrays["x"], arrays["y"]
        if suffix == ".pt":
            obj = torch.load(file, mmap=True, weights_only=True, map_location="cpu")
            if not both:
                if not isinstance(obj, Tensor):
                    raise DataError(f"{path}: holds {type(obj).__name__}, not a tensor")
                return obj
            if isinstance(obj, Mapping) and "x" in obj and "y" in obj:
                return obj["x"], obj["y"]
            if isinstance(obj, tuple | list) and len(obj) == 2:
                return obj[0], obj[1]
            raise DataError(f"{path}: holds {type(obj).__name__}, not {{'x': ..., 'y': ...}}")
    except DataError:
        raise
    except Exception as exc:
        raise DataError(f"{path}: cannot read: {type(exc).__name__}: {exc}") from None
    kinds = ".npz or .pt" if both else ".npy, .npz or .pt"
    raise DataError(f"{path}: expected a {kinds} file")


_LOADERS = {"digits": _digits, "synthetic": _synthetic, "tensors": load_tensors}


_IN_MEMORY = {"digits": _digits, "synthetic": _synthetic}


def load_dataset(name: str, args: Mapping[str, Any] | None = None) -> Dataset:
    """Data set ``name`` (``"digits"`` or ``"synthetic"``) made with keyword ``args``, as
    four tensors (any other name: :func:`hetpipe.data.load_data`)."""
    if name not in _IN_MEMORY:
        raise DataError(f"data '{name}': unknown; use one of {', '.join(_IN_MEMORY)}")
    args = {} if args is None else args
    if not isinstance(args, Mapping):
        raise DataError(f"data '{name}': args must be a table, got {args!r}")
    return _IN_MEMORY[name](args)
