"""Metric functions as users write them, named by jobs as ``usermetrics:<function>`` (a module
the tests put on the path; not a test module)."""

from __future__ import annotations

from typing import Any

import torch


def top_logit(outputs: torch.Tensor, target: torch.Tensor) -> float:
    """The mean of each row's largest output: a number that moves with the weights."""
    return float(outputs.max(dim=-1).values.mean())


def pair(outputs: torch.Tensor, target: torch.Tensor) -> dict[str, Any]:
    """A mapping of two figures: the share of label 0 among the targets, and the top logit."""
    return {"zeros": float((target == 0).float().mean()), "top": top_logit(outputs, target)}


def broken(outputs: torch.Tensor, target: torch.Tensor) -> float:
    """A metric with a bug: it raises."""
    raise RuntimeError("metric bug on purpose")
