"""One sample of a job's data through its model, at submit: a data set the model cannot take
is refused before anything runs, in one line naming the data function (and, for a layer that
refuses the sample, the layer and both shapes)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from hetpipe.capture import capture_of
from hetpipe.data.builtin import DataError
from hetpipe.data.evaluate import call_model
from hetpipe.data.source import DataSource, _say, first_batch

__all__ = ["check_batch", "check_fit", "describe"]


def describe(value: Any) -> str:
    """A minibatch part as its shapes and dtypes: ``[1, 3, 8, 8] float32``."""
    if isinstance(value, Tensor):
        return f"{list(value.shape)} {str(value.dtype).removeprefix('torch.')}"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {describe(v)}" for k, v in value.items()) + "}"
    if isinstance(value, tuple | list):
        return "(" + ", ".join(describe(v) for v in value) + ")"
    return type(value).__name__


def expects(layer: nn.Module) -> str:
    """What ``layer`` takes, where its type says it (else its type's name)."""
    name = type(layer).__name__
    if isinstance(layer, nn.Linear):
        return f"{name} taking [*, {layer.in_features}] float"
    if isinstance(layer, nn.modules.conv._ConvNd):
        space = ", ".join("*" for _ in layer.kernel_size)
        return f"{name} taking [N, {layer.in_channels}, {space}] float"
    if isinstance(layer, nn.Embedding):
        return f"{name} taking integer indices < {layer.num_embeddings}"
    if isinstance(layer, nn.LayerNorm):
        return f"{name} taking [*, {', '.join(map(str, layer.normalized_shape))}] float"
    if isinstance(layer, nn.modules.batchnorm._BatchNorm):
        return f"{name} taking [N, {layer.num_features}, ...] float"
    return name


def check_fit(
    source: DataSource,
    model: nn.Module,
    loss_fn: Callable[[Any, Any], Any] | None = None,
) -> None:
    """Feed the first training sample of ``source`` through ``model`` and its loss
    (:func:`check_batch`); the refusal names the data set."""
    inputs, target = first_batch(source)
    check_batch(f"data '{source.name}'", model, inputs, target, loss_fn)


@torch.no_grad()
def check_batch(
    who: str,
    model: nn.Module,
    inputs: Any,
    target: Any,
    loss_fn: Callable[[Any, Any], Any] | None = None,
) -> None:
    """Feed a minibatch through ``model`` (on its device, in eval mode so that no running
    statistic moves and no dropout draws) and its output with ``target`` through
    ``loss_fn``. Raises :class:`DataError` (one line starting with ``who``) where a layer or
    block refuses it (for a captured model the block and the submodule it starts at, else
    the layer and what it takes, with what it got), or the loss refuses the target."""
    starts = capture_of(model).starts if capture_of(model) is not None else None
    was_training = model.training
    model.eval()
    try:
        # an nn.Sequential layer by layer, its first taking the inputs as one argument
        sequential = isinstance(model, nn.Sequential)
        layers = list(model) if sequential else [model]
        x: Any = inputs
        for i, layer in enumerate(layers):
            try:
                x = layer(x) if sequential else call_model(layer, x)
            except Exception as exc:
                if len(layers) == 1:
                    where = "the model"
                elif starts is not None:
                    where = f"block {i} ({starts[i] or 'the inputs'})"
                else:
                    where = f"layer {i} ({expects(layer)})"
                raise DataError(
                    f"{who}: a sample of {describe(inputs)} does not fit: {where} got "
                    f"{describe(x)}: {_say(exc)}"
                ) from None
        if loss_fn is not None and target is not None:
            try:
                loss_fn(x, target)
            except Exception as exc:
                raise DataError(
                    f"{who}: the target {describe(target)} does not fit the loss of the "
                    f"model's output {describe(x)}: {_say(exc)}"
                ) from None
    finally:
        model.train(was_training)
