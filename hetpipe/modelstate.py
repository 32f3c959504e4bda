"""Which of a model's tensors are trained, shared, kept local or tied: one home for the rule.

A model's state is not just ``state_dict()``. Four kinds of tensor need different homes:

- **parameters** that train: on the parameter server, pushed and pulled every wave;
- **frozen parameters** (``requires_grad=False``): on the parameter server (so they are
  exported) but never given a gradient, an optimizer state or a push;
- **persistent buffers** (in ``state_dict()``, e.g. batch-norm statistics): on the server;
- **non-persistent buffers** (``register_buffer(..., persistent=False)``): kept on the stage
  only, never on the server and never exported, exactly as ``state_dict()`` leaves them out.

**Tied** tensors (``b.weight = a.weight``) are one tensor under several names. The first name
in module order, the one ``named_parameters()`` keeps, is the *canonical* name: only it lives
on the server and in a stage's weights, so a tie has one value, one gradient (the sum of all
its uses) and one optimizer state. The other names are *aliases*, restored on export so the
written state_dict has every name ``state_dict()`` would give, sharing one storage.

A tie whose names fall in several stages (GPT's input embedding on the first stage, its
output head on the last) is one tensor on several devices: each stage that uses it holds its
own *copy* under the canonical name (:meth:`StateLayout.on_stage`), all initialised from the
one entry on the shards. The stage holding the canonical name's layer is the tie's *owner*;
the others hold copies (:meth:`StateLayout.spanning` says which stages hold which tie). How
the copies are kept equal is the runtime's (:mod:`hetpipe.pipeline`): in the synchronous
schedules the gradient of the tie is summed over the stages that use it before each steps, as
Megatron does; in the asynchronous one each stage steps on its own use's gradient and every
copy pushes its updates to the one entry on the shards. Where copies cannot be kept (a
replicated stage) the split is refused (:meth:`StateLayout.check_split`) with one line naming
the tensors and the stages.

Names are global (``"3.weight"``): the leading integer is the layer of the ``nn.Sequential``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

__all__ = ["LayoutError", "StateLayout", "layer_of"]


class LayoutError(ValueError):
    """A model's state cannot be laid out on stages; ``str(e)`` is one line."""


def layer_of(name: str) -> int:
    """The layer of the flat ``nn.Sequential`` a global state name belongs to."""
    return int(name.partition(".")[0])


@dataclass(frozen=True)
class StateLayout:
    """The kinds of a model's state tensors, by global (canonical) name, in module order."""

    params: tuple[str, ...]  # canonical names of distinct parameters
    frozen: frozenset[str]  # canonical parameter names with requires_grad False
    buffers: tuple[str, ...]  # canonical names of persistent buffers
    local: tuple[str, ...]  # canonical names of non-persistent buffers
    aliases: Mapping[str, str] = field(default_factory=dict)  # tied name -> canonical name

    @classmethod
    def of(cls, model: nn.Module) -> StateLayout:
        """Read the layout of ``model`` (on any device, the meta device included)."""
        aliases: dict[str, str] = {}
        params = _canonical(model.named_parameters(remove_duplicate=False), aliases)
        buffers = _canonical(model.named_buffers(remove_duplicate=False), aliases)
        kept = set(model.state_dict(keep_vars=True))
        named = set(params) | set(buffers) | set(aliases)
        extra = sorted(kept - named)
        if extra:
            raise LayoutError(
                f"state_dict entry {extra[0]!r} is neither a parameter nor a "
                f"buffer (extra state is not supported)"
            )
        by_name = dict(model.named_parameters())
        return cls(
            params=tuple(params),
            frozen=frozenset(n for n in params if not by_name[n].requires_grad),
            buffers=tuple(b for b in buffers if b in kept),
            local=tuple(b for b in buffers if b not in kept),
            aliases=aliases,
        )

    # -- views ------------------------------------------------------------------------------

    @property
    def shared(self) -> tuple[str, ...]:
        """Names kept on the parameter server: parameters (frozen ones too), then buffers."""
        return self.params + self.buffers

    @property
    def trainable(self) -> tuple[str, ...]:
        """Parameters that get gradients and optimizer steps."""
        return tuple(n for n in self.params if n not in self.frozen)

    def ties(self) -> dict[str, list[str]]:
        """Canonical name -> every name of that tensor, for tensors with more than one."""
        out: dict[str, list[str]] = {}
        for alias, canonical in self.aliases.items():
            out.setdefault(canonical, [canonical]).append(alias)
        return out

    def with_aliases(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``state`` plus every alias pointing at its canonical tensor (one storage)."""
        out = dict(state)
        for alias, canonical in self.aliases.items():
            if canonical in state:
                out[alias] = state[canonical]
        return out

    # -- stages -----------------------------------------------------------------------------

    def check_split(self, bounds: Sequence[tuple[int, int]], where: Sequence[str]) -> None:
        """Refuse a split that puts the names of one tied tensor in different stages: where
        a stage cannot hold a copy of it (a replicated stage, :mod:`hetpipe.replicas`).

        ``bounds`` are the stages' layer ranges ``(first, last)``; ``where`` names each stage.
        """
        for names in self.ties().values():
            stages = sorted({_stage_of(layer_of(n), bounds) for n in names})
            if len(stages) > 1:
                listed = ", ".join(f"{n} ({where[_stage_of(layer_of(n), bounds)]})" for n in names)
                raise LayoutError(
                    f"tied parameters {listed} fall in {len(stages)} stages; tied tensors "
                    f"must share one stage: put layers {min(layer_of(n) for n in names)}.."
                    f"{max(layer_of(n) for n in names)} in one stage"
                )

    def spanning(self, bounds: Sequence[tuple[int, int]]) -> dict[str, list[int]]:
        """Canonical name -> the stages holding a name of it (ascending: the owner first), for
        every tie whose names fall in more than one of the stages ``bounds``."""
        out: dict[str, list[int]] = {}
        for canonical, names in self.ties().items():
            stages = sorted({_stage_of(layer_of(n), bounds) for n in names})
            if len(stages) > 1:
                out[canonical] = stages
        return out

    def holds(self, name: str, first: int, last: int) -> bool:
        """Whether the stage of layers ``first``..``last``-1 holds canonical ``name`` (its
        layer, or the layer of one of its aliases, is in the stage)."""
        if first <= layer_of(name) < last:
            return True
        return any(first <= layer_of(a) < last for a, c in self.aliases.items() if c == name)

    def on_stage(self, first: int, last: int) -> StateLayout:
        """The layout of the stage of layers ``first``..``last``-1, a copy of every tie it
        uses included: a tie whose canonical name lies in an earlier stage is held here under
        that name (in module order), its names in this stage being aliases of it."""
        held = {c for a, c in self.aliases.items() if first <= layer_of(a) < last}

        def keep(names: Iterable[str]) -> tuple[str, ...]:
            return tuple(n for n in names if first <= layer_of(n) < last or n in held)

        return StateLayout(
            params=keep(self.params),
            frozen=frozenset(keep(self.frozen)),
            buffers=keep(self.buffers),
            local=keep(self.local),
            aliases={a: c for a, c in self.aliases.items() if first <= layer_of(a) < last},
        )

    def within(self, first: int, last: int) -> StateLayout:
        """The part of this layout in layers ``first``..``last``-1."""

        def keep(names: Iterable[str]) -> tuple[str, ...]:
            return tuple(n for n in names if first <= layer_of(n) < last)

        return StateLayout(
            params=keep(self.params),
            frozen=frozenset(keep(self.frozen)),
            buffers=keep(self.buffers),
            local=keep(self.local),
            aliases={a: c for a, c in self.aliases.items() if first <= layer_of(c) < last},
        )


def _canonical(named: Iterable[tuple[str, torch.Tensor]], aliases: dict[str, str]) -> list[str]:
    """First names of distinct tensors in order; later names of the same one go to
    ``aliases``."""
    first: dict[int, str] = {}
    out = []
    for name, t in named:
        seen = first.get(id(t))
        if seen is None:
            first[id(t)] = name
            out.append(name)
        else:
            aliases[name] = seen
    return out


def _stage_of(layer: int, bounds: Sequence[tuple[int, int]]) -> int:
    return next(i for i, (a, b) in enumerate(bounds) if a <= layer < b)
