"""The order of devices inside a virtual worker: which device runs stage 0, 1, ...

The order matters because the first stage receives the model input, every stage but the last
keeps Nm minibatches of activations and weight versions (the last keeps one), and links
between consecutive devices differ (same node or not). For a fixed order the split is exact
(:mod:`hetpipe.planner.partition`); this module searches the orders.

* **Small VWs (k <= 6): exhaustive** over *distinct* orders. Two devices are interchangeable
  when swapping them changes nothing the planner sees: same type, memory and speed, and the
  same bandwidth to every other device of the VW (so two devices of one node are
  interchangeable unless a link override says otherwise, and so are two devices on different
  nodes when every link between the VW's members is an inter-node link). Only permutations
  of the multiset of classes are enumerated: 4 devices of 2 classes x2 give 6 orders, not 24.
  The enumeration is a branch and bound: a prefix of the order whose best possible
  bottleneck (exact DP over the prefix, plus a relaxation for the devices still to place)
  cannot beat the best rate found so far is dropped with all its completions. A whole
  order is then first held against its rate bound at every Nm (least bottleneck, and Nm
  over the least latency where the pipeline's fill limits the rate:
  :meth:`~hetpipe.planner.partition.CostModel.rate_below`), so that an order below the
  best costs no split. The answer is the same as trying every order;
  ``OrderResult.pruned`` counts the orders skipped.
* **Larger VWs, Nm chosen: the class DP** (:mod:`hetpipe.planner.classdp`) where its size
  (:func:`~hetpipe.planner.classdp.dp_cells`) is at most :data:`CLASS_DP_MAX_CELLS`: a
  dynamic program over the layers placed and the multiset of classes used, exact for the
  best estimated rate over every order, split and Nm (``OrderResult.by_classes``).
* **Otherwise (larger VWs beyond that size, or Nm fixed): heuristic.** Start from a few
  natural orders (devices grouped by node, larger memory first, since the last stage needs
  the least memory; by memory alone; by speed), keep the best, then swap adjacent devices
  (first improvement, repeated passes) while that improves the objective. Interchangeable
  neighbours are never swapped.
* **That local search on a large model** (more than :data:`COARSE_MIN_LAYERS` layers, Nm
  chosen) ranks the orders it tries on a grid: splits that cut only at about
  :data:`COARSE_POINTS` evenly spaced layer boundaries (:class:`~hetpipe.planner.partition.
  GridModel`, each DP step a small fraction of the full one's). The
  :data:`COARSE_FINAL` best orders it saw then get the full model's exact split and Nm, and
  the best of them is the answer. A heuristic as the local search is (a grid split's rate
  bounds its order's from below, so the ranking can differ from the full model's); the
  exhaustive search of small VWs and the class DP stay exact at every size.

The objective is the estimated pipeline rate of the best split and Nm for the order
(:meth:`Partition.minibatches_per_s`), then the lower bottleneck, smaller Nm, lower latency.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from hetpipe.planner.classdp import ClassSpace, best_class_order, class_space, dp_cells
from hetpipe.planner.partition import CostModel, Infeasible, Partition

__all__ = [
    "CLASS_DP_MAX_CELLS",
    "COARSE_FINAL",
    "COARSE_MIN_LAYERS",
    "COARSE_POINTS",
    "EXHAUSTIVE_MAX",
    "OrderResult",
    "best_order",
    "count_orders",
    "device_classes",
    "distinct_orders",
]

EXHAUSTIVE_MAX = 6
# above EXHAUSTIVE_MAX devices, Nm chosen, on a model of more than COARSE_MIN_LAYERS layers
# (where the class DP does not run): the local search ranks orders on about COARSE_POINTS
# layer boundaries (the grid), and the COARSE_FINAL best orders it saw get the full model's
# split and Nm
COARSE_MIN_LAYERS = 256
COARSE_POINTS = 128
COARSE_FINAL = 2
# the exhaustive search's prefix bound, at a depth where it pruned none of the last
# BOUND_MISSES prefixes, tests only every BOUND_PROBE-th prefix there until it prunes again
BOUND_MISSES = 16
BOUND_PROBE = 8
# above EXHAUSTIVE_MAX devices with Nm chosen, the class DP runs where one sweep's measure
# (classdp.dp_cells) is at most this; beyond it the local search remains
CLASS_DP_MAX_CELLS = 400_000


@dataclass(frozen=True)
class OrderResult:
    """The best order found, its split, and how the search went."""

    order: tuple[Any, ...]
    partition: Partition | Infeasible
    evaluated: int  # distinct orders whose split was computed
    exhaustive: bool  # every distinct order was tried (or proved unable to win)
    pruned: int = 0  # distinct orders skipped because a bound proved they cannot win
    by_classes: bool = False  # found by the DP over device classes (exact, none enumerated)

    @property
    def exact(self) -> bool:
        """Whether no order has a higher estimated rate (see the module docs)."""
        return self.exhaustive or self.by_classes


def device_classes(devices: Sequence[Any], bandwidth: Callable[[Any, Any], float]) -> list[int]:
    """Class index of each device; devices of one class are interchangeable in an order.

    ``x`` and ``y`` are interchangeable when they have the same type, memory and speed and
    every third device ``z`` of the VW sees the same bandwidth to (and from) both: then
    swapping them leaves every stage time and memory cap of every order unchanged.
    """

    def same(x: Any, y: Any) -> bool:
        if (x.type, x.memory, x.speed) != (y.type, y.memory, y.speed):
            return False
        return all(
            bandwidth(x, z) == bandwidth(y, z) and bandwidth(z, x) == bandwidth(z, y)
            for z in devices
            if z is not x and z is not y
        )

    classes: list[int] = []
    members: list[list[Any]] = []
    for x in devices:
        for c, group in enumerate(members):
            if all(same(x, y) for y in group):
                classes.append(c)
                group.append(x)
                break
        else:
            classes.append(len(members))
            members.append([x])
    return classes


def distinct_orders(devices: Sequence[Any], classes: Sequence[int]) -> Iterator[tuple[Any, ...]]:
    """Every order of ``devices`` up to swapping devices of one class, each exactly once."""
    pools: dict[int, list[Any]] = {}
    for d, c in zip(devices, classes, strict=True):
        pools.setdefault(c, []).append(d)
    counts = {c: len(v) for c, v in pools.items()}
    k = len(devices)
    labels: list[int] = []

    def rec() -> Iterator[tuple[Any, ...]]:
        if len(labels) == k:
            used = dict.fromkeys(pools, 0)
            out = []
            for c in labels:
                out.append(pools[c][used[c]])
                used[c] += 1
            yield tuple(out)
            return
        for c in pools:
            if counts[c]:
                counts[c] -= 1
                labels.append(c)
                yield from rec()
                labels.pop()
                counts[c] += 1

    yield from rec()


# the score of an order proved worse than the best one found before it (never the best)
BELOW: tuple[float, ...] = (-math.inf,)


def score(p: Partition | Infeasible) -> tuple[float, ...]:
    """Larger is better; any split beats none."""
    if not isinstance(p, Partition):
        return (-math.inf,)
    return (p.minibatches_per_s, -p.bottleneck, -p.nm, -p.latency)


def count_orders(classes: Sequence[int]) -> int:
    """How many distinct orders a multiset of classes has (k! / prod(count!))."""
    counts: dict[int, int] = {}
    for c in classes:
        counts[c] = counts.get(c, 0) + 1
    n = math.factorial(len(classes))
    for c in counts.values():
        n //= math.factorial(c)
    return n


def best_order(
    model: CostModel,
    devices: Sequence[Any],
    *,
    nm: int | None = None,
    nm_candidates: Iterable[int] | None = None,
    exhaustive_max: int = EXHAUSTIVE_MAX,
    prune: bool = True,
    classes_dp: bool = True,
) -> OrderResult:
    """The best order of ``devices`` and its split (Nm fixed to ``nm`` or chosen).

    The exhaustive search is a branch and bound over orders: the DP's state after a prefix
    of devices bounds every order that starts with it (a bottleneck only grows with more
    stages, and Nm above the smallest candidate only adds memory), so a prefix whose bound
    cannot beat the best rate found so far is skipped with all its completions. The result
    is the same as trying every order (``prune=False``), which tests check.

    Either search, with Nm chosen, skips the split-and-Nm search of an order whose best
    rate bounds prove strictly below the best order's so far (:meth:`CostModel.best_nm`'s
    ``beat``; not under ``prune=False``): such an order can become neither the best nor
    the local search's current order (always the best so far), so the answer is the same.
    """
    devices = tuple(devices)
    k = len(devices)
    cands = None if nm_candidates is None else tuple(nm_candidates)
    if classes_dp and nm is None and k > exhaustive_max and model._plain(devices):
        space = class_space(model, devices, device_classes(devices, model.link))
        if dp_cells(space, model.L) <= CLASS_DP_MAX_CELLS:
            return _by_classes(model, devices, space, cands)
    bound_nm = nm if nm is not None else min(cands or (1,))
    seen: dict[tuple[int, ...], tuple[float, ...]] = {}
    best: list[Any] = []  # [score, order, partition]
    first_fail: list[Infeasible] = []
    classes = device_classes(devices, model.link)
    cls = {id(d): c for d, c in zip(devices, classes, strict=True)}
    exhaustive = k <= exhaustive_max

    def evaluate(order: tuple[Any, ...]) -> tuple[float, ...]:
        sig = tuple(cls[id(d)] for d in order)
        if sig in seen:
            return seen[sig]
        if nm is not None:
            p: Partition | Infeasible | None = model.partition(order, nm)
        else:
            # an order whose best rate is strictly below the best so far can neither become
            # the best nor the local search's current order (that is the best so far), so
            # its split and Nm need not be found (CostModel.best_nm's ``beat``)
            beat = best[0][0] if best and prune else -math.inf
            # the same answer (None) proved by each Nm's rate bound, before any split of the
            # order is described: pays in the exhaustive search, whose orders are mostly
            # below the best (the local search's neighbours are too often not)
            if exhaustive and model.rate_below(order, cands, beat):
                seen[sig] = BELOW
                return BELOW
            p = model.best_nm(order, cands, beat)
        if p is None:
            seen[sig] = BELOW
            return BELOW
        s = seen[sig] = score(p)
        if isinstance(p, Infeasible) and not first_fail:
            first_fail.append(p)
        if not best or s > best[0]:
            best[:] = [s, order, p]
        return s

    if nm is None and not exhaustive and model.L > COARSE_MIN_LAYERS:
        ranked = _grid_ranked(model, devices, cands, classes)
        got = _best_of(model, ranked, cands, len(ranked))
        if got is not None:
            return got
    for order in _starts(devices):  # good first guesses make the bound bite early
        evaluate(order)
    if exhaustive:
        _branch_and_bound(model, devices, classes, bound_nm, evaluate, best, prune)
    else:
        _local_search(evaluate, best[1], best[0], cls)
    _, order, p = best
    if isinstance(p, Infeasible) and first_fail:
        p = first_fail[0]
    pruned = count_orders(classes) - len(seen) if exhaustive else 0
    return OrderResult(order, p, len(seen), exhaustive, pruned)


def _local_search(
    evaluate: Callable[[tuple[Any, ...]], tuple[float, ...]],
    start: Sequence[Any],
    start_score: tuple[float, ...],
    cls: dict[int, int],
) -> None:
    """Swap adjacent devices of ``start`` (first improvement, repeated passes) while that
    improves ``evaluate``'s score; interchangeable neighbours are never swapped."""
    current, cur_score = list(start), start_score
    improved = True
    while improved:
        improved = False
        for i in range(len(current) - 1):
            if cls[id(current[i])] == cls[id(current[i + 1])]:
                continue  # swapping interchangeable devices changes nothing
            trial = current[:]
            trial[i], trial[i + 1] = trial[i + 1], trial[i]
            s = evaluate(tuple(trial))
            if s > cur_score:
                current, cur_score, improved = trial, s, True


def _grid_ranked(
    model: CostModel,
    devices: tuple[Any, ...],
    cands: tuple[int, ...] | None,
    classes: Sequence[int],
) -> list[tuple[tuple[float, ...], tuple[Any, ...]]]:
    """The orders of ``devices`` the local search (natural orders, then adjacent swaps) saw
    on the model's grid (:meth:`CostModel.grid_model`, about :data:`COARSE_POINTS`
    boundaries), best first by their best rate over grid-restricted splits. Empty where no
    order has a split on the grid; orders the grid's bounds ruled out are left out."""
    grid = model.grid_model(COARSE_POINTS)
    cls = {id(d): c for d, c in zip(devices, classes, strict=True)}
    seen: dict[tuple[int, ...], tuple[tuple[float, ...], tuple[Any, ...]]] = {}
    best: list[Any] = []  # [score, order]

    def evaluate(order: tuple[Any, ...]) -> tuple[float, ...]:
        sig = tuple(cls[id(d)] for d in order)
        if sig in seen:
            return seen[sig][0]
        p = grid.best_nm(order, cands, best[0][0] if best else -math.inf)
        s = score(p) if p is not None else BELOW
        seen[sig] = (s, order)
        if not best or s > best[0]:
            best[:] = [s, order]
        return s

    for order in _starts(devices):
        evaluate(order)
    if not best or best[0][0] == -math.inf:
        return []
    _local_search(evaluate, best[1], best[0], cls)
    ranked = sorted(seen.values(), key=lambda x: x[0], reverse=True)
    return [x for x in ranked if x[0][0] > -math.inf]


def _best_of(
    model: CostModel,
    ranked: Sequence[tuple[tuple[float, ...], tuple[Any, ...]]],
    cands: tuple[int, ...] | None,
    evaluated: int,
) -> OrderResult | None:
    """The best, by the full model's split and Nm (:meth:`CostModel.best_nm`), of the
    :data:`COARSE_FINAL` first orders of ``ranked`` (:func:`_grid_ranked`); None where
    none has a split."""
    top: tuple[tuple[float, ...], tuple[Any, ...], Partition] | None = None
    for s, order in ranked[:COARSE_FINAL]:
        # the grid's split is one of the full model's, so the full model's best rate for
        # this order is at least the grid's: a bound that lets best_nm skip whatever Nm and
        # stage-time limits cannot reach it (the answer is the same split)
        own = s[0] * (1.0 - 1e-9)
        beat = max(top[0][0] if top is not None else -math.inf, own)
        p = model.best_nm(order, cands, beat)
        if p is None and (top is None or own >= top[0][0]):
            p = model.best_nm(order, cands)  # rounding: searched in full instead
        if not isinstance(p, Partition):
            continue
        fs = score(p)
        if top is None or fs > top[0]:
            top = (fs, order, p)
    if top is None:
        return None
    return OrderResult(top[1], top[2], evaluated, False)


def _by_classes(
    model: CostModel, devices: tuple[Any, ...], space: ClassSpace, cands: tuple[int, ...] | None
) -> OrderResult:
    """:func:`best_order` by the DP over device classes (:mod:`hetpipe.planner.classdp`):
    the order of the best rate over all orders, with :meth:`CostModel.best_nm`'s split and
    Nm for it; where no order fits, the first natural order's reason."""
    got = best_class_order(model, space, cands)
    order = got.order if got.order is not None else _starts(devices)[0]
    p = model.best_nm(order, cands)
    assert p is not None
    return OrderResult(order, p, 1, False, by_classes=True)


def _branch_and_bound(
    model: CostModel,
    devices: tuple[Any, ...],
    classes: Sequence[int],
    bound_nm: int,
    evaluate: Callable[[tuple[Any, ...]], tuple[float, ...]],
    best: list[Any],
    prune: bool,
) -> None:
    """Depth-first over distinct orders, skipping prefixes that cannot beat ``best``.

    The prefix bound costs a DP step and a pass over the layers for every prefix, and where
    the best rate is set by the pipeline's fill rather than its bottleneck it never prunes.
    So at each depth, after :data:`BOUND_MISSES` prefixes in a row that it did not prune,
    only every :data:`BOUND_PROBE`-th prefix there is tested, until one is pruned again: a
    prefix not tested is searched, so the answer is the same either way."""
    pools: dict[int, list[Any]] = {}
    for d, c in zip(devices, classes, strict=True):
        pools.setdefault(c, []).append(d)
    used = dict.fromkeys(pools, 0)
    k = len(devices)
    prefix: list[Any] = []
    misses = [0] * (k + 1)  # per prefix length: prefixes in a row the bound did not prune

    def hopeless() -> bool:
        rate = best[0][0] if best else -math.inf
        if not prune or not rate > 0 or math.isinf(rate):
            return False
        depth = len(prefix)
        misses[depth] += 1
        if misses[depth] > BOUND_MISSES and misses[depth] % BOUND_PROBE:
            return False  # untested: searched
        rest = [d for c, pool in pools.items() for d in pool[used[c] :]]
        lb = model.prefix_bound(prefix, k, bound_nm, rest)
        # rate <= 1 / bottleneck <= 1 / lb for every completion; the margin absorbs rounding
        if lb * rate > 1.0 + 1e-9:
            misses[depth] = 0
            return True
        return False

    def rec() -> None:
        if len(prefix) == k:
            evaluate(tuple(prefix))
            return
        for c, pool in pools.items():
            if used[c] == len(pool):
                continue
            prefix.append(pool[used[c]])
            used[c] += 1
            if not hopeless():
                rec()
            used[c] -= 1
            prefix.pop()

    rec()


def _starts(devices: Sequence[Any]) -> list[tuple[Any, ...]]:
    """Natural first guesses for a large VW (see the module docs)."""
    node_mem: dict[str, int] = {}
    for d in devices:
        node_mem[d.node] = node_mem.get(d.node, 0) + d.memory
    by_node = sorted(devices, key=lambda d: (-node_mem[d.node], d.node, -d.memory, -d.speed))
    by_mem = sorted(devices, key=lambda d: (-d.memory, -d.speed))
    by_speed = sorted(devices, key=lambda d: (-d.speed, -d.memory))
    return [tuple(by_node), tuple(by_mem), tuple(by_speed), tuple(devices)]
