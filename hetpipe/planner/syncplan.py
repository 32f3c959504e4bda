"""Planning synchronous pipelines (gpipe, 1f1b): partition, device mapping and microbatch
order chosen together to minimise the predicted time of one iteration.

A synchronous iteration is a flush: M microbatches go forward and back through the stages in
a fixed per-stage order (:func:`hetpipe.core.schedule.microbatch_order`), then every stage steps
its optimizer once. Its time is not the bottleneck stage's alone: with few microbatches the
fill and drain (every stage's forward and backward once, every link crossed twice) weigh as
much as the slowest stage's M - 1 further microbatches, so a fast pipeline may use fewer,
faster devices, and the device *mapping* matters through the actual link between each pair
of consecutive devices (an arbitrary bandwidth matrix: ``[[network.link]]`` overrides and
the intra/inter-node defaults).

Search (:func:`plan_sync`):

1. cuts for a fixed mapping and order: a min-max dynamic program gives the least bottleneck
   B*; min-sum programs under caps B* x (1, 1.1, 1.25, 1.5, 2, 3, inf) trade the fill and
   drain against the bottleneck; each candidate is timed exactly by the simulator's rules
   (:func:`hetpipe.planner.simulate.iteration_time`),
   and the best is refined by moving single cuts while that helps;
2. mappings: for every pipeline length, the fastest devices chained along their fastest
   links (greedy from several starts, then 2-opt), then a local search over the mapping
   (swap two stages' devices, replace one by an unused device, drop one, add one), within a
   time budget;
3. orders: every candidate is timed with each allowed order (gpipe; 1f1b, and with
   ``warmup = "auto"`` 1f1b with each extra warm-up of :func:`warmup_ladder`, the orders
   between the two); the fastest is kept;
4. several virtual workers (:func:`search_formations`): groups of devices formed by the
   asynchronous planner's policies (:mod:`.formation`), each group's pipeline searched as
   above for every M it may get, the iteration's M shared out so that the slowest group is
   as fast as it can be (:func:`split_microbatches`), plus the gradient exchange through
   the shards (:meth:`SyncModel.exchange_s`). :func:`sync_plan` compares them with one
   virtual worker by the simulated iteration time.

Every stage must fit its device's memory cap under the chosen kind (gpipe holds all M
microbatches' activations, 1f1b at most k - position; no weight stashing). :func:`exhaustive`
enumerates every mapping, partition and order, to check the search on small instances.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hetpipe.core.memory import StageMemory, in_flight, stage_memory_of, stage_terms
from hetpipe.core.profile import ModelProfile, padded_speed, update_scale
from hetpipe.core.schedule import (
    SYNC_KINDS,
    iteration_trips,
    microbatch_order,
)
from hetpipe.planner.runtime import RuntimeCosts, reduce_answer_s
from hetpipe.planner.simulate import iteration_time

__all__ = [
    "SyncChoice",
    "SyncFormation",
    "SyncModel",
    "SyncStage",
    "exhaustive",
    "iteration_time",  # the simulator's (hetpipe.planner.simulate), the search's timing
    "plan_sync",
    "search_formations",
    "search_sync",
    "split_microbatches",
    "sync_plan",
    "warmup_ladder",
]

INF = math.inf
PREDICT_ITERATIONS = 12  # iterations the final prediction simulates
RERANK = 5  # the fastest pipelines of the search ranked again with the hosts' sharing
SMALL = 7  # clusters this small get every mapping tried when no heuristic start fits
CAPS = (1.0, 1.1, 1.25, 1.5, 2.0, 3.0, INF)


@dataclass(frozen=True)
class SyncStage:
    """One stage's times: per microbatch (forward, backward, each with sending its output),
    per iteration (step, push), and per hand-off to the compute thread and back, paid once
    for all the actions that go in it (:meth:`hetpipe.core.schedule.StageSchedule.joins`), as the
    simulator's :class:`~hetpipe.planner.simulate.SimStage`, which times them
    (:func:`~hetpipe.planner.simulate.iteration_time`)."""

    fwd_s: float
    bwd_s: float
    step_s: float = 0.0
    push_s: float = 0.0
    handoff_s: float = 0.0
    state: bool = True  # as the simulator's: a stage without state pushes nothing


@dataclass(frozen=True)
class SyncChoice:
    """A planned synchronous pipeline: devices (indices into the model's), cuts, kind, and
    (1f1b) the extra warm-up forwards of its microbatch order."""

    devices: tuple[int, ...]
    cuts: tuple[tuple[int, int], ...]
    kind: str
    iteration_s: float
    warmup: int = 0


def warmup_ladder(m: int) -> tuple[int, ...]:
    """The extra warm-ups of 1f1b the planner tries with ``m`` microbatches: every one below
    ``m - 1`` (from there on the order is gpipe's) up to 4, then a geometric ladder, so that
    a long iteration adds a few orders, not m."""
    return tuple(w for w in (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64) if w < max(m - 1, 1))


class SyncModel:
    """Times and memory of stages of one model on the devices of one cluster.

    ``devices`` are the cluster's device specs (``name``, ``type``, ``memory``, ``speed``);
    ``bandwidth(a, b)`` bytes/s between two of them; ``m`` microbatches per iteration.
    """

    def __init__(
        self,
        profile: ModelProfile,
        devices: Sequence[Any],
        bandwidth: Callable[[Any, Any], float],
        m: int,
        optimizer_state_factor: int,
        costs: RuntimeCosts | None = None,
        kinds: Sequence[str] = SYNC_KINDS,
        warmups: Sequence[int] = (0,),
        shards: int = 1,
    ) -> None:
        if m < 1:
            raise ValueError(f"microbatches per iteration must be >= 1, got {m}")
        bad = [k for k in kinds if k not in SYNC_KINDS]
        if bad or not kinds:
            raise ValueError(f"kinds must be among {SYNC_KINDS}, got {list(kinds)}")
        self.profile = profile
        self.devices = tuple(devices)
        self.m = m
        self.kinds = tuple(kinds)
        if not warmups or min(warmups) < 0:
            raise ValueError(f"warmups must be >= 0, got {list(warmups)}")
        self.warmups = tuple(warmups)
        self.shards = shards  # the parameter-server shards the gradient exchange goes through
        # the microbatch orders tried: each kind; 1f1b with each extra warm-up that is not
        # gpipe's order already
        self.orders = tuple(
            dict.fromkeys(
                (kind, w)
                for kind in self.kinds
                for w in (self.warmups if kind == "1f1b" else (0,))
                if not (kind == "1f1b" and w >= m - 1 and w > 0 and "gpipe" in self.kinds)
            )
        )
        self.factor = optimizer_state_factor
        self.rt = costs or RuntimeCosts.zero()
        self.L = profile.n_layers()
        self.bw = np.array(
            [
                [float(bandwidth(a, b)) if a is not b else INF for b in self.devices]
                for a in self.devices
            ]
        )
        self._type: dict[str, dict[str, np.ndarray]] = {}
        self._cut_memo: dict[tuple, tuple[float, tuple[tuple[int, int], ...]] | None] = {}
        self.evaluations = 0
        self.deadline = INF  # time.monotonic() after which refinement stops early

    # -- per type prefix sums -------------------------------------------------------------

    def _t(self, dtype: str) -> dict[str, np.ndarray]:
        t = self._type.get(dtype)
        if t is None:
            lps = self.profile.layers[dtype]

            def pre(vals: Any) -> np.ndarray:
                return np.array([0, *itertools.accumulate(vals)], dtype=np.float64)

            t = {
                "F": pre(lp.fwd_s for lp in lps),
                "B": pre(lp.bwd_s for lp in lps),
                "U": pre(lp.update_s for lp in lps),
                # the stage call term (profile.CallProfile): once per forward, per backward,
                # per step
                "cf": np.float64(self.profile.call(dtype).fwd_s),
                "cb": np.float64(self.profile.call(dtype).bwd_s),
                "cu": np.float64(self.profile.call(dtype).update_s),
                "P": pre(lp.param_bytes for lp in lps),
                "Bu": pre(lp.buffer_bytes for lp in lps),
                "S": pre(lp.saved_bytes for lp in lps),
                "in": np.array(
                    [self.profile.input_bytes] + [lp.out_bytes for lp in lps], dtype=np.float64
                ),  # in[a]: input bytes of a stage from a
                "W": np.array([lp.work_bytes for lp in lps], dtype=np.float64),
            }
            self._type[dtype] = t
        return t

    @staticmethod
    def _speed(d: Any) -> float:
        """``d``'s emulation speed as the runtime pads it (at most 1)."""
        return padded_speed(float(getattr(d, "speed", 1.0)))

    def _task_s(self, d: Any) -> float:
        """A compute task's own cost inside the padded region (its hand-off is apart)."""
        return self.rt.task_s / self._speed(d)

    def _hop_s(self, d: Any, fwd: Any, bwd: Any) -> Any:
        """A hand-off's hop on ``d`` for tasks of these costs (numbers or arrays): none
        where they run on the event loop (an unslowed CPU device's tasks shorter than
        ``inline_s``: :mod:`hetpipe.computethread`). The search prices a virtual worker as if
        alone; with several, whose stages exchange every iteration and so keep the hand-off,
        the prediction that picks among formations (:func:`.predict.stage_costs`) knows."""
        inline = self.rt.runs_inline(
            np.maximum(fwd, bwd),
            speed=self._speed(d),
            on_cpu=str(getattr(d, "device", "cpu")).startswith("cpu"),
        )
        return np.where(inline, 0.0, self.rt.hop_s)

    def _send_s(self, nbytes: Any) -> Any:
        """The sender's cost of a message of ``nbytes`` (a number or an array of them)."""
        return self.rt.message_s + nbytes * self.rt.message_byte_s

    def stage(self, i: int, a: int, b: int, first: bool = True, last: bool = True) -> SyncStage:
        """Stage costs of layers ``[a, b)`` on device ``i`` (``first``/``last``: no gradient
        / activation to send) with the runtime's costs on an idle host, as
        :func:`hetpipe.planner.predict.stage_costs` and the simulator's stages have them
        unslowed: a forward or backward with its task cost and sending its output, a step
        and a push per iteration, a hop per hand-off."""
        d = self.devices[i]
        t = self._t(d.type)
        rt = self.rt
        task = self._task_s(d)
        state = (t["P"][b] - t["P"][a]) + (t["Bu"][b] - t["Bu"][a])
        fwd = t["F"][b] - t["F"][a] + t["cf"] + task
        bwd = t["B"][b] - t["B"][a] + t["cb"] + task
        return SyncStage(
            fwd_s=fwd + (0.0 if last else self._send_s(t["in"][b])),
            bwd_s=bwd + (0.0 if first else self._send_s(t["in"][a])),
            # the runtime pads forwards and backwards, never the step (the profile's is)
            step_s=(t["U"][b] - t["U"][a] + t["cu"]) * update_scale(self._speed(d)),
            push_s=(rt.wave_s + state * rt.wave_byte_s) if state else 0.0,
            handoff_s=float(self._hop_s(d, fwd, bwd)),
        )

    def link(self, i: int, j: int, b: int) -> float:
        """Flight of the activation of layer ``b - 1`` from device i to j (and of its
        gradient back): the bytes over the link, the latency, the receiver's decoding (the
        sender's cost is in its stage's)."""
        nbytes = self._t(self.devices[i].type)["in"][b]
        rt = self.rt
        return nbytes / self.bw[i, j] + rt.latency_s + nbytes * rt.message_byte_s

    def memory(
        self,
        i: int,
        a: int,
        b: int,
        position: int,
        k: int,
        kind: str,
        m: int | None = None,
        warmup: int = 0,
    ) -> StageMemory:
        """The one memory model (:func:`memory.stage_memory_of`) for layers ``[a, b)`` on
        device ``i`` (``m`` microbatches, default the model's); :meth:`_memory_matrix` is its
        vectorised total, the same integers."""
        return stage_memory_of(
            self.profile,
            self.devices[i].type,
            (a, b),
            position,
            k,
            m or self.m,
            self.factor,
            kind,
            warmup=warmup,
        )

    def _memory_matrix(
        self, i: int, position: int, k: int, kind: str, warmup: int = 0
    ) -> np.ndarray:
        """Total memory of every ``[a, b)`` on device ``i`` at ``position`` (inf if a >= b)."""
        t = self._t(self.devices[i].type)
        L = self.L
        P, Bu, S = t["P"], t["Bu"], t["S"]
        W = np.zeros((L + 1, L + 1))
        for a in range(L):
            W[a, a + 1 :] = np.maximum.accumulate(t["W"][a:])
        mem = stage_terms(
            P[None, :] - P[:, None],
            Bu[None, :] - Bu[:, None],
            S[None, :] - S[:, None],
            t["in"][: L + 1][:, None],
            W,
            factor=self.factor,
            flight=in_flight(position, k, self.m, kind, warmup=warmup),
            schedule=kind,
        ).total
        upper = np.arange(L + 1)[None, :] > np.arange(L + 1)[:, None]
        return np.where(upper, mem, INF)

    def sub(
        self,
        indices: Sequence[int],
        m: int,
        kinds: Sequence[str] | None = None,
        warmups: Sequence[int] | None = None,
    ) -> SyncModel:
        """The same model on the devices ``indices`` only, with ``m`` microbatches (one
        virtual worker of several); its device indices are positions in ``indices``."""
        devs = [self.devices[i] for i in indices]
        where = {id(d): k for k, d in enumerate(devs)}
        bw = self.bw[np.ix_(list(indices), list(indices))]
        out = SyncModel(
            self.profile,
            devs,
            lambda a, b: bw[where[id(a)], where[id(b)]],
            m,
            self.factor,
            self.rt,
            kinds or self.kinds,
            warmups or self.warmups,
            self.shards,
        )
        out._type = self._type  # the per-type prefix sums do not depend on the devices
        return out

    def exchange_s(self, devs: Sequence[int], cuts: Sequence[tuple[int, int]], vws: int) -> float:
        """The gradient exchange of ``vws`` virtual workers at an iteration's end, as the
        runtime does it (and :mod:`.predict` prices it): each stage with parameters sends its
        gradient sum to its shards, which answer once every virtual worker's has arrived; the
        stage then adopts the mean. The slowest stage's exchange delays the iteration."""
        rt = self.rt
        out = 0.0
        for i, (a, b) in zip(devs, cuts, strict=True):
            t = self._t(self.devices[i].type)
            state = (t["P"][b] - t["P"][a]) + (t["Bu"][b] - t["Bu"][a])
            if state:
                answer = reduce_answer_s(rt, state, vws, self.shards)
                merge = rt.hop_s + rt.wave_s + state * rt.wave_byte_s
                out = max(out, answer + merge)
        return float(out)

    # -- a mapping's iteration time -------------------------------------------------------

    def evaluate(
        self, devs: Sequence[int], cuts: Sequence[tuple[int, int]], kind: str, warmup: int = 0
    ) -> float:
        """Predicted iteration time, or inf where a stage does not fit its device."""
        self.evaluations += 1
        k = len(devs)
        for pos, (i, (a, b)) in enumerate(zip(devs, cuts, strict=True)):
            if self.memory(i, a, b, pos, k, kind, warmup=warmup).total > self.devices[i].memory:
                return INF
        return self.unchecked(devs, cuts, kind, warmup)

    def unchecked(
        self, devs: Sequence[int], cuts: Sequence[tuple[int, int]], kind: str, warmup: int = 0
    ) -> float:
        """Predicted iteration time, memory caps aside (also to price a split the user
        gave)."""
        k = len(devs)
        stages = [
            self.stage(i, a, b, pos == 0, pos == k - 1)
            for pos, (i, (a, b)) in enumerate(zip(devs, cuts, strict=True))
        ]
        links = [(self.link(devs[s], devs[s + 1], cuts[s][1]),) * 2 for s in range(k - 1)]
        return iteration_time(
            stages, links, [microbatch_order(kind, k, s, self.m, warmup) for s in range(k)]
        )

    def best_cuts(
        self, devs: Sequence[int], kind: str, warmup: int = 0
    ) -> tuple[float, tuple[tuple[int, int], ...]] | None:
        """The best cuts the search finds for this mapping and order (None: nothing fits)."""
        key = (tuple(devs), kind, warmup)
        if key in self._cut_memo:
            return self._cut_memo[key]
        k, L = len(devs), self.L
        out: tuple[float, tuple[tuple[int, int], ...]] | None = None
        if k <= L:
            cost, ok, link = self._matrices(devs, kind, warmup)
            cands = set()
            bstar = self._minmax(cost, ok, link)
            if bstar < INF:
                for f in CAPS:
                    cuts = self._minsum(cost, ok, link, bstar * f)
                    if cuts is not None:
                        cands.add(cuts)
            best = min(((self.evaluate(devs, c, kind, warmup), c) for c in cands), default=None)
            if best is not None and best[0] < INF:
                out = self._refine(devs, kind, warmup, *best)
        self._cut_memo[key] = out
        return out

    def _matrices(self, devs: Sequence[int], kind: str, warmup: int = 0):
        """Per position: busy time of [a, b) per microbatch (forward and backward with their
        sends, and the position's hand-offs of an iteration shared out), where it fits, and
        the link time after a stage ending at b."""
        k, L = len(devs), self.L
        cost, ok, link = [], [], []
        for pos, i in enumerate(devs):
            t = self._t(self.devices[i].type)
            F, B = t["F"], t["B"]
            trips = len(iteration_trips(k, pos, microbatch_order(kind, k, pos, self.m, warmup)))
            task = self._task_s(self.devices[i])
            fwd = (F[None, :] - F[:, None]) + t["cf"] + task
            bwd = (B[None, :] - B[:, None]) + t["cb"] + task
            c = fwd + bwd + self._hop_s(self.devices[i], fwd, bwd) * trips / self.m
            if pos > 0:
                c = c + self._send_s(t["in"][:, None])
            if pos + 1 < k:
                c = c + self._send_s(t["in"][None, :])
            mem = self._memory_matrix(i, pos, k, kind, warmup)
            ok.append(mem <= self.devices[i].memory)
            cost.append(c)
            if pos + 1 < k:
                link.append(
                    np.array(
                        [self.link(i, devs[pos + 1], b) if b > 0 else INF for b in range(L + 1)]
                    )
                )
        return cost, ok, link

    def _minmax(self, cost, ok, link) -> float:
        L = self.L
        f = np.full(L + 1, INF)
        f[0] = 0.0
        for pos in range(len(cost)):
            c = np.where(ok[pos], cost[pos], INF)
            if pos + 1 < len(cost):
                c = np.maximum(c, 2 * link[pos][None, :])
            f = np.min(np.maximum(f[:, None], c), axis=0)
        return float(f[L])

    def _minsum(self, cost, ok, link, cap: float) -> tuple[tuple[int, int], ...] | None:
        """Cuts minimising the sum of stage and link times with every stage (and link) under
        ``cap``: the fill and drain, for a bound on the bottleneck."""
        L, k = self.L, len(cost)
        f = np.full(L + 1, INF)
        f[0] = 0.0
        back = []
        for pos in range(k):
            c = np.where(ok[pos] & (cost[pos] <= cap * (1 + 1e-12)), cost[pos], INF)
            if pos + 1 < k:
                lk = link[pos][None, :]
                c = np.where(2 * lk <= cap * (1 + 1e-12), c + 2 * lk, INF)
            tot = f[:, None] + c
            arg = np.argmin(tot, axis=0)
            f = tot[arg, np.arange(L + 1)]
            back.append(arg)
        if not f[L] < INF:
            return None
        cuts = []
        b = L
        for pos in range(k - 1, -1, -1):
            a = int(back[pos][b])
            cuts.append((a, b))
            b = a
        return tuple(reversed(cuts))

    def _refine(self, devs, kind, warmup, t, cuts):
        """Move single cuts by up to two layers while the iteration gets faster."""
        cuts = list(cuts)
        improved = True
        while improved and time.monotonic() < self.deadline:
            improved = False
            for s in range(len(cuts) - 1):
                for d in (-2, -1, 1, 2):
                    b = cuts[s][1] + d
                    if not cuts[s][0] < b < cuts[s + 1][1]:
                        continue
                    trial = [*cuts[:s], (cuts[s][0], b), (b, cuts[s + 1][1]), *cuts[s + 2 :]]
                    tt = self.evaluate(devs, trial, kind, warmup)
                    if tt < t * (1 - 1e-9):
                        t, cuts, improved = tt, trial, True
        return t, tuple(cuts)

    def choice(self, devs: Sequence[int], kind: str, warmup: int = 0) -> SyncChoice | None:
        """This mapping in this order with its best cuts (None: nothing fits)."""
        r = self.best_cuts(devs, kind, warmup)
        return None if r is None else SyncChoice(tuple(devs), r[1], kind, r[0], warmup)

    def best_kind(self, devs: Sequence[int]) -> SyncChoice | None:
        """The fastest of :attr:`orders` on this mapping, each with its best cuts."""
        best = None
        for kind, warmup in self.orders:
            c = self.choice(devs, kind, warmup)
            if c is not None and (best is None or c.iteration_s < best.iteration_s):
                best = c
        return best


# -- the search over mappings ------------------------------------------------------------------


def _chain(model: SyncModel, subset: Sequence[int], start: int) -> list[int]:
    """``subset`` ordered as a path from ``start`` along the fastest links, then 2-opt."""
    rest = [i for i in subset if i != start]
    path = [start]
    while rest:
        nxt = max(rest, key=lambda j: model.bw[path[-1], j])
        path.append(nxt)
        rest.remove(nxt)

    def length(p: Sequence[int]) -> float:
        return sum(1.0 / model.bw[a, b] for a, b in itertools.pairwise(p))

    improved = True
    while improved and len(path) > 3:
        improved = False
        for i in range(1, len(path) - 1):
            for j in range(i + 1, len(path)):
                trial = path[:i] + path[i : j + 1][::-1] + path[j + 1 :]
                if length(trial) < length(path) * (1 - 1e-12):
                    path, improved = trial, True
    return path


def plan_sync(model: SyncModel, budget_s: float = 5.0) -> SyncChoice | None:
    """The fastest synchronous pipeline the search finds (None: the model fits nowhere)."""
    found = search_sync(model, budget_s)
    return found[0] if found else None


def search_sync(model: SyncModel, budget_s: float = 5.0) -> list[SyncChoice]:
    """Every pipeline the search timed, fastest first (empty: the model fits nowhere)."""
    deadline = model.deadline = time.monotonic() + budget_s
    n, L = len(model.devices), model.L

    def whole_s(t: dict[str, np.ndarray]) -> float:  # the model as one stage on a type
        return float(t["F"][-1] + t["B"][-1] + t["cf"] + t["cb"])

    power = [1.0 / max(whole_s(model._t(d.type)), 1e-12) for d in model.devices]
    ranked = sorted(range(n), key=lambda i: (-power[i], -model.devices[i].memory, i))
    lengths = list(range(1, min(n, L) + 1))
    if len(lengths) > 12:  # long clusters: a geometric ladder of pipeline lengths
        lengths = sorted({1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, min(n, L)} & set(lengths))
    seen: dict[tuple[int, ...], SyncChoice | None] = {}

    def try_(devs: Sequence[int]) -> SyncChoice | None:
        key = tuple(devs)
        if key not in seen:
            seen[key] = model.best_kind(key)
        return seen[key]

    starts: list[SyncChoice] = []
    for k in lengths:
        for subset in (ranked[:k], sorted(ranked, key=lambda i: -model.devices[i].memory)[:k]):
            orders = [
                _chain(model, subset, start)
                for start in dict.fromkeys((subset[0], max(subset, key=lambda i: power[i])))
            ]
            orders.append(sorted(subset, key=lambda i: -model.devices[i].memory))
            for order in orders:  # either direction: memory and links differ by position
                for devs in (order, order[::-1]):
                    c = try_(devs)
                    if c is not None:
                        starts.append(c)
        if time.monotonic() > deadline:
            break
    if not starts and n <= SMALL:
        # nothing the heuristics tried fits: on a small cluster, try every mapping in turn
        for k in range(1, min(n, L) + 1):
            for devs in itertools.permutations(range(n), k):
                c = try_(devs)
                if c is not None:
                    starts.append(c)
                    break
            if starts or time.monotonic() > deadline:
                break
    if not starts:
        return []
    starts.sort(key=lambda c: c.iteration_s)
    best = starts[0]
    for start in starts[:3]:
        cur = start
        while time.monotonic() < deadline:
            nxt = _improve(model, cur, try_, deadline)
            if nxt is None:
                break
            cur = nxt
        if cur.iteration_s < best.iteration_s:
            best = cur
    return sorted((c for c in seen.values() if c is not None), key=lambda c: c.iteration_s)


def _improve(model: SyncModel, cur: SyncChoice, try_, deadline: float) -> SyncChoice | None:
    """The first neighbouring mapping that is faster, or None."""
    devs = list(cur.devices)
    unused = [i for i in range(len(model.devices)) if i not in devs]
    k = len(devs)
    moves: list[list[int]] = []
    moves += [devs[:i] + devs[i + 1 :] for i in range(k) if k > 1]
    moves += [[*devs[:i], u, *devs[i + 1 :]] for i in range(k) for u in unused]
    moves += [
        [*devs[:i], devs[j], *devs[i + 1 : j], devs[i], *devs[j + 1 :]]
        for i in range(k)
        for j in range(i + 1, k)
    ]
    if k < model.L:
        moves += [[*devs[:i], u, *devs[i:]] for i in range(k + 1) for u in unused]
    for mv in moves:
        if time.monotonic() > deadline:
            return None
        c = try_(mv)
        if c is not None and c.iteration_s < cur.iteration_s * (1 - 1e-9):
            return c
    return None


def exhaustive(model: SyncModel) -> SyncChoice | None:
    """Every mapping (ordered subset of devices), every partition and every kind: the optimum
    of :meth:`SyncModel.evaluate`. For small instances only."""
    n, L = len(model.devices), model.L
    best: SyncChoice | None = None
    for k in range(1, min(n, L) + 1):
        partitions = [
            tuple(zip((0, *c), (*c, L), strict=True))
            for c in itertools.combinations(range(1, L), k - 1)
        ]
        for devs in itertools.permutations(range(n), k):
            for kind, warmup in model.orders:
                for cuts in partitions:
                    t = model.evaluate(devs, cuts, kind, warmup)
                    if best is None or t < best.iteration_s:
                        best = SyncChoice(devs, cuts, kind, t, warmup)
    return best if best is not None and best.iteration_s < INF else None


# -- several virtual workers -------------------------------------------------------------------


@dataclass(frozen=True)
class SyncFormation:
    """Synchronous virtual workers planned together: each one's pipeline (device indices of
    the whole model) and its microbatches per iteration, summing to the job's M."""

    vws: tuple[SyncChoice, ...]
    ms: tuple[int, ...]
    exchange_s: float
    iteration_s: float  # the slowest virtual worker's iteration plus the exchange
    policy: str


def split_microbatches(times: Sequence[Sequence[float]], m: int) -> tuple[int, ...] | None:
    """Microbatches per virtual worker, ``m`` in all and at least one each, that minimise the
    slowest one's iteration time. ``times[g][j]``: virtual worker g's time with j + 1
    microbatches (non-decreasing in j; inf where nothing fits). Greedy: every further
    microbatch goes to whoever it slows least; for non-decreasing times that minimises the
    maximum (no worker is ever given a microbatch past the optimum's bound while another
    could take it under that bound). None: fewer microbatches than workers, or one fits
    nowhere."""
    n = len(times)
    if n == 0 or n > m or any(not row or row[0] == INF for row in times):
        return None
    ms = [1] * n
    for _ in range(m - n):
        g = min(range(n), key=lambda g: (times[g][ms[g]] if ms[g] < len(times[g]) else INF, g))
        if ms[g] >= len(times[g]) or times[g][ms[g]] == INF:
            return None
        ms[g] += 1
    return tuple(ms)


def search_formations(
    model: SyncModel,
    formations: Sequence[tuple[str, Sequence[Sequence[int]]]],
    budget_s: float = 5.0,
) -> list[SyncFormation]:
    """Every formation of two or more virtual workers (``(policy, groups of device
    indices)``), each group's pipeline searched at each M it may get, M split by
    :func:`split_microbatches`, the exchange added; fastest first. One order for all (the
    runtime runs one schedule and warm-up per job)."""
    deadline = time.monotonic() + budget_s
    found: dict[tuple[tuple[int, ...], int, str, int], SyncChoice | None] = {}

    def best(group: tuple[int, ...], m: int, kind: str, warmup: int) -> SyncChoice | None:
        key = (group, m, kind, warmup)
        if key not in found:
            left = deadline - time.monotonic()
            sub = model.sub(group, m, (kind,), (warmup,))
            c = plan_sync(sub, max(0.05, left / 4)) if left > 0 else None
            found[key] = (
                None
                if c is None
                else SyncChoice(
                    tuple(group[i] for i in c.devices), c.cuts, c.kind, c.iteration_s, c.warmup
                )
            )
        return found[key]

    out = []
    for policy, groups in formations:
        n = len(groups)
        if not 2 <= n <= model.m:
            continue
        for kind, warmup in model.orders:
            if time.monotonic() > deadline:
                break
            rows = []
            for g in groups:
                row = []
                for j in range(1, model.m - n + 2):
                    c = best(tuple(g), j, kind, warmup)
                    row.append(INF if c is None else c.iteration_s)
                rows.append(row)
            ms = split_microbatches(rows, model.m)
            if ms is None:
                continue
            vws = tuple(best(tuple(g), mg, kind, warmup) for g, mg in zip(groups, ms, strict=True))
            assert all(c is not None for c in vws)
            x = max(
                model.exchange_s(c.devices, c.cuts, len(vws))  # type: ignore[union-attr]
                for c in vws
            )
            slowest = max(c.iteration_s for c in vws)  # type: ignore[union-attr]
            out.append(SyncFormation(vws, ms, x, slowest + x, policy))  # type: ignore[arg-type]
    return sorted(out, key=lambda f: f.iteration_s)


# -- plans the runtime executes ----------------------------------------------------------------


def _explicit(
    model: SyncModel,
    given: Sequence[tuple[tuple[int, ...], tuple[tuple[int, int], ...] | None]],
    warnings: list[str],
) -> list[SyncChoice]:
    """The job's own virtual workers (devices, and cuts or None for the best ones), all in
    the one order of :attr:`SyncModel.orders` whose slowest virtual worker is fastest (the
    runtime runs one order per job). Given cuts over a memory cap are priced anyway, in the
    first order, with a warning per stage over its cap."""
    best: list[SyncChoice] | None = None
    for kind, warmup in model.orders:
        row = []
        for devs, cuts in given:
            if cuts is None:
                row.append(model.choice(devs, kind, warmup))
            else:
                row.append(
                    SyncChoice(devs, cuts, kind, model.evaluate(devs, cuts, kind, warmup), warmup)
                )
        if all(c is not None and c.iteration_s < INF for c in row) and (
            best is None
            or max(c.iteration_s for c in row)  # type: ignore[union-attr]
            < max(c.iteration_s for c in best)
        ):
            best = row  # type: ignore[assignment]
    if best is not None:
        return best
    from hetpipe.planner.plans import PlanError

    kind, warmup = model.orders[0]
    out = []
    for v, (devs, cuts) in enumerate(given):
        if cuts is None:
            c = model.choice(devs, kind, warmup)
            if c is None:
                names = [model.devices[i].name for i in devs]
                raise PlanError(f"vw {v}: the model fits on no split of {names}")
            out.append(c)
            continue
        for pos, (i, (a, b)) in enumerate(zip(devs, cuts, strict=True)):
            need = model.memory(i, a, b, pos, len(devs), kind, warmup=warmup).total
            if need > model.devices[i].memory:
                warnings.append(
                    f"vw {v}: {model.devices[i].name} needs {need} bytes, "
                    f"over its cap {model.devices[i].memory}"
                )
        out.append(SyncChoice(devs, cuts, kind, model.unchecked(devs, cuts, kind, warmup), warmup))
    return out


def sync_plan(
    cluster: Any,
    profile: ModelProfile,
    *,
    minibatch: int,
    m: int,
    optimizer_state_factor: int,
    kind: str | None = None,
    vws: Sequence[tuple[Sequence[str], Sequence[int] | None]] | None = None,
    num_vws: int | None = None,
    policy: str = "auto",
    costs: RuntimeCosts | None = None,
    budget_s: float = 5.0,
    warmup: int | None = 0,
) -> Any:
    """A :class:`~hetpipe.planner.plans.Plan` for a synchronous job of ``m`` microbatches per
    iteration: searched (``kind`` None picks gpipe or 1f1b), or priced for the given ``vws``
    (devices in order, layers per stage or None for the best cuts; each runs ``m``).
    ``warmup``: 1f1b's extra warm-up forwards (:func:`hetpipe.core.schedule.microbatch_order`);
    None: the planner picks the order from :func:`warmup_ladder` too.

    Searched, one virtual worker or several (``num_vws``: exactly that many; None: whichever
    is predicted faster): several are formed by the asynchronous planner's policies
    (:mod:`.formation`: NP, ED, HD), each gets its own pipeline, and the iteration's ``m``
    microbatches are shared out so that the virtual workers end their parts together (the
    faster get more); the iteration then waits for the gradient exchange. The few fastest
    candidates on an idle host are ranked again with the hosts' sharing simulated."""
    from hetpipe.planner.formation import candidate_formations
    from hetpipe.planner.placement import place_plan
    from hetpipe.planner.plan import _at_minibatch, _cost_model, _power, _shard_hosts
    from hetpipe.planner.plans import Plan, PlanError, StagePlan, VWPlan
    from hetpipe.planner.predict import predict

    if m < 1:
        raise PlanError(f"microbatches per iteration must be >= 1, got {m}")
    warnings: list[str] = []
    profile = _at_minibatch(profile, minibatch, warnings)
    usable = [d for d in cluster.devices if d.type in profile.layers]
    if not usable:
        raise PlanError("no device has a profile")
    model = SyncModel(
        profile,
        usable,
        cluster.network.bytes_per_s,
        m,
        optimizer_state_factor,
        (costs or RuntimeCosts()).with_runtime(cluster),
        (kind,) if kind else SYNC_KINDS,
        (warmup,) if warmup is not None else warmup_ladder(m),
        shards=len(_shard_hosts(cluster)),
    )
    index = {d.name: i for i, d in enumerate(usable)}
    cm = _cost_model(cluster, profile, optimizer_state_factor, costs)

    def _predict(vws: Sequence[SyncChoice], ms: Sequence[int]) -> tuple[float, Any]:
        """Iteration time with the runtime's costs, the gradient exchange and the sharing of
        each host's cores, simulated (the search ranks with the idle-host costs alone)."""
        parts = [
            (
                tuple(usable[i] for i in c.devices),
                cm.describe([usable[i] for i in c.devices], c.cuts, mv),
            )
            for c, mv in zip(vws, ms, strict=True)
        ]
        pred = predict(
            cm,
            parts,
            minibatch=minibatch,
            staleness=0,
            shard_hosts=_shard_hosts(cluster),
            minibatches=PREDICT_ITERATIONS * ms[0],
            schedule=vws[0].kind,
            warmup=vws[0].warmup,
        )
        return max(*pred.sim.iteration_s, 1e-12), pred

    chosen: list[SyncChoice] = []
    ms: tuple[int, ...] = ()
    exchange = 0.0
    if vws:
        given = []
        for v, (names, layers) in enumerate(vws):
            try:
                devs = tuple(index[n] for n in names)
            except KeyError as e:
                raise PlanError(f"vw {v}: unknown or unprofiled device {e.args[0]!r}") from None
            cuts = (
                None
                if layers is None
                else tuple(itertools.pairwise(itertools.accumulate(layers, initial=0)))
            )
            given.append((devs, cuts))
        chosen = _explicit(model, given, warnings)
        ms = (m,) * len(chosen)
        exchange = (
            max(model.exchange_s(c.devices, c.cuts, len(chosen)) for c in chosen)
            if len(chosen) > 1
            else 0.0
        )
        how = "explicit"
    else:
        several = num_vws is None or num_vws > 1
        single = num_vws in (None, 1)
        cands: list[tuple[str, tuple[SyncChoice, ...], tuple[int, ...], float]] = []
        if single:
            found = search_sync(model, budget_s / 2 if several else budget_s)
            cands += [("sync", (c,), (m,), 0.0) for c in found[:RERANK]]
        if several:
            try:
                forms = candidate_formations(
                    usable, policy, num_vws if num_vws != 1 else None, _power(profile)
                )
            except ValueError as e:
                raise PlanError(str(e)) from None
            groups = [
                (f.policy, [tuple(index[d.name] for d in g) for g in f.groups]) for f in forms
            ]
            formed = search_formations(model, groups, budget_s / 2 if single else budget_s)
            cands += [(f.policy, f.vws, f.ms, f.exchange_s) for f in formed[:RERANK]]
        if not cands:
            if single:
                raise PlanError(
                    "the model fits on no pipeline of the usable devices under the "
                    "synchronous schedules' memory"
                )
            raise PlanError(
                f"no formation of {num_vws} synchronous virtual workers fits (each "
                f"needs a pipeline that fits and at least one of the {m} "
                f"microbatches per iteration)"
            )
        # the few fastest on an idle host, ranked again with the sharing of the hosts' cores
        how, best, ms, exchange = min(cands, key=lambda x: _predict(x[1], x[2])[0])
        chosen = list(best)
        if how != "sync":
            why = "predicted faster than one" if num_vws is None else "as asked (train.vws)"
            warnings.append(
                f"{len(chosen)} synchronous virtual workers ({how}), microbatches "
                f"per iteration {list(ms)}: {why}"
            )
    kinds = {(c.kind, c.warmup) for c in chosen}
    if len(kinds) > 1:
        raise PlanError(f"virtual workers would run different orders {sorted(kinds)}")
    warm = chosen[0].warmup
    searched = max(c.iteration_s for c in chosen) + exchange
    iteration, pred = _predict(chosen, ms)
    layer_shards, stage_shards = place_plan(
        cluster,
        profile,
        [[(usable[i], ab) for i, ab in zip(c.devices, c.cuts, strict=True)] for c in chosen],
    )
    plans = []
    for v, (c, mv) in enumerate(zip(chosen, ms, strict=True)):
        k = len(c.devices)
        stages = []
        for pos, (i, (a, b)) in enumerate(zip(c.devices, c.cuts, strict=True)):
            # the order fixes what a stage holds, whatever the timing: the expected peak is
            # the bound (hetpipe.core.memory.expected_in_flight)
            mem = model.memory(i, a, b, pos, k, c.kind, mv, warm)
            n = in_flight(pos, k, mv, c.kind, warmup=warm)
            stages.append(
                StagePlan(
                    usable[i].name,
                    usable[i].type,
                    (a, b),
                    pred.compute_s(v, pos),
                    mem,
                    usable[i].memory,
                    stage_shards[v][pos],
                    pred.busy_s(v, pos, mv),
                    pred.slowdown[v][pos],
                    expected_memory=mem,
                    expected_in_flight=n,
                    in_flight=n,
                )
            )
        plans.append(
            VWPlan(
                tuple(usable[i].name for i in c.devices),
                tuple(stages),
                mv,
                mv * minibatch / iteration,
            )
        )
    used = {n for p in plans for n in p.devices}
    unused = tuple(d.name for d in cluster.devices if d.name not in used)
    details = {
        "iteration_s": iteration,
        "searched_iteration_s": searched,
        "kind": chosen[0].kind,
        "warmup": warm,
        "slowdown": [list(x) for x in pred.slowdown],
        "evaluations": model.evaluations,
        "microbatches": list(ms),
        "exchange_s": exchange,
        "orders": {
            str(s): [
                f"{op}{j}"
                for op, j in microbatch_order(
                    chosen[0].kind, len(chosen[0].devices), s, ms[0], warm
                )
            ]
            for s in range(len(chosen[0].devices))
        },
    }
    return Plan(
        tuple(plans),
        sum(p.samples_per_s for p in plans),
        how,
        unused,
        tuple(warnings),
        tuple(layer_shards),
        minibatch,
        0,
        profile.model,
        details,
        chosen[0].kind,
        iteration,
        warm,
    )
