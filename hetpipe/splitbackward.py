"""A backward split in two passes: the input gradient now, the weights' gradient later.

The zero-bubble schedules (:mod:`hetpipe.core.schedule`, ``BackwardInput`` and
``BackwardWeight``) send a stage's input gradient to the previous stage at once and take the
weights' gradient where the schedule puts it. Differentiating the weights later from the
outputs again would redo the whole chain of activation gradients; instead, the input pass
captures the gradient flowing into each *intermediate*: each node of the input's path where
a weight's path joins it. The weight pass starts from those captured gradients and walks
only the weights' own branches. The same method as ``torch.distributed.pipelining``'s
``stage_backward_input`` / ``stage_backward_weight`` (Qi et al., ICLR'24), returning the
gradients instead of accumulating into ``.grad`` (a stage's weight versions are plain dicts).

Where a weight's path never joins the input's (the first stage's input takes no gradient),
the weight pass differentiates it from the outputs, whose graph the input pass kept.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node

__all__: list[str] = []


def _node(t: torch.Tensor) -> Node | None:
    """The autograd node a tensor's gradient flows into: its grad_fn, or a leaf's
    accumulator."""
    if t.grad_fn is not None:
        return t.grad_fn
    if t.requires_grad:
        return t.view_as(t).grad_fn.next_functions[0][0]  # type: ignore[union-attr]
    return None


@dataclass
class Kept:
    """What the input pass leaves for the weight pass: per group of weights, the
    intermediates their paths join and the gradients captured there; and the outputs with
    their gradients, for weights outside every group."""

    groups: list[tuple[list[Node], list[int], list[tuple[torch.Tensor | None, ...] | None]]]
    outputs: Sequence[torch.Tensor]
    grad_outputs: Sequence[torch.Tensor]
    rest: list[int] = field(default_factory=list)  # weights (by index) in no group


def input_gradients(
    outputs: Sequence[torch.Tensor],
    grad_outputs: Sequence[torch.Tensor],
    inputs: Sequence[torch.Tensor],
    weights: Sequence[torch.Tensor],
) -> tuple[tuple[torch.Tensor | None, ...], Kept]:
    """The gradients of ``inputs`` (None where unused) from ``outputs`` and their
    ``grad_outputs``, and what :func:`weight_gradients` needs for ``weights``. The graph
    is kept."""
    reverse: dict[Node, list[Node]] = {}
    roots = [n for n in map(_node, outputs) if n is not None]
    seen: set[Node] = set(roots)
    todo = deque(roots)
    while todo:
        n = todo.popleft()
        for child, _ in n.next_functions:
            if child is None:
                continue
            reverse.setdefault(child, []).append(n)
            if child not in seen:
                seen.add(child)
                todo.append(child)
    # the nodes on the inputs' paths to the outputs
    on_path: set[Node] = set()
    todo = deque(n for n in map(_node, inputs) if n is not None)
    while todo:
        n = todo.popleft()
        if n in on_path:
            continue
        on_path.add(n)
        todo.extend(reverse.get(n, ()))
    by_meet: dict[frozenset[Node], list[int]] = {}
    rest = []
    for i, w in enumerate(weights):
        meets: set[Node] = set()
        walked: set[Node] = set()
        todo = deque([_node(w)])
        while todo:
            n = todo.popleft()
            if n is None or n in walked:
                continue
            walked.add(n)
            for parent in reverse.get(n, ()):
                if parent in on_path:
                    meets.add(parent)
                else:
                    todo.append(parent)
        if meets:
            by_meet.setdefault(frozenset(meets), []).append(i)
        else:
            rest.append(i)
    groups: list[tuple[list[Node], list[int], list[tuple[torch.Tensor | None, ...] | None]]] = []
    handles = []
    for meets_set, members in by_meet.items():
        meets = list(meets_set)
        captured: list[tuple[torch.Tensor | None, ...] | None] = [None] * len(meets)
        for j, n in enumerate(meets):

            def hook(grads: tuple[torch.Tensor | None, ...], j: int = j, into=captured) -> None:
                into[j] = grads

            handles.append(n.register_prehook(hook))
        groups.append((meets, members, captured))
    wanted = [t for t in inputs if t.requires_grad]
    try:
        grads = (
            torch.autograd.grad(outputs, wanted, grad_outputs, retain_graph=True, allow_unused=True)
            if wanted
            else ()
        )
    finally:
        for h in handles:
            h.remove()
    it = iter(grads)
    out = tuple(next(it) if t.requires_grad else None for t in inputs)
    return out, Kept(groups, outputs, grad_outputs, rest)


def weight_gradients(
    kept: Kept, weights: Sequence[torch.Tensor]
) -> tuple[torch.Tensor | None, ...]:
    """The gradients of ``weights`` (None where unused) from what :func:`input_gradients`
    kept; frees the graph."""
    out: list[torch.Tensor | None] = [None] * len(weights)
    for meets, members, captured in kept.groups:
        edges, grads = [], []
        for n, got in zip(meets, captured, strict=True):
            for i, g in enumerate(got or ()):
                if g is not None:
                    edges.append(GradientEdge(n, i))
                    grads.append(g)
        if not edges:
            continue
        handles = []
        if len(meets) > 1:  # a later intermediate's gradient is taken as captured, not summed
            for n, got in zip(meets, captured, strict=True):
                handles.append(n.register_prehook(lambda _g, got=got: got))
        try:
            targets = [GradientEdge(_node(weights[i]), 0) for i in members]  # type: ignore[arg-type]
            got_w = torch.autograd.grad(
                edges, targets, grads, retain_graph=bool(kept.rest), allow_unused=True
            )
        finally:
            for h in handles:
                h.remove()
        for i, g in zip(members, got_w, strict=True):
            out[i] = g
    if kept.rest:
        wanted = [weights[i] for i in kept.rest]
        got = torch.autograd.grad(kept.outputs, wanted, kept.grad_outputs, allow_unused=True)
        for i, g in zip(kept.rest, got, strict=True):
            out[i] = g
    return tuple(out)
