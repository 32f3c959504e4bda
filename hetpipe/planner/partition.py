"""Cut a model into contiguous stages for a FIXED device order: exact dynamic programming.

Index letters and the stage time ``time(i, a, b)`` (compute, links, the runtime's per-task
costs, and the activation policy's extra time) are :mod:`hetpipe.planner.costs`'s; here the
search over them.

**Objective:** minimise the bottleneck ``max_i time(i, a_i, b_i)`` subject to every stage
fitting its device (``memory.stage_memory(...).total <= device.memory``) and every device
getting at least one layer. Ties on the bottleneck are broken towards the lower sum of stage
times (the latency), exactly: a second pass (:meth:`CostModel._least_latency`) minimises the
sum of stage times over the splits whose every stage takes at most the optimal bottleneck.

**Joint split and Nm** (:meth:`CostModel.best_rate`, :meth:`CostModel.best_nm`): the
estimated rate ``min(1 / bottleneck, Nm / latency)`` (:attr:`Partition.minibatches_per_s`)
is maximised over the cuts at each Nm, not only the bottleneck. With ``h(T)`` the least
latency of a split whose every stage takes at most ``T``, the best rate is
``max_T min(1 / T, Nm / h(T))`` over the stage times ``T`` (a split of bottleneck ``B`` and
latency ``l`` has ``h(B) <= l``). ``1 / T`` falls and ``Nm / h(T)`` rises with ``T``, so
the maximum sits at the smallest ``T`` whose least-latency split fills the pipeline
(``Nm * T >= h(T)``) or the stage time just below it: a binary search over the sorted stage
times between the least bottleneck ``B*`` and ``h(B*) / Nm`` finds both, exact for
contiguous cuts.

**Ties** (a tensor several layers share): a stage's memory counts it once however many of its
layers use it, and a stage holding a copy past the tie's first holder pays the copy's push and
pull each wave (:mod:`hetpipe.planner.costs`, ``tie``): both are per-stage terms of ``[a, b)``,
so the DP stays exact, and a split that keeps a tie on one stage wins where spanning it is not
faster.

**Exactness.** The DP is ``f_i(b) = min_a max(f_{i-1}(a), time(i, a, b))`` over feasible
``[a, b)``, O(L^2 k) with prefix sums (vectorised over ``(a, b)`` with numpy). A bottleneck
is always the maximum of some stage times, so the DP and the brute force compare the very
same floats: both evaluate ``time`` with one expression on the same prefix sums
(:meth:`CostModel.stage_time` for scalars, :meth:`CostModel.time_matrix` elementwise, same
operation order), and IEEE arithmetic is deterministic, so their optima are *equal*, not
merely close. Memory is integer arithmetic and exact by nature.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hetpipe.config import format_size
from hetpipe.core.memory import (
    StageMemory,
    in_flight,
    stage_memory,
)
from hetpipe.core.profile import ModelProfile
from hetpipe.planner.costs import (
    DEFAULT_HOST_GBPS,
    INF,
    Bandwidth,
    CostTables,
    check_devices,
    first_finite,
    least_ratio,
    skew,
)
from hetpipe.planner.plans import PlanError
from hetpipe.planner.runtime import RuntimeCosts

__all__ = [
    "Bandwidth",
    "CostModel",
    "GridModel",
    "Infeasible",
    "Partition",
    "brute_force",
    "partition",
    "partition_best_nm",
]


@dataclass(frozen=True)
class Partition:
    """A feasible split of the model over an ordered list of devices."""

    devices: tuple[str, ...]
    types: tuple[str, ...]
    cuts: tuple[tuple[int, int], ...]
    stage_times: tuple[float, ...]
    memory: tuple[StageMemory, ...]
    caps: tuple[int, ...]
    nm: int
    bottleneck: float
    # per stage: the global layers whose activations are recomputed, and the memory the
    # stage would need keeping them all (empty: the split was described without a policy)
    recompute: tuple[tuple[int, ...], ...] = ()
    keep_memory: tuple[StageMemory, ...] = ()
    swap: tuple[tuple[int, ...], ...] = ()  # per stage: the global layers swapped to host
    # stage replicas (:mod:`hetpipe.planner.replicas`), empty where no stage is replicated;
    # else per stage: its devices (leader first, the objects), the minibatch's row bounds
    # over them, and their gradient exchange per minibatch (0 on one device)
    groups: tuple[tuple[Any, ...], ...] = ()
    rows: tuple[tuple[int, ...], ...] = ()
    exchange_s: tuple[float, ...] = ()
    # per stage, async: the most minibatches it holds, filled to that first (0: the
    # schedule's maximum; empty: none limited); set by the planner under train.in_flight =
    # "plan" (:func:`hetpipe.planner.plan.make_plan`), simulated as the runtime runs it
    limits: tuple[int, ...] = ()

    @property
    def k(self) -> int:
        return len(self.devices)

    @property
    def sizes(self) -> tuple[int, ...]:
        """Layers per stage, the job file's ``layers = [...]`` form."""
        return tuple(b - a for a, b in self.cuts)

    def group_of(self, i: int, leader: Any) -> tuple[Any, ...]:
        """Stage ``i``'s devices, leader first (``(leader,)`` where it is not replicated)."""
        return self.groups[i] if self.groups else (leader,)

    def rows_of(self, i: int, minibatch: int) -> tuple[int, ...]:
        """Stage ``i``'s row bounds over its devices (``(0, minibatch)`` on one)."""
        return self.rows[i] if self.rows else (0, minibatch)

    @property
    def latency(self) -> float:
        """Time for one minibatch to go forward and back through every stage."""
        return sum(self.stage_times)

    @property
    def minibatches_per_s(self) -> float:
        """Steady-state estimate: the bottleneck's rate, unless Nm is too small to fill.

        With ``Nm`` minibatches in flight and a round trip of ``latency``, at most
        ``Nm / latency`` minibatches finish per second; the bottleneck stage allows at most
        ``1 / bottleneck``.
        """
        if self.bottleneck <= 0:
            return INF
        return min(1.0 / self.bottleneck, self.nm / self.latency)

    def __bool__(self) -> bool:
        return True


@dataclass(frozen=True)
class Infeasible:
    """No split fits; ``reason`` says why in one line a user can act on."""

    reason: str

    def __bool__(self) -> bool:
        return False


# the joint split's search probes up to PROBES_MAX stage-time limits per round, as many as
# keep a step of its batched DP (CostModel._latencies) within PROBE_CELLS cells; 1 (a
# large model's wide bands) is the plain binary search
PROBES_MAX = 15
PROBE_CELLS = 400_000


def _order_key(devices: Sequence[Any], bws: Any, nm: int) -> tuple:
    """What an order's answers depend on, for the memos: its devices up to their names (type,
    memory, host copy rate), its links and Nm."""
    return (tuple((d.type, d.memory, d.host_gbps) for d in devices), bws, nm)


class CostModel(CostTables):
    """The cost tables of one profile under one network (:class:`CostTables`) and the exact
    min-bottleneck partition over them, with caches.

    One instance is shared by every partition the planner tries, so besides the tables the
    DP states of shared order prefixes are cached, and whole partitions of an identical
    device sequence (same types, caps and link bandwidths) are memoised.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """The tables' arguments (:class:`CostTables`)."""
        super().__init__(*args, **kwargs)
        self._memo: dict[tuple, Partition | Infeasible] = {}
        self._prefix: dict[tuple, np.ndarray] = {}
        # bound the DP states cached to ~32 MiB
        self._prefix_limit = max(256, (32 << 20) // (8 * (self.L + 1)))
        self._f0 = np.full(self.L + 1, INF)
        self._f0[0] = 0.0
        self._cols = np.arange(self.L + 1)
        self.dp_steps = 0  # DP stage steps computed (the rest came from the prefix cache)
        self._ref_type = next(iter(self.profile.layers), "")
        self._rest: dict[tuple, np.ndarray] = {}
        self._trip: dict[frozenset, float] = {}  # round_trip_floor by the types present
        self._ratios: dict[str, float] = {}
        self.dp_runs = 0  # how many DPs actually ran (the rest came from the memo)
        self._joint: dict[tuple, Partition] = {}  # best_rate's splits that do not fill
        self._short: dict[tuple, float] = {}  # least latencies (_shortest)
        self._least: dict[tuple, float] = {}  # least bottlenecks (_least_bottleneck)
        # set by the caller when bandwidth depends only on whether two devices share a node,
        # so that VWs alike up to renaming nodes can share one order search
        self.uniform_nodes = False

    # ---------------------------------------------------------------- partitioning

    def partition(self, devices: Sequence[Any], nm: int) -> Partition | Infeasible:
        """The exact min-bottleneck split of the model over ``devices`` in this order."""
        return self._partition(devices, nm, why=True)

    def _partition(self, devices: Sequence[Any], nm: int, why: bool) -> Partition | Infeasible:
        """:meth:`partition`; ``why`` False leaves a memory-infeasible reason empty (the
        diagnosis costs more than the DP, and a scan over Nm only needs to know)."""
        k, L = len(devices), self.L
        if k == 0:
            return Infeasible("no devices")
        if nm < 1:
            raise PlanError(f"Nm must be >= 1, got {nm}")
        missing = sorted({d.type for d in devices} - set(self.profile.layers))
        if missing:
            return Infeasible(f"no profile for device type(s) {', '.join(missing)}")
        if k > L:
            return Infeasible(
                f"{k} devices but the model has only {L} layers (every device needs one)"
            )
        bws = self.links(devices)
        key = _order_key(devices, bws, nm)
        names = tuple(d.name for d in devices)
        hit = self._memo.get(key)
        if hit is None:
            hit = self._memo[key] = self._solve(devices, bws, nm)
        if isinstance(hit, Partition) and hit.devices != names:
            hit = dataclasses.replace(hit, devices=names)
        elif isinstance(hit, Infeasible) and why:
            hit = Infeasible(self.diagnose(devices, nm))  # name these devices
        return hit

    def _run(
        self, devices: Sequence[Any], bws: tuple[float, ...], nm: int, k: int, stages: int
    ) -> np.ndarray:
        """DP states (least bottleneck per boundary ``b``) after the first ``stages`` stages
        of a ``k``-stage order.

        The state after stage i depends only on devices 0..i+1 (types, caps and the links
        between them), so states are cached by that prefix: orders searched one after
        another share most of their prefixes and skip those steps. A step runs over the
        stage's band (:meth:`CostTables.band`), only for the boundaries some finite state
        reaches; the latency tie-break is :meth:`_least_latency`'s, on the final bottleneck.
        The last stage's step fills ``b = L`` alone: every caller of a whole order reads
        only that state (and the key's ``k`` keeps it from any shorter prefix's).
        """
        f = self._f0
        sig: tuple = (k, nm)
        n = self.L + 1
        for i in range(stages):
            d = devices[i]
            bw_in = bws[i - 1] if i > 0 else None
            bw_out = bws[i] if i < k - 1 else None
            sig = (*sig, d.type, d.memory, d.host_gbps, bw_out)
            hit = _recall(self._prefix, sig)
            if hit is None:
                flight = in_flight(i, k, nm, weights=self.weights)
                band, w = self.band(d.type, bw_in, bw_out, flight, d.memory, d.host_gbps, nm)
                best = np.full(n, INF)
                live = np.flatnonzero(np.isfinite(f))
                if live.size:
                    lo, hi = int(live[0]) + 1, min(n, int(live[-1]) + w + 1)
                    if i == k - 1:
                        lo = max(lo, self.L)  # of the last stage's states only f[L] is read
                    if lo < hi:
                        win = _windows(f, w)[lo:hi]
                        best[lo:hi] = np.maximum(win, band[lo:hi]).min(axis=1)
                f = best
                self.dp_steps += 1
                _keep(self._prefix, sig, f, self._prefix_limit)
            else:
                f = hit
        return f

    def prefix_bound(
        self, prefix: Sequence[Any], k: int, nm: int, rest: Sequence[Any] = ()
    ) -> float:
        """A lower bound on the bottleneck of every ``k``-device order that starts with
        ``prefix`` and continues with the devices ``rest`` in any order.

        The DP gives the exact best over the prefix's stages for each boundary ``b`` (the
        prefix's last device only fixes the link out of the one before it, unless the prefix
        is the whole order); the devices still to place must then run layers ``[b, L)``,
        which takes them at least :meth:`rest_bound`. Used to prune order searches.
        """
        m = len(prefix)
        done = k if m == k else m - 1
        if done <= 0:
            return 0.0
        f = self._run(prefix, self.links(prefix), nm, k, done)
        left = [*prefix[done:], *rest]
        stop = self.L - len(left) + 1  # each remaining stage needs at least one layer
        if not left:
            return float(f[self.L])
        return float(np.maximum(f[:stop], self.rest_bound(left)[:stop]).min())

    def rest_bound(self, devices: Sequence[Any]) -> np.ndarray:
        """For each ``b``, a lower bound on the bottleneck of ``devices`` running ``[b, L)``.

        Two relaxations, both true for any order and split: (1) a device of type t spends at
        least ``ratio(t)`` x the reference type's time on any layers, so together the
        devices need ``ref_time([b, L)) / sum(1 / ratio)``; (2) some device runs each layer,
        at best on the fastest type present for it.
        """
        key = tuple(sorted(d.type for d in devices))
        hit = self._rest.get(key)
        if hit is not None:
            return hit
        ref = self.costs(self._ref_type)
        remaining = ref.cum_np[-1] - ref.cum_np
        ratios = [self._ratio(t) for t in key]
        power = sum(1.0 / r if r > 0 else INF for r in ratios)
        share = remaining / power if power < INF else np.zeros_like(remaining)
        per_layer = (
            np.min([np.diff(self.costs(t).cum_np) for t in set(key)], axis=0)
            if self.L
            else np.zeros(0)
        )
        biggest = np.zeros(self.L + 1)
        if self.L:
            biggest[:-1] = np.maximum.accumulate(per_layer[::-1])[::-1]
        out = np.maximum(share, biggest) * (1.0 - 1e-9)  # margin for rounding
        self._rest[key] = out
        return out

    def round_trip_floor(self, devices: Sequence[Any]) -> float:
        """A lower bound on any minibatch's round trip through ``devices`` in any order and
        split: every layer's forward and backward, each on the fastest of their types for
        it (no update, link or per-task term). A VW keeping at most ``Nm`` minibatches in
        flight then completes at most ``Nm`` of them per this time (each is in flight for
        its whole round trip), whatever its order or split."""
        key = frozenset(d.type for d in devices)
        hit = self._trip.get(key)
        if hit is None:
            per_layer = np.min([self.costs(t).passes for t in key], axis=0)
            hit = self._trip[key] = float(per_layer.sum()) * (1.0 - 1e-9)
        return hit

    def _ratio(self, dtype: str) -> float:
        """Least per-layer time of ``dtype`` relative to the reference type."""
        r = self._ratios.get(dtype)
        if r is None:
            mine = np.diff(self.costs(dtype).cum_np)
            r = least_ratio(mine, np.diff(self.costs(self._ref_type).cum_np))
            self._ratios[dtype] = r
        return r

    def _solve(
        self, devices: Sequence[Any], bws: tuple[float, ...], nm: int
    ) -> Partition | Infeasible:
        self.dp_runs += 1
        k, L = len(devices), self.L
        bands = self._stage_bands(devices, bws, nm)
        if self._unreachable(bands):
            return Infeasible("")  # as the DP's all-inf states below, without its steps
        f = self._run(devices, bws, nm, k, k)
        if not math.isfinite(f[L]):
            return Infeasible("")  # diagnosed by partition(), for the devices it is given
        # the DP's tie-break is per prefix; the least latency at this bottleneck, exactly
        best = self._least_latency(bands, float(f[L]))
        assert best is not None, "the DP's own split meets its bottleneck"
        return self.describe(devices, best[0], nm, bws)

    def _stage_bands(
        self, devices: Sequence[Any], bws: tuple[float, ...], nm: int
    ) -> list[tuple[np.ndarray, int]]:
        """Each stage's masked time matrix (inf where ``[a, b)`` does not fit it) as its band
        (:meth:`CostTables.band`)."""
        k = len(devices)
        return [
            self.band(
                d.type,
                bws[i - 1] if i > 0 else None,
                bws[i] if i < k - 1 else None,
                in_flight(i, k, nm, weights=self.weights),
                d.memory,
                d.host_gbps,
                nm,
            )
            for i, d in enumerate(devices)
        ]

    def _least_latency(
        self, bands: Sequence[tuple[np.ndarray, int]], limit: float, cuts: bool = True
    ) -> tuple[list[tuple[int, int]], float] | None:
        """The split with the least sum of stage times among those whose every stage takes
        at most ``limit`` (and fits its device), and that sum; None where none does.

        ``g_i(b) = min_a g_{i-1}(a) + time(i, a, b)`` over ``time(i, a, b) <= limit``: the
        same vectorised step as the bottleneck DP over each stage's band, with a sum for the
        max; among equal sums the first ``a``, as over the whole matrix.
        ``cuts`` False: the sum alone (the cuts are an empty list), about half the work.
        """
        L, n = self.L, self.L + 1
        g = self._f0
        cols = self._cols
        choice: list[np.ndarray] = []
        # boundaries from which the stages still to come can reach L (each at most its
        # band's width, at least one layer): other states never lead to the end
        low = self._lows(bands)
        for i, (band, w) in enumerate(bands):
            live = np.flatnonzero(g < INF)
            out_g = np.full(n, INF)
            arg = np.zeros(n, dtype=np.intp)
            if live.size:
                lo = max(int(live[0]) + 1, low[i])
                hi = min(int(live[-1]) + w, L - (len(bands) - 1 - i))
                if lo <= hi:
                    rows = band[lo : hi + 1]
                    cand = _windows(g, w)[lo : hi + 1] + rows
                    if limit != INF:  # a stage over the limit is no option (in place: cheap)
                        np.putmask(cand, ~(rows <= limit), INF)
                    if cuts:
                        j = cand.argmin(axis=1)
                        out_g[lo : hi + 1] = cand[np.arange(hi + 1 - lo), j]
                        arg[lo : hi + 1] = cols[lo : hi + 1] - w + j
                    else:
                        out_g[lo : hi + 1] = cand.min(axis=1)
            g = out_g
            choice.append(arg)
        if not math.isfinite(g[self.L]):
            return None
        out: list[tuple[int, int]] = []
        b = self.L
        for arg in reversed(choice):
            a = int(arg[b])
            out.append((a, b))
            b = a
        out.reverse()
        assert b == 0 or not cuts
        return out, float(g[self.L])

    def _latencies(self, bands: Sequence[tuple[np.ndarray, int]], limits: np.ndarray) -> np.ndarray:
        """:meth:`_least_latency`'s sum (``cuts`` False) at each of ``limits`` at once, inf
        where no split meets a limit: the same DP with one row of states per limit, over
        the union of the rows' live boundaries (a boundary live for one limit only is inf
        for the others, as it is in their own DP), so the very same floats."""
        L, n = self.L, self.L + 1
        m = len(limits)
        g = np.full((m, n), INF)
        g[:, 0] = 0.0
        cap = np.asarray(limits, dtype=np.float64)[:, None, None]
        low = self._lows(bands)
        for i, (band, w) in enumerate(bands):
            live = np.flatnonzero((g < INF).any(axis=0))
            out = np.full((m, n), INF)
            if live.size:
                lo = max(int(live[0]) + 1, low[i])
                hi = min(int(live[-1]) + w, L - (len(bands) - 1 - i))
                if lo <= hi:
                    rows = band[lo : hi + 1]
                    cand = _windows_rows(g, w)[:, lo : hi + 1] + rows
                    np.putmask(cand, ~(rows <= cap), INF)
                    out[:, lo : hi + 1] = cand.min(axis=2)
            g = out
        return g[:, L]

    def describe(
        self,
        devices: Sequence[Any],
        cuts: Sequence[tuple[int, int]],
        nm: int,
        bws: tuple[float, ...] | None = None,
    ) -> Partition:
        """Times and memory of a given split (also used for user-given splits)."""
        k = len(devices)
        bws = self.links(devices) if bws is None else bws
        pairs = list(enumerate(zip(devices, cuts, strict=True)))
        policies = tuple(
            self.chosen(
                d.type, a, b, in_flight(i, k, nm, weights=self.weights), d.memory, d.host_gbps
            )
            if self.activations != "keep"
            else ((), ())
            for i, (d, (a, b)) in pairs
        )
        rec = tuple(r for r, _ in policies)
        swp = tuple(w for _, w in policies)
        times = tuple(
            self.stage_time(
                d.type, a, b, bws[i - 1] if i > 0 else None, bws[i] if i < k - 1 else None
            )
            + self.extra_time(d, a, b, rec[i], swp[i])
            + self.tie_time(a, b, bws[i - 1] if i > 0 else None, nm)
            for i, (d, (a, b)) in pairs
        )
        mem = tuple(
            self.stage_memory(d.type, a, b, i, k, nm, recompute=rec[i], swap=swp[i])
            for i, (d, (a, b)) in pairs
        )
        keep_mem = tuple(self.stage_memory(d.type, a, b, i, k, nm) for i, (d, (a, b)) in pairs)
        return Partition(
            tuple(d.name for d in devices),
            tuple(d.type for d in devices),
            tuple((int(a), int(b)) for a, b in cuts),
            times,
            mem,
            tuple(d.memory for d in devices),
            nm,
            max(times),
            rec,
            keep_mem,
            swp if any(swp) else (),
        )

    def diagnose(self, devices: Sequence[Any], nm: int) -> str:
        """Why no split fits: the most specific true statement we can make."""
        k, L = len(devices), self.L
        layers = np.arange(L)
        # need[i, j]: the memory one layer j alone needs on device i at stage i
        need = np.array(
            [
                self.memory_total(d.type, in_flight(i, k, nm, weights=self.weights))[
                    layers, layers + 1
                ]
                for i, d in enumerate(devices)
            ],
            dtype=np.int64,
        ).reshape(k, L)
        caps = np.array([d.memory for d in devices], dtype=np.int64)

        def desc(d: Any) -> str:
            return f"{d.name} ({d.type}, cap {format_size(d.memory)})"

        lower = self.min_total_memory()
        total_cap = sum(d.memory for d in devices)
        if lower > total_cap:
            return (
                f"the model needs at least {format_size(lower)} in total, "
                f"the devices hold {format_size(total_cap)}"
            )
        nowhere = np.flatnonzero((need > caps[:, None]).all(axis=0)) if k else ()
        if len(nowhere):  # a layer that fits nowhere, wherever it is placed
            j = int(nowhere[0])
            i = int(np.argmin(need[:, j] - caps))  # the first of equal shortfalls
            n = format_size(int(need[i, j]))
            return f"layer {j} alone needs {n} on {desc(devices[i])} (Nm={nm})"
        for i, d in enumerate(devices):  # a device that cannot take any layer it could get
            lo, hi = i, L - k + i
            smallest = int(need[i, lo : hi + 1].min())
            if smallest > d.memory:
                return (
                    f"{desc(d)} cannot hold even one layer at stage {i} "
                    f"(the smallest needs {format_size(smallest)}, Nm={nm})"
                )
        names = ", ".join(d.name for d in devices)
        return (
            f"no contiguous split of {L} layers over {names} fits in memory at Nm={nm} "
            f"(the model needs at least {format_size(lower)}, the devices hold "
            f"{format_size(total_cap)})"
        )

    def best_rate(
        self, devices: Sequence[Any], nm: int, floor: float = 0.0, beat: float = -INF
    ) -> Partition | Infeasible:
        """The split with the highest estimated rate at this Nm (``minibatches_per_s``),
        exact over contiguous splits (module docs); among equal rates the lower bottleneck,
        then the lower latency. Where the least-bottleneck split fills the pipeline it is
        that split; memoised like :meth:`partition`. ``floor``: a rate the caller already
        has; where no split at this Nm can beat it, the least-bottleneck split is returned
        without the search. ``beat``: the same where no split at this Nm can even reach it
        (a rate strictly below it is of no use to the caller)."""
        p = self.partition(devices, nm)
        if not isinstance(p, Partition) or _full(p):
            return p
        bws = self.links(devices)
        key = _order_key(devices, bws, nm)
        hit = self._joint.get(key)
        if hit is None:
            if _below(p.bottleneck, 1.0, beat):
                return p  # no split at this Nm reaches ``beat`` (none beats 1 / B*)
            hit = self._joint_split(devices, bws, nm, p, floor, beat)
            if hit is None:
                return p  # cannot beat ``floor`` or reach ``beat``
            self._joint[key] = hit
        names = tuple(d.name for d in devices)
        return hit if hit.devices == names else dataclasses.replace(hit, devices=names)

    def _joint_split(
        self,
        devices: Sequence[Any],
        bws: tuple[float, ...],
        nm: int,
        least: Partition,
        floor: float,
        beat: float = -INF,
    ) -> Partition | None:
        """:meth:`best_rate` of a ``least`` bottleneck split that does not fill: the binary
        search over stage times of the module docs; None where even the bound
        ``min(1 / B*, Nm / least latency)`` is at most ``floor`` or below ``beat``, or where
        the search's steps bound the best rate below ``beat``."""
        mats = self._stage_bands(devices, bws, nm)
        shortest = self._shortest(devices, nm)
        assert shortest < INF
        bound = min(1.0 / least.bottleneck, nm / shortest)
        if bound <= least.minibatches_per_s:
            return least
        if bound <= floor or bound * (1.0 + 1e-9) < beat:
            return None
        # Only stage times in [start, top] can be the least limit whose least-latency split
        # fills: below start even the shortest split does not, at top the split of ``least``
        # does (h(top) <= least.latency). Also the largest below start (the last that does
        # not fill, if it is the answer) and the first above top.
        lo, top = least.bottleneck, least.latency / nm
        start = max(lo, shortest / nm)
        values = [self._band_values(tm) for tm, _ in mats]  # each band's distinct times
        # sorted, so each range is a slice: (lo, start) below, [start, top] inside (above
        # lo), (top, inf) over
        inside, under, over = [], [], []
        for v in values:
            above_lo = int(np.searchsorted(v, lo, "right"))
            from_start = int(np.searchsorted(v, start, "left"))
            past_top = int(np.searchsorted(v, top, "right"))
            inside.append(v[max(above_lo, from_start) : past_top])
            under.append(v[above_lo:from_start])
            over.append(v[past_top:])
        under_max = [float(x.max()) for x in under if x.size]
        over_min = [float(x.min()) for x in over if x.size]
        inside.append(np.array([max(under_max)] if under_max else [], dtype=np.float64))
        inside.append(np.array([min(over_min)] if over_min else [], dtype=np.float64))
        limits = _merge_distinct(inside)
        # invariant: the split at limits[below] does not fill (-1: ``least``), the one at
        # limits[fills] does (len: none known to)
        below, fills = -1, len(limits)
        h_below, h_fills = least.latency, shortest  # h at limits[below] and limits[fills]
        # limits probed together per round (:meth:`_latencies`): where a DP step is small,
        # its Python calls, not its cells, are its cost
        width = max(w for _, w in mats)
        many = min(PROBES_MAX, PROBE_CELLS // ((self.L + 1) * width))
        while fills - below > 1:
            if many > 1 and fills - below > 2:
                # ``many`` limits evenly inside (below, fills); whether a limit's least
                # latency fills only grows with the limit, so the last that does not and the
                # first that does are the binary search's answers there
                gap = fills - below - 1
                probe = np.unique(below + 1 + (np.arange(1, many + 1) * gap) // (many + 1))
                hs = self._latencies(mats, limits[probe])
                for j, h in zip(probe.tolist(), hs.tolist(), strict=True):
                    assert h < INF, "a limit above the least bottleneck admits a split"
                    if nm * float(limits[j]) >= h:
                        fills, h_fills = j, h
                        break
                    below, h_below = j, h
            else:
                mid = (below + fills) // 2
                hit = self._least_latency(mats, float(limits[mid]), cuts=False)
                assert hit is not None, "a limit above the least bottleneck admits a split"
                if nm * float(limits[mid]) >= hit[1]:
                    fills, h_fills = mid, hit[1]
                else:
                    below, h_below = mid, hit[1]
            if beat > -INF:
                # the best rate is max over T of min(1 / T, Nm / h(T)), h falling with T:
                # at most Nm / h_below up to limits[below], 1 / limits[fills] from there,
                # and min(1 / limits[below], Nm / h_fills) between
                t_below = float(limits[below]) if below >= 0 else lo
                t_fills = float(limits[fills]) if fills < len(limits) else INF
                most = rate_bound(nm, t_below, h_below, t_fills, h_fills)
                if most * (1.0 + 1e-9) < beat:
                    return None
        options = [least] if below < 0 else []
        for j in (below, fills):
            if 0 <= j < len(limits):
                hit = self._least_latency(mats, float(limits[j]))
                assert hit is not None
                options.append(self.describe(devices, hit[0], nm, bws))
        return max(options, key=lambda q: (q.minibatches_per_s, -q.bottleneck, -q.latency))

    def _band_values(self, band: np.ndarray) -> np.ndarray:
        """The distinct finite stage times of a band (:meth:`CostTables.band`), sorted; kept
        while the band is cached, since the joint search asks for them at every Nm."""
        hit = self._band_vals.get(id(band))
        if hit is None or hit[0] is not band:
            # cleared with the bands (CostTables.band), so it holds no more than they do
            hit = self._band_vals[id(band)] = (band, np.unique(band[band < INF]))
        return hit[1]

    def _band_reach(self, band: np.ndarray, w: int) -> tuple[np.ndarray, np.ndarray]:
        """Two arrays over the boundaries of a band's stages (its finite entries): for each
        ``r``, the furthest end of a stage that starts at or before ``r`` (-1 where none
        does), and the earliest start of a stage that ends at or after ``r`` (``L + 1``
        where none does). Kept while the band is cached (:meth:`_unreachable` and the
        least-latency DPs ask for them at every order)."""
        hit = self._band_ends.get(id(band))
        if hit is None or hit[0] is not band:
            n = len(band)
            finite = band < INF
            rows = np.flatnonzero(finite.any(axis=1))
            # row b's first finite entry j is its stage of the earliest start, b - w + j
            starts = rows - w + finite[rows].argmax(axis=1)
            ends = np.full(n, -1, dtype=np.intp)
            np.maximum.at(ends, starts, rows)
            first = np.full(n, n, dtype=np.intp)
            first[rows] = starts
            first = np.minimum.accumulate(first[::-1])[::-1]
            # cleared with the bands (CostTables.band), so it holds no more than they do
            hit = self._band_ends[id(band)] = (band, (np.maximum.accumulate(ends), first))
        return hit[1]

    def _lows(self, bands: Sequence[tuple[np.ndarray, int]]) -> list[int]:
        """For each stage ``i``, a boundary below which no state after stage ``i`` leads to
        ``L``, the larger of two: the stages after it, each at most its band's width, must
        still cover the layers up to ``L``; and they end at ``L`` with each starting no
        earlier than its band's earliest start among the stages ending at or after the next
        one's bound (:meth:`_band_reach`). The least-latency DPs skip the states below it
        (they could only feed splits that never end at ``L``), the same answer for fewer
        cells."""
        low = [self.L] * len(bands)
        for i in range(len(bands) - 2, -1, -1):
            band, w = bands[i + 1]
            # past L (L + 1): no stage of the next band ends at or after its bound
            nxt = low[i + 1]
            low[i] = nxt if nxt > self.L else int(self._band_reach(band, w)[1][nxt])
        reach = 0  # the widths of the stages after i, together
        out = [0] * len(bands)
        for i in range(len(bands) - 1, -1, -1):
            out[i] = max(low[i], self.L - reach)
            reach += bands[i][1]
        return out

    def _unreachable(self, bands: Sequence[tuple[np.ndarray, int]]) -> bool:
        """Whether no split over these stage bands (:meth:`_stage_bands`) reaches the last
        layer, proved without the DP: after each stage every boundary a split can reach is
        at most the furthest end (:meth:`_band_reach`) of a stage starting at or before the
        previous stage's furthest boundary, so where the last stage's is short of ``L`` (or
        some stage has none), no split fits. A proof only: False says nothing (the DP
        decides). Most orders the exhaustive search asks at a larger Nm end here: their
        stages, each at most its band's width, cannot cover the model."""
        reach = 0
        for band, w in bands:
            reach = int(self._band_reach(band, w)[0][reach])
            if reach < 0:
                return True
        return reach < self.L

    def _plain(self, devices: Sequence[Any]) -> bool:
        """Whether :meth:`partition` of ``devices`` runs the DP (no early answer)."""
        return 0 < len(devices) <= self.L and all(d.type in self.profile.layers for d in devices)

    def _least_bottleneck(self, devices: Sequence[Any], nm: int) -> float:
        """``B*``: the least bottleneck of any split of ``devices`` at ``nm`` (inf where none
        fits), the DP alone (its states are cached for :meth:`partition`); memoised by the
        device sequence like :meth:`partition`, and inf without the DP where the stages
        cannot reach the last layer (:meth:`_unreachable`)."""
        bws = self.links(devices)
        key = _order_key(devices, bws, nm)
        hit = self._least.get(key)
        if hit is None:
            k = len(devices)
            if self._unreachable(self._stage_bands(devices, bws, nm)):
                hit = INF  # what the DP finds, without its steps
            else:
                hit = float(self._run(devices, bws, nm, k, k)[self.L])
            self._least[key] = hit
        return hit

    def _shortest(self, devices: Sequence[Any], nm: int) -> float:
        """The least latency of any split of ``devices`` that fits at ``nm`` (inf where none
        does); memoised by the device sequence like :meth:`partition`."""
        bws = self.links(devices)
        key = _order_key(devices, bws, nm)
        hit = self._short.get(key)
        if hit is None:
            bands = self._stage_bands(devices, bws, nm)
            got = None if self._unreachable(bands) else self._least_latency(bands, INF, False)
            hit = self._short[key] = INF if got is None else got[1]
        return hit

    def best_nm(
        self,
        devices: Sequence[Any],
        nm_candidates: Iterable[int] | None = None,
        beat: float = -INF,
    ) -> Partition | Infeasible | None:
        """The split and Nm with the best estimated throughput (see ``minibatches_per_s``),
        chosen together: exact over contiguous splits and the candidates.

        More Nm never lowers the least bottleneck ``B*(Nm)`` (memory grows with Nm, so the
        feasible splits shrink), and no split at Nm beats ``1 / B*(Nm)``; so the scan goes
        up from the smallest candidate, takes each Nm's best split (:meth:`best_rate`, told
        the best rate so far so that it can skip a search that cannot beat it), and stops
        once the best so far reaches ``1 / B*`` of this Nm, or no split fits. A shortcut
        first: the smallest Nm's least-bottleneck split has the least bottleneck of all; if
        the smallest Nm that would fill it keeps that bottleneck, no Nm can do better.
        Among equal estimates the smaller Nm wins (less memory, fresher weights).

        ``beat``: a rate the caller already has (an order search's best). Where this
        order's best rate is provably strictly below it, None instead of the split: the
        search skips each Nm whose bound (``1 / B*``, ``Nm`` over the least latency) is
        below ``beat``, every larger Nm once ``1 / B*`` is, and each Nm below ``beat`` times
        a least latency already found (the least latency never falls with Nm either: the
        feasible splits only shrink and their stages only slow). The answer is otherwise the
        very split found without ``beat``: a skipped Nm's best is below ``beat``, so it
        never decides the maximum, nor any stop of the scan, of an order that reaches it.
        The scan over larger Nm relies on ``B*`` not falling with Nm, which a tied tensor's
        per-wave cost breaks (it is shared over Nm minibatches), so with ties only each
        Nm's own bound is used.
        """
        k = len(devices)
        cands = sorted(set(nm_candidates) if nm_candidates is not None else range(1, k + 1))
        if not cands or cands[0] < 1:
            raise PlanError(f"Nm candidates must be >= 1, got {cands}")
        # B*(Nm) never falls as Nm grows (without ties): Nm whose bound is below ``beat``
        # are then skipped before their split is found (the DP's bottleneck and the least
        # latency only), else each Nm's own bound is checked inside best_rate
        skim = beat > -INF and self._tie_copies is None and self._plain(devices)
        if skim and _below(self._least_bottleneck(devices, cands[0]), 1.0, beat):
            return None
        first = self.partition(devices, cands[0])
        if not isinstance(first, Partition) or _full(first):
            return first
        fill = next((n for n in cands if n * first.bottleneck >= first.latency), None)
        if fill is not None:
            p = self._partition(devices, fill, why=False)
            if isinstance(p, Partition) and p.bottleneck == first.bottleneck and _full(p):
                return p
        best = first
        shortest = 0.0  # a least latency no larger Nm goes below (it, too, never falls)
        for n in cands:
            if skim:
                if _below(shortest, n, beat):
                    continue  # Nm / least latency is below ``beat`` at this Nm
                b_star = self._least_bottleneck(devices, n)
                if not math.isfinite(b_star):
                    break  # as below: no split fits at this Nm
                if _below(b_star, 1.0, beat):
                    break  # no split at this Nm or above reaches ``beat``
                if _below(self.round_trip_floor(devices), n, beat):
                    continue  # a floor under the least latency proves it without the DP
                shortest = self._shortest(devices, n)
                if _below(shortest, n, beat):
                    continue
            p = self._partition(devices, n, why=False)
            if not isinstance(p, Partition):
                break  # more Nm only needs more memory
            ceiling = 1.0 / p.bottleneck  # no split at this Nm or above beats it
            if n > cands[0] and best.minibatches_per_s >= ceiling:
                break
            q = self.best_rate(devices, n, best.minibatches_per_s if n > cands[0] else 0.0, beat)
            assert isinstance(q, Partition)
            if q.minibatches_per_s > best.minibatches_per_s:
                best = q
            if best.minibatches_per_s >= ceiling:
                break
        return best if best.minibatches_per_s >= beat else None

    def rate_below(
        self, devices: Sequence[Any], nm_candidates: Iterable[int] | None, beat: float
    ) -> bool:
        """Whether this order's best rate over the candidates (:meth:`best_nm`) is proved
        strictly below ``beat`` by bounds alone, before any split is described.

        At each Nm every split's rate is at most ``min(1 / B*(Nm), Nm / h(Nm))`` (``B*`` the
        least bottleneck, ``h`` the least latency of the splits that fit); the order is
        below ``beat`` when that bound is at every candidate. Both only grow with Nm
        (without tied tensors; with them this answers False), so the scan stops at the
        first Nm whose ``1 / B*`` is below ``beat`` or where nothing fits. False where some
        Nm's bound reaches ``beat``. The bounds are the DP's and the least latency's, both
        memoised, so :meth:`best_nm` reuses them on an order not ruled out. Where this is
        True, :meth:`best_nm` told ``beat`` answers None (its scan skims or stops at every
        Nm); asked first, it saves describing the order's splits, which pays where most
        orders are below the best (the exhaustive search), not in general.
        """
        if not beat > -INF or self._tie_copies is not None or not self._plain(devices):
            return False
        k = len(devices)
        cands = sorted(set(nm_candidates) if nm_candidates is not None else range(1, k + 1))
        if not cands or cands[0] < 1:
            return False  # best_nm raises on these
        for i, n in enumerate(cands):
            b_star = self._least_bottleneck(devices, n)
            if i > 0 and not math.isfinite(b_star):
                break  # more Nm only needs more memory: nothing fits above either
            if _below(b_star, 1.0, beat):  # (at the smallest Nm also where nothing fits)
                break  # B* never falls with Nm: no larger Nm reaches ``beat`` either
            if _below(self.round_trip_floor(devices), n, beat):
                continue  # below the least latency's floor already: no DP for it
            if not _below(self._shortest(devices, n), n, beat):
                return False  # this Nm's bound reaches ``beat``
        return True

    def grid_model(self, points: int) -> CostModel:
        """This model restricted to cuts on about ``points`` evenly spaced layer boundaries
        (:class:`GridModel`), itself where the model has no more layers than that; one per
        model, kept for the next caller."""
        layers = self.L
        if layers <= points:
            return self
        grid = _grid(layers, points)
        hit = getattr(self, "_grid_model", None)
        if hit is None or not np.array_equal(hit.grid, grid):
            hit = self._grid_model = GridModel(self, grid)
        return hit


class GridModel(CostModel):
    """A :class:`CostModel` whose splits cut only at the layer boundaries ``grid`` (0 and L
    among them): the same DPs over the time matrices' rows and columns at the grid, so each
    step costs about ``(len(grid) / L)^2`` of the full model's.

    Every split it returns is a split of the full model (its cuts are the grid's layers,
    its times and memory described by the full model), so its best rate for an order is a
    lower bound on the full model's, and its DPs compare the very same floats. A proxy
    that ranks device orders cheaply (:func:`hetpipe.planner.order.best_order` on large
    models); never exact for the full model's splits.
    """

    def __init__(self, fine: CostModel, grid: np.ndarray) -> None:
        """Share ``fine``'s cost tables; DP caches of its own, over ``grid``."""
        self.__dict__.update(fine.__dict__)
        self.fine = fine
        self.grid = np.asarray(grid, dtype=np.intp)
        self.L = len(self.grid) - 1
        n = self.L + 1
        self._memo = {}
        self._prefix = {}
        self._prefix_limit = max(256, (32 << 20) // (8 * n))
        self._f0 = np.full(n, INF)
        self._f0[0] = 0.0
        self._cols = np.arange(n)
        self.dp_steps = 0
        self.dp_runs = 0
        self._joint = {}
        self._short = {}
        self._least = {}
        self._bands = {}
        self._band_vals = {}
        self._band_ends = {}
        self._band_cells = 0
        self._grid_masked: dict[tuple, np.ndarray] = {}
        self._matrix_limit = max(16, (64 << 20) // (8 * n * n))

    def grid_model(self, points: int) -> CostModel:
        """Itself (already a grid)."""
        return self

    def masked_times(
        self,
        dtype: str,
        bw_in: float | None,
        bw_out: float | None,
        flight: int,
        cap: int,
        host_gbps: float = DEFAULT_HOST_GBPS,
        nm: int = 1,
    ) -> np.ndarray:
        """The full model's :meth:`CostTables.masked_times` at the grid's rows and columns."""
        key = self.fine.masked_key(dtype, bw_in, bw_out, flight, cap, host_gbps, nm)
        tm = self._grid_masked.get(key)
        if tm is None:
            if len(self._grid_masked) >= self._matrix_limit:
                self._grid_masked.clear()
            tm = self.fine.masked_at(dtype, bw_in, bw_out, flight, cap, host_gbps, nm, self.grid)
            self._grid_masked[key] = tm
        return tm

    def _new_band(
        self,
        dtype: str,
        bw_in: float | None,
        bw_out: float | None,
        flight: int,
        cap: int,
        host_gbps: float,
        nm: int,
    ) -> tuple[np.ndarray, int]:
        """The band of the grid's masked matrix (:meth:`masked_times`), small enough to
        build whole."""
        tm = self.masked_times(dtype, bw_in, bw_out, flight, cap, host_gbps, nm)
        return skew(lambda a, b: tm[a, b], first_finite(np.isfinite(tm)))

    def rest_bound(self, devices: Sequence[Any]) -> np.ndarray:
        """The full model's bound (:meth:`CostModel.rest_bound`) at the grid's boundaries."""
        return self.fine.rest_bound(devices)[self.grid]

    def describe(
        self,
        devices: Sequence[Any],
        cuts: Sequence[tuple[int, int]],
        nm: int,
        bws: tuple[float, ...] | None = None,
    ) -> Partition:
        """The full model's description of the split at these grid cuts."""
        g = self.grid
        return self.fine.describe(devices, [(int(g[a]), int(g[b])) for a, b in cuts], nm, bws)

    def diagnose(self, devices: Sequence[Any], nm: int) -> str:
        """No reason: a caller that needs one asks the full model."""
        return "no split on the coarse grid fits"


def _rate(count: float, time: float) -> float:
    """``count / time``, inf where ``time`` is 0."""
    return count / time if time > 0 else INF


def rate_bound(nm: float, t_below: float, h_below: float, t_fills: float, h_fills: float) -> float:
    """The most rate a stage-time limit between two known ones can reach: the rate is
    ``min(1 / T, Nm / h(T))`` with the least latency ``h`` falling as the limit ``T`` grows,
    so it is at most ``Nm / h_below`` up to ``t_below``, ``1 / t_fills`` from ``t_fills`` on,
    and ``min(1 / t_below, Nm / h_fills)`` between (shared by the per-order joint search and
    the class DP's)."""
    return max(
        _rate(nm, h_below),
        _rate(1.0, t_fills),
        min(_rate(1.0, t_below), _rate(nm, h_fills)),
    )


def _below(time: float, count: float, beat: float) -> bool:
    """Whether ``count / time`` (a rate bound) is below ``beat`` with a margin for rounding,
    so that a bound read from the DP's tables never prunes a split whose described rate
    rounds to ``beat`` or above."""
    if not time > 0:
        return False
    return count / time * (1.0 + 1e-9) < beat


def _windows(f: np.ndarray, w: int) -> np.ndarray:
    """``out[b, j] = f[b - w + j]`` (inf where ``b - w + j < 0``) for every ``b`` of ``f``: the
    states a band row (:meth:`CostTables.band`) pairs with, as a view."""
    padded = np.empty(len(f) + w)
    padded[:w] = INF
    padded[w:] = f
    step = padded.strides[0]
    return np.ndarray((len(f), w), dtype=padded.dtype, buffer=padded, strides=(step, step))


def _windows_rows(f: np.ndarray, w: int) -> np.ndarray:
    """:func:`_windows` of each row of ``f`` (shape ``(m, n)``): ``out[r, b, j] = f[r, b - w +
    j]``, as a view."""
    m, n = f.shape
    padded = np.empty((m, n + w))
    padded[:, :w] = INF
    padded[:, w:] = f
    s0, s1 = padded.strides
    return np.lib.stride_tricks.as_strided(
        padded, shape=(m, n, w), strides=(s0, s1, s1), writeable=False
    )


def _recall(states: dict[tuple, np.ndarray], sig: tuple) -> np.ndarray | None:
    """A cached DP state, moved to the end of the cache's order (the most recently used)."""
    hit = states.pop(sig, None)
    if hit is not None:
        states[sig] = hit
    return hit


def _keep(states: dict[tuple, np.ndarray], sig: tuple, f: np.ndarray, limit: int) -> None:
    """Cache a DP state, first dropping the least recently used eighth of a full cache: a
    search keeps coming back to short prefixes, which a cache cleared whole would lose."""
    if len(states) >= limit:
        for old in list(itertools.islice(states, max(1, limit // 8))):
            del states[old]
    states[sig] = f


def _grid(n_layers: int, points: int) -> np.ndarray:
    """About ``points`` evenly spaced layer boundaries from 0 to ``n_layers``, both included."""
    return np.unique(np.linspace(0, n_layers, points + 1).round().astype(np.intp))


def _merge_distinct(runs: Sequence[np.ndarray]) -> np.ndarray:
    """The distinct values of sorted arrays of finite floats, sorted: ``np.unique`` of their
    concatenation, the same array. A stable sort (timsort) merges the sorted runs in about
    ``n log(runs)`` where ``np.unique``'s sort takes ``n log n``."""
    merged = np.sort(np.concatenate(runs), kind="stable")
    if merged.size < 2:
        return merged
    keep = np.empty(merged.size, dtype=bool)
    keep[0] = True
    np.not_equal(merged[1:], merged[:-1], out=keep[1:])
    return merged[keep]


def _full(p: Partition) -> bool:
    """Nm covers the round trip: the bottleneck, not Nm, limits the rate."""
    return p.bottleneck <= 0 or p.nm * p.bottleneck >= p.latency


# ------------------------------------------------------------------------- functions


def partition(
    profile: ModelProfile,
    devices: Sequence[Any],
    nm: int,
    bandwidth: Bandwidth,
    optimizer_state_factor: int,
    *,
    model: CostModel | None = None,
    costs: RuntimeCosts | None = None,
    speeds: Mapping[str, float] | None = None,
) -> Partition | Infeasible:
    """Exact min-bottleneck contiguous split of ``profile`` over ``devices`` (in this order).

    ``devices`` need ``name``, ``type`` and ``memory`` (bytes); ``bandwidth(a, b)`` gives the
    bytes/s of the link between two of them. ``costs`` and ``speeds`` (by device type) add
    the runtime's per-stage costs (see the module docs). Raises :class:`PlanError` naming
    the device, link or layer whose figures cannot be priced (:func:`costs.check_devices`).
    """
    check_devices(devices, bandwidth)
    model = model or CostModel(profile, bandwidth, optimizer_state_factor, costs, speeds)
    return model.partition(devices, nm)


def partition_best_nm(
    profile: ModelProfile,
    devices: Sequence[Any],
    bandwidth: Bandwidth,
    optimizer_state_factor: int,
    nm_candidates: Iterable[int] | None = None,
    *,
    model: CostModel | None = None,
    costs: RuntimeCosts | None = None,
    speeds: Mapping[str, float] | None = None,
) -> Partition | Infeasible:
    """:func:`partition` with Nm chosen from ``nm_candidates`` (default 1..k) for throughput.

    A pipeline of k stages fills at Nm = k at the latest (its round trip is at most k
    bottlenecks), so larger candidates only cost memory under this estimate. Inputs are
    checked as :func:`partition` checks them.
    """
    check_devices(devices, bandwidth)
    model = model or CostModel(profile, bandwidth, optimizer_state_factor, costs, speeds)
    return model.best_nm(devices, nm_candidates)


def brute_force(
    profile: ModelProfile,
    devices: Sequence[Any],
    nm: int,
    bandwidth: Bandwidth,
    optimizer_state_factor: int,
    *,
    costs: RuntimeCosts | None = None,
    speeds: Mapping[str, float] | None = None,
    weights: str = "stash",
) -> Partition | Infeasible:
    """Every set of k-1 cuts, for tests: the optimum the DP must match exactly.

    Memory comes straight from :func:`memory.stage_memory` on the layer slices (independent
    of the DP's vectorised form); times from the scalar :meth:`CostModel.stage_time`.
    """
    model = CostModel(profile, bandwidth, optimizer_state_factor, costs, speeds, weights)
    k, L = len(devices), profile.n_layers()
    if k > L or k == 0:
        return Infeasible(f"{k} devices for {L} layers")
    bws = model.links(devices)
    best: tuple[float, float] | None = None
    best_cuts: list[tuple[int, int]] = []
    for inner in itertools.combinations(range(1, L), k - 1):
        bounds = (0, *inner, L)
        cuts = list(itertools.pairwise(bounds))
        ok = True
        times = []
        for i, (d, (a, b)) in enumerate(zip(devices, cuts, strict=True)):
            lps = profile.layers[d.type]
            inb = profile.input_bytes if a == 0 else lps[a - 1].out_bytes
            mem = stage_memory(
                lps[a:b],
                i,
                k,
                nm,
                optimizer_state_factor,
                inb,
                weights=weights,
                shared=profile.duplicate_bytes(a, b),
            )
            if mem.total > d.memory:
                ok = False
                break
            bw_in = bws[i - 1] if i > 0 else None
            times.append(
                model.stage_time(d.type, a, b, bw_in, bws[i] if i < k - 1 else None)
                + model.tie_time(a, b, bw_in, nm)
            )
        if not ok:
            continue
        score = (max(times), sum(times))
        if best is None or score < best:
            best, best_cuts = score, cuts
    if best is None:
        return Infeasible("no split fits in memory (brute force)")
    return model.describe(devices, best_cuts, nm, bws)
