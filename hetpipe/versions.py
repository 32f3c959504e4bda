"""A stage's weight versions: the current one, its out-of-place updates, and each wave's
accumulated update for the parameter server.

Weight stashing by out-of-place updates: the weights are a dict of leaf tensors, one dict per
*version*. A forward keeps a reference to the dict it ran on (:class:`hetpipe.stage.StageCompute`
keeps it with the minibatch) and :meth:`WeightVersions.update` builds a new dict of new
tensors, so an old version lives exactly as long as an in-flight minibatch needs it and the
backward differentiates exactly the weights its forward used.

Every local change of the stage's state (optimizer steps, batch-norm statistics) is also
added to the accumulator of its wave (:meth:`WeightVersions.accumulate`): what the stage
pushes to the parameter server (:meth:`WeightVersions.push_deltas`), and re-adds on top of
pulled global weights (:meth:`WeightVersions.load`) until the server confirms it applied it.
This is its own class so that the compute (:mod:`hetpipe.stage`), the checkpoint state
(:mod:`hetpipe.stagestate`) and the memory count (:mod:`hetpipe.stagememory`) read one
owner of the weights.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from hetpipe.core.wsp import covers, unincluded_waves
from hetpipe.cudaipc import Shared, open_shared
from hetpipe.hostcopy import HostCopier, HostCopy
from hetpipe.modelstate import StateLayout
from hetpipe.optim import StageOptimizer

__all__: list[str] = []


def to_device(t: torch.Tensor | Shared, dev: str, copy: bool = False) -> torch.Tensor:
    """A received tensor on device ``dev``. A host tensor goes to a GPU through pinned
    memory (a copy from pageable memory would wait for the work queued on the device); one
    shared by a GPU of this host is opened in place (hetpipe.cudaipc)."""
    if isinstance(t, Shared):
        return open_shared(t, dev)
    if dev.startswith("cuda") and t.device.type == "cpu":
        return t.pin_memory().to(dev, non_blocking=True)
    return t.to(dev, copy=copy)


class WeightVersions:
    """The stage's current weights, buffers and non-persistent buffers, its optimizer, and
    the update accumulated per wave since the parameter server last confirmed it."""

    def __init__(
        self,
        layout: StateLayout,
        optimizer: StageOptimizer,
        local: dict[str, torch.Tensor],
        dev: str,
        copier: HostCopier,
        *,
        num_vws: int,
        sync: bool,
        copies: frozenset[str] = frozenset(),
    ) -> None:
        """``local``: the non-persistent buffers, on ``dev`` already; ``copier`` takes a
        wave's update to the host; ``num_vws`` virtual workers share the global weights, in
        a synchronous schedule (``sync``) or not; ``copies``: the ties spanning stages this
        stage holds but another owns (:mod:`hetpipe.modelstate`)."""
        self.layout = layout
        self.param_names = list(layout.params)
        self.buffer_names = list(layout.buffers)
        self.params: dict[str, torch.Tensor] = {}
        self.buffers: dict[str, torch.Tensor] = {}
        # non-persistent buffers: the stage's own, never pushed, pulled or exported
        self.local = local
        self.version = 0  # bumped by every update and every merge
        self.steps_taken = 0  # optimizer steps of this stage
        self.optimizer = optimizer
        self.acc: dict[int, dict[str, torch.Tensor]] = {}  # wave -> its update so far
        self.dev = dev
        self.copier = copier
        self.num_vws = num_vws
        self.sync = sync
        self.copies = copies

    def update(self, grads: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
        """Local update out of place: a new version of the weights, the old one untouched.
        Returns the update (new minus old, per name) for the caller to :meth:`accumulate`,
        or None where there were no gradients (no step)."""
        if not grads:
            return None
        updated = self.optimizer.step(self.params, grads)
        names = list(updated)
        with torch.no_grad():
            new = [updated[n] for n in names]
            deltas = torch._foreach_sub(new, [self.params[n] for n in names])
        self.params = {
            **self.params,
            **{n: w.requires_grad_() for n, w in zip(names, new, strict=True)},
        }
        self.version += 1
        self.steps_taken += 1
        return dict(zip(names, deltas, strict=True))

    def accumulate(self, wave: int, deltas: Mapping[str, torch.Tensor]) -> None:
        """Add ``deltas`` to the update of ``wave`` (one fused add for the names it has)."""
        acc = self.acc.setdefault(wave, {})
        with torch.no_grad():
            have = [n for n in deltas if n in acc]
            if have:
                torch._foreach_add_([acc[n] for n in have], [deltas[n] for n in have])
            for n, d in deltas.items():
                if n not in acc:
                    acc[n] = d.detach()  # a fresh tensor: it becomes the accumulator

    def buffer_deltas(self, before: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A forward's change of the buffers (from ``before``), as it goes to the parameter
        server.

        Running statistics (batch norm) are averages, not sums: every virtual worker moves
        them towards its own batches, so their updates are averaged over the virtual workers.
        Summed, n workers would take n steps towards the batch statistics at once and
        overshoot (a running variance gone negative). Counters stay summed.
        """
        n = self.num_vws
        with torch.no_grad():
            return {
                name: (self.buffers[name] - b) / n
                if b.is_floating_point() and n > 1
                else self.buffers[name] - b
                for name, b in before.items()
            }

    def push_deltas(self, wave: int, keep: bool = True) -> HostCopy:
        """The stage's update of ``wave``, on its way to host memory (:mod:`hetpipe.hostcopy`:
        on a GPU the copy runs on a side stream while the next minibatch computes).

        In the synchronous schedules a tie's copy (:attr:`copies`) is left out: the owner
        pushes the step every copy took. With ``keep`` it stays until a pull shows the shard
        applied it (a pull answered before then lacks it and it must be re-added); without,
        it is released at once, for a stage that never pulls again.
        """
        acc = self.acc.get(wave, {}) if keep else self.acc.pop(wave, {})
        if self.sync and self.copies:
            # a synchronous step of a tie is the same on every copy (its gradient summed over
            # them first): the owner's push carries it, once
            acc = {k: t for k, t in acc.items() if k not in self.copies}
        if self.sync and self.num_vws > 1:
            # every virtual worker took the same step: each contributes its share of it
            n = self.num_vws
            with torch.no_grad():
                acc = {k: t / n if t.is_floating_point() else t for k, t in acc.items()}
        return self.copier.to_host(acc)

    def carry(self, wave: int) -> None:
        """Move the update of ``wave`` into the next wave's, unpushed (a virtual worker alone
        in its job, between the pushes that carry its updates)."""
        acc = self.acc.pop(wave, None)
        if acc:
            self.accumulate(wave + 1, acc)

    def load(
        self, pulled: Mapping[str, torch.Tensor], applied: Mapping[str, list[list[int]]]
    ) -> None:
        """Set local state to pulled global state plus own updates the shard had not applied.

        ``applied`` maps each pulled global name to the waves of this stage the answering shard
        had applied, as ``[first, end)`` runs (:func:`hetpipe.core.wsp.wave_ranges`: a long job's
        answer stays one run, not a list of every wave); accumulators confirmed for every
        name are dropped.
        """
        params = dict(self.params)
        with torch.no_grad():
            for n, value in pulled.items():
                t = to_device(value, self.dev, copy=True)
                for w in unincluded_waves(
                    (w for w, acc in self.acc.items() if n in acc), applied[n]
                ):
                    t.add_(self.acc[w][n])
                if n in self.buffer_names:
                    self.buffers[n] = t
                else:  # a frozen parameter never gets a gradient, so never an update
                    params[n] = t.requires_grad_(n not in self.layout.frozen)
            for w in list(self.acc):
                acc = self.acc[w]
                for n in [n for n in acc if n in pulled and covers(applied[n], w)]:
                    del acc[n]
                if not acc:
                    del self.acc[w]
        self.params = params
        self.version += 1

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Current local state (for tests and debugging)."""
        return {**{n: t.detach() for n, t in self.params.items()}, **self.buffers}


def fingerprint(params: Mapping[str, torch.Tensor]) -> float:
    """A cheap digest of a weight version: a few elements of its first and last tensors.

    Every update changes every parameter that has a gradient, so these few values tell
    versions apart; reading them at backward time observes the weights actually used.
    """
    if not params:
        return 0.0
    tensors = list(params.values())
    with torch.no_grad():
        return float(
            tensors[0].reshape(-1)[:8].double().sum() + tensors[-1].reshape(-1)[:8].double().sum()
        )
