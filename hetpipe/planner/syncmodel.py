"""The costs of synchronous pipelines (gpipe, 1f1b) for the synchronous planner: each
stage's times and memory on each device, the iteration time of a mapping with given cuts
(timed by the simulator's rules, :func:`hetpipe.planner.simulate.iteration_time`), and the
best cuts for a mapping and order (:meth:`SyncModel.best_cuts`). The search over mappings is
:mod:`hetpipe.planner.syncsearch`; the plan, :mod:`hetpipe.planner.syncplan`.

**Ties** (:attr:`ModelProfile.ties`). A stage counts a tied tensor once however many of its
layers use it. A tie whose layers fall in several stages is a copy on each, and before each
step the runtime sums its gradient over the copies along the pipeline's links
(:class:`hetpipe.pipeline.TieRoute`): every copy's sum goes to every other copy, passed on
by the stages between. The link after stage ``s`` carries, each iteration, the sums of the
holders at or before ``s`` up and of those after it down
(:meth:`ModelProfile.tie_link_bytes`); a stage passes a sum on once it has it, so each
direction's hops add up, and the steps wait for the slower direction
(:meth:`SyncModel.tie_exchange_s`), which the iteration time includes. The cut search also
tries the best cuts that keep every tie on one stage, so the exchange is paid only where
spanning a tie is faster.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hetpipe.core.memory import (
    StageMemory,
    backward_kind,
    deferred_grads,
    stage_memory_of,
    stage_terms,
)
from hetpipe.core.profile import ModelProfile, padded_speed, update_scale
from hetpipe.core.schedule import (
    DEVICE_KINDS,
    SYNC_KINDS,
    SYNCHRONOUS,
    iteration_trips,
    max_deferred,
    max_in_flight,
    microbatch_order,
)
from hetpipe.planner.costs import duplicate_matrix, kept_matrix, working_matrix
from hetpipe.planner.runtime import RuntimeCosts, reduce_answer_s
from hetpipe.planner.simulate import iteration_time

__all__ = ["SyncChoice", "SyncModel", "SyncStage", "warmup_ladder"]

INF = math.inf
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
    ``chunk_devices``: where a device-level kind (``interleaved-1f1b``, ``zbv``) is priced for
    a split whose devices run several stages each, the virtual worker's real device count D
    (each stage's order is its projection of its device's order on D devices); None prices
    two stages a device (:func:`hetpipe.core.devschedule.default_devices`).
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
        chunk_devices: int | None = None,
    ) -> None:
        if m < 1:
            raise ValueError(f"microbatches per iteration must be >= 1, got {m}")
        bad = [k for k in kinds if k not in SYNCHRONOUS]  # a device kind: priced when given
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
        self.chunk_devices = chunk_devices
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
        self._dup = duplicate_matrix(profile)  # tied bytes every [a, b) counts twice
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
                "S": kept_matrix(lps).astype(np.float64),  # [a, b) keeping all
                # outputs of the layers with weights (memory.split_grad_bytes)
                "Ow": pre(lp.out_bytes if lp.param_bytes else 0 for lp in lps),
                "in": np.array(
                    [self.profile.input_bytes] + [lp.out_bytes for lp in lps], dtype=np.float64
                ),  # in[a]: input bytes of a stage from a
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
        state = self._state(t, a, b)
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

    def _state(self, t: dict[str, np.ndarray], a: int, b: int) -> float:
        """Bytes of the state a stage of ``[a, b)`` holds: parameters (a tie once) and
        buffers."""
        dup = self.profile.duplicate_bytes(a, b) if self.profile.ties else 0
        return (t["P"][b] - t["P"][a]) - dup + (t["Bu"][b] - t["Bu"][a])

    def tie_bytes(self, cuts: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
        """Per link after each stage but the last: the ties' gradient bytes it carries up
        and down each iteration (:meth:`ModelProfile.tie_link_bytes`)."""
        return self.profile.tie_link_bytes(cuts)

    def tie_exchange_s(self, devs: Sequence[int], cuts: Sequence[tuple[int, int]]) -> float:
        """The time the ties' gradient sums add to an iteration of this mapping (0 where no
        tie spans stages): each direction's hops one after the other (a stage passes a sum
        on once it has it), each the bytes over the link, its latency and both ends'
        per-message costs; the steps wait for the slower direction."""
        if not self.profile.ties:
            return 0.0
        rt = self.rt
        up = down = 0.0
        for s, (u, d) in enumerate(self.tie_bytes(cuts)):
            bw = self.bw[devs[s], devs[s + 1]]
            for nbytes, side in ((u, 0), (d, 1)):
                if nbytes:
                    hop = (
                        nbytes / bw
                        + rt.latency_s
                        + self._send_s(nbytes)
                        + nbytes * rt.message_byte_s
                    )
                    if side == 0:
                        up += hop
                    else:
                        down += hop
        return float(max(up, down))

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
        # the one memory model prices every synchronous kind alike but for its counts: in
        # flight as :meth:`flight` charges, passed; the deferred gradients it counts from the
        # kind's default device count, which for interleaved-1f1b (whole backwards: none
        # deferred) need not divide m, so that kind is priced with 1f1b's (none either)
        priced = "1f1b" if kind == "interleaved-1f1b" else kind
        return stage_memory_of(
            self.profile,
            self.devices[i].type,
            (a, b),
            position,
            k,
            m or self.m,
            self.factor,
            priced,
            warmup=warmup,
            flight=self.flight(position, k, kind, m, warmup),
        )

    def chunk_devices_of(self, kind: str) -> int | None:
        """The device count ``kind``'s orders are projected from: :attr:`chunk_devices` for
        a device-level kind, None (the schedule's own default) otherwise."""
        return self.chunk_devices if kind in DEVICE_KINDS else None

    def order(self, kind: str, k: int, position: int, m: int | None = None, warmup: int = 0):
        """The microbatch order of ``position`` of ``k`` (:func:`microbatch_order`), a
        device-level kind's projected from :attr:`chunk_devices` devices."""
        return microbatch_order(
            kind, k, position, m or self.m, warmup, devices=self.chunk_devices_of(kind)
        )

    def flight(
        self, position: int, k: int, kind: str, m: int | None = None, warmup: int = 0
    ) -> int:
        """The minibatches in flight the memory model charges ``position`` of ``k``
        (:func:`max_in_flight` of its order, a device-level kind's on :attr:`chunk_devices`
        devices)."""
        return max_in_flight(
            kind, k, position, m or self.m, warmup=warmup, devices=self.chunk_devices_of(kind)
        )

    def _memory_matrix(
        self, i: int, position: int, k: int, kind: str, warmup: int = 0
    ) -> np.ndarray:
        """Total memory of every ``[a, b)`` on device ``i`` at ``position`` (inf if a >= b)."""
        t = self._t(self.devices[i].type)
        L = self.L
        P, Bu, S = t["P"], t["Bu"], t["S"]
        walk = "W:" + backward_kind(kind)
        if walk not in t:  # the working term of every [a, b) for the kind's backward
            lps = self.profile.layers[self.devices[i].type]
            t[walk] = working_matrix(lps, backward_kind(kind), ties=self.profile.ties).astype(
                np.float64
            )
        W = t[walk]
        mem = stage_terms(
            P[None, :] - P[:, None] - self._dup,
            Bu[None, :] - Bu[:, None],
            S,
            t["in"][: L + 1][:, None],
            W,
            factor=self.factor,
            flight=self.flight(position, k, kind, warmup=warmup),
            schedule=kind,
            deferred=deferred_grads(
                max_deferred(kind, k, position, self.m, devices=self.chunk_devices_of(kind)),
                self._split_grads(t, position),
            ),
        ).total
        upper = np.arange(L + 1)[None, :] > np.arange(L + 1)[:, None]
        return np.where(upper, mem, INF)

    def _split_grads(self, t: dict[str, np.ndarray], position: int) -> np.ndarray:
        """:func:`memory.split_grad_bytes` of every ``[a, b)``: the output's gradient, and
        past the first stage each other layer's with weights; none where ``[a, b)`` has no
        weights (``b <= a``: meaningless)."""
        L = self.L
        out = np.broadcast_to(t["in"][None, : L + 1], (L + 1, L + 1))
        weighted = (t["P"][None, :] - t["P"][:, None]) > 0
        if position == 0:
            return np.where(weighted, out, 0)
        ow = t["Ow"]
        before_last = ow[np.maximum(np.arange(L + 1) - 1, 0)]  # layers a .. b - 2
        return np.where(weighted, out + before_last[None, :] - ow[:, None], 0)

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
            self.chunk_devices,
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
            state = self._state(self._t(self.devices[i].type), a, b)
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
            stages, links, [self.order(kind, k, s, warmup=warmup) for s in range(k)]
        ) + self.tie_exchange_s(devs, cuts)

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
            for fits in (ok, self._ties_kept(ok)):
                bstar = self._minmax(cost, fits, link) if fits is not None else INF
                if bstar < INF:
                    for f in CAPS:
                        cuts = self._minsum(cost, fits, link, bstar * f)
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
            trips = len(iteration_trips(k, pos, self.order(kind, k, pos, warmup=warmup)))
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

    def _ties_kept(self, ok: list[np.ndarray]) -> list[np.ndarray] | None:
        """``ok`` with every stage but the last forbidden to end inside a tie (after its
        first layer, up to its last): the splits that keep every tie on one stage (None
        where the profile has no ties or none could span)."""
        inside = np.zeros(self.L + 1, dtype=bool)
        for tie in self.profile.ties:
            inside[tie.layers[0] + 1 : tie.layers[-1] + 1] = True
        if not inside.any() or len(ok) < 2:
            return None
        return [o & ~inside[None, :] if pos + 1 < len(ok) else o for pos, o in enumerate(ok)]

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
