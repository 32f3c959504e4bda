"""The layers of one stage: built on their device, and run one by one, each under its
activation policy.

A stage's weights are not its modules' own: every pass binds the tensors of one weight
version into the layers' parameter and buffer slots (:meth:`StageLayers.call`, what
:func:`torch.func.functional_call` does without its per-call set-up and restore), so the
weight versions (:mod:`hetpipe.versions`) stay plain dicts. A run of *recomputed* layers runs
under non-reentrant :func:`torch.utils.checkpoint.checkpoint` and reruns in the backward with
the same dropout masks and throwaway copies of the batch-norm statistics; a *swapped* layer
runs under :class:`hetpipe.swap.HostSwap`'s hooks; a late-bound forward (``predict`` paper)
packs its weights as names (:mod:`hetpipe.lateweights`). The first forward of each input
shape also measures each layer's bytes in the planner's terms (:mod:`hetpipe.stagememory`).
Its own module because how a layer runs is the same for every pass the compute
(:mod:`hetpipe.stage`) makes: forward, rerun and measurement.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from hetpipe.carry import Carry, float_bytes
from hetpipe.core.memory import recompute_runs
from hetpipe.job import JobSpec
from hetpipe.lateweights import LateWeights
from hetpipe.models import build_model
from hetpipe.modelstate import StateLayout
from hetpipe.seeding import LayerSeeds
from hetpipe.stagememory import LayerBytes, SavedBytes, nbytes, saved_ends, storages
from hetpipe.swap import HostSwap

__all__: list[str] = []

# a layer's state name: (name in the layer, global name, whether it is a buffer)
Key = tuple[str, str, bool]


def build_stage_module(spec: JobSpec, first: int, last: int, device: str) -> nn.Sequential:
    """Build layers ``first``..``last``-1 on ``device`` without materialising the rest.

    The whole model is constructed on the meta device (no memory), sliced, and only the
    slice is allocated; its values come from the parameter server. ``to_empty`` gives every
    use of a tied tensor its own new one, so the ties of the slice are restored after it.
    """
    with torch.device("meta"):
        full = build_model(spec.model)
    if not 0 <= first < last <= len(full):
        raise ValueError(f"layers {first}..{last - 1} out of range: the model has {len(full)}")
    part = full[first:last]
    ties = StateLayout.of(part).aliases
    part.to_empty(device=device)
    for alias, canonical in ties.items():
        path, _, attr = alias.rpartition(".")
        owner = part.get_submodule(path)
        cpath, _, cattr = canonical.rpartition(".")
        setattr(owner, attr, getattr(part.get_submodule(cpath), cattr))
    return part


class StageLayers:
    """A stage's layers, where each takes its state from, and their activation policies."""

    def __init__(
        self,
        module: nn.Module,
        layout: StateLayout,
        seeds: LayerSeeds,
        *,
        first: int,
        recompute: frozenset[int],
        swap: frozenset[int],
        dev: str,
    ) -> None:
        """``module``: the stage's layers, the first being the model's layer ``first``;
        ``recompute`` and ``swap``: its layers (from 0) under those policies."""
        self.seeds = seeds
        self.first = first
        self.recompute = recompute
        self.swap = swap
        self.swapper = HostSwap(dev)
        self.late = LateWeights()
        self.layers = layer_states(module, layout)
        self.slots = [_slots(layer, keys) for layer, keys in self.layers]
        # each layer's trainable weights as (local name, global name): what a late backward
        # binds (predict paper), and the names a recomputed run needs again in its backward
        self.weight_keys = [
            [(local, name) for local, name, is_buffer in keys if not is_buffer]
            for _layer, keys in self.layers
        ]
        self.recomputed_names = {name for i in recompute for _local, name in self.weight_keys[i]}

    def run(
        self, p: int, x: Any, state: Mapping[str, torch.Tensor], measure: bool
    ) -> tuple[Carry, LayerBytes]:
        """The stage's layers on ``x``, each under its activation policy. ``x`` and what each
        layer returns are carries (:mod:`hetpipe.carry`: a tensor or a tuple of tensors; the
        first stage's input may be a dict), passed on as they are; a carry's bytes are the
        sum of its tensors'.

        With ``measure`` (the first forward of each input shape) each layer's bytes are
        recorded in the planner's terms (as :func:`hetpipe.planner.profile.measure_layers`
        counts them): what autograd saves, deduplicated by storage and without the layer's
        own state, its input, and its working memory (output plus input gradient); they come
        back with the output. A recomputed run is measured by a throwaway pass on copies of
        its buffers before its real, checkpointed one: its saved tensors live only during
        that pass, which is the rerun the ``working`` term already holds room for.
        """
        saved: list[int] = []
        inputs: list[int] = []
        work: list[int] = []
        saved_in: list[int] = []
        saved_out: list[int] = []
        params: list[int] = []  # per layer, without the tied tensors (one gradient each)
        tied: dict[str, int] = {}  # tied tensors: bytes by canonical name
        users = Counter(n for _l, keys in self.layers for _loc, n, buf in keys if not buf)

        def counted(i: int, layer: nn.Module, sub: dict[str, torch.Tensor], x: Any) -> Any:
            own = storages(sub)
            if i in self.swap:  # the swap counts what it parks the same way
                before = self.swapper.bytes
                with self.swapper.layer(own):
                    y = self.call(i, sub, x)
                saved.append(self.swapper.bytes - before)
                saved_in.append(0)  # parked on the host: the device holds none of them
                saved_out.append(0)
            else:
                counter = SavedBytes(own)
                with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
                    y = self.call(i, sub, x)
                saved.append(counter.bytes)
                ends = saved_ends(counter.seen, x, y)
                saved_in.append(ends[0])
                saved_out.append(ends[1])
            inputs.append(nbytes(x))
            own = [(loc, n) for loc, n, buf in self.layers[i][1] if not buf]
            params.append(sum(nbytes(sub[loc]) for loc, n in own if users[n] == 1))
            tied.update((n, nbytes(sub[loc])) for loc, n in own if users[n] > 1)
            if self.first + i == 0:  # the model's input takes no gradient
                grad_in = 0
            elif isinstance(x, torch.Tensor):
                grad_in = nbytes(x) if x.is_floating_point() else 0
            else:  # a carry: its floating tensors take one each
                grad_in = float_bytes(x)
            work.append(nbytes(y) + grad_in)
            return y

        runs = dict(recompute_runs(self.recompute))
        j = 0
        while j < len(self.layers):
            end = runs.get(j)
            if end is not None and torch.is_grad_enabled():
                subs = [
                    (i, keys, {local: state[name] for local, name, _ in keys})
                    for i, (_layer, keys) in enumerate(self.layers[j:end], start=j)
                ]
                if measure:  # a throwaway pass; the checkpoint reseeds the same masks
                    y = x
                    for i, keys, sub in subs:
                        y = counted(i, self.layers[i][0], _buffer_copies(keys, sub), y)
                    del y
                x = checkpoint(
                    self._rerunnable(subs, p), x, use_reentrant=False, preserve_rng_state=False
                )
                j = end
                continue
            layer, keys = self.layers[j]
            sub = {local: state[name] for local, name, _ in keys}
            if measure:
                x = counted(j, layer, sub, x)
            elif j in self.swap and torch.is_grad_enabled():
                with self.swapper.layer(storages(sub)):
                    x = self.call(j, sub, x)
            else:
                x = self.call(j, sub, x)
            j += 1
        output = nbytes(x) if measure else 0
        return x, LayerBytes(
            saved, inputs, work, saved_in, saved_out, output, params, sum(tied.values())
        )

    def call(self, i: int, sub: Mapping[str, torch.Tensor], x: Any) -> Any:
        """Layer ``i`` of the stage on ``x`` with the tensors of ``sub`` (its local names) in
        its parameter and buffer slots: what :func:`torch.func.functional_call` does, without
        its per-call set-up and restore. The slots keep these tensors until the next call
        (only this stage's compute thread runs its layers, and every call sets all of them).
        """
        for table, attr, local in self.slots[i]:
            table[attr] = sub[local]
        if self.late.packing:  # a forward (or a recomputed run's rerun) bound late
            with self.late.layer({name: sub[local] for local, name in self.weight_keys[i]}):
                return self.layers[i][0](x)
        return self.layers[i][0](x)

    def _rerunnable(
        self,
        subs: list[tuple[int, list[Key], dict[str, torch.Tensor]]],
        p: int,
    ) -> Any:
        """A run of layers' forward for :func:`checkpoint`: the first call is the real
        forward; the rerun in the backward reseeds for minibatch ``p`` (same dropout masks)
        and updates copies of the buffers, so batch-norm statistics move once per minibatch."""
        calls = 0

        def run(x: Any) -> Any:
            nonlocal calls
            calls += 1
            if calls > 1:
                self.seeds.p = p
            for i, keys, sub in subs:
                x = self.call(i, _buffer_copies(keys, sub) if calls > 1 else sub, x)
            return x

        return run


def layer_states(module: nn.Module, layout: StateLayout) -> list[tuple[nn.Module, list[Key]]]:
    """Each layer with the names it takes from the stage's state: ``(name in the layer,
    global name, whether it is a buffer)``. Tied names map to their canonical tensor."""
    aliases = dict(layout.aliases)
    canonical = [*layout.params, *layout.buffers, *layout.local]
    buffers = {*layout.buffers, *layout.local}
    out = []
    for child, layer in module.named_children():
        prefix = child + "."
        keys = [(n[len(prefix) :], n, n in buffers) for n in canonical if n.startswith(prefix)]
        keys += [
            (a[len(prefix) :], c, c in buffers) for a, c in aliases.items() if a.startswith(prefix)
        ]
        out.append((layer, keys))
    return out


def _slots(layer: nn.Module, keys: list[Key]) -> list[tuple[dict[str, Any], str, str]]:
    """Where each of a layer's state tensors goes: ``(the owning module's parameter or buffer
    table, attribute, local name)`` for every local name of ``keys``."""
    out = []
    for local, _name, is_buffer in keys:
        path, _, attr = local.rpartition(".")
        owner = layer.get_submodule(path) if path else layer
        table = owner._buffers if is_buffer else owner._parameters
        if attr not in table:
            raise ValueError(
                f"{local!r} is not a {'buffer' if is_buffer else 'parameter'} "
                f"of {type(layer).__name__}"
            )
        out.append((table, attr, local))
    return out


def _buffer_copies(keys: list[Key], sub: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A layer's state with copies of its buffers: a pass that must not move batch-norm
    statistics (a measurement, a recompute) updates the copies."""
    return {local: sub[local].clone() if is_buffer else sub[local] for local, _, is_buffer in keys}
