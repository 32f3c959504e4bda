"""The planner's staleness penalty: what a deep asynchronous pipeline's rate is worth.

Under the async schedule a virtual worker with Nm minibatches in flight computes each
minibatch on weights that miss up to Nm - 1 of its own latest updates (stage 0's forward;
see :mod:`hetpipe.core.staleness`). More Nm fills a deeper pipeline and raises the predicted
rate, but a stale update is worth less than a fresh one, and past some depth it is worth
almost nothing: the project's staleness benchmark (``scripts/bench_staleness.py``; the
H200 report in ``benchmarks/bench_staleness_h200_2026-11.md``) trains the builtin ``gpt``
at k = 4 and k = 8 with Nm = k. At k = 4 every weights mode learns like the synchronous
schedule; at k = 8 ``stash`` falls to chance, the paper's ``predict`` loses much of the
way, and ``predict`` with ``predict_variant = "consistent"`` stays close to synchronous.

So the planner does not compare plans by samples per second alone (which would buy
throughput with accuracy silently). It compares them by the **effective rate**: each
virtual worker's predicted samples/s times :func:`factor` of its Nm and the job's weights
mode,

    factor(Nm, mode) = 1                                  where Nm <= SHALLOW_NM
                     = (SHALLOW_NM / Nm) ** EXPONENT[mode] beyond,

a stale update counted as that share of a fresh one. ``SHALLOW_NM`` is the deepest Nm the
benchmark found harmless for every mode; the exponents order the modes as it did: ``stash``
and ``latest`` lose fastest (2: Nm = 8 counts a quarter), the paper's ``predict`` slower (1:
a half), the consistent prediction not at all (0) within the depths measured. The rule is a
stated prior, not a fit: it only has to rank a deep stale pipeline below a shallower one (or
a synchronous schedule) of nearly the same speed, and never to rank a shallow one lower.

Where it acts (:mod:`hetpipe.planner.plan`, :func:`choose_schedule`):

- each virtual worker's Nm is the one with the best effective rate for its order
  (:func:`best_effective_nm`), and never above the job's ``train.max_nm``;
- raising the Nm of faster VWs to balance WSP's waves, and the comparison of formations,
  use the effective rate (:func:`effective_rate`);
- ``train.schedule = "auto"`` compares the async plan's effective rate with the
  synchronous plan's samples/s (synchronous updates are never stale);
- a plan with a deep pipeline (:func:`is_deep`) carries a warning (:func:`deep_warnings`).

WSP's staleness bound D is the job's (``train.staleness``), not the planner's choice: the
rule prices the pipeline's own staleness (Nm), which the planner picks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from hetpipe.planner.partition import CostModel, Partition

__all__ = [
    "EXPONENT",
    "SHALLOW_NM",
    "best_effective_nm",
    "choose_schedule",
    "deep_warnings",
    "effective_rate",
    "factor",
    "is_deep",
    "summary",
]

# the deepest Nm at which the staleness benchmark found every weights mode learning like
# the synchronous schedule; beyond it an update's worth falls with the mode's exponent
SHALLOW_NM = 4

# how fast an update's worth falls beyond SHALLOW_NM, by weights mode
# (hetpipe.core.memory.weights_mode's names): the order the benchmark measured them in
EXPONENT: dict[str, float] = {
    "stash": 2.0,
    "latest": 2.0,
    "predict": 1.0,
    "predict-consistent": 0.0,
}


def factor(nm: int, weights: str = "stash") -> float:
    """The share of a fresh update that an update of a VW with ``nm`` minibatches in flight
    is worth under weights mode ``weights`` (the module's rule): 1 up to
    :data:`SHALLOW_NM`, then ``(SHALLOW_NM / nm) ** EXPONENT[weights]``."""
    if nm <= SHALLOW_NM:
        return 1.0
    return (SHALLOW_NM / nm) ** EXPONENT.get(weights, EXPONENT["stash"])


def is_deep(nm: int, weights: str = "stash") -> bool:
    """Whether a VW of ``nm`` in flight is deep enough for its staleness to be priced (Nm
    above :data:`SHALLOW_NM`), whatever its mode makes of it."""
    return nm > SHALLOW_NM


def effective_rate(rates: Sequence[float], nms: Sequence[int], weights: str) -> float:
    """The sum of the VWs' ``rates`` each weighted by :func:`factor` of its Nm: what the
    planner maximises."""
    return sum(r * factor(n, weights) for r, n in zip(rates, nms, strict=True))


def best_effective_nm(
    model: CostModel, order: Sequence[Any], p: Partition, weights: str, cap: int | None = None
) -> Partition:
    """The split of ``order`` with the best effective rate (:func:`factor` times
    ``minibatches_per_s``) over Nm 1..``p.nm`` (``p``: the best raw rate's split, whose Nm
    already obeys the job's cap; ``cap`` lowers it further). Exact for this order: up to
    :data:`SHALLOW_NM` (no penalty) the best split and Nm together
    (:meth:`CostModel.best_nm`), then each deeper Nm's best split
    (:meth:`CostModel.best_rate`) while ``p``'s rate, the most any Nm reaches, at that
    Nm's factor could still beat the best so far. Among equal effective rates the smaller
    Nm. Where ``p`` is not deep, or the mode is not penalised, ``p`` itself."""
    top = p.nm if cap is None else min(p.nm, cap)
    if top == p.nm and factor(p.nm, weights) == 1.0:
        return p
    shallow = model.best_nm(order, range(1, min(top, SHALLOW_NM) + 1))
    best, best_score = p, -math.inf
    if isinstance(shallow, Partition):
        best, best_score = shallow, shallow.minibatches_per_s
    ceiling = p.minibatches_per_s
    for n in range(SHALLOW_NM + 1, top + 1):
        f = factor(n, weights)
        if ceiling * f <= best_score * (1 + 1e-12):
            break  # deeper Nm only lowers the factor
        q = p if n == p.nm else model.best_rate(order, n, best_score / f)
        if not isinstance(q, Partition):
            break  # more Nm only needs more memory
        s = q.minibatches_per_s * f
        if s > best_score * (1 + 1e-12):
            best, best_score = q, s
    return best


def summary(rates: Sequence[float], nms: Sequence[int], weights: str) -> dict[str, Any]:
    """What a plan records of the rule (``details["staleness"]``): per VW its Nm, factor and
    effective samples/s, the total, and the rule in words."""
    factors = [factor(n, weights) for n in nms]
    return {
        "weights": weights,
        "shallow_nm": SHALLOW_NM,
        "exponent": EXPONENT.get(weights, EXPONENT["stash"]),
        "factors": factors,
        "effective_samples_per_s": effective_rate(rates, nms, weights),
        "rule": (
            f"an update of a VW with Nm > {SHALLOW_NM} in flight counts "
            f"({SHALLOW_NM}/Nm)^{EXPONENT.get(weights, EXPONENT['stash']):g} of a fresh one "
            f"under weights {weights!r}"
        ),
    }


def deep_warnings(nms: Sequence[int], weights: str) -> list[str]:
    """One warning per deep asynchronous VW (:func:`is_deep`): its staleness, what the rule
    credited it, and what would train fresher."""
    out = []
    for v, n in enumerate(nms):
        if not is_deep(n, weights):
            continue
        f = factor(n, weights)
        remedy = (
            "the consistent prediction holds up best at this depth; compare with a short "
            "synchronous run"
            if weights == "predict-consistent"
            else 'consider train.weights = "predict" with predict_variant = "consistent", '
            'a synchronous schedule (train.schedule = "1f1b" or "auto"), or train.max_nm'
        )
        out.append(
            f"vw {v}: deep asynchronous pipeline (Nm={n} > {SHALLOW_NM}): its weights miss up "
            f"to {n - 1} of its own updates, which costs accuracy (weights {weights!r}: the "
            f"planner credits its rate x{f:.2f}); {remedy}"
        )
    return out


def choose_schedule(plans: Sequence[Any], errors: Sequence[str] = ()) -> tuple[Any, str]:
    """``train.schedule = "auto"``'s choice among an async plan and synchronous ones: the
    highest effective rate (an async plan's ``details["staleness"]``; a synchronous plan's
    samples/s, its updates never stale), and the reason in words. Ties keep the earlier."""

    def worth(p: Any) -> float:
        if p.schedule == "async":
            st = p.details.get("staleness") or {}
            return float(st.get("effective_samples_per_s", p.samples_per_s))
        return p.samples_per_s

    best = max(plans, key=worth)
    figures = []
    for p in plans:
        text = f"{p.schedule} {p.samples_per_s:.1f}"
        if worth(p) < p.samples_per_s * (1 - 1e-9):
            text += f" (staleness-weighted {worth(p):.1f})"
        figures.append(text)
    why = f"schedule auto chose {best.schedule}: predicted samples/s {', '.join(figures)}" + (
        f" ({'; '.join(errors)})" if errors else ""
    )
    if best.schedule == "async":
        st = best.details.get("staleness") or {}
        why += "; async trains on stale weights, priced by the staleness rule: " + str(
            st.get("rule", f"Nm <= {SHALLOW_NM} is not penalised")
        )
    else:
        why += "; exact minibatch SGD"
    return best, why
