"""Plans the search did not choose: a split the user wrote in the job file, priced so that
predicted and measured figures can be compared (:func:`explicit_plan`), and the stage
replicas the planner would propose for a plan's virtual workers (:func:`replica_proposals`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

from hetpipe.core.layout import VWSpec, bounds_of
from hetpipe.core.profile import ModelProfile
from hetpipe.core.units import format_size
from hetpipe.planner.partition import Infeasible, Partition
from hetpipe.planner.plan import (
    _assemble,
    _at_minibatch,
    _cost_model,
    _predict,
    _shard_hosts,
)
from hetpipe.planner.plans import Plan, PlanError, PlanInputs, check_split
from hetpipe.planner.replicas import (
    Replicated,
    as_partition,
    describe_groups,
    partition_replicated,
)

__all__ = ["explicit_plan", "replica_proposals"]


def explicit_plan(
    cluster: Any,
    profile: ModelProfile,
    vws: Sequence[tuple[Sequence[str], Sequence[int] | None, int | None]],
    inputs: PlanInputs | None = None,
    *,
    groups: Sequence[Sequence[Sequence[str]] | None] = (),
    **options: Any,
) -> Plan:
    """Predicted figures for a user-given split: ``(devices in order, layers per stage or
    None, Nm or None)`` per VW; ``groups[v]`` (where given and not None): VW v's stages'
    devices, leader first, a replicated stage's several (its layers given): priced as the
    planner prices the replicas it chooses (:func:`hetpipe.planner.replicas.as_partition`),
    or as the leaders alone, with a warning, where the runtime would refuse the group.
    ``inputs`` (and ``options`` replacing its fields, or all of them without it) as for
    :func:`make_plan`; the search's ``policy``, ``num_vws``, ``max_replicas`` and
    ``in_flight`` do not apply. Missing layers are split optimally for that order; a missing
    Nm falls back to ``inputs.nm``, else the best for the split (for given layers: the least
    Nm that fills the pipeline). Memory over a cap is a warning here (the runtime refuses
    it), so a user sees every problem at once."""
    inputs = PlanInputs.of(inputs, options)
    minibatch, nm = inputs.minibatch, inputs.nm
    warnings: list[str] = []
    profile = _at_minibatch(profile, minibatch, warnings)
    model = _cost_model(cluster, profile, inputs)
    L = profile.n_layers()
    by_name = {d.name: d for d in cluster.devices}
    # a stage's replicas count where they are priced: given groups with the layers given
    replicated = [
        g if g is not None and any(len(x) > 1 for x in g) and layers is not None else None
        for g, (_, layers, _) in itertools.zip_longest(groups[: len(vws)], vws)
    ]
    specs = [
        VWSpec(
            tuple(names),
            tuple(layers) if layers is not None else None,
            vw_nm,
            tuple(tuple(x[1:]) for x in g) if g is not None else None,
        )
        for (names, layers, vw_nm), g in zip(vws, replicated, strict=True)
    ]
    check_split(specs, by_name, L)
    used = {n for spec in specs for n in spec.all_devices()}
    chosen: list[tuple[tuple[Any, ...], Partition]] = []
    for v, (names, layers, vw_nm) in enumerate(vws):
        devs = tuple(by_name[n] for n in names)
        missing = sorted({d.type for d in devs} - set(profile.layers))
        if missing:
            raise PlanError(f"vw {v}: no profile for device type(s) {', '.join(missing)}")
        want = vw_nm if vw_nm is not None else nm
        if layers is None:
            p = model.best_nm(devs) if want is None else model.partition(devs, want)
            if not isinstance(p, Partition):
                raise PlanError(f"vw {v}: {p.reason}")
        else:
            if len(layers) != len(devs):
                raise PlanError(
                    f"vw[{v}].layers: {len(layers)} layer counts for {len(devs)} devices"
                )
            cuts = bounds_of(layers)
            if want is None:  # the least Nm that fills this split's pipeline
                p1 = model.describe(devs, cuts, 1)
                fill = math.ceil(p1.latency / p1.bottleneck * (1 - 1e-12)) if p1.bottleneck else 1
                want = min(len(devs), max(1, fill))
            p = model.describe(devs, cuts, want)
        for d, mem in zip(devs, p.memory, strict=True):
            if mem.total > d.memory:
                warnings.append(
                    f"vw {v}: {d.name} needs {format_size(mem.total)}, over its cap "
                    f"{format_size(d.memory)}"
                )
        given = replicated[v]
        if given is not None:
            group_devs = [[by_name[n] for n in g] for g in given]
            r = describe_groups(model, group_devs, p.cuts, p.nm, minibatch)
            if math.isfinite(r.bottleneck):
                devs, p = as_partition(
                    model, [d for g in group_devs for d in g], r, p.nm, minibatch
                )
            else:
                warnings.append(
                    f"vw {v}: a replicated stage does not fit its devices or "
                    "may not run on them (batch norm, rows, nodes): predicted "
                    "as its leaders alone"
                )
        chosen.append((devs, p))
    if not chosen:
        raise PlanError("no virtual workers given")
    pred = _predict(model, chosen, inputs, _shard_hosts(cluster))
    unused = [(d.name, "not in the explicit split") for d in cluster.devices if d.name not in used]
    return _assemble(
        cluster,
        model,
        chosen,
        pred,
        "explicit",
        unused,
        warnings,
        inputs,
        {},
    )


def replica_proposals(
    cluster: Any,
    profile: ModelProfile,
    plan: Plan,
    orders: Sequence[Sequence[str]],
    inputs: PlanInputs | None = None,
    *,
    given: Sequence[tuple[Sequence[Sequence[str]], Sequence[int]] | None] = (),
    **options: Any,
) -> list[dict[str, Any]]:
    """Per virtual worker of ``plan`` (its devices in ``orders[v]``, replicas included): the
    best grouping of its order into replicated stages (at most ``max_replicas`` devices
    each), and a split given with groups (``given[v]``: groups, layers) priced the same way,
    each beside the same order without replicas (:mod:`hetpipe.planner.replicas`).
    ``inputs`` and ``options`` as for :func:`make_plan`; the minibatch and staleness are the
    plan's."""
    inputs = PlanInputs.of(
        inputs, {"minibatch": plan.minibatch, "staleness": plan.staleness, **options}
    )
    max_replicas = inputs.max_replicas
    profile = _at_minibatch(profile, plan.minibatch, [])
    model = _cost_model(cluster, profile, inputs)
    by_name = {d.name: d for d in cluster.devices}
    out: list[dict[str, Any]] = []
    for v, (vw, order) in enumerate(zip(plan.vws, orders, strict=True)):
        devs = [by_name[n] for n in order]
        alone = partition_replicated(model, devs, vw.nm, plan.minibatch, 1)
        base = alone.bottleneck if isinstance(alone, Replicated) else math.inf
        found: list[tuple[str, Replicated | Infeasible]] = []
        if v < len(given) and given[v] is not None:
            groups, layers = given[v]  # type: ignore[misc]
            bounds = list(itertools.accumulate(layers, initial=0))
            found.append(
                (
                    "as given",
                    describe_groups(
                        model,
                        [[by_name[n] for n in g] for g in groups],
                        list(itertools.pairwise(bounds)),
                        vw.nm,
                        plan.minibatch,
                    ),
                )
            )
        if max_replicas > 1:
            found.append(
                (
                    f"best with train.max_replicas = {max_replicas}",
                    partition_replicated(model, devs, vw.nm, plan.minibatch, max_replicas),
                )
            )
        for what, r in found:
            if isinstance(r, Replicated):
                out.append(
                    {
                        "vw": v,
                        "what": what,
                        "groups": [list(g) for g in r.groups],
                        "layers": list(r.layers),
                        "bottleneck": r.bottleneck,
                        "exchange_s": list(r.exchange_s),
                        "unreplicated": base,
                    }
                )
    return out
