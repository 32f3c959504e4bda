"""What crosses a cut between stages: a *carry*, one tensor or a tuple of tensors.

The runtime cuts a model (an ``nn.Sequential``) between elements; an element's forward takes
one positional argument, the carry, and returns the next one. A carry is a bare tensor (the
plain case: one activation) or a tuple of tensors (a residual stream beside its skip, a
hidden state beside its position ids and attention mask). Integer and boolean tensors of a
carry take no gradient; every floating one does.

Besides carries, the first stage's input from the data may be a tensor, a tuple or a dict of
tensors (by the model's forward parameter names), and the target travelling to the last stage
a tensor, a dict of tensors or None (a model that computes its own loss). The helpers here
walk all of these alike; each takes the bare tensor first, so the plain case pays one
``isinstance``.

On the wire a carry's tensors are named after their place (:func:`names`): ``x`` for a bare
activation, ``x.0``, ``x.1``, ... for a tuple; ``g``/``g.0``... for gradients; ``y`` or
``y.<key>`` for a target, no name at all for None. :func:`carry_of` and :func:`target_of`
read the names back and refuse, in one line, a set that forms neither.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor

__all__: list[str] = []

# a carry: what an element returns and the next one takes
Carry = Tensor | tuple[Tensor, ...]
# what the first stage takes from the data, and the target the last stage's loss takes
Inputs = Tensor | tuple[Tensor, ...] | dict[str, Tensor]
Target = Tensor | dict[str, Tensor] | None


def tensors(c: Any) -> list[Any]:
    """The tensors of a carry, batch or target, in order (a dict's in its key order). A
    tensor still to be opened (one shared by a GPU's handle, :class:`hetpipe.cudaipc.Shared`)
    counts as a tensor."""
    if isinstance(c, Tensor):
        return [c]
    if c is None:
        return []
    if isinstance(c, Mapping):
        return list(c.values())
    if isinstance(c, (tuple, list)):
        return list(c)
    return [c]


def mapped(c: Any, fn: Callable[[Any], Any]) -> Any:
    """``fn`` applied to each tensor of a carry, batch or target, in the same structure (a
    list becomes a tuple: a carry)."""
    if isinstance(c, Tensor):
        return fn(c)
    if c is None:
        return None
    if isinstance(c, Mapping):
        return {k: fn(t) for k, t in c.items()}
    if isinstance(c, (tuple, list)):
        return tuple(fn(t) for t in c)
    return fn(c)


def leaves(c: Any) -> Iterator[Tensor]:
    """Every tensor in a carry, batch, target or model output, however nested: tuples, lists,
    mappings and ``ModelOutput``-style dataclasses (the last stage's output may be any of
    them); what is not a tensor (a flag, a count) is skipped."""
    if isinstance(c, Tensor):
        yield c
    elif isinstance(c, Mapping):
        for v in c.values():
            yield from leaves(v)
    elif isinstance(c, (tuple, list)):
        for v in c:
            yield from leaves(v)
    elif dataclasses.is_dataclass(c) and not isinstance(c, type):
        for f in dataclasses.fields(c):
            yield from leaves(getattr(c, f.name))


def nbytes(c: Any) -> int:
    """The bytes of the elements of a tensor, or of every tensor of a carry or output."""
    if isinstance(c, Tensor):
        return c.numel() * c.element_size()
    return sum(t.numel() * t.element_size() for t in leaves(c))


def float_bytes(c: Any) -> int:
    """The bytes of the floating tensors of a carry: what its gradient takes."""
    return sum(t.numel() * t.element_size() for t in leaves(c) if t.is_floating_point())


def shape_of(c: Any) -> Hashable:
    """A key of a carry's (or batch's) shapes: a bare tensor's own shape, else one shape per
    tensor (a dict's with its keys)."""
    if isinstance(c, Tensor):
        return tuple(c.shape)
    if isinstance(c, Mapping):
        return tuple((k, tuple(t.shape)) for k, t in c.items())
    return tuple(tuple(t.shape) for t in c)


def samples(target: Any, first: Any) -> int:
    """The samples of a minibatch: the rows of its target's first tensor, else of its input's
    first tensor (1 for a scalar, or where neither has a tensor)."""
    for c in (target, first):
        ts = tensors(c)
        if ts:
            return int(ts[0].shape[0]) if ts[0].dim() else 1
    return 1


def names(c: Any, base: str) -> dict[str, Tensor]:
    """A carry or target by wire name: ``{base: t}`` for a bare tensor, ``base.<i>`` for a
    tuple's, ``base.<key>`` for a dict's; nothing for None."""
    if isinstance(c, Tensor):
        return {base: c}
    if c is None:
        return {}
    if isinstance(c, Mapping):
        return {f"{base}.{k}": t for k, t in c.items()}
    if isinstance(c, (tuple, list)):
        return {f"{base}.{i}": t for i, t in enumerate(c)}
    return {base: c}


def carry_of(got: Mapping[str, Any], base: str, what: str) -> Any:
    """The carry named ``base`` in ``got`` (a message's tensors by name, of :func:`names`):
    the bare ``base``, or the tuple ``base.0`` .. ``base.<n-1>``. ``ValueError`` (one line,
    ``what`` says which message) where the names form no carry."""
    if base in got:
        if any(n.startswith(base + ".") for n in got):
            raise ValueError(f"{what} carries both {base!r} and {base}.<i>: not one carry")
        return got[base]
    prefix = base + "."
    parts = sorted(n[len(prefix) :] for n in got if n.startswith(prefix))
    if not parts:
        raise ValueError(f"{what} carries no tensor {base!r}")
    if sorted(parts) != sorted(str(i) for i in range(len(parts))):
        raise ValueError(f"{what}: tensors {base}.{{{','.join(parts)}}} are not a carry")
    return tuple(got[f"{prefix}{i}"] for i in range(len(parts)))


def target_of(got: Mapping[str, Any], base: str = "y") -> Any:
    """The target named ``base`` in ``got``: the bare ``base``, the dict of ``base.<key>``,
    or None where neither is there."""
    if base in got:
        return got[base]
    prefix = base + "."
    keys = [n for n in got if n.startswith(prefix)]
    if not keys:
        return None
    return {n[len(prefix) :]: got[n] for n in keys}


def message_parts(got: Mapping[str, Any], what: str) -> tuple[Any, Any]:
    """An activation message's (carry ``x``, target ``y``) from its tensors by name;
    ``ValueError`` (one line) for a name that is neither."""
    for n in got:
        if n != "x" and n != "y" and not n.startswith(("x.", "y.")):
            raise ValueError(f"{what} carries tensor {n!r}, neither activation nor target")
    return carry_of(got, "x", what), target_of(got, "y")


def gradient_of(got: Mapping[str, Any], what: str) -> Any:
    """A gradient message's carry ``g``; ``ValueError`` (one line) for any other name."""
    for n in got:
        if n != "g" and not n.startswith("g."):
            raise ValueError(f"{what} carries tensor {n!r}, not a gradient")
    return carry_of(got, "g", what)


def requiring_grad(c: Any) -> Any:
    """A received carry as a stage's input: each floating tensor a new leaf that takes a
    gradient (detached from whatever made it), the others as they are."""
    return mapped(c, lambda t: t.detach().requires_grad_() if t.is_floating_point() else t)


def to_half(c: Any, dtype: torch.dtype) -> Any:
    """A carry's floating tensors in ``dtype``, the half compute precision that travels
    between stages (bfloat16 or float16)."""
    return mapped(c, lambda t: t.to(dtype) if t.is_floating_point() else t)
