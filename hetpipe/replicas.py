"""Stage replicas: one stage of a virtual worker run data-parallel on several devices.

A stage's devices may be a group (``devices = ["gpu0", ["gpu1", "gpu2"], "gpu3"]`` in a
job's ``[[vw]]``): the first of the group is the stage's *leader*, the others its replicas.
Each minibatch is split by rows across the group, in proportion to the devices' speeds
(:func:`split_rows`); every neighbour sends each replica exactly the rows it holds and
gathers what comes back by row (:func:`pieces_for`, :func:`gather`), so a stage never knows
whether its neighbours are replicated.

Gradients: a replicated last stage scales its loss by its share of the rows, so every
replica's weight gradient is its rows' part of the whole minibatch's mean-loss gradient
(upstream gradients are slices of the unsplit one already). The full gradient is then the
plain *sum* of the replicas' gradients (:func:`combine`). Every replica sums them in the
same order (replica 0 first), so the replicas take bit-identical steps and hold
bit-identical weights without ever comparing them.

Where the gradients are combined: directly between the replicas, each sending its gradients
to the others on their data ports (one hop, ZeroMQ), not through the parameter server (two
hops and a round trip through a shard that serves every virtual worker). Only the leader
pushes to the shards, writes checkpoints and reports (a replicated last stage's reported
loss is its leader's rows' mean); every replica pulls. With several virtual workers each
replica's pull is answered when it arrives, so two replicas may merge global weights of
slightly different moments, both within WSP's bound; the next pull realigns them.

Batch norm: a replicated stage holding running statistics is refused at submit
(per-replica statistics would drift apart, and no one copy would be the stage's). Dropout
masks are drawn per replica, for its rows' shape: a replicated stage with dropout trains
correctly but not bit-identically to the unsplit stage.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

import torch

from hetpipe.config import ClusterConfig, DeviceSpec

__all__ = ["check_group", "combine", "gather", "piece", "pieces_for", "split_rows"]


def check_group(cluster: ClusterConfig, group: Sequence[DeviceSpec], minibatch: int) -> None:
    """Refuse a stage's device group that cannot run (``ValueError``, one line): more
    replicas than samples in a minibatch, or replicas on different nodes that no
    ``[[network.link]]`` joins (they exchange the stage's whole gradient every minibatch, so
    the link they use must be one the cluster file states, not the inter-node default)."""
    if len(group) < 2:
        return
    split_rows(minibatch, [d.speed for d in group])
    declared = {frozenset((ln.a, ln.b)) for ln in cluster.network.links}
    for a, b in itertools.combinations(group, 2):
        if a.node != b.node and frozenset((a.name, b.name)) not in declared:
            raise ValueError(
                f"{a.name} ({a.node}) and {b.name} ({b.node}) replicate one "
                f"stage on different nodes but no [[network.link]] joins them"
            )


def split_rows(n: int, speeds: Sequence[float]) -> list[int]:
    """Row bounds ``[0, b1, .., n]`` splitting ``n`` rows in proportion to ``speeds``
    (largest remainders; ties to the earlier replica). ``ValueError`` where a replica would
    get no row."""
    if len(speeds) > n:
        raise ValueError(
            f"{len(speeds)} replicas for a minibatch of {n} samples (at least one sample each)"
        )
    total = sum(speeds)
    exact = [n * s / total for s in speeds]
    rows = [int(e) for e in exact]
    for i in sorted(range(len(speeds)), key=lambda i: (rows[i] - exact[i], i))[: n - sum(rows)]:
        rows[i] += 1
    if min(rows) < 1:
        raise ValueError(f"speeds {list(speeds)} leave a replica no sample of {n}")
    bounds = [0]
    for r in rows:
        bounds.append(bounds[-1] + r)
    return bounds


def pieces_for(mine: tuple[int, int], theirs: Sequence[int]) -> list[tuple[int, int, int]]:
    """The pieces between a stage holding rows ``mine`` and a neighbour split by ``theirs``:
    ``(their replica, lo, hi)`` for each replica whose rows overlap ``mine``."""
    out = []
    for j in range(len(theirs) - 1):
        lo, hi = max(mine[0], theirs[j]), min(mine[1], theirs[j + 1])
        if lo < hi:
            out.append((j, lo, hi))
    return out


def piece(t: torch.Tensor, mine: tuple[int, int], lo: int, hi: int) -> torch.Tensor:
    """Rows ``[lo, hi)`` of ``t``, which holds rows ``mine``. A tensor without those rows
    (an empty "no gradient" marker) goes whole."""
    if t.dim() == 0 or t.shape[0] != mine[1] - mine[0]:
        return t
    return t[lo - mine[0] : hi - mine[0]]


def gather(pieces: Mapping[int, torch.Tensor]) -> torch.Tensor:
    """One tensor of pieces keyed by their first row (a single piece is returned as is; empty
    markers stay one marker)."""
    parts = [pieces[lo] for lo in sorted(pieces)]
    if len(parts) == 1 or all(p.numel() == 0 for p in parts):
        return parts[0]
    return torch.cat(parts)


def combine(
    grads: Sequence[Mapping[str, torch.Tensor]], device: torch.device | str
) -> dict[str, torch.Tensor]:
    """The sum of the replicas' gradients, in replica order (the same on every replica, so
    their steps agree bit for bit)."""
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for g in grads:
            for n, t in g.items():
                t = t.to(device)
                out[n] = t.clone() if n not in out else out[n].add_(t)
    return out
