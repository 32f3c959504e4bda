"""Discrete-event simulation of virtual workers under the runtime's exact rules.

Why simulate: a split's bottleneck says how fast a *full* pipeline runs, but not how Nm, the
links, and WSP waits between virtual workers (VWs) of different speed shape what a job gets.
The planner compares formations by what this simulator predicts.

What each stage does next is not decided here: every simulated stage asks a
:class:`hetpipe.core.schedule.StageSchedule` (the object the runtime executes), and this module
only times the actions and delivers the inputs. Timing:

* Forward, backward and optimizer step take the stage's ``fwd_s``, ``bwd_s`` and ``step_s``
  (async: the step is part of ``bwd_s`` as profiled, so ``step_s`` is 0); a push takes
  ``push_s``, a merge of pulled weights ``merge_s`` (wave >= 1). A stage runs one action at
  a time. Forwards, backwards, steps and pushes go to the compute thread in hand-offs as the
  runtime makes them (:meth:`hetpipe.core.schedule.StageSchedule.trip`): each hand-off costs
  ``handoff_s`` once, and what its actions send leaves when the whole hand-off is done.
* Each link between consecutive stages carries activations forward and gradients backward;
  each direction is a FIFO channel that moves one tensor at a time.
* WSP: a VW's clock is the number of waves every one of its stages with state has pushed,
  the global clock the minimum over VWs; a VW that has finished its minibatches no longer
  holds others back (its clock counts as infinite), as when the runtime retires it. A push
  counts on the shards ``push_flight_s`` after the stage sent it (its bytes' way over the
  links to shards on other hosts, one push after the other; the stage goes on meanwhile, as
  the runtime awaits the acknowledgements only at the end). A pull of wave c is answered
  ``pull_s`` after both it reached the shards and the global clock reached ``c - 1 - D``;
  it reaches them behind the stage's pushes sent before it (one connection per shard
  carries both, in order), so where pushes take a flight a pull waits for them to land.
  An answer whose weights cross a link (``pull_flight_s``, the part of ``pull_s`` that is
  their way back) takes that part on the link's channel, below.
* Shared links. A link between two hosts carries, in each direction, every transfer that
  crosses it: activations and gradients of every VW whose consecutive stages sit on that
  host pair, pushes to shards across it and pull answers from them. Transfers that name
  the same *channel* (``SimLink.fwd_channel``/``bwd_channel``, ``SimStage.push_channel``/
  ``pull_channel``, e.g. ``"a>b"``: host a's way to host b) share its capacity: the
  activations and gradients on it move one at a time, in the order they were sent; the
  parameter server's pushes and answers on it move one at a time among themselves, each
  stretched to the capacity the activations leave (its time / (1 - the share of the
  channel's time the activations took so far, at most :data:`ACT_SHARE_MAX`)). So two VWs
  that both send across one link each wait for the other's tensor, a push shares the link
  with the activations beside it, and alone a transfer goes as fast as before. An unnamed
  channel is the transfer's own (a VW's link direction, a stage's pushes), as when nothing
  shares it. Approximated: first come first served instead of the fair sharing TCP tends
  to, so a transfer waits for a whole earlier one rather than going on at half speed (the
  same finish time for the last of them, the link's throughput the same); activations go
  first, the parameter server's traffic takes what they leave on average (a small
  activation never waits behind a whole push, nor does a push slow one: TCP would slow
  both a little); a pull answer is booked on its channel when the clock releases it, so
  one booked ahead can hold up another sent before its time.
* Synchronous kinds: the mean gradient of an iteration is answered ``pull_s`` after every
  stage with state of every VW has sent its gradient for it.

One synchronous virtual worker alone needs no event queue: its stages' hand-offs are known
in advance, and :func:`iteration_time` times one iteration of them by the same rules
(:func:`trip_s`, :func:`send`), fast enough for the synchronous planner's search, which
prices every candidate with it.

Rates. ``vw_samples_per_s`` is each VW's steady rate: minibatches completed at stage 0 after
the first quarter (the pipeline's fill) and before the last Nm (the drain), divided by the
time they took. ``samples_per_s`` is their sum, what a long job gets; ``job_samples_per_s``
is every sample of the simulated run over its makespan (fill and drain included).
``iteration_s`` (synchronous kinds) is the mean time of one iteration after the first.

Memory. ``peak_in_flight`` is, per stage, the most minibatches it held at once under this
timing, a minibatch counting from its forward's start to its backward's end. The runtime
holds one from its forward's end to its backward's start
(:meth:`hetpipe.stage.StageCompute.forward` and ``backward``) and counts after each
forward; a stage runs one action at a time, so the two counts agree at every moment the
runtime looks, and both follow from the order of the stage's forwards and backwards alone.
The planner prices it as the stage's expected peak memory
(:func:`hetpipe.core.memory.expected_in_flight`).

One file on purpose: :func:`simulate` is one event loop whose handlers share its state, and
:func:`iteration_time` is its event-free path, which must time by the very same rules
(:func:`trip_s`, :func:`send`); the command line (``python -m hetpipe.planner.simulate``) is
the rest.
"""

from __future__ import annotations

import argparse
import functools
import heapq
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from hetpipe.core.schedule import (
    INPUT_GRAD_SHARE,
    Action,
    Backward,
    BackwardInput,
    BackwardWeight,
    Done,
    Forward,
    Merge,
    OptimizerStep,
    Push,
    StageSchedule,
    Wait,
    fill_counts,
    iteration_trips,
)
from hetpipe.core.wsp import pull_need

# the most of a shared link's time its activations are taken to leave the parameter
# server's traffic without (it always keeps some: a bound, not a measured figure)
ACT_SHARE_MAX = 0.9

__all__ = [
    "SimLink",
    "SimResult",
    "SimStage",
    "SimVW",
    "iteration_time",
    "main",
    "send",
    "simulate",
    "trip_s",
]


class Timed(Protocol):
    """What timing a stage's hand-offs reads of it (:class:`SimStage`, and the synchronous
    planner's :class:`hetpipe.planner.syncmodel.SyncStage`)."""

    @property
    def fwd_s(self) -> float: ...
    @property
    def bwd_s(self) -> float: ...
    @property
    def step_s(self) -> float: ...
    @property
    def push_s(self) -> float: ...
    @property
    def handoff_s(self) -> float: ...
    @property
    def state(self) -> bool: ...


@dataclass(frozen=True)
class SimStage:
    """Time of one stage per minibatch (forward, backward) and per wave (push, pull, merge)."""

    fwd_s: float
    bwd_s: float
    push_s: float = 0.0  # busy after the backward of a wave's last minibatch
    merge_s: float = 0.0  # busy before the forward of a wave's first minibatch (wave >= 1)
    pull_s: float = 0.0  # latency of a pull's (or a gradient exchange's) answer
    step_s: float = 0.0  # a synchronous iteration's optimizer step
    state: bool = True  # holds weights on the shards (pushes, and pulls with several VWs)
    handoff_s: float = 0.0  # per hand-off to the compute thread and back (any actions in it)
    push_flight_s: float = 0.0  # a push's way to the shards: they count it this much later
    push_channel: str = ""  # the shared link it takes (see the module docs); "": its own
    pull_flight_s: float = 0.0  # the part of pull_s that is the answer's way over a link
    pull_channel: str = ""  # the shared link the answer takes back; "": none shared
    # async: holds a copy of a tie spanning stages, so it pulls every wave even in a VW
    # alone, and then after every stage's push of the wave before (the runtime's rule)
    tied: bool = False


@dataclass(frozen=True)
class SimLink:
    """Transfer time over the link after a stage: activations forward, gradients backward."""

    fwd_s: float = 0.0
    bwd_s: float = 0.0
    # the shared link each direction takes (see the module docs); "": this VW's own
    fwd_channel: str = ""
    bwd_channel: str = ""


@dataclass(frozen=True)
class SimVW:
    stages: tuple[SimStage, ...]
    nm: int
    links: tuple[SimLink, ...] = ()  # k - 1 links, or empty for free transfers
    minibatch: int = 1  # samples per minibatch
    name: str = ""
    schedule: str = "async"  # hetpipe.core.schedule.KINDS; nm is M for the synchronous ones
    orders: tuple[tuple[tuple[str, int], ...], ...] | None = None  # per stage (sync)
    warmup: int = 0  # 1f1b: extra warm-up forwards of the default orders
    # async, per stage: the most minibatches it holds (0: the schedule's maximum), each
    # limited stage filled to :func:`hetpipe.core.schedule.fill_counts` first, as the runtime
    # runs a plan under train.in_flight = "plan"; empty: no stage is limited
    limits: tuple[int, ...] = ()
    # a device-level kind (interleaved-1f1b, zbv): the devices its stages' orders are
    # projected from (None: two stages a device)
    devices: int | None = None

    def __post_init__(self) -> None:
        if not self.stages:
            raise ValueError("a VW needs at least one stage")
        if self.nm < 1:
            raise ValueError(f"Nm must be >= 1, got {self.nm}")
        if self.links and len(self.links) != len(self.stages) - 1:
            raise ValueError(f"{len(self.stages)} stages need {len(self.stages) - 1} links")
        if self.limits and len(self.limits) != len(self.stages):
            raise ValueError(f"{len(self.stages)} stages need {len(self.stages)} limits")


@dataclass(frozen=True)
class SimResult:
    vw_samples_per_s: tuple[float, ...]
    samples_per_s: float
    job_samples_per_s: float
    makespan_s: float
    vw_finish_s: tuple[float, ...]
    busy: tuple[tuple[float, ...], ...]  # per VW, per stage: busy time / the VW's finish time
    gate_wait_s: tuple[float, ...]  # per VW: time stage 0 had a forward ready but WSP held it
    minibatches: int = 0  # per VW as simulated (sync: the first VW's; all run as many iterations)
    iteration_s: tuple[float, ...] = ()  # per VW, synchronous kinds: mean iteration time
    # per VW, per stage: (start time, action) in the order the stage ran them
    actions: tuple[tuple[tuple[tuple[float, Action], ...], ...], ...] = ()
    # per VW, per stage: hand-offs to the compute thread per minibatch (each pays handoff_s)
    trips: tuple[tuple[float, ...], ...] = ()
    # per VW, per stage: the most minibatches it held at once under this timing (a
    # minibatch counts from its forward's start to its backward's end, as the runtime holds
    # it: hetpipe.stage.StageStats.peak_in_flight); at most the schedule's maximum
    # (hetpipe.core.schedule.max_in_flight), which holds under ANY timing
    peak_in_flight: tuple[tuple[int, ...], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "vw_samples_per_s": list(self.vw_samples_per_s),
            "samples_per_s": self.samples_per_s,
            "job_samples_per_s": self.job_samples_per_s,
            "makespan_s": self.makespan_s,
            "vw_finish_s": list(self.vw_finish_s),
            "busy": [list(b) for b in self.busy],
            "gate_wait_s": list(self.gate_wait_s),
            "minibatches": self.minibatches,
            "iteration_s": list(self.iteration_s),
            "peak_in_flight": [list(x) for x in self.peak_in_flight],
        }


@dataclass
class _Stage:
    """One simulated stage: its schedule and what has arrived at it."""

    spec: SimStage
    schedule: StageSchedule
    acts: set[int] = field(default_factory=set)
    grads: set[int] = field(default_factory=set)
    answers: dict[tuple[int, bool], float] = field(default_factory=dict)  # pull -> ready at
    now: float = 0.0  # the simulated time the schedule is asked at
    idle: bool = True
    busy_s: float = 0.0
    trips: int = 0  # hand-offs to the compute thread
    held: int = 0  # minibatches between a forward's start and its backward's end
    peak_held: int = 0
    gate_since: float | None = None
    landed: float = 0.0  # when its pushes sent so far have all reached the shards
    log: list[tuple[float, Action]] = field(default_factory=list)

    # the schedule's Inputs
    def has_activation(self, p: int) -> bool:
        return p in self.acts

    def has_gradient(self, p: int) -> bool:
        return p in self.grads

    def pulled(self, c: int, grads: bool) -> bool:
        ready = self.answers.get((c, grads))
        return ready is not None and ready <= self.now

    def combined(self, p: int) -> bool:
        return True  # a replicated stage is simulated as one, its exchange in its time


@dataclass
class _VW:
    spec: SimVW
    stages: list[_Stage]
    link_free_f: list[float]
    link_free_b: list[float]
    done: int = 0  # backwards finished at stage 0 (in order)
    done_at: list[float] = field(default_factory=list)
    steps_at: list[float] = field(default_factory=list)  # sync: stage 0's optimizer steps
    gate_wait: float = 0.0
    pushed: list[int] = field(default_factory=list)
    end: float = 0.0  # when its last action so far completed

    def clock(self, total: int) -> float:
        if self.done >= total:
            return math.inf
        held = [n for n, st in zip(self.pushed, self.stages, strict=True) if st.spec.state]
        return min(held) if held else min(self.pushed)


def simulate(
    vws: Sequence[SimVW], staleness: int, minibatches: int, *, record: bool = False
) -> SimResult:
    """Run every VW for ``minibatches`` minibatches under WSP with staleness ``staleness``;
    ``record`` keeps every stage's timed actions (``SimResult.actions``)."""
    if staleness < 0:
        raise ValueError(f"staleness must be >= 0, got {staleness}")
    if minibatches < 1:
        raise ValueError(f"minibatches must be >= 1, got {minibatches}")
    N, D = minibatches, staleness
    several = len(vws) > 1
    # synchronous VWs exchange gradients every iteration, so all run as many iterations: N
    # counts the first one's microbatches, another with its own M runs that many of its M
    # (the runtime's rule, JobPlan.minibatches_of)
    counts = [-(-N // vws[0].nm) * v.nm if several and v.schedule != "async" else N for v in vws]
    state = [
        _VW(
            v,
            [
                _Stage(
                    st,
                    StageSchedule(
                        v.schedule,
                        k=len(v.stages),
                        stage=i,
                        nm=v.nm,
                        total=n_v,
                        staleness=D,
                        pulls=(several or st.tied) and st.state,
                        pushes=True,
                        order=v.orders[i] if v.orders else None,
                        warmup=v.warmup,
                        limit=limit or None,
                        fill=fill,
                        devices=v.devices,
                    ),
                )
                for i, (st, limit, fill) in enumerate(
                    zip(v.stages, limits, fill_counts(limits, v.nm), strict=True)
                )
            ],
            [0.0] * (len(v.stages) - 1),
            [0.0] * (len(v.stages) - 1),
            pushed=[0] * len(v.stages),
        )
        for v, n_v in zip(vws, counts, strict=True)
        for limits in [v.limits or (0,) * len(v.stages)]
    ]
    events: list[tuple[float, int, int, int, int, Any]] = []  # (time, seq, kind, vw, stage, x)
    seq = 0
    FREE, ARRIVE_F, ARRIVE_B, WAKE, PUSHED = 0, 1, 2, 3, 4
    glob = 0.0  # global clock
    glob_at = [0.0]  # glob_at[g]: when the global clock reached g
    pending: list[tuple[int, int, int, float]] = []  # weight pulls the clock still holds
    reduces: dict[int, list[tuple[int, int, float]]] = {}  # iteration -> contributions
    contributors = sum(1 for w in state for st in w.stages if st.schedule.pulls)
    # a shared link's direction -> when its activations' and its parameter server's queues
    # are free again, and the time its activations took so far
    channels: dict[str, float] = {}
    ps_channels: dict[str, float] = {}
    act_busy: dict[str, float] = {}

    def carry(channel: str, now: float, dur: float) -> float:
        """When an activation or gradient sent at ``now`` on a shared ``channel`` arrives."""
        start = max(now, channels.get(channel, 0.0))
        channels[channel] = start + dur
        act_busy[channel] = act_busy.get(channel, 0.0) + dur
        return start + dur

    def carry_ps(channel: str, now: float, dur: float) -> float:
        """When a push or pull answer sent at ``now`` on a shared ``channel`` arrives: after
        the ones before it, at the capacity the activations leave (see the module docs)."""
        share = min(ACT_SHARE_MAX, act_busy.get(channel, 0.0) / now) if now > 0 else 0.0
        start = max(now, ps_channels.get(channel, 0.0))
        ps_channels[channel] = start + dur / (1.0 - share)
        return ps_channels[channel]

    def push(t: float, kind: int, v: int, s: int, x: Any) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (t, seq, kind, v, s, x))

    # each VW's clock, recomputed only when one of its stages pushed or it finished
    clocks = [w.clock(n_v) for w, n_v in zip(state, counts, strict=True)]

    def global_clock() -> float:
        return min(clocks)

    def answer(v: int, s: int, key: tuple[int, bool], at: float) -> None:
        st = state[v].stages[s]
        st.answers[key] = at
        push(at, WAKE, v, s, None)

    def release_pulls(now: float) -> None:
        keep = []
        for v, s, c, sent in pending:
            need = c if not several and state[v].stages[s].spec.tied else pull_need(c, D)
            if glob >= need:
                ok = glob_at[min(need, len(glob_at) - 1)] if need >= 0 else 0.0
                # the initial weights are loaded before the run starts: not timed
                sp = state[v].stages[s].spec
                latency = sp.pull_s if c >= 1 else 0.0
                if c >= 1 and sp.pull_channel and sp.pull_flight_s > 0:
                    ready = max(sent, ok) + latency - sp.pull_flight_s
                    answer(v, s, (c, False), carry_ps(sp.pull_channel, ready, sp.pull_flight_s))
                else:
                    answer(v, s, (c, False), max(sent, ok) + latency)
            else:
                keep.append((v, s, c, sent))
        pending[:] = keep

    def dispatch(now: float, v: int, s: int) -> None:
        w = state[v]
        st = w.stages[s]
        if not st.idle:
            return
        st.now = now
        sched, sp = st.schedule, st.spec
        while True:
            a = sched.next(st)
            kind = type(a)
            if kind is Done:
                return
            if kind is Wait:
                if s == 0 and a.what == "pull" and st.gate_since is None:  # type: ignore[union-attr]
                    st.gate_since = now
                return
            if st.gate_since is not None and (kind is Forward or kind is Merge):
                w.gate_wait += now - st.gate_since
                st.gate_since = None
            sched.done(a)
            if kind in HANDED:  # a hand-off: the actions that join it run with it
                run = sched.trip(a, st)
                st.trips += 1
                for x in run:  # one at a time, in order: the count at each moment
                    if type(x) is Forward:
                        st.held += 1
                        if st.held > st.peak_held:
                            st.peak_held = st.held
                    elif type(x) is Backward or type(x) is BackwardWeight:
                        st.held -= 1
                dur = trip_s(sp, run)
                if record:
                    st.log.extend(zip(_starts(sp, run, now), run, strict=True))
                if dur <= 0:
                    for x in run:
                        finish(now, v, s, x)
                    continue
                st.idle = False
                st.busy_s += dur
                push(now + dur, FREE, v, s, run)
                return
            if record:
                st.log.append((now, a))
            if kind is Merge:
                dur = sp.merge_s if a.c >= 1 and not a.grads else 0.0  # type: ignore[union-attr]
            else:  # a pull: sent now, answered when the clock or the other VWs allow
                c = a.c  # type: ignore[union-attr]
                if a.grads:  # type: ignore[union-attr]
                    reduces.setdefault(c, []).append((v, s, now))
                    if len(reduces[c]) == contributors:
                        at = max(t for _v, _s, t in reduces[c])
                        for u, j, _t in reduces.pop(c):
                            answer(u, j, (c, True), at + state[u].stages[j].spec.pull_s)
                else:
                    pending.append((v, s, c, max(now, st.landed)))
                    release_pulls(now)
                continue
            if dur <= 0:
                finish(now, v, s, a)
                continue
            st.idle = False
            st.busy_s += dur
            push(now + dur, FREE, v, s, [a])
            return

    def finish(now: float, v: int, s: int, a: Action) -> None:
        """The effects of action ``a`` of stage ``s`` completing at ``now``."""
        w = state[v]
        if now > w.end:
            w.end = now
        links = w.spec.links
        kind = type(a)
        if kind is Forward:
            if s + 1 < len(w.stages):
                dur = links[s].fwd_s if links else 0.0
                if links and links[s].fwd_channel:
                    at = carry(links[s].fwd_channel, now, dur)
                else:
                    at = send(w.link_free_f, s, now, dur)
                push(at, ARRIVE_F, v, s + 1, a.p)
        elif kind is Backward or kind is BackwardInput or kind is BackwardWeight:
            if s > 0:
                if kind is not BackwardWeight:
                    dur = links[s - 1].bwd_s if links else 0.0
                    if links and links[s - 1].bwd_channel:
                        at = carry(links[s - 1].bwd_channel, now, dur)
                    else:
                        at = send(w.link_free_b, s - 1, now, dur)
                    push(at, ARRIVE_B, v, s - 1, a.p)
            elif kind is not BackwardInput:  # a minibatch is done once its weights' gradient is
                w.done += 1
                w.done_at.append(now)
                if w.done >= counts[v]:
                    advance(now, v)
        elif kind is OptimizerStep:
            if s == 0 and w.spec.schedule != "async":
                w.steps_at.append(now)
        elif kind is Push:
            st = w.stages[s]
            flight = st.spec.push_flight_s
            if flight > 0:
                if st.spec.push_channel:
                    st.landed = carry_ps(st.spec.push_channel, max(now, st.landed), flight)
                else:
                    st.landed = max(now, st.landed) + flight
                push(st.landed, PUSHED, v, s, a.c + 1)
            else:
                w.pushed[s] = a.c + 1
                advance(now, v)

    def advance(now: float, v: int) -> None:
        """VW ``v``'s clock may have moved: move the global clock where it does."""
        nonlocal glob
        clocks[v] = state[v].clock(counts[v])
        g = global_clock()
        if g > glob:
            glob = g
            while len(glob_at) <= min(g, N):
                glob_at.append(now)
            release_pulls(now)

    for v in range(len(state)):
        for s in range(len(state[v].stages)):
            dispatch(0.0, v, s)
    now = 0.0
    while events:
        now, _, kind, v, s, x = heapq.heappop(events)
        st = state[v].stages[s]
        if kind == ARRIVE_F:
            st.acts.add(x)
        elif kind == ARRIVE_B:
            st.grads.add(x)
        elif kind == FREE:
            st.idle = True
            for a in x:
                finish(now, v, s, a)
        elif kind == PUSHED:
            state[v].pushed[s] = max(state[v].pushed[s], x)
            advance(now, v)
            continue  # the stage itself did nothing: nothing new for it to run
        dispatch(now, v, s)
    unfinished = [
        (w.spec.name or f"vw{v}", s, st.schedule.next(st))
        for v, w in enumerate(state)
        for s, st in enumerate(w.stages)
        if not isinstance(st.schedule.next(st), Done)
    ]
    if unfinished:
        raise ValueError(f"simulation stalled: {unfinished[:3]}")
    finish_t = tuple(w.end for w in state)
    makespan = max(finish_t)
    rates = []
    for w, n_v in zip(state, counts, strict=True):
        # steady window: after the fill (first quarter), before the drain (the last Nm
        # complete with no forwards left to interleave, faster than the steady state)
        lo = n_v // 4
        hi = max(lo + 1, n_v - w.spec.nm)
        t0 = w.done_at[lo - 1] if lo > 0 else 0.0
        span = w.done_at[hi - 1] - t0
        rates.append((hi - lo) * w.spec.minibatch / span if span > 0 else math.inf)
    total = sum(n_v * w.spec.minibatch for w, n_v in zip(state, counts, strict=True))
    return SimResult(
        tuple(rates),
        sum(rates),
        total / makespan if makespan > 0 else math.inf,
        makespan,
        finish_t,
        tuple(
            tuple(st.busy_s / f if f > 0 else 0.0 for st in w.stages)
            for w, f in zip(state, finish_t, strict=True)
        ),
        tuple(w.gate_wait for w in state),
        N,
        tuple(_iteration_s(w.steps_at) for w in state),
        tuple(tuple(tuple(st.log) for st in w.stages) for w in state),
        tuple(
            tuple(st.trips / n_v for st in w.stages) for w, n_v in zip(state, counts, strict=True)
        ),
        tuple(tuple(st.peak_held for st in w.stages) for w in state),
    )


# actions run in hand-offs
HANDED = (Forward, Backward, BackwardInput, BackwardWeight, OptimizerStep, Push)


def _compute_s(sp: Timed, a: Action) -> float:
    """Time of a handed action in its hand-off (the hand-off's own cost aside). A split
    backward's halves take :data:`hetpipe.core.schedule.INPUT_GRAD_SHARE` of the backward
    and the rest."""
    kind = type(a)
    if kind is Forward:
        return sp.fwd_s
    if kind is Backward:
        return sp.bwd_s
    if kind is BackwardInput:
        return sp.bwd_s * INPUT_GRAD_SHARE
    if kind is BackwardWeight:
        return sp.bwd_s * (1.0 - INPUT_GRAD_SHARE)
    if kind is OptimizerStep:
        return sp.step_s
    return sp.push_s if sp.state else 0.0


def trip_s(sp: Timed, run: Sequence[Action]) -> float:
    """How long a hand-off to the compute thread keeps a stage busy: the hand-off's own cost
    once (there, and back after the last action) and each of its actions in order. What its
    actions send leaves when it is done. The one rule both timings use: :func:`simulate`
    and :func:`iteration_time`."""
    dur = sp.handoff_s
    for a in run:
        dur += _compute_s(sp, a)
    return dur


def _starts(sp: Timed, run: Sequence[Action], now: float) -> list[float]:
    """When each action of a hand-off starting at ``now`` starts (half the hand-off's cost
    is the way there)."""
    at, t = [], now + sp.handoff_s / 2
    for a in run:
        at.append(t)
        t += _compute_s(sp, a)
    return at


def send(free: list[float], i: int, now: float, dur: float) -> float:
    """When a tensor sent at ``now`` over direction ``i`` of a link arrives: each direction
    moves one tensor at a time (``free[i]``: when it is free again, updated), ``dur`` each."""
    start = max(now, free[i])
    free[i] = start + dur
    return start + dur


def iteration_time(
    stages: Sequence[Timed],
    links: Sequence[tuple[float, float]],
    orders: Sequence[Sequence[tuple[str, int]]],
) -> float:
    """Time of one synchronous iteration of a virtual worker alone in its job, by the
    simulator's rules (:func:`trip_s`, :func:`send`) without its event queue: every stage
    runs its order, then steps and pushes, in the hand-offs the schedule makes
    (:func:`hetpipe.core.schedule.iteration_trips`), one at a time, each starting when its
    first action's input is there. The grouping never waits for an input past the first
    action's, so each stage's hand-offs are known in advance and a sweep over the stages
    times them: what :func:`simulate` gives for one such iteration (``makespan_s``), at the
    speed the synchronous planner's search needs. ``links[s]``: the flight of an activation
    and of a gradient between stages ``s`` and ``s + 1``."""
    k = len(stages)
    m = sum(op == "F" for op, _ in orders[0])
    trips = [iteration_trips(k, s, tuple(orders[s])) for s in range(k)]
    took = []  # per stage, per hand-off: how long it keeps the stage busy
    for s in range(k):
        reps, shape = _trip_shapes(k, s, tuple(orders[s]))
        by_shape = [trip_s(stages[s], r) for r in reps]
        took.append([by_shape[j] for j in shape])
    fwd_in: list[list[float | None]] = [[0.0] * m] + [[None] * m for _ in range(k - 1)]
    bwd_in: list[list[float | None]] = [[None] * m for _ in range(k)]
    free = [0.0] * k
    link_f = [0.0] * max(k - 1, 0)
    link_b = [0.0] * max(k - 1, 0)
    pos = [0] * k
    total = sum(len(t) for t in trips)
    done = 0
    while done < total:
        moved = False
        for s in range(k):
            while pos[s] < len(trips[s]):
                trip = trips[s][pos[s]]
                head = trip[0]
                # what joins a trip needs no input; the last stage's backward needs its
                # forward only, run before it
                ready = (
                    fwd_in[s][head.p]  # type: ignore[union-attr]
                    if type(head) is Forward
                    else bwd_in[s][head.p]  # type: ignore[union-attr]
                    if (type(head) is Backward or type(head) is BackwardInput) and s < k - 1
                    else 0.0
                )
                if ready is None:
                    break
                end = max(free[s], ready) + took[s][pos[s]]
                for a in trip:  # sent once the hand-off is back
                    kind = type(a)
                    if kind is Forward and s + 1 < k:
                        fwd_in[s + 1][a.p] = send(link_f, s, end, links[s][0])  # type: ignore[union-attr]
                    elif (kind is Backward or kind is BackwardInput) and s > 0:
                        bwd_in[s - 1][a.p] = send(link_b, s - 1, end, links[s - 1][1])  # type: ignore[union-attr]
                free[s] = end
                pos[s] += 1
                done += 1
                moved = True
        if not moved:
            raise ValueError("iteration_time: the orders deadlock")
    return max(free)


@functools.lru_cache(maxsize=4096)
def _trip_shapes(
    k: int, stage: int, order: tuple[tuple[str, int], ...]
) -> tuple[tuple[tuple[Action, ...], ...], tuple[int, ...]]:
    """The stage's hand-offs of one iteration (:func:`iteration_trips`) by the kinds of
    their actions: one hand-off of each such shape, and each hand-off's shape. Hand-offs of
    one shape take equally long, so :func:`iteration_time` times each shape once."""
    reps: list[tuple[Action, ...]] = []
    index: dict[tuple[type, ...], int] = {}
    shape = []
    for trip in iteration_trips(k, stage, order):
        key = tuple(type(a) for a in trip)
        if key not in index:
            index[key] = len(reps)
            reps.append(trip)
        shape.append(index[key])
    return tuple(reps), tuple(shape)


def _iteration_s(steps_at: list[float]) -> float:
    """Mean time between a synchronous VW's iterations (after the first); 0 for async."""
    if not steps_at:
        return 0.0
    if len(steps_at) == 1:
        return steps_at[0]
    return (steps_at[-1] - steps_at[0]) / (len(steps_at) - 1)


# ------------------------------------------------------------------------------- CLI


def _vw_from_json(d: dict[str, Any], i: int) -> SimVW:
    def pair(x: Any, a: str, b: str) -> tuple[float, float]:
        if isinstance(x, dict):
            return float(x[a]), float(x[b])
        f, g = x
        return float(f), float(g)

    def stage(x: Any) -> SimStage:
        if isinstance(x, dict):
            extra: dict[str, Any] = {
                k: float(x[k])
                for k in ("push_s", "merge_s", "pull_s", "step_s", "push_flight_s", "pull_flight_s")
                if k in x
            }
            extra.update({k: str(x[k]) for k in ("push_channel", "pull_channel") if k in x})
            return SimStage(float(x["fwd_s"]), float(x["bwd_s"]), **extra)
        return SimStage(*pair(x, "fwd_s", "bwd_s"))

    def link(x: Any) -> SimLink:
        channels = (
            (str(x.get("fwd_channel", "")), str(x.get("bwd_channel", "")))
            if isinstance(x, dict)
            else ("", "")
        )
        return SimLink(*pair(x, "fwd_s", "bwd_s"), *channels)

    stages = tuple(stage(x) for x in d["stages"])
    links = tuple(link(x) for x in d.get("links", ()))
    return SimVW(
        stages,
        int(d.get("nm", 1)),
        links,
        int(d.get("minibatch", 1)),
        d.get("name", f"vw{i}"),
        str(d.get("schedule", "async")),
        limits=tuple(int(x) for x in d.get("limits", ())),
    )


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m hetpipe.planner.simulate",
        description="Simulate virtual workers (pipelines under asynchronous 1F1B) coupled by "
        "Wave Synchronous Parallel, and print their predicted throughput.",
        epilog='Input JSON: {"staleness": 0, "minibatches": 64, "vws": [{"nm": 4, '
        '"minibatch": 32, "stages": [[fwd_s, bwd_s], ...], "links": [[fwd_s, bwd_s], ...]}]}; '
        'a link as {"fwd_s", "bwd_s", "fwd_channel", "bwd_channel"} names the shared link '
        "each direction takes (a channel's transfers share its capacity)",
    )
    ap.add_argument("description", help="JSON file describing the VWs ('-' reads stdin)")
    ap.add_argument("--staleness", "-D", type=int, help="override the file's staleness D")
    ap.add_argument("--minibatches", "-n", type=int, help="override minibatches per VW")
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    args = ap.parse_args(argv)
    try:
        if args.description == "-":
            text = sys.stdin.read()
        else:
            with open(args.description) as fh:
                text = fh.read()
        desc = json.loads(text)
        vws = [_vw_from_json(x, i) for i, x in enumerate(desc["vws"])]
        D = args.staleness if args.staleness is not None else int(desc.get("staleness", 0))
        N = args.minibatches if args.minibatches is not None else int(desc.get("minibatches", 64))
        res = simulate(vws, D, N)
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"simulate: {args.description}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(res.to_dict()))
        return 0
    print(f"{'vw':<8}{'stages':>7}{'Nm':>4}{'samples/s':>12}{'gate wait s':>13}  busy per stage")
    for v, spec in enumerate(vws):
        busy = " ".join(f"{b:.0%}" for b in res.busy[v])
        print(
            f"{spec.name:<8}{len(spec.stages):>7}{spec.nm:>4}{res.vw_samples_per_s[v]:>12.1f}"
            f"{res.gate_wait_s[v]:>13.3f}  {busy}"
        )
    print(
        f"total {res.samples_per_s:.1f} samples/s steady; {res.job_samples_per_s:.1f} over the "
        f"whole run of {res.makespan_s:.3f}s (D={D}, {N} minibatches per VW)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
