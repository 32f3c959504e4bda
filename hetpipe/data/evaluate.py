"""The validation minibatches (:func:`val_batches`: what a first stage's validation pass reads,
:mod:`hetpipe.evalpass`, and what the head reads where it scores the global weights itself),
accuracy of a whole model on a validation set, and batch-norm recalibration."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils import data as tud

from hetpipe.data.builtin import Dataset, TensorPairs
from hetpipe.data.source import Batch, Batcher, DataSource, is_iterable, to_device
from hetpipe.data.stream import MinibatchStream

__all__ = ["VAL_BATCH", "call_model", "evaluate", "recalibrate_bn", "val_batches"]

VAL_BATCH = 512  # rows per validation minibatch (the figures are per sample, whatever it is)


def call_model(model: nn.Module, inputs: Any) -> Any:
    """``model`` applied to a minibatch's inputs. A model of hetpipe's (an ``nn.Sequential``
    of blocks) takes them as its one argument, whatever their shape: its first block binds a
    tuple or a mapping to forward's parameters. Any other module takes a tuple as its
    positional arguments and a mapping as keyword arguments."""
    if isinstance(model, nn.Sequential):
        return model(inputs)
    if isinstance(inputs, tuple):
        return model(*inputs)
    if isinstance(inputs, dict):
        return model(**inputs)
    return model(inputs)


def val_batches(data: DataSource | Dataset, batch: int = VAL_BATCH) -> Iterator[Batch]:
    """The validation set in order, in minibatches of ``batch`` rows (the last may be
    short), read as they are asked for."""
    if isinstance(data, Dataset):
        data = DataSource(data.name, None, data.val, Batcher(data.name))
    val = data.val
    if isinstance(val, TensorPairs) and data.batcher.collate is None:
        for start in range(0, len(val), batch):
            got = val.rows(list(range(start, min(start + batch, len(val)))))
            if got is not None:
                yield got
                continue
            yield data.batcher([val[i] for i in range(start, min(start + batch, len(val)))])
        return
    loader = tud.DataLoader(
        val,
        batch_size=batch,
        shuffle=False if not is_iterable(val) else None,
        collate_fn=data.batcher,
    )
    yield from loader


@torch.no_grad()
def evaluate(model: nn.Module, data: DataSource | Dataset, batch: int = 512) -> float | None:
    """Accuracy of ``model`` on the validation set (per token for sequence outputs): the
    share of rows whose output's argmax equals the target. None where there is nothing to
    compare: no validation set, or targets that are not one Tensor.

    Runs in eval mode under ``no_grad`` on the device of the model's first parameter, and
    puts the model back in the mode it was in.
    """
    if isinstance(data, DataSource) and data.val is None:
        return None
    first = next(itertools.chain(model.parameters(), model.buffers()), None)
    device = first.device if first is not None else torch.device("cpu")
    was_training = model.training
    model.eval()
    try:
        correct = total = 0
        for inputs, target in val_batches(data, batch):
            if not isinstance(target, torch.Tensor):
                return None
            out = call_model(model, to_device(inputs, device))
            pred = out.argmax(dim=-1)
            correct += int((pred == target.to(device)).sum())
            total += target.numel()
    finally:
        model.train(was_training)
    return correct / total if total else 0.0


def recalibrate_bn(model: nn.Module, stream: MinibatchStream, n: int) -> bool:
    """Re-estimate every batch-norm layer's running statistics on ``n`` training minibatches
    with the model's current weights (``train.bn_recalibrate``); False if it has none.

    Running statistics accumulated during asynchronous training follow weights that kept
    moving (and stale ones): they lag the final weights. Here they are reset and recomputed
    as a plain average over the ``n`` minibatches (momentum None), in train mode under
    ``no_grad``; the weights are not touched.
    """
    norms = [
        m
        for m in model.modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats
    ]
    if not norms or n < 1:
        return False
    first = next(itertools.chain(model.parameters(), model.buffers()))
    momenta = [m.momentum for m in norms]
    was_training = model.training
    for m in norms:
        m.reset_running_stats()
        m.momentum = None
    model.train()
    try:
        with torch.no_grad(), stream.reader(0, workers=0) as reader:
            for p in range(n):
                inputs, _target = reader.get(p)
                call_model(model, to_device(inputs, first.device))
    finally:
        for m, momentum in zip(norms, momenta, strict=True):
            m.momentum = momentum
        model.train(was_training)
    return True
