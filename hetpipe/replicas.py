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

from collections.abc import Mapping, Sequence

import torch

# the row split and the group check are pure (hetpipe.core.replicas); re-exported here
from hetpipe.core.replicas import check_group, pieces_for, split_rows

__all__ = ["check_group", "combine", "gather", "piece", "pieces_for", "split_rows"]


def piece(t: torch.Tensor, mine: tuple[int, int], lo: int, hi: int) -> torch.Tensor:
    """Rows ``[lo, hi)`` of ``t``, which holds rows ``mine``. A tensor without those rows
    (an empty "no gradient" marker, a tensor of a carry that is not row-major) goes whole;
    :func:`gather` puts each back by its name (each tensor of a carry is pieced alone)."""
    if t.dim() == 0 or t.shape[0] != mine[1] - mine[0]:
        return t
    return t[lo - mine[0] : hi - mine[0]]


def gather(
    pieces: Mapping[int, torch.Tensor],
    ends: Mapping[int, int] | None = None,
    *,
    add: bool = False,
) -> torch.Tensor:
    """One tensor of pieces keyed by their first row (a single piece is returned as is; empty
    markers stay one marker).

    ``ends``: each piece's end row by its first. Where no piece has its rows (a tensor of a
    carry that is not row-major, which :func:`piece` sends whole: position ids of one
    sequence, a mask), the pieces are one whole tensor: the first of them, or with ``add``
    their sum (the replicas' gradients of a tensor each of them used whole)."""
    parts = [pieces[lo] for lo in sorted(pieces)]
    if len(parts) == 1 or all(p.numel() == 0 for p in parts):
        return parts[0]
    if ends is not None and not any(
        t.dim() and t.shape[0] == ends[lo] - lo for lo, t in sorted(pieces.items())
    ):
        return torch.stack(parts).sum(0) if add else parts[0]
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
