"""Weights bound at backward time: the forward's graph differentiated on other weights.

``train.weights = "predict"``, variant ``paper`` (SpecTrain): the forward of a minibatch runs
on the weights predicted ``s_fwd`` updates ahead, its backward on the weights predicted
``s_bwd`` ahead of those current at the backward. The forward's graph is kept (no second
forward): while it is built, every tensor a layer saves for its backward that is one of its
weights (or a view of one, or autocast's cast of one, or a view of that cast) is packed as a
:class:`_Token` (the weight's name and how to take the same view again) instead of the
tensor, by :func:`torch.autograd.graph.saved_tensors_hooks`. The backward unpacks each token
to the weights it is given then (:meth:`LateWeights.backward`): input gradients go through
the backward's weights, weight gradients come from the forward's saved activations, as the
paper does. The graph does not hold the forward's weights, so the stage can release them.

The hooks are the innermost of any others (they go around one layer's call): a tensor that
is no weight goes on to the hooks that were current (the activation policy's: a checkpoint's
own, :class:`hetpipe.swap.HostSwap`'s, a measuring counter's), so the policies work as they
do without this. A recomputed run (non-reentrant checkpoint) packs through these hooks in
its forward and again in its rerun inside the backward: the same tensors are left out of
the checkpoint's count both times, the rerun computes its activations on the weights the
run's forward used (the caller keeps them) and its weights unpack to the backward's, the
same computation as a kept layer.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch

__all__: list[str] = []

# autograd nodes of ops that return a view of their one input: a saved tensor reached from
# a weight through these (and at most one dtype cast) is that weight's, seen another way
_VIEWS = frozenset(
    {
        "TBackward0",
        "TransposeBackward0",
        "PermuteBackward0",
        "ViewBackward0",
        "UnsafeViewBackward0",
        "AliasBackward0",
        "ExpandBackward0",
        "AsStridedBackward0",
    }
)


class _Token:
    """A saved weight as its name, the dtype autocast cast it to (None: not cast) and the
    view of it that was saved."""

    __slots__ = ("dtype", "name", "offset", "size", "stride")

    def __init__(self, name: str, dtype: torch.dtype | None, t: torch.Tensor) -> None:
        self.name, self.dtype = name, dtype
        self.size, self.stride, self.offset = t.size(), t.stride(), t.storage_offset()


class LateWeights:
    """Packs saved weights as tokens while :meth:`forward` or :meth:`backward` is on, and
    unpacks them to the weights :meth:`backward` was given."""

    def __init__(self) -> None:
        self.packing = False
        self._now: Mapping[str, torch.Tensor] | None = None

    @contextmanager
    def forward(self, on: bool = True) -> Iterator[None]:
        """A forward whose backward will take other weights (nothing changes without ``on``)."""
        before, self.packing = self.packing, on
        try:
            yield
        finally:
            self.packing = before

    @contextmanager
    def backward(self, weights: Mapping[str, torch.Tensor]) -> Iterator[None]:
        """The backward of such a forward, on ``weights`` (a recomputed run's rerun packs
        as its forward did)."""
        self._now, self.packing = weights, True
        try:
            yield
        finally:
            self._now, self.packing = None, False

    def layer(self, weights: Mapping[str, torch.Tensor]) -> AbstractContextManager[Any]:
        """The hooks around one layer's call; ``weights`` maps its weights' names to the
        tensors the call runs on."""
        if not self.packing or not weights:
            return nullcontext()
        storages = {w.untyped_storage().data_ptr(): n for n, w in weights.items()}
        outer = torch._C._autograd._top_saved_tensors_default_hooks(True)

        def pack(t: torch.Tensor) -> Any:
            name = storages.get(t.untyped_storage().data_ptr())
            if name is not None:
                return _Token(name, None, t)
            # a cast has a history (ToCopyBackward0 at or below views): a tensor without one,
            # an activation's input or a buffer, needs no walk
            if t.grad_fn is not None:
                name = _cast_of(t, weights)
                if name is not None:
                    return _Token(name, t.dtype, t)
            return outer[0](t) if outer is not None else t

        def unpack(packed: Any) -> Any:
            if type(packed) is _Token:
                return self._resolve(packed)
            return outer[1](packed) if outer is not None else packed

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def _resolve(self, token: _Token) -> torch.Tensor:
        if self._now is None:
            raise RuntimeError(f"weight {token.name!r} unpacked outside a late backward")
        w = self._now[token.name].detach()
        if token.dtype is not None:
            w = w.to(token.dtype)
        if (w.size(), w.stride(), w.storage_offset()) == (token.size, token.stride, token.offset):
            return w
        return w.as_strided(token.size, token.stride, token.offset)


def _cast_of(t: torch.Tensor, weights: Mapping[str, torch.Tensor]) -> str | None:
    """The name of the weight ``t`` is a cast of (autocast's copy in the compute dtype, or a
    view of it), found by walking its autograd history back to the weight's leaf (compared
    by identity with ``weights``' tensors: a layer has a few)."""
    node = t.grad_fn
    cast = False
    while node is not None:
        kind = type(node).__name__
        if kind == "AccumulateGrad":
            if not cast:
                return None
            leaf = node.variable
            return next((n for n, w in weights.items() if w is leaf and w.requires_grad), None)
        if kind == "ToCopyBackward0" and not cast:
            cast = True
        elif kind not in _VIEWS:
            return None
        node = node.next_functions[0][0]
    return None
