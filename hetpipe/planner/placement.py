"""Where the parameter server keeps each layer's state, and what reaching it costs on the links.

Two placements, the HetPipe paper's (:data:`PLACEMENTS`, :func:`place_layers`):

* **default**: layer j's state on shard ``j mod S`` of the S shards (by shard index),
  round-robin as TensorFlow's default device setter places variables on PS tasks; it
  ignores where the stages run, so most bytes cross a link.
* **local**: each layer's state on a shard on the host of the stage that runs it
  (:func:`place_stages`, below). Under ED every VW runs stage i on a device of the same node
  (its VWs are alike, so they share one order), so every layer is on its own node for
  every VW that runs it: the paper's ED-local, whose pushes and pulls cross no link.

The runtime places by the job's ``train.placement`` (local unless it says default); the
planner prices both (:func:`shard_flights`'s ``placement``) so that ``hetpipe plan
--explain`` can show what the other would cost or save.

Local placement (:func:`place_stages`): the PS holds one global copy of each layer, but VWs may
cut the model differently, so placement is per *segment* (a maximal run of layers that
every VW keeps inside one stage). A segment goes to a shard on the host of the stages
holding it (the host most of those stages share; where several hosts tie, any of theirs),
balancing bytes among those shards; where no shard shares a host with them, it goes to the
least loaded shard. So under NP, where every VW runs a layer on its own node, the layers are
spread over the nodes' shards rather than piled on the first. With one VW this
is exactly "a stage's parameters go to the shard on its host". The runtime places a job's
real tensors by this same function (:func:`hetpipe.jobplan.place_state`).

Links (:func:`shard_flights`): every wave a stage pushes its update to each shard holding
its state and, with several VWs, pulls the global weights back. Bytes for a shard on the
stage's own host cross no link (their CPU is the runtime's ``wave_byte_s``); bytes for a
shard on another host cross the link from the stage's device to that host, priced by the
planner's one link model (:meth:`~hetpipe.planner.partition.CostModel.link`: a
``[[network.link]]`` override, else the intra/inter node default) between the device and a
device of the shard's host, where the plan has one (a shard shares its host's links); a
shard on a host without such a device is reached over the inter-node default. A stage sends
to its shards one after the other, so its flight is the sum over its remote shards.

Those flights are each stage's as if alone on the link. Where several stages' pushes and
pulls cross one link between two hosts at once (every VW's first stage on host a pushing
to a shard on host b, as under ED with the default placement), they share its capacity:
:func:`shard_routes` names the link each stage's flight takes (the host it mostly goes to),
and the simulator shares the link's capacity among the transfers that name it
(:mod:`hetpipe.planner.simulate`, shared links). :func:`remote_link_times` gives both at
once (per stage, the link seconds to each other host), for a caller that needs both.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

from hetpipe.core.keys import PLACEMENTS
from hetpipe.core.profile import ModelProfile
from hetpipe.planner.partition import CostModel, Partition

__all__ = [
    "PLACEMENTS",
    "compare_placements",
    "default_placement",
    "layer_state_bytes",
    "place_layers",
    "place_plan",
    "place_stages",
    "remote_link_times",
    "shard_flights",
    "shard_routes",
    "shard_shares",
    "stage_shard_bytes",
]

RULES = {
    "local": "each layer on a shard on the host of the stage that runs it",
    "default": "layer j on shard j mod S, round-robin, wherever its stage runs",
}


def layer_state_bytes(profile: ModelProfile) -> list[int]:
    """Bytes each layer keeps on the shards: its parameters and buffers (alike for every
    device type, so any type's profile says it)."""
    any_type = next(iter(profile.layers))
    return [lp.param_bytes + lp.buffer_bytes for lp in profile.layers[any_type]]


def place_stages(
    shards: Sequence[Any],
    vws: Sequence[Sequence[tuple[str, tuple[int, int]]]],
    layer_bytes: Sequence[int],
) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
    """Shard of every layer, and of every stage, from stages given as ``(host, (a, b))``.

    ``shards`` need ``index`` and ``host``. Returns ``(layer_shards, stage_shards)`` where
    ``stage_shards[v][i]`` is the shard holding most of VW v's stage i (see module docs).
    """
    L = len(layer_bytes)
    outside = [ab for v in vws for _, ab in v if not 0 <= ab[0] <= ab[1] <= L]
    if outside:  # a caller's count of layers that misses some: say so, not an IndexError
        a, b = outside[0]
        raise ValueError(f"stage layers {a}..{b - 1} lie outside the {L} layers given")
    if not shards:
        return (0,) * L, tuple((0,) * len(v) for v in vws)
    bounds = sorted({0, L, *(x for v in vws for _, ab in v for x in ab)})
    segments = [(a, b) for a, b in itertools.pairwise(bounds) if a < b]

    def host_of(v: Sequence[tuple[str, tuple[int, int]]], layer: int) -> str | None:
        return next((h for h, (a, b) in v if a <= layer < b), None)

    load = {s.index: 0 for s in shards}
    layer_shards = [0] * L
    seg_bytes = {seg: sum(layer_bytes[seg[0] : seg[1]]) for seg in segments}
    for seg in sorted(segments, key=lambda s: (-seg_bytes[s], s)):
        votes: dict[str, int] = {}
        for v in vws:
            h = host_of(v, seg[0])
            if h is not None:
                votes[h] = votes.get(h, 0) + 1
        pool = list(shards)
        for n in sorted(set(votes.values()), reverse=True):
            local = [s for s in shards if votes.get(s.host) == n]
            if local:  # the shards of the hosts most of the stages share (tied: all of them)
                pool = local
                break
        chosen = min(pool, key=lambda s: (load[s.index], s.index)).index
        load[chosen] += seg_bytes[seg]
        for j in range(*seg):
            layer_shards[j] = chosen
    stage_shards = []
    for v in vws:
        row = []
        for _, (a, b) in v:
            per = _bytes_by_shard(layer_shards, layer_bytes, a, b)
            row.append(min(per, key=lambda s: (-per[s], s)) if per else layer_shards[a])
        stage_shards.append(tuple(row))
    return tuple(layer_shards), tuple(stage_shards)


def default_placement(shards: Sequence[Any], n_layers: int) -> tuple[int, ...]:
    """The paper's default placement: layer j on the ``j mod S``-th of the shards in index
    order (shard 0 for every layer where there are none)."""
    order = sorted(s.index for s in shards)
    if not order:
        return (0,) * n_layers
    return tuple(order[j % len(order)] for j in range(n_layers))


def place_layers(
    placement: str,
    shards: Sequence[Any],
    vws: Sequence[Sequence[tuple[str, tuple[int, int]]]],
    layer_bytes: Sequence[int],
) -> tuple[int, ...]:
    """The shard of every layer under ``placement`` ("local": :func:`place_stages`;
    "default": :func:`default_placement`), stages given as for :func:`place_stages`."""
    if placement == "local":
        return place_stages(shards, vws, layer_bytes)[0]
    if placement == "default":
        return default_placement(shards, len(layer_bytes))
    raise ValueError(f"unknown placement {placement!r} (choose from {', '.join(PLACEMENTS)})")


def compare_placements(
    figure: Callable[[str], float], chosen: str = "local"
) -> list[dict[str, Any]]:
    """Each placement with its predicted samples/s (``figure(placement)``), for ``hetpipe
    plan --explain``; ``chosen``: the job's (``train.placement``), the one the runtime uses."""
    return [
        {"name": pl, "score": figure(pl), "rule": RULES[pl], "chosen": pl == chosen}
        for pl in PLACEMENTS
    ]


def place_plan(
    cluster: Any,
    profile: ModelProfile,
    vws: Sequence[Sequence[tuple[Any, tuple[int, int]]]],
    placement: str = "local",
) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
    """The shard of every layer and of every stage (the one holding most of its bytes) for a
    plan: its VWs' stages as ``(device, (a, b))`` on the cluster's shards under
    ``placement``, the model's state bytes from ``profile``."""
    shards = tuple(getattr(cluster, "ps", ()) or ())
    stages = [[(d.host, ab) for d, ab in v] for v in vws]
    layer_bytes = layer_state_bytes(profile)
    if placement == "local":
        return place_stages(shards, stages, layer_bytes)
    layer_shards = place_layers(placement, shards, stages, layer_bytes)

    def most(a: int, b: int) -> int:
        per = _bytes_by_shard(layer_shards, layer_bytes, a, b)
        if not per:
            return layer_shards[a] if a < len(layer_shards) else 0
        return min(per, key=lambda s: (-per[s], s))

    return layer_shards, tuple(tuple(most(a, b) for _, (a, b) in v) for v in stages)


def _bytes_by_shard(
    layer_shards: Sequence[int], layer_bytes: Sequence[int], a: int, b: int
) -> dict[int, int]:
    """State bytes of layers ``[a, b)`` on each shard that holds some of them."""
    per: dict[int, int] = {}
    for j in range(a, b):
        per[layer_shards[j]] = per.get(layer_shards[j], 0) + layer_bytes[j]
    return per


def _host(d: Any) -> str:
    return str(getattr(d, "host", getattr(d, "node", "")))


def shard_flights(
    model: CostModel,
    chosen: Sequence[tuple[Sequence[Any], Partition]],
    shard_hosts: Sequence[str],
    placement: str = "local",
) -> tuple[tuple[float, ...], ...]:
    """Per VW, per stage: the time on the links for the stage's state to reach the shards
    ``placement`` (:func:`place_layers`) gives it on other hosts (see the module docs), which
    is also the time of the global weights' way back in a pull. 0 where every shard of the
    stage shares its host (or there are no shards)."""
    return flights_of(remote_link_times(model, chosen, shard_hosts, placement))


def shard_routes(
    model: CostModel,
    chosen: Sequence[tuple[Sequence[Any], Partition]],
    shard_hosts: Sequence[str],
    placement: str = "local",
) -> tuple[tuple[str, ...], ...]:
    """Per VW, per stage: the host whose shards take most of the stage's link time in
    :func:`shard_flights` (its pushes and pulls share that host's link with others that
    cross it), "" where none is on another host."""
    return routes_of(remote_link_times(model, chosen, shard_hosts, placement))


def flights_of(times: Sequence[Sequence[dict[str, float]]]) -> tuple[tuple[float, ...], ...]:
    """:func:`shard_flights` from :func:`remote_link_times`: each stage's sum."""
    return tuple(tuple(sum(per.values()) for per in row) for row in times)


def routes_of(times: Sequence[Sequence[dict[str, float]]]) -> tuple[tuple[str, ...], ...]:
    """:func:`shard_routes` from :func:`remote_link_times`: each stage's host of most."""
    return tuple(
        tuple(min(per, key=lambda h: (-per[h], h)) if per else "" for per in row) for row in times
    )


def remote_link_times(
    model: CostModel,
    chosen: Sequence[tuple[Sequence[Any], Partition]],
    shard_hosts: Sequence[str],
    placement: str = "local",
    per_shard: Sequence[Sequence[dict[int, int]]] | None = None,
) -> list[list[dict[str, float]]]:
    """Per VW, per stage: link seconds of its state to the shards on each other host (by
    host; see the module docs). ``per_shard``: :func:`stage_shard_bytes`, where made
    already."""
    if per_shard is None:
        per_shard = stage_shard_bytes(model, chosen, shard_hosts, placement)
    near: dict[str, Any] = {}  # host -> a device of the plan on it
    for devs, p in chosen:
        for i, leader in enumerate(devs):
            for d in p.group_of(i, leader):
                near.setdefault(_host(d), d)
    out = []
    for (devs, _), stages in zip(chosen, per_shard, strict=True):
        row = []
        for d, on in zip(devs, stages, strict=True):
            per: dict[str, float] = {}
            for shard, nbytes in on.items():
                host = str(shard_hosts[shard])
                if nbytes and host != _host(d):
                    there = near.get(host) or SimpleNamespace(
                        name=f"ps@{host}", node=f"ps@{host}", host=host, type=""
                    )
                    per[host] = per.get(host, 0.0) + nbytes / model.link(d, there)
            row.append(per)
        out.append(row)
    return out


def shard_shares(
    per_shard: Sequence[Sequence[dict[int, int]]], shards: int
) -> list[list[dict[int, float]]]:
    """Per VW, per stage: the share of its state's bytes on each of the ``shards`` shards,
    from :func:`stage_shard_bytes`; a stage without state spreads evenly. A shard's work
    applying pushes and answering pulls follows these shares, so a placement that piles the
    heavy layers of every VW on one shard makes that shard the busy one."""
    out = []
    for stages in per_shard:
        row = []
        for on in stages:
            total = sum(on.values())
            row.append(
                {j: nbytes / total for j, nbytes in on.items() if nbytes}
                if total
                else {j: 1.0 / shards for j in range(shards)}  # none where no shards
            )
        out.append(row)
    return out


def stage_shard_bytes(
    model: CostModel,
    chosen: Sequence[tuple[Sequence[Any], Partition]],
    shard_hosts: Sequence[str],
    placement: str = "local",
) -> list[list[dict[int, int]]]:
    """Per VW, per stage: its state's bytes on each shard (index in ``shard_hosts``) that
    ``placement`` (:func:`place_layers`) gives some of it; empty where there are no shards."""
    if not shard_hosts:
        return [[{} for _ in devs] for devs, _ in chosen]
    layer_bytes = layer_state_bytes(model.profile)
    shards = [SimpleNamespace(index=j, host=str(h)) for j, h in enumerate(shard_hosts)]
    stage_hosts = [
        [(_host(d), ab) for d, ab in zip(devs, p.cuts, strict=True)] for devs, p in chosen
    ]
    layer_shards = place_layers(placement, shards, stage_hosts, layer_bytes)
    return [
        [_bytes_by_shard(layer_shards, layer_bytes, a, b) for a, b in p.cuts] for _, p in chosen
    ]
