"""Stage replicas, the pure part: how a minibatch's rows are split over a stage's device
group and which pieces pass between neighbours, and which groups can run.

The runtime (:mod:`hetpipe.replicas`: slicing, gathering and summing tensors) and the
planner (:mod:`hetpipe.planner.replicas`: pricing replicated stages) both follow these
rules; see :mod:`hetpipe.replicas` for how replicas train.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hetpipe.config import ClusterConfig, DeviceSpec

__all__ = ["check_group", "pieces_for", "split_rows"]


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
