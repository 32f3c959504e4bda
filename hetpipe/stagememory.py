"""What one stage keeps alive, counted from its real tensors in the planner's own terms.

The planner predicts a stage's memory from its profile (:func:`hetpipe.core.memory.compose`);
the runtime counts the same terms from what it holds: the weights and buffers, the
optimizer's state, the weight versions in-flight backwards still hold, the update
accumulators, the activations each in-flight minibatch keeps under its layers' policies
with its stage output (kept until its backward), and the working peak of the largest
layer. The activation bytes of each layer are measured by the first forward of each input
shape (:class:`SavedBytes` counts what autograd saves, :func:`saved_ends` which of it is
the layer's input and output, so a tensor two layers save counts once) and kept per shape
in :class:`MemoryCount`, which also checks the count against the
device's cap. Its own module because it is the one place the runtime's accounting meets
the memory model; the compute (:mod:`hetpipe.stage`) only hands it what it holds.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import nn

from hetpipe.carry import leaves
from hetpipe.carry import nbytes as carry_bytes
from hetpipe.core.memory import (
    StageMemory,
    activation_bytes,
    backward_kind,
    compose,
    working_bytes,
)
from hetpipe.probes import Probe

if TYPE_CHECKING:
    from hetpipe.stage import _InFlight

__all__: list[str] = []


class LayerBytes(NamedTuple):
    """A stage's layers' bytes as its first forward of one input shape measured them, in
    the profile's terms (:class:`hetpipe.core.profile.LayerProfile`)."""

    saved: list[int]  # per layer: what it saves for its backward when kept
    inputs: list[int]  # per layer: its input
    work: list[int]  # per layer: its working peak (output plus input gradient)
    saved_in: list[int]  # per layer: of ``saved``, its input
    saved_out: list[int]  # per layer: of ``saved``, its output
    output: int = 0  # the stage's output, kept by every in-flight minibatch
    params: list[int] | None = None  # per layer: its weights' bytes, tied tensors left out
    tied: int = 0  # the tied tensors the stage's layers share: one gradient each

    def outputs(self) -> list[int]:
        """Per layer: its output (the next layer's input; the last's, the stage output)."""
        return [*self.inputs[1:], self.output] if self.inputs else []


def nbytes(t: Any) -> int:
    """The bytes of a tensor's elements, or of every tensor of a carry (a stage's input or
    output: :mod:`hetpipe.carry`)."""
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    return carry_bytes(t)


def storages(state: Mapping[str, torch.Tensor]) -> set[int]:
    """The storages of a layer's weights and buffers: state, never counted or swapped as
    what the layer saves for its backward."""
    return {t.untyped_storage().data_ptr() for t in state.values()}


def saved_ends(seen: Mapping[int, int], inp: Any, out: Any) -> tuple[int, int]:
    """Of the storages a layer saved (``seen``: data pointer to bytes), the bytes of its
    input ``inp`` and of its output ``out`` (tensors, carries, or a last stage's model
    output, however nested: :func:`hetpipe.carry.leaves`): what a stage holds
    otherwise (:func:`hetpipe.core.memory.activation_bytes`). An output that is a view of
    the input (a Flatten's) is held with the input, so it counts as saved output, whole.
    The profiler's (:func:`hetpipe.measure.measure_layers`) and the runtime's one rule."""
    ins = {t.untyped_storage().data_ptr() for t in leaves(inp)}
    outs = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in leaves(out)}
    saved_in = sum(b for ptr, b in seen.items() if ptr in ins)
    saved_out = sum(b for ptr, b in seen.items() if ptr in outs and ptr not in ins)
    saved_out += sum(b for ptr, b in outs.items() if ptr in ins)
    return saved_in, saved_out


class SavedBytes:
    """Counts the bytes autograd saves for one layer's backward, deduplicated by storage,
    without the storages in ``own`` (the layer's weights and buffers, counted as state);
    ``seen``: each counted storage's bytes, by data pointer (:func:`saved_ends`)."""

    def __init__(self, own: set[int]) -> None:
        self.bytes = 0
        self._own = set(own)
        self.seen: dict[int, int] = {}

    def pack(self, t: torch.Tensor) -> Any:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self._own and ptr not in self.seen:
            self.seen[ptr] = storage.nbytes()
            self.bytes += storage.nbytes()
        # detached (same storage): a saved output handed back as itself would hold its own
        # grad_fn, a cycle through autograd's nodes that the garbage collector cannot see,
        # so a graph whose nodes a backward does not free (a split backward's input half
        # retains them) would stay alive for good
        return t.detach()

    @staticmethod
    def unpack(t: Any) -> Any:
        return t


class MemoryCount:
    """A stage's sizes, its layers' measured bytes per input shape, and its device's cap."""

    def __init__(
        self,
        module: nn.Module,
        recompute: frozenset[int],
        swap: frozenset[int],
        cap: int,
        where: str,
        schedule: str = "async",
    ) -> None:
        """``recompute`` and ``swap``: the stage's layers (from 0) under those policies;
        ``schedule``: how its backward's working peak is walked
        (:func:`hetpipe.core.memory.backward_kind`)."""
        self.backward = backward_kind(schedule)
        self.recompute = recompute
        self.swap = swap
        self.cap = cap
        self.where = where
        self.param_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
        self.weight_bytes = self.param_bytes + sum(
            b.numel() * b.element_size() for b in module.buffers()
        )
        # per input shape (of each tensor of a carry: hetpipe.carry.shape_of): each layer's
        # bytes, measured by the first forward of that shape, which keeps every layer
        self.layer_bytes: dict[Hashable, LayerBytes] = {}
        self.working = 0  # the backward's working peak, the largest of the shapes measured

    def measured(self, shape: Hashable, known: LayerBytes) -> None:
        """Record the layers' bytes the first forward of input ``shape`` measured."""
        self.layer_bytes[shape] = known
        self.working = max(
            self.working,
            working_bytes(
                known.work,
                known.saved,
                self.recompute,
                self.swap,
                backward=self.backward,
                out=known.outputs(),
                params=known.params or [0] * len(known.work),
                saved_in=known.saved_in,
                saved_out=known.saved_out,
                tied=known.tied,
            ),
        )

    def kept(self, known: LayerBytes) -> int:
        """What a minibatch's layers keep for its backward under their policies, and its
        stage output (its stage input not included)."""
        return activation_bytes(
            known.saved,
            known.inputs,
            self.recompute,
            self.swap,
            known.saved_in,
            known.saved_out,
            known.output,
        )

    def rerun_bytes(self) -> int:
        """What one minibatch's rerun keeps under the layers' policies (the largest shape
        measured so far): the room the backward of a rerun forward needs, counted as a kept
        graph is (:meth:`kept`: its output, a tensor two layers save once), since the rerun
        rebuilds that graph."""
        return max((self.kept(b) for b in self.layer_bytes.values()), default=0)

    def count(
        self,
        in_flight: Mapping[int, _InFlight],
        params: Mapping[str, torch.Tensor],
        *,
        acc: Mapping[int, Mapping[str, torch.Tensor]],
        grad_sum: Mapping[str, torch.Tensor],
        optimizer: int,
        paper: bool,
        probe: Probe | None,
    ) -> StageMemory:
        """What the stage keeps alive now, composed as the planner composes its prediction:
        ``params`` its current weights, ``in_flight`` its minibatches between forward and
        backward, ``acc`` and ``grad_sum`` its update accumulators and gradient sum,
        ``optimizer`` the optimizer state's bytes; ``paper``: weights ``predict`` variant
        ``paper``, whose outstanding ``probe`` keeps its prediction.

        The other weight versions in-flight backwards hold (``predict`` paper: the
        predicted copy a forward or backward computes, and the predicted weights of
        recomputed layers every late-bound minibatch keeps for its rerun), the activations
        every in-flight minibatch keeps under its layers' policies (only its input where the
        backward reruns the forward, ``latest``, plus room for one minibatch's rerun, which
        a kept graph's tensors make: the two never live at once), and the working peak of
        the largest layer (measured per input shape)."""
        versions = {id(f.params) for f in in_flight.values() if f.params and f.late is None} | {
            id(params)
        }
        n = len(versions)
        held = 0
        if paper:
            n = max(n, 2)  # the predicted copy a pass computes (or a probe still judges)
            probed = probe.predicted if probe is not None else None
            # a late-bound forward's graph keeps its recomputed layers' predicted weights
            kept = {
                w.untyped_storage().data_ptr(): nbytes(w)
                for f in in_flight.values()
                if f.late is not None and f.params is not probed
                for name, w in f.params.items()
                if w.untyped_storage().nbytes() and w is not params[name]
            }
            held = sum(kept.values())
        accumulators = sum(nbytes(t) for a in acc.values() for t in a.values())
        accumulators += sum(nbytes(t) for t in grad_sum.values())
        activations = sum(f.kept_bytes for f in in_flight.values())
        # a split backward between its halves: the output gradient and the gradients its
        # weight half starts from (hetpipe.splitbackward)
        activations += sum(_split_bytes(f) for f in in_flight.values())
        if any(f.recompute for f in in_flight.values()):
            # a rerun's room is never used while a forward's graph is kept: a graph is kept
            # only where no other update comes before its backward (fixed order), and a
            # rerun backward brings one; so the room is the kept graph's where there is one
            graphs = sum(f.kept_bytes - nbytes(f.x) for f in in_flight.values() if not f.recompute)
            activations += max(0, self.rerun_bytes() - graphs)
        return compose(
            self.param_bytes,
            self.weight_bytes - self.param_bytes,
            optimizer=optimizer,
            copies=n - 1,
            held=held,
            accumulators=accumulators,
            activations=activations,
            working=self.working,
        )


def _split_bytes(flight: _InFlight) -> int:
    """Bytes a minibatch keeps between the input and weight halves of its backward (none
    outside a split backward)."""
    out = nbytes(flight.grad) if flight.grad is not None else 0
    if flight.kept is not None:
        for _meets, _members, captured in flight.kept.groups:
            for got in captured:
                out += sum(nbytes(g) for g in got or () if g is not None)
    return out
