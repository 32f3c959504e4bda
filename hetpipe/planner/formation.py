"""Virtual-worker formation: which devices train together as one pipeline.

The policies (after the HetPipe paper's):

* **NP** ("node partition"): one VW per node. Links inside a VW are all fast intra-node
  links, but VWs are as unequal as the nodes.
* **ED** ("equal distribution"): every VW gets an equal share of every device type, so VWs
  are alike and WSP never holds a fast VW back for a slow one. The number of VWs is the gcd
  of the type counts unless asked; devices that do not divide evenly are left out.
* **HD** ("hybrid distribution"), two forms:

  - the paper's (:func:`paper_hd_formation`, label ``hd-paper``): nodes are paired, the node
    with the most device memory with the one with the least, the second most with the second
    least, and so on; each pair of g-device nodes forms two VWs, each taking half of either
    node's devices. Every VW then has devices of two nodes (two types on a cluster of one type
    per node), so a memory-poor "whimpy" GPU shares its VW with larger ones, and there are as
    many VWs of g devices as under NP. On the paper's 4 x 4 testbed (TITAN V 12 GB, TITAN RTX
    24 GB, RTX 2060 6 GB, Quadro P4000 8 GB) that is two VWs of 2 TITAN RTX + 2 RTX 2060 and
    two of 2 TITAN V + 2 Quadro P4000.
  - a search by power (:func:`hd_formation`): VWs balanced by total compute power, mixing
    fast and slow types: devices go, most powerful first, to the VW with the least power so
    far (preferring a VW already on the device's node, to keep links local).
* **auto**: the candidates of all of them for several VW counts, each evaluated by the
  caller (split, order and simulation), keeping the best; see :func:`best_formation`, whose
  ``trace`` records every candidate's figure (or why it was skipped) for ``hetpipe plan
  --explain``.

Within a formation the device order of a VW is not decided here (:mod:`.order` does that).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import reduce
from typing import Any, TypeVar

__all__ = [
    "POLICIES",
    "Formation",
    "best_formation",
    "candidate_formations",
    "ed_formation",
    "hd_formation",
    "np_formation",
    "paper_hd_formation",
]

POLICIES = ("auto", "np", "ed", "hd")
T = TypeVar("T")


@dataclass(frozen=True)
class Formation:
    """Devices grouped into VWs, and the devices left out with the reason."""

    policy: str
    groups: tuple[tuple[Any, ...], ...]
    unused: tuple[tuple[str, str], ...] = ()  # (device name, why)
    label: str = ""  # the candidate's name where the policy has several forms ("hd-paper")

    @property
    def name(self) -> str:
        """The candidate's name: its label, else its policy."""
        return self.label or self.policy

    def signature(self) -> frozenset[frozenset[str]]:
        """Groupings equal up to the order of VWs and of devices inside them."""
        return frozenset(frozenset(d.name for d in g) for g in self.groups)

    def describe(self) -> str:
        return " | ".join(",".join(d.name for d in g) for g in self.groups)


def np_formation(devices: Sequence[Any]) -> Formation:
    """One VW per node, nodes in order of first appearance."""
    groups: dict[str, list[Any]] = {}
    for d in devices:
        groups.setdefault(d.node, []).append(d)
    return Formation("np", tuple(tuple(g) for g in groups.values()))


def ed_formation(devices: Sequence[Any], num_vws: int | None = None) -> Formation:
    """Each VW gets ``count // num_vws`` devices of every type (default: gcd of the counts).

    Devices of one type are dealt in file order in contiguous chunks, so a VW takes devices
    of the same node where it can. The remainder of a type that does not divide evenly is
    left unused, named with the reason.
    """
    by_type: dict[str, list[Any]] = {}
    for d in devices:
        by_type.setdefault(d.type, []).append(d)
    if not by_type:
        return Formation("ed", ())
    n = num_vws if num_vws is not None else reduce(math.gcd, (len(v) for v in by_type.values()))
    if n < 1:
        raise ValueError(f"number of VWs must be >= 1, got {n}")
    groups: list[list[Any]] = [[] for _ in range(n)]
    unused: list[tuple[str, str]] = []
    for t, devs in by_type.items():
        share = len(devs) // n
        for v in range(n):
            groups[v].extend(devs[v * share : (v + 1) * share])
        for d in devs[n * share :]:
            why = (
                f"ED: {len(devs)} device(s) of type {t} do not split evenly into {n} VWs"
                if share
                else f"ED: fewer devices of type {t} ({len(devs)}) than VWs ({n})"
            )
            unused.append((d.name, why))
    return Formation("ed", tuple(tuple(g) for g in groups if g), tuple(unused))


def hd_formation(
    devices: Sequence[Any], num_vws: int, power: Callable[[Any], float] | None = None
) -> Formation:
    """``num_vws`` VWs of near-equal total ``power`` (default: the device's ``speed``).

    Greedy longest-processing-time: devices by decreasing power, each to the VW with the
    least power so far; ties go to a VW on the device's node, then to the smaller VW.
    """
    if num_vws < 1:
        raise ValueError(f"number of VWs must be >= 1, got {num_vws}")
    pw = power or (lambda d: float(d.speed))
    n = min(num_vws, len(devices))
    groups: list[list[Any]] = [[] for _ in range(n)]
    total = [0.0] * n
    order = sorted(range(len(devices)), key=lambda i: (-pw(devices[i]), i))
    for i in order:
        d = devices[i]

        def key(v: int, d: Any = d) -> tuple[float, int, int, int]:
            local = any(x.node == d.node for x in groups[v])
            return (round(total[v], 12), 0 if local else 1, len(groups[v]), v)

        v = min(range(n), key=key)
        groups[v].append(d)
        total[v] += pw(d)
    return Formation("hd", tuple(tuple(g) for g in groups if g))


def paper_hd_formation(devices: Sequence[Any]) -> Formation | None:
    """The HetPipe paper's hybrid distribution (see the module docs), or None where the
    cluster does not have its shape: every node with the same even number of devices.

    Nodes are ranked by their devices' total memory (then total speed, then first
    appearance), and the i-th from the top is paired with the i-th from the bottom; with an
    odd number of nodes the middle one forms one VW by itself. A pair (A, B) forms the VWs
    ``A[:g/2] + B[:g/2]`` and ``A[g/2:] + B[g/2:]`` (devices in file order), the larger
    node's devices first.
    """
    nodes: dict[str, list[Any]] = {}
    for d in devices:
        nodes.setdefault(d.node, []).append(d)
    sizes = {len(v) for v in nodes.values()}
    if len(nodes) < 2 or len(sizes) != 1 or next(iter(sizes)) % 2:
        return None
    half = next(iter(sizes)) // 2
    first = {n: i for i, n in enumerate(nodes)}
    ranked = sorted(
        nodes,
        key=lambda n: (
            -sum(d.memory for d in nodes[n]),
            -sum(float(d.speed) for d in nodes[n]),
            first[n],
        ),
    )
    groups: list[tuple[Any, ...]] = []
    for i in range(len(ranked) // 2):
        big, small = nodes[ranked[i]], nodes[ranked[-1 - i]]
        groups.append(tuple(big[:half] + small[:half]))
        groups.append(tuple(big[half:] + small[half:]))
    if len(ranked) % 2:
        groups.append(tuple(nodes[ranked[len(ranked) // 2]]))
    return Formation("hd", tuple(groups), label="hd-paper")


def candidate_formations(
    devices: Sequence[Any],
    policy: str = "auto",
    num_vws: int | None = None,
    power: Callable[[Any], float] | None = None,
) -> list[Formation]:
    """The formations a policy considers, without duplicates (first policy named wins).

    ``auto`` = NP, ED for every divisor of the gcd of the type counts, the paper's HD
    (where the cluster has its shape, and it has ``num_vws`` VWs when that is given), HD by
    power for 1..n VWs (or only ``num_vws`` VWs when given).
    """
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r} (choose from {', '.join(POLICIES)})")
    n = len(devices)
    if n == 0:
        return []
    if num_vws is not None and not 1 <= num_vws <= n:
        raise ValueError(f"number of VWs must be in 1..{n} (the device count), got {num_vws}")
    out: list[Formation] = []
    if policy in ("auto", "np"):
        f = np_formation(devices)
        if policy == "np" or num_vws is None or len(f.groups) == num_vws:
            out.append(f)
    if policy in ("auto", "ed"):
        if num_vws is not None:
            out.append(ed_formation(devices, num_vws))
        else:
            counts: dict[str, int] = {}
            for d in devices:
                counts[d.type] = counts.get(d.type, 0) + 1
            g = reduce(math.gcd, counts.values())
            divisors = [c for c in range(1, g + 1) if g % c == 0]
            if policy == "ed":
                divisors = [g]
            out.extend(ed_formation(devices, c) for c in divisors)
    if policy in ("auto", "hd"):
        paper = paper_hd_formation(devices)
        if paper is not None and (num_vws is None or len(paper.groups) == num_vws):
            out.append(paper)
        counts_hd = [num_vws] if num_vws is not None else list(range(1, n + 1))
        if policy == "hd" and num_vws is None:
            counts_hd = list(range(1, n + 1))
        out.extend(hd_formation(devices, c, power) for c in counts_hd)
    seen: set[frozenset[frozenset[str]]] = set()
    unique = []
    for f in out:
        sig = f.signature()
        if f.groups and sig not in seen:
            seen.add(sig)
            unique.append(f)
    return unique


def best_formation(
    candidates: Iterable[Formation],
    evaluate: Callable[[Formation], tuple[float, T]],
    upper_bound: Callable[[Formation], float] | None = None,
    trace: list[dict[str, Any]] | None = None,
) -> tuple[Formation, float, T] | None:
    """The candidate with the highest ``evaluate(f)[0]`` (``auto``'s search).

    ``upper_bound(f)`` (optional) must never be below what ``evaluate`` would return;
    candidates are tried in decreasing bound and skipped once their bound cannot beat the
    best so far. Ties keep the earlier candidate, so list the preferred policies first.

    ``trace`` (optional) receives one entry per candidate, in the candidates' order:
    ``name``, ``policy``, ``formation`` (:meth:`Formation.describe`), ``bound``, ``score``
    (None where skipped), ``skipped`` (why, or None) and ``chosen``.
    """
    cands = list(candidates)
    bounds = [upper_bound(f) if upper_bound else math.inf for f in cands]
    order = sorted(range(len(cands)), key=lambda i: (-bounds[i], i))
    best: tuple[int, float, T] | None = None
    scores: dict[int, float] = {}
    skipped: dict[int, float] = {}  # candidate -> the best score when it was skipped
    for i in order:
        if best is not None and bounds[i] <= best[1]:
            skipped[i] = best[1]
            continue
        score, result = evaluate(cands[i])
        scores[i] = score
        if best is None or score > best[1] or (score == best[1] and i < best[0]):
            best = (i, score, result)
    if trace is not None:
        for i, f in enumerate(cands):
            trace.append(
                {
                    "name": f.name,
                    "policy": f.policy,
                    "formation": f.describe(),
                    "bound": _finite(bounds[i]),
                    "score": _finite(scores.get(i)),
                    "skipped": (
                        f"its bound {bounds[i]:.4g} cannot beat {skipped[i]:.4g}"
                        if i in skipped
                        else "no VW of it can hold the model"
                        if scores.get(i) == -math.inf
                        else None
                    ),
                    "chosen": best is not None and i == best[0],
                }
            )
    if best is None:
        return None
    return cands[best[0]], best[1], best[2]


def _finite(x: float | None) -> float | None:
    """``x`` where it is a finite number, else None (a trace travels as JSON)."""
    return x if x is not None and math.isfinite(x) else None
