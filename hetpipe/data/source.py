"""A job's data: the data set its ``data.name`` names, and minibatches in the one shape the
first stage takes.

``data.name`` is a builtin (``digits``, ``synthetic``, ``tensors``), the name of an entry
point installed in the ``hetpipe.data`` group, or ``"package.module:function"``. The function
(or entry point) is called with ``data.args`` as keywords and returns the training set, a
``(train, val)`` pair, or a mapping ``{"train": ..., "val": ...}``; each set is a map-style
``torch.utils.data.Dataset`` (``__getitem__`` and ``__len__``) or a
``torch.utils.data.IterableDataset``. A user module is made current on each host before the
call (:mod:`hetpipe.usercode`), so the data function trained on is the one submitted.

**The batch contract.** A minibatch is ``(inputs, target)``: ``inputs`` a Tensor, a tuple of
Tensors or a dict of Tensors; ``target`` a Tensor, a dict of Tensors, or None. Samples are
batched by ``data.collate`` (a ``"package.module:function"`` taking the list of samples) or
torch's ``default_collate``, and what that makes is read as:

- a sequence ``(input, target)``: those two; ``(a, b, ..., target)``: inputs ``(a, b, ...)``;
- a mapping (``input_ids``, ``attention_mask``, ``labels``): inputs are its entries other
  than ``labels``, the target its ``labels`` (None without). ``labels`` travels to the last
  stage as the target, not through the stages as an input;
- a Tensor alone: the inputs, with no target.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from importlib import metadata
from typing import Any

import torch
from torch import Tensor
from torch.utils import data as tud

from hetpipe import carry
from hetpipe.data.builtin import DataError, TensorPairs, load_dataset, load_tensors
from hetpipe.usercode import FunctionError, load_function

__all__ = [
    "ENTRY_POINTS",
    "Batch",
    "Batcher",
    "DataSource",
    "as_batch",
    "first_batch",
    "load_data",
    "resolve",
    "rows_of",
]

ENTRY_POINTS = "hetpipe.data"  # the entry-point group a package publishes data sets in
BUILTINS = ("digits", "synthetic", "tensors")

Batch = tuple[Any, Any]  # (inputs, target), as the module's docstring says


def is_iterable(data: Any) -> bool:
    """Whether ``data`` is read as a stream (an ``IterableDataset``), not by index."""
    return isinstance(data, tud.IterableDataset)


def _map_style(data: Any) -> bool:
    return (
        not is_iterable(data)
        and not isinstance(data, str | bytes | Mapping)
        and hasattr(data, "__getitem__")
        and hasattr(data, "__len__")
    )


@dataclass(frozen=True, eq=False)
class DataSource:
    """A job's data set: ``train`` (None where a process keeps only the validation set, as
    the head does) and ``val`` (None: the data function gave none), each map-style or
    iterable, and the batcher that turns a list of samples into a :data:`Batch`."""

    name: str
    train: Any
    val: Any
    batcher: Batcher

    @property
    def iterable(self) -> bool:
        return is_iterable(self.train)

    def train_len(self) -> int | None:
        """Training samples; None for a stream without ``__len__``."""
        if self.train is None:
            return None
        try:
            return len(self.train)
        except TypeError:
            return None

    def without_train(self) -> DataSource:
        """This source holding only its validation set (what the head keeps for accuracy)."""
        return replace(self, train=None)


class Batcher:
    """The loader's ``collate_fn``: the user's collate (or torch's default), then
    :func:`as_batch`. A class, so that loader worker processes can take it by pickle."""

    def __init__(self, name: str, collate: Callable[[list], Any] | None = None, key: str = ""):
        self.name = name
        self.collate = collate
        self.key = key  # "pkg.mod:fn" of the user's collate, for messages

    def __call__(self, samples: list) -> Batch:
        if self.collate is None:
            try:
                made = tud.default_collate(samples)
            except Exception as exc:
                raise DataError(
                    f"data '{self.name}': samples cannot be batched: {_say(exc)}", "data.name"
                ) from None
            return as_batch(made, f"data '{self.name}'")
        try:
            made = self.collate(samples)
        except Exception as exc:
            raise DataError(
                f"data.collate '{self.key}': raised {_say(exc)}", "data.collate"
            ) from None
        return as_batch(made, f"data.collate '{self.key}'", "data.collate")


def _say(exc: BaseException) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())


def as_batch(made: Any, who: str, key: str = "data.name") -> Batch:
    """``made`` (a collated minibatch) as ``(inputs, target)``; ``who`` names the function in
    the one-line :class:`DataError` a minibatch of another shape gets."""
    if isinstance(made, Mapping):
        # labels stay among the inputs for a forward that takes them (one that returns its
        # own loss); a captured model's first block leaves them out where forward does not
        inputs: Any = dict(made)
        target = made.get("labels")
    elif isinstance(made, tuple | list) and len(made) >= 2:
        inputs = made[0] if len(made) == 2 else tuple(made[:-1])
        target = made[-1]
    elif isinstance(made, Tensor):
        inputs, target = made, None
    else:
        raise DataError(
            f"{who}: a minibatch is {_kind(made)}, not (inputs, target), a mapping or a Tensor",
            key,
        )
    if isinstance(inputs, list):
        inputs = tuple(inputs)
    if isinstance(target, list):
        target = tuple(target)
    _check_part(inputs, who, "inputs", key, allow_tuple=True)
    if target is not None:
        _check_part(target, who, "target", key, allow_tuple=False)
    return inputs, target


def _kind(value: Any) -> str:
    if isinstance(value, Tensor):
        return "a Tensor"
    if isinstance(value, tuple | list):
        return f"a {type(value).__name__} of {len(value)}"
    return type(value).__name__


def _check_part(value: Any, who: str, what: str, key: str, *, allow_tuple: bool) -> None:
    if isinstance(value, Tensor):
        return
    if isinstance(value, Mapping) and value:
        for k, v in value.items():
            if not isinstance(k, str) or not isinstance(v, Tensor):
                raise DataError(
                    f"{who}: the minibatch's {what}[{k!r}] is {_kind(v)}, not a Tensor", key
                )
        return
    if allow_tuple and isinstance(value, tuple) and value:
        for i, v in enumerate(value):
            if not isinstance(v, Tensor):
                raise DataError(
                    f"{who}: the minibatch's {what}[{i}] is {_kind(v)}, not a Tensor", key
                )
        return
    shapes = (
        "a Tensor, a tuple of Tensors or a dict of Tensors"
        if allow_tuple
        else ("a Tensor, a dict of Tensors or None")
    )
    raise DataError(f"{who}: the minibatch's {what} is {_kind(value)}, not {shapes}", key)


def rows_of(batch: Batch, lo: int, hi: int) -> Batch:
    """Rows ``lo:hi`` of every tensor of a minibatch (a replicated stage's share)."""
    return tuple(carry.mapped(part, lambda t: t[lo:hi]) for part in batch)  # type: ignore[return-value]


# --------------------------------------------------------------------------- names


def _entry_point(name: str) -> metadata.EntryPoint | None:
    try:
        found = metadata.entry_points(group=ENTRY_POINTS)
    except Exception:  # a broken installed distribution: as if it published nothing
        return None
    return next((ep for ep in found if ep.name == name), None)


def _entry_point_names() -> list[str]:
    try:
        return sorted({ep.name for ep in metadata.entry_points(group=ENTRY_POINTS)})
    except Exception:
        return []


def resolve(name: Any, key: str = "data.name") -> Callable[..., Any]:
    """The function ``name`` stands for: an entry point of :data:`ENTRY_POINTS` or an
    imported ``package.module:function``. Raises :class:`DataError` (one line, ``key``)."""
    what = "data" if key == "data.name" else key
    if not isinstance(name, str):
        raise DataError(f"{what} name must be a string, got {name!r}", key)
    if ":" not in name:
        ep = _entry_point(name)
        if ep is None:
            published = ", ".join(_entry_point_names()) or "none installed"
            choices = f"{', '.join(BUILTINS)}, " if key == "data.name" else ""
            raise DataError(
                f"{what} '{name}': unknown; use one of {choices}an installed "
                f"'{ENTRY_POINTS}' entry point ({published}) or 'package.module:function'",
                key,
            )
        try:
            func = ep.load()
        except Exception as exc:
            raise DataError(f"{what} '{name}': entry point cannot load: {_say(exc)}", key) from None
    else:
        try:
            func = load_function(name, what)
        except FunctionError as exc:
            raise DataError(str(exc), key) from None
    if not callable(func):
        raise DataError(f"{what} '{name}': {type(func).__name__} is not callable", key)
    return func


def load_data(
    name: str, args: Mapping[str, Any] | None = None, collate: str | None = None
) -> DataSource:
    """The data set ``name`` made with keyword ``args``, batched by ``collate`` (a
    ``"package.module:function"``; None: torch's ``default_collate``).

    Any failure is one :class:`DataError` naming the function: it raised, or returned
    something that is not a data set (see the module's docstring for what is)."""
    args = {} if args is None else args
    if not isinstance(args, Mapping) or not all(isinstance(k, str) for k in args):
        raise DataError(f"data '{name}': args must be a table of named values, got {args!r}")
    batcher = Batcher(
        str(name),
        None if collate is None else resolve(collate, "data.collate"),
        collate or "",
    )
    if name in ("digits", "synthetic"):
        ds = load_dataset(name, args)
        return DataSource(name, ds.train, ds.val, batcher)
    if name == "tensors":
        train, val = load_tensors(args)
        return DataSource(name, train, val, batcher)
    func = resolve(name)
    try:
        inspect.signature(func).bind(**args)
    except TypeError as exc:
        raise DataError(f"data '{name}': bad args {dict(args)!r}: {exc}", "data.args") from None
    except ValueError:
        pass  # no signature to read (a builtin): the call says
    try:
        made = func(**args)
    except DataError:
        raise
    except Exception as exc:
        raise DataError(f"data '{name}': raised {_say(exc)}") from None
    train, val = _sets(made, name)
    return DataSource(name, train, val, batcher)


def _is_set(value: Any) -> bool:
    return is_iterable(value) or isinstance(value, tud.Dataset) or _map_style(value)


def _sets(made: Any, name: str) -> tuple[Any, Any]:
    """(train, val) of what a data function returned."""
    shapes = (
        "a torch.utils.data.Dataset, an IterableDataset, a (train, val) pair or "
        "{'train': ..., 'val': ...}"
    )
    if isinstance(made, Mapping):
        unknown = sorted(set(map(str, made)) - {"train", "val"})
        if "train" not in made or unknown:
            keys = ", ".join(map(repr, made)) or "none"
            raise DataError(f"data '{name}': returned a mapping of {keys}, not {shapes}")
        train, val = made["train"], made.get("val")
    elif (
        isinstance(made, tuple | list)
        and len(made) == 2
        and all(v is None or (_is_set(v) and not isinstance(v, tuple)) for v in made)
        and made[0] is not None
    ):
        train, val = made
    elif _is_set(made):
        train, val = made, None
    else:
        raise DataError(f"data '{name}': returned {_kind(made)}, not {shapes}")
    for what, value in (("training set", train), ("validation set", val)):
        if value is not None and not _is_set(value):
            raise DataError(f"data '{name}': its {what} is {_kind(value)}, not a Dataset")
    if _map_style(train) and len(train) == 0:
        raise DataError(f"data '{name}': the training set is empty")
    return train, val


def first_batch(source: DataSource, n: int = 1, *, val: bool = False) -> Batch:
    """The first ``n`` samples of the training (or validation) set as one minibatch: what a
    check or a profile feeds the model. Raises :class:`DataError` naming the function where
    reading a sample fails."""
    data = source.val if val else source.train
    who = f"data '{source.name}'"
    samples = []
    try:
        if isinstance(data, TensorPairs) and source.batcher.collate is None:
            got = data.rows(list(range(min(n, len(data)))))
            if got is not None:
                return got
        if is_iterable(data):
            for sample in data:
                samples.append(sample)
                if len(samples) == n:
                    break
        else:
            samples = [data[i] for i in range(min(n, len(data)))]
    except DataError:
        raise
    except Exception as exc:
        raise DataError(f"{who}: reading a sample raised {_say(exc)}") from None
    if not samples:
        raise DataError(f"{who}: the {'validation' if val else 'training'} set yields no sample")
    return source.batcher(samples)


def to_device(part: Any, device: torch.device | str, non_blocking: bool = False) -> Any:
    """A minibatch part (Tensor, tuple or dict of Tensors, None) on ``device``."""
    return carry.mapped(part, lambda t: t.to(device, non_blocking=non_blocking))
