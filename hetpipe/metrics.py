"""Validation metrics: what ``train.metrics`` names, how an evaluation sums them over the
validation set, which evaluation is the best (``train.keep_best``) and when a job stops for
lack of gain (``train.stop_after_no_gain``).

An evaluation runs the validation minibatches through the model in eval mode under
``no_grad`` (nothing trains, no running statistic moves) and keeps one :class:`Tally`:

- ``val_loss``: the mean of the job's loss (``model.loss``) over the validation samples,
  each minibatch's mean loss weighted by its rows (the last minibatch may be short);
- ``accuracy``: the share of target entries that the output's argmax over its last dimension
  equals (per token for sequence outputs); absent where the target is not one Tensor;
- ``perplexity``: ``exp(val_loss)`` (the loss being a mean cross entropy);
- a user's ``"package.module:function"``: called as ``function(outputs, target)`` on each
  minibatch, returning a number or a mapping of names to numbers; each number is averaged
  over the minibatches weighted by their rows, and reported as the function's name (a
  mapping's entries as ``function.key``).

Direction of ``keep_best``: ``val_loss`` and ``perplexity`` are better lower, ``accuracy``
higher; a user's metric says it with a sign: ``"-name"`` (lower is better) or ``"+name"``
(higher); unsigned, it is refused at submit. :class:`Best` keeps the best value and counts
the evaluations since it last improved.

The rules (:func:`parse_every`, :func:`check_metrics`, :func:`best_rule`, :class:`Best`) import
no torch: the job parser reads them; torch is imported where a minibatch is scored.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = [
    "BUILTIN",
    "LOSS",
    "Best",
    "MetricError",
    "Tally",
    "best_rule",
    "check_metrics",
    "evaluate",
    "parse_every",
    "resolve",
]

LOSS = "val_loss"
BUILTIN = ("accuracy", "perplexity")
# better lower (False) or higher (True)
_HIGHER = {LOSS: False, "accuracy": True, "perplexity": False}
_FUNCTION = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
_SECONDS = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*s\s*$")

MetricFn = Callable[[Any, Any], Any]


class MetricError(ValueError):
    """A metric cannot be computed (or a key naming one is wrong); one line naming it."""


def parse_every(value: Any) -> tuple[int, float | None]:
    """``train.eval_every`` as (waves, seconds): an integer >= 0 counts waves (0: only at the
    end); a string ``"<number>s"`` counts seconds. Raises :class:`ValueError` with the text
    of a one-line refusal."""
    if isinstance(value, bool):
        raise ValueError(f'must be an integer >= 0 or a string "<seconds>s", got {value!r}')
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"must be >= 0, got {value}")
        return value, None
    if isinstance(value, str):
        m = _SECONDS.match(value)
        if m is None:
            raise ValueError(f'a duration is "<seconds>s" (e.g. "30s"), got {value!r}')
        seconds = float(m.group(1))
        if seconds < 0.1:
            raise ValueError(f"must be at least 0.1 s, got {value!r}")
        return 0, seconds
    raise ValueError(f'must be an integer >= 0 or a string "<seconds>s", got {value!r}')


def metric_name(name: str) -> str:
    """The name a metric's value is reported under: a builtin's own, a function's name."""
    return name.rpartition(":")[2]


def check_metrics(names: Sequence[str]) -> None:
    """Refuse a ``train.metrics`` entry that is neither a builtin nor ``module:function``,
    and a name given twice (without importing anything)."""
    seen: set[str] = set()
    for name in names:
        if name not in BUILTIN and not _FUNCTION.match(name):
            raise ValueError(
                f"unknown metric {name!r} (one of: {', '.join(BUILTIN)}, "
                "or 'package.module:function')"
            )
        short = metric_name(name)
        if short in seen or short == LOSS:
            raise ValueError(f"metric {short!r} named twice")
        seen.add(short)


def best_rule(keep_best: str | None, names: Sequence[str]) -> tuple[str, bool]:
    """The metric ``keep_best`` (or ``stop_after_no_gain``) follows and whether higher is
    better: ``val_loss`` where unset. Raises :class:`ValueError` naming what is wrong."""
    if keep_best is None:
        return LOSS, False
    sign, name = (keep_best[0], keep_best[1:]) if keep_best[:1] in "+-" else ("", keep_best)
    shorts = {metric_name(n): n for n in names}
    if name != LOSS and name not in shorts and name.partition(".")[0] not in shorts:
        known = ", ".join([LOSS, *shorts])
        raise ValueError(f"{name!r} is not evaluated (one of: {known}; add it to train.metrics)")
    if sign:
        return name, sign == "+"
    if name in _HIGHER:
        return name, _HIGHER[name]
    raise ValueError(
        f'say whether {name!r} is better lower or higher: "-{name}" (lower) or "+{name}" (higher)'
    )


def resolve(names: Sequence[str]) -> list[tuple[str, MetricFn | None]]:
    """Each metric's reported name and its function (None for a builtin), importing the
    user's modules (the job check has allowed them and compared their content hashes)."""
    from hetpipe.models import ModelError, _resolve

    out: list[tuple[str, MetricFn | None]] = []
    for name in names:
        if name in BUILTIN:
            out.append((name, None))
            continue
        try:
            fn = _resolve(name, "metric")
        except ModelError as exc:
            raise MetricError(f"train.metrics: {exc}") from None
        out.append((metric_name(name), fn))
    return out


@dataclass
class Tally:
    """Sums of one evaluation over validation minibatches; :meth:`result` the figures."""

    metrics: list[tuple[str, MetricFn | None]]
    rows: int = 0
    loss_sum: float = 0.0
    correct: int = 0
    entries: int = 0  # target entries compared (accuracy), -1: a target that is not a Tensor
    sums: dict[str, float] = field(default_factory=dict)  # user metrics, weighted by rows
    full: dict[str, str] = field(default_factory=dict)  # reported name -> "module:function"

    def add(self, outputs: Any, target: Any, loss: float, rows: int) -> None:
        """One minibatch of ``rows`` samples: its outputs, its target and its mean loss."""
        self.rows += rows
        self.loss_sum += float(loss) * rows
        import torch

        names = {n for n, _ in self.metrics}
        if "accuracy" in names and self.entries >= 0:
            logits = _logits(outputs)
            if isinstance(target, torch.Tensor) and isinstance(logits, torch.Tensor):
                pred = logits.argmax(dim=-1)
                self.correct += int((pred == target.to(pred.device)).sum())
                self.entries += target.numel()
            else:
                self.entries = -1
        for name, fn in self.metrics:
            if fn is None:
                continue
            try:
                got = fn(outputs, target)
                values = _numbers(name, got)
            except MetricError:
                raise
            except Exception as exc:
                raise MetricError(
                    f"metric {name!r} raised {type(exc).__name__}: {exc}".splitlines()[0]
                ) from exc
            for key, value in values.items():
                self.sums[key] = self.sums.get(key, 0.0) + value * rows

    def result(self) -> dict[str, float]:
        """``val_loss`` and each metric asked for (accuracy only where targets are Tensors)."""
        if not self.rows:
            return {}
        loss = self.loss_sum / self.rows
        out = {LOSS: loss}
        for name, _fn in self.metrics:
            if name == "accuracy" and self.entries > 0:
                out["accuracy"] = self.correct / self.entries
            elif name == "perplexity":
                out["perplexity"] = math.exp(min(loss, 700.0))
        out.update({k: v / self.rows for k, v in self.sums.items()})
        return out


def _logits(outputs: Any) -> Any:
    if isinstance(outputs, Mapping) and "logits" in outputs:
        return outputs["logits"]
    if isinstance(outputs, (tuple, list)) and outputs:
        return outputs[0]
    return getattr(outputs, "logits", outputs)


def _numbers(name: str, got: Any) -> dict[str, float]:
    """A metric function's value as {reported name: float}; a wrong type is one line."""

    import torch

    def number(key: str, v: Any) -> float:
        if isinstance(v, torch.Tensor) and v.numel() == 1:
            v = v.item()
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise MetricError(
                f"metric {key!r} returned {type(v).__name__}; return a number or a mapping "
                "of names to numbers"
            )
        return float(v)

    if isinstance(got, Mapping):
        return {f"{name}.{k}": number(f"{name}.{k}", v) for k, v in got.items()}
    return {name: number(name, got)}


def evaluate(
    model: nn.Module,
    batches: Iterable[tuple[Any, Any]],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    metrics: Sequence[tuple[str, MetricFn | None]],
) -> dict[str, float]:
    """The validation figures of ``model`` over ``batches`` (``(inputs, target)`` pairs):
    eval mode under ``no_grad`` on the device of the model's first tensor, the model put
    back in the mode it was in; running statistics are not updated (eval mode)."""
    import torch

    from hetpipe.data import call_model
    from hetpipe.data.source import to_device

    first = next(itertools.chain(model.parameters(), model.buffers()), None)
    device = first.device if first is not None else torch.device("cpu")
    tally = Tally(list(metrics))
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for inputs, target in batches:
                inputs = to_device(inputs, device)
                target = to_device(target, device) if target is not None else None
                out = call_model(model, inputs)
                loss = loss_fn(out, target)
                tally.add(out, target, float(loss), _rows(inputs))
    finally:
        model.train(was_training)
    return tally.result()


def _rows(part: Any) -> int:
    """The samples of a minibatch's inputs: the first dimension of its first tensor."""
    import torch

    if isinstance(part, torch.Tensor):
        return int(part.shape[0]) if part.dim() else 1
    items = part.values() if isinstance(part, Mapping) else part
    for item in items:
        if isinstance(item, (torch.Tensor, Mapping, tuple, list)):
            return _rows(item)
    return 1


@dataclass
class Best:
    """The best evaluation so far of one metric, and the evaluations since it improved."""

    name: str
    higher: bool
    value: float | None = None
    since: int = 0  # evaluations in a row without a gain

    def offer(self, figures: Mapping[str, float]) -> bool:
        """Take one evaluation's figures; True where it is a new best (the first one is).
        An evaluation without the metric (or a NaN) counts as no gain."""
        v = figures.get(self.name)
        if v is None or v != v:
            self.since += 1
            return False
        if self.value is None or (v > self.value if self.higher else v < self.value):
            self.value, self.since = float(v), 0
            return True
        self.since += 1
        return False
