"""From chosen splits to predicted times: the runtime's costs, host sharing, and the simulator.

:mod:`.partition` picks splits by their stage times on an otherwise idle machine; this module
predicts what a job of those splits really gets. Per stage and minibatch it adds what the
runtime does around the layers (:class:`.runtime.RuntimeCosts`: hand-offs to the compute
thread, sending activations and gradients, per wave pushing the update and, with several
virtual workers, pulling and merging the global weights; the bytes of a push and of a pull
to a shard on another host also cross that link: :func:`.placement.shard_flights`), then
finds how much the processes of each host slow each other down (:func:`.runtime.slowdowns`)
as a fixed point with the simulated rates:

1. every process starts unslowed (slowdown 1);
2. the simulator gives each virtual worker's rate with stage times stretched by the current
   slowdowns;
3. a worker wants a core for its compute (a padded device only ``speed`` of it: the pad
   sleeps) and its event loop's work, a shard for applying pushes and answering pulls; rate x
   CPU seconds per minibatch x slowdown is the fraction of time each wants a core;
4. processor sharing on each host's cores gives new slowdowns, taken whole after the first
   round (the unslowed start is far from any answer) and halfway after that (the sharing
   and the rates pull against each other); repeat until they settle. A padded device's
   compute has its own: the runtime pads it to the least CPU time its kind of pass took /
   speed (:func:`hetpipe.emulate.pad`), so a share of a core down to ``speed``, or cycles
   lost to co-running cores, only fill time the pad would sleep
   (:func:`.runtime.slowdown_of`). The workers of a synchronous
   job are not independent (a flush decides who computes at once): there the law of who
   else wants a core comes from the simulated timeline (:func:`_timeline_laws`).

Devices on ``cuda`` compute on their GPU: only their event loop competes for the host's cores.

Shared links. A stage's costs price each transfer as if it were alone on its link; but
every VW of an ED formation sends its activations over the same link between two hosts,
and under the default placement every VW's stages push to and pull from a shard across
it at about the same moment of each wave (WSP keeps the VWs' waves together), so a link
that carries one VW's traffic comfortably can be the bottleneck of four. Each transfer
between two different hosts therefore names its link's direction (:func:`_channels`:
activations host i > host i+1, gradients back, a push to the host of its shards
(:func:`.placement.shard_routes`), a pull's answer back), and the simulator shares one
direction's capacity among the transfers that name it (:mod:`.simulate`, shared links);
alone a transfer is as fast as before. Approximated: a link is a
host pair (every device pair between two hosts shares it, whatever their
``[[network.link]]`` figures); activations go first on it and the parameter server's
traffic takes the capacity they leave on average (:mod:`.simulate`: a small activation
never waits behind a whole push, where TCP would slow both a little); a stage whose state
lies on several other hosts sends it all over the link to the one with most of it;
traffic inside a host (its loopback) is not shared. Inside :func:`links_alone` every
transfer is priced alone again (a benchmark's comparison).

One file on purpose: the per-stage costs (:func:`stage_costs`), the simulated virtual
workers built from them and the fixed point over host sharing (:func:`predict`) are one
computation, each step feeding the next.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hetpipe.core.memory import copy_seconds, unhidden_copy_s
from hetpipe.core.schedule import (
    INPUT_GRAD_SHARE,
    Backward,
    BackwardInput,
    BackwardWeight,
    Forward,
    Merge,
    OptimizerStep,
    Push,
)
from hetpipe.planner.partition import CostModel, Partition
from hetpipe.planner.placement import (
    flights_of,
    remote_link_times,
    routes_of,
    shard_shares,
    stage_shard_bytes,
)
from hetpipe.planner.replicas import exchange_time, flight_time
from hetpipe.planner.runtime import (
    all_busy,
    count_law,
    host_cores,
    reduce_answer_s,
    slowdown_of,
    slowdowns,
)
from hetpipe.planner.simulate import SimLink, SimResult, SimStage, SimVW, simulate

__all__ = [
    "Prediction",
    "StageCost",
    "links_alone",
    "predict",
    "sim_minibatches",
    "stage_costs",
]

MAX_ROUNDS = 30
# transfers that cross one link between hosts at once share its capacity (see the module
# docs); links_alone() prices each as if alone, to show what the sharing changes
SHARE_LINKS = True


@contextlib.contextmanager
def links_alone() -> Iterator[None]:
    """Within it, every transfer is priced as if alone on its link (:data:`SHARE_LINKS`
    off), as the planner did before links were shared; restored on leaving."""
    global SHARE_LINKS
    saved, SHARE_LINKS = SHARE_LINKS, False
    try:
        yield
    finally:
        SHARE_LINKS = saved


TOLERANCE = 0.01  # relative change of every slowdown at which the fixed point has settled


@dataclass(frozen=True)
class StageCost:
    """One stage's costs on an idle host, per minibatch unless said per wave."""

    compute_fwd_s: float  # forward task(s) as the runtime measures them (padded)
    compute_bwd_s: float  # backward task (padded) and async update (not); 0 on the last stage
    loop_fwd_s: float  # hand-off and sending the activation (last stage: the gradient)
    loop_bwd_s: float  # hand-off and sending the gradient (0 where no backward task)
    recv_s: float  # decoding what arrives (overlaps compute: CPU, not stage time)
    push_s: float  # per wave
    merge_s: float  # per wave, several VWs only
    pull_s: float  # per wave, latency of the answer, several VWs only
    link_s: float  # flight of this stage's activation to the next stage (and the gradient back)
    cpu_s: float  # CPU seconds per minibatch of the worker on an idle host
    shard_cpu_s: float  # CPU seconds per wave of the shards for this stage
    compute_cpu_s: float = 0.0  # the part of cpu_s that is compute (cools down when idle)
    on_cpu: bool = True  # computes on the host's cores (an emulated device)
    step_s: float = 0.0  # synchronous kinds: the iteration's optimizer step (unpadded)
    hop_s: float = 0.0  # a hand-off's own CPU, in each loop above that is not 0 and in push_s
    exchange_s: float = 0.0  # a replicated stage: its replicas' gradient exchange
    # per wave: its state's time on the links to shards on other hosts (a push's way there,
    # and a pull's way back: :func:`.placement.shard_flights`); link time, not CPU
    shard_link_s: float = 0.0
    # the speed the runtime pads this stage's compute to on its thread's CPU time (1: no
    # such pad; :func:`hetpipe.emulate.pad`), and the unpadded async update inside the
    # backward task (the last async stage: its one task)
    pad_speed: float = 1.0
    update_in_task_s: float = 0.0
    # its tasks run on the event loop, not handed to the compute thread (an unslowed CPU
    # device's tasks shorter than ``RuntimeCosts.inline_s``): no hop, no hand-off wake-ups
    inline: bool = False
    # async: holds a copy of a tie spanning stages (pulls every wave: SimStage.tied)
    tied: bool = False

    @property
    def compute_s(self) -> float:
        return self.compute_fwd_s + self.compute_bwd_s

    @property
    def cools(self) -> bool:
        """Whether a task of this stage costs more after its thread idled
        (``RuntimeCosts.cold``): an unpadded device on the host's cores. A GPU's kernels do
        not run on the host's caches and clocks; a padded device pads each pass from the
        least CPU time its kind took (:class:`hetpipe.emulate.Pace`), so a cold start only
        shortens its sleep."""
        return self.on_cpu and self.pad_speed >= 1.0

    def tasks_s(self, slow: float, pad_slow: float, cold: float) -> tuple[float, float]:
        """The forward and backward tasks' compute when the worker's CPU work runs ``slow``
        times slower, its padded compute ``pad_slow`` times (a share of a core down to
        ``pad_speed`` only fills what the pad would sleep: :func:`.runtime.slowdown_of`) and
        a cold start costs ``cold`` times the work."""
        upd = self.update_in_task_s
        in_fwd = upd if not self.compute_bwd_s else 0.0
        in_bwd = upd - in_fwd
        return (
            cold * (pad_slow * (self.compute_fwd_s - in_fwd) + slow * in_fwd),
            cold * (pad_slow * (self.compute_bwd_s - in_bwd) + slow * in_bwd),
        )


@dataclass(frozen=True)
class Prediction:
    """What a job of the chosen splits gets, after host sharing settled."""

    sim: SimResult
    costs: tuple[tuple[StageCost, ...], ...]
    slowdown: tuple[tuple[float, ...], ...]  # per VW, per stage: its worker's slowdown
    wake: tuple[tuple[float, ...], ...]  # per VW, per stage: the expected wait of a wake-up
    cold: tuple[tuple[float, ...], ...]  # per VW, per stage: compute stretch from cold starts
    # per VW, per stage: its padded compute's slowdown (:meth:`StageCost.tasks_s`)
    pad_slowdown: tuple[tuple[float, ...], ...]
    rounds: int  # fixed-point rounds run

    def compute_s(self, v: int, i: int) -> float:
        """Predicted compute per minibatch of stage i of VW v (the runtime's ``time_s``)."""
        return sum(
            self.costs[v][i].tasks_s(self.slowdown[v][i], self.pad_slowdown[v][i], self.cold[v][i])
        )

    def busy_s(self, v: int, i: int, nm: int) -> float:
        """Predicted busy time per minibatch: compute, sends, push, merge and step, and the
        hand-offs to the compute thread the simulator made (a hop and two wake-ups each,
        whatever actions went in it: :meth:`hetpipe.core.schedule.StageSchedule.trip`), which is
        what the simulated stage was busy for."""
        c = self.costs[v][i]
        # each of loop_fwd_s, loop_bwd_s (where not 0) and push_s holds one hand-off's hop
        hops = c.hop_s * (1 + (c.loop_bwd_s > 0) + (c.push_s > 0) / nm)
        loop = c.loop_fwd_s + c.loop_bwd_s + (c.push_s + c.merge_s + c.step_s) / nm - hops
        trips = self.sim.trips[v][i]
        wakes = 2 * trips * (not c.inline) + 2 * (c.merge_s > 0) / nm + 2 * (c.exchange_s > 0)
        return (
            self.compute_s(v, i)
            + self.slowdown[v][i] * (loop + trips * c.hop_s)
            + wakes * self.wake[v][i]
            + c.exchange_s
        )


# The most minibatches per VW a prediction simulates. A longer job's rate is that run's: the
# fill, the drain and the VWs' different finishing times are a fixed number of minibatches'
# time, so past a few thousand minibatches their share is negligible, while simulating every
# minibatch of a long job would hold its start up in the head.
LONG_JOB = 4096


def sim_minibatches(nms: Sequence[int]) -> int:
    """Enough minibatches for a steady state: many waves past the pipeline fill."""
    return max(64, 16 * max(nms, default=1))


def stage_costs(
    model: CostModel,
    devices: Sequence[Any],
    p: Partition,
    *,
    vws: int,
    shards: int,
    schedule: str = "async",
    shard_link_s: Sequence[float] = (),
) -> tuple[StageCost, ...]:
    """Per-stage costs of one VW's split on an idle host (see the module docs). In the
    async schedule the last stage runs forward and backward as one task; in the synchronous
    ones they are two, and the per-wave push and merge are per iteration (the merge is the
    gradient exchange of several VWs). A synchronous backward only adds to the iteration's
    gradient sum: the optimizer runs once per iteration (``step_s``). Either way the update
    is charged unpadded, since the runtime pads forwards and backwards only
    (:meth:`.CostModel.step_scale`).

    A replicated stage (``p.groups``, :mod:`hetpipe.planner.replicas`) is its slowest
    replica: that device's compute and messages at its rows' share (the update whole), its
    rows' flights to the next stage's replicas (:func:`.replicas.flight_time`), plus the
    replicas' gradient exchange (:func:`.replicas.exchange_time`, ``exchange_s``).
    ``vws``: the job's virtual workers (with several, a synchronous stage's exchange waits
    for all of them: :func:`.runtime.reduce_answer_s`).

    ``shard_link_s`` (per stage, default 0) is its state's time on the links to shards on
    other hosts (:func:`.placement.shard_flights`): an async pull waits for the weights'
    way back, a synchronous exchange for the gradients' way there and the mean's way back;
    a push's way there is the simulator's (``SimStage.push_flight_s``: the shards count it
    late, the stage does not wait)."""
    rt = model.runtime
    prof = model.profile
    k = len(devices)
    minibatch = prof.minibatch
    out = []
    copies = {i for held in prof.spanning(p.cuts).values() for i in held}
    for i, (leader, (a, b)) in enumerate(zip(devices, p.cuts, strict=True)):
        group = p.group_of(i, leader)
        rows = p.rows_of(i, minibatch)
        d, share = _slowest(model, group, rows, a, b)
        lps = prof.layers[d.type][a:b]
        first, last = i == 0, i == k - 1
        task = rt.task_s / model.speed(d.type)
        sync = schedule != "async"
        times = model.stage_times_at(d.type, a, b, share)  # the layers and the call term
        fwd, bwd, update = times.fwd_s, times.bwd_s, times.update_s
        # async: each backward task steps (unpadded); sync: one step per iteration
        in_backward, step = (0.0, update) if sync else (update, 0.0)
        bwd += in_backward
        # recomputed layers run their forward again inside the backward; swapped layers'
        # copies show where they exceed the forward and the backward they run beside
        bwd += sum(prof.layers[d.type][j].fwd_s for j in (p.recompute[i] if p.recompute else ()))
        if p.swap and p.swap[i]:
            copy = copy_seconds(
                sum(prof.layers[d.type][j].saved_bytes for j in p.swap[i]), d.host_gbps
            )
            back = sum(lp.bwd_s for lp in lps)
            fwd += unhidden_copy_s(copy, fwd)
            bwd += unhidden_copy_s(copy, back)
        in_bytes = (prof.input_bytes if a == 0 else prof.layers[d.type][a - 1].out_bytes) * share
        out_bytes = lps[-1].out_bytes * share
        send_act = 0.0 if last else rt.message_s + out_bytes * rt.message_byte_s
        send_grad = 0.0 if first else rt.message_s + in_bytes * rt.message_byte_s
        recv = (0.0 if first else rt.message_s + in_bytes * rt.message_byte_s) + (
            0.0 if last else rt.message_s + out_bytes * rt.message_byte_s
        )
        speed = model.speed(d.type)
        on_cpu = str(getattr(d, "device", "cpu")).startswith("cpu")
        if last and schedule == "async":
            compute_fwd, compute_bwd = fwd + bwd + task, 0.0
        else:
            compute_fwd, compute_bwd = fwd + task, bwd + task
        # a tie its layers share is one tensor on the stage (ModelProfile.duplicate_bytes)
        state = sum(lp.param_bytes + lp.buffer_bytes for lp in lps) - prof.duplicate_bytes(a, b)
        tied = schedule == "async" and i in copies
        pulls = (vws > 1 or tied) and state > 0
        inline = bool(
            rt.runs_inline(max(compute_fwd, compute_bwd), on_cpu=on_cpu, speed=speed, pulls=pulls)
        )
        hop = 0.0 if inline else rt.hop_s
        if last and schedule == "async":
            loop_fwd, loop_bwd = hop + send_grad, 0.0
        else:
            loop_fwd, loop_bwd = hop + send_act, hop + send_grad
        wave = hop + rt.wave_s + state * rt.wave_byte_s if state else 0.0
        push = wave
        if not sync and i > 0:  # a tie's copy: its push and pull each wave (costs.py, ``tie``)
            push += model.tie_time(a, b, model.link(devices[i - 1], leader), 1)
        merge = wave if pulls else 0.0
        to_shards = shard_link_s[i] if shard_link_s else 0.0
        if not pulls:
            pull = 0.0
        elif sync:  # the answer waits for every virtual worker's sum and the shards' mean
            pull = reduce_answer_s(rt, state, vws, shards) + 2 * to_shards
        else:
            pull = 2 * rt.latency_s + state * rt.wave_byte_s + to_shards
        shard_cpu = (
            (1 + pulls * len(group)) * (state * rt.shard_byte_s + max(1, shards) * rt.message_s)
            if state
            else 0.0
        )
        link = 0.0
        if not last:
            nxt = p.group_of(i + 1, devices[i + 1])
            if len(group) == 1 and len(nxt) == 1:
                flight = out_bytes / model.link(d, devices[i + 1])
            else:
                flight = flight_time(
                    model, group, rows, nxt, p.rows_of(i + 1, minibatch), float(lps[-1].out_bytes)
                )
            link = flight + rt.latency_s + out_bytes * rt.message_byte_s
        pbytes = float(sum(lp.param_bytes for lp in lps) - prof.duplicate_bytes(a, b))
        exchange = exchange_time(model, group, pbytes)
        exchange_cpu = 2 * (len(group) - 1) * (rt.message_s + pbytes * rt.message_byte_s)
        # the CPU a task wants: a padded device sleeps all but ``speed`` of its forward and
        # backward; the update in its backward task runs unpadded, all of it on the CPU
        compute_cpu = (
            (compute_fwd + compute_bwd - in_backward) * speed + in_backward if on_cpu else 0.0
        )
        cpu = compute_cpu + loop_fwd + loop_bwd + recv + step / p.nm + exchange_cpu
        out.append(
            StageCost(
                compute_fwd,
                compute_bwd,
                loop_fwd,
                loop_bwd,
                recv,
                push,
                merge,
                pull,
                link,
                cpu + (push + merge) / p.nm,
                shard_cpu,
                compute_cpu,
                on_cpu,
                step,
                hop,
                exchange,
                to_shards,
                speed if on_cpu else 1.0,
                in_backward,
                inline,
                tied,
            )
        )
    return tuple(out)


def _slowest(
    model: CostModel, group: Sequence[Any], rows: Sequence[int], a: int, b: int
) -> tuple[Any, float]:
    """The device of a stage's group whose rows take longest on layers ``[a, b)``, and its
    share of the rows (the device itself and 1.0 for a stage on one device)."""
    if len(group) == 1:
        return group[0], 1.0
    n = rows[-1]

    def work(j: int) -> float:
        return model.stage_times_at(group[j].type, a, b, (rows[j + 1] - rows[j]) / n).time_s

    j = max(range(len(group)), key=work)
    return group[j], (rows[j + 1] - rows[j]) / n


def _sim_vw(
    costs: Sequence[StageCost],
    slow: Sequence[float],
    wake: Sequence[float],
    cold: Sequence[float],
    p: Partition,
    minibatch: int,
    schedule: str = "async",
    warmup: int = 0,
    pad_slow: Sequence[float] | None = None,
    devices: int | None = None,
    channels: tuple[Sequence[tuple[str, str]], Sequence[tuple[str, str]]] | None = None,
) -> SimVW:
    """The simulator's stages: compute stretched by starting cold, CPU work by the slowdown
    (padded compute by ``pad_slow``, default the same), plus the wait of each wake-up (two
    per hand-off to the compute thread and back, two per pull, one per message). The
    hand-off's hop and wake-ups are ``handoff_s``, paid once per hand-off whatever actions
    join it (the runtime's rule, which the simulator follows). ``channels``: the shared
    link of each link's two directions and of each stage's pushes and pull answers
    (:func:`_channels`; None: none shared)."""
    stages = []
    pads = slow if pad_slow is None else pad_slow
    link_chs, stage_chs = channels or ((("", ""),) * (len(costs) - 1), (("", ""),) * len(costs))
    for c, k, g, w, h, (push_ch, pull_ch) in zip(
        costs, slow, pads, wake, cold, stage_chs, strict=True
    ):
        bwd_hop = c.hop_s if c.loop_bwd_s else 0.0
        # a replicated stage's exchange follows its backward (the last async stage's one
        # task), before the step: time on the links, not the host's cores, and the wake-ups
        # of the replica waiting for the others' gradients (as a pull's)
        exchange = c.exchange_s + 2 * w if c.exchange_s else 0.0
        after_fwd = exchange if not c.compute_bwd_s else 0.0
        fwd, bwd = c.tasks_s(k, g, h)
        stages.append(
            SimStage(
                fwd + k * (c.loop_fwd_s - c.hop_s) + after_fwd,
                bwd + k * (c.loop_bwd_s - bwd_hop) + exchange - after_fwd,
                k * (c.push_s - c.hop_s) if c.push_s else 0.0,
                k * c.merge_s + (2 * w if c.merge_s else 0.0),
                k * c.pull_s + (2 * w if c.pull_s else 0.0),
                step_s=k * h * c.step_s,
                handoff_s=k * c.hop_s + (0.0 if c.inline else 2 * w),
                push_flight_s=c.shard_link_s if schedule == "async" else 0.0,
                push_channel=push_ch if schedule == "async" else "",
                # an async pull's answer: the weights' way back is the last part of pull_s
                pull_flight_s=c.shard_link_s if schedule == "async" and c.pull_s else 0.0,
                pull_channel=pull_ch if schedule == "async" and c.pull_s else "",
                tied=c.tied,
            )
        )
    links = tuple(
        SimLink(
            costs[i].link_s * slow[i + 1] + wake[i + 1],
            costs[i].link_s * slow[i] + wake[i],
            *link_ch,
        )
        for i, link_ch in zip(range(len(costs) - 1), link_chs, strict=True)
    )
    return SimVW(
        tuple(stages),
        p.nm,
        links,
        minibatch,
        ",".join(p.devices),
        schedule,
        warmup=warmup,
        limits=p.limits,
        devices=devices,
    )


def predict(
    model: CostModel,
    chosen: Sequence[tuple[Sequence[Any], Partition]],
    *,
    minibatch: int,
    staleness: int,
    cores: int | Mapping[str, int] | None = None,
    shard_hosts: Sequence[str] = (),
    minibatches: int | None = None,
    schedule: str = "async",
    warmup: int = 0,
    placement: str = "local",
    devices: int | None = None,
) -> Prediction:
    """Simulate the chosen VWs with the runtime's costs, slowed by sharing their hosts.

    ``chosen`` holds each VW's devices in order (with ``name``, ``type``, ``node``, ``host``,
    ``device``) and split. ``cores`` gives each node's cores (one number for all, or by node
    name; default: this machine's). ``minibatches``: per VW, how long the job runs (at
    most :data:`LONG_JOB` are simulated). ``shard_hosts`` are the hosts of the parameter-server
    shards (each stage's state is placed on them as the runtime places it: each shard's work
    follows the bytes it holds, :func:`.placement.shard_shares`, and the bytes to those on
    other hosts are priced on the links).
    ``warmup``: 1f1b's extra warm-up forwards (:func:`hetpipe.core.schedule.microbatch_order`).
    ``placement``: the parameter placement priced (:data:`.placement.PLACEMENTS`).
    ``devices``: a device-level kind's device count (its stages' orders are projected from
    it; None: two stages a device).
    """
    rt = model.runtime
    n_shards = max(1, len(shard_hosts))
    per_shard = stage_shard_bytes(model, chosen, shard_hosts, placement)
    remote = remote_link_times(model, chosen, shard_hosts, per_shard=per_shard)
    flights = flights_of(remote)
    on_shards = shard_shares(per_shard, len(shard_hosts))
    channels = (
        [
            _channels(devs, routes)
            for (devs, _), routes in zip(chosen, routes_of(remote), strict=True)
        ]
        if SHARE_LINKS
        else [None] * len(chosen)
    )
    costs = tuple(
        stage_costs(
            model, devs, p, vws=len(chosen), shards=n_shards, schedule=schedule, shard_link_s=f
        )
        for (devs, p), f in zip(chosen, flights, strict=True)
    )
    n = min(minibatches, LONG_JOB) if minibatches else sim_minibatches([p.nm for _, p in chosen])
    # the fixed point needs rates, not the whole run: its rounds simulate a shorter one
    n_round = min(n, max(32, 8 * max(p.nm for _, p in chosen)))
    # processes: one per worker (each replica of a replicated stage one), one per shard;
    # grouped by host
    node_of_host: dict[str, str] = {}
    workers: list[tuple[int, int, str]] = []  # (vw, stage, host)
    procs_of: dict[tuple[int, int], list[int]] = {}  # a stage's workers, its leader first
    for v, (devs, p) in enumerate(chosen):
        for i, leader in enumerate(devs):
            for d in p.group_of(i, leader):
                node = str(getattr(d, "node", ""))
                host = str(getattr(d, "host", node))
                procs_of.setdefault((v, i), []).append(len(workers))
                workers.append((v, i, host))
                node_of_host.setdefault(host, node)

    def per_stage(values: Sequence[float], v: int) -> list[float]:
        """Per stage of VW ``v``: the worst of its workers' ``values`` (a replicated
        stage waits for its slowest replica)."""
        return [max(values[j] for j in procs_of[(v, i)]) for i in range(len(chosen[v][0]))]

    shard_list = list(shard_hosts)
    hosts: dict[str, list[int]] = {}  # host -> process indices (workers first, then shards)
    for j, (_, _, h) in enumerate(workers):
        hosts.setdefault(h, []).append(j)
    for j, h in enumerate(shard_list):
        hosts.setdefault(h, []).append(len(workers) + j)
    n_proc = len(workers) + len(shard_list)
    host_n = {h: host_cores(cores, node_of_host.get(h, h)) for h in hosts}
    contended = (
        rt.corun > 0
        or rt.wake_s > 0
        or rt.cold > 0
        or any(len(procs) > host_n[h] for h, procs in hosts.items())
    )
    synchronous = schedule != "async"
    slow = [1.0] * n_proc
    pad_slow = [1.0] * n_proc  # of the padded compute (:meth:`StageCost.tasks_s`)
    # per worker: the chance that a wake-up of one of its threads finds every core of its
    # host taken (an asynchronous job: all its host's cores; a synchronous one: by others)
    busy = [0.0] * len(workers)
    flat = [costs[v][i] for v, i, _ in workers]
    speeds = [c.pad_speed for c in flat] + [1.0] * len(shard_list)
    cold = [1.0 + rt.cold * c.cools for c in flat]  # refined below
    sim: SimResult | None = None
    rounds = 0
    settled = False
    while True:
        rounds += 1
        wake_of = [rt.wake_s * b for b in busy]
        sims = [
            _sim_vw(
                costs[v],
                per_stage(slow, v),
                per_stage(wake_of, v),
                per_stage(cold, v),
                p,
                minibatch,
                schedule,
                warmup,
                per_stage(pad_slow, v),
                devices,
                channels[v],
            )
            for v, (_, p) in enumerate(chosen)
        ]
        final = not contended or settled or rounds >= MAX_ROUNDS
        sim = simulate(sims, staleness, n if final else n_round, record=final or synchronous)
        if final:
            break
        demand = [0.0] * n_proc
        for j, (v, i, _) in enumerate(workers):
            rate = sim.vw_samples_per_s[v] / minibatch
            if not math.isfinite(rate):
                rate = 0.0
            c = costs[v][i]
            demand[j] = rate * (c.cpu_s + (cold[j] - 1.0) * c.compute_cpu_s)
            if j == procs_of[(v, i)][0]:  # its shards' work, as its state lies on them
                for s, share in on_shards[v][i].items():
                    demand[len(workers) + s] += rate / chosen[v][1].nm * c.shard_cpu_s * share
        new = list(slow)
        new_pad = list(pad_slow)
        new_busy = list(busy)
        laws = (
            _timeline_laws(sim, sims, costs, workers, [rt.wake_s * b for b in busy])
            if synchronous
            else None
        )
        for h, procs in hosts.items():
            want = [min(1.0, slow[j] * demand[j]) for j in procs]
            for j, s in zip(procs, slowdowns(want, host_n[h], rt.corun), strict=True):
                new[j] = s
            padded = slowdowns(want, host_n[h], rt.corun, [speeds[j] for j in procs])
            for j, s in zip(procs, padded, strict=True):
                new_pad[j] = s
            if laws is None:  # asynchronous: independent processes, the stage's own included
                taken = all_busy(want, host_n[h])
                for j in procs:
                    if j < len(workers):
                        new_busy[j] = taken
            else:
                # a flush correlates the stages: who computes together comes from the
                # simulated timeline, the shards (independent of it) are added as before
                shard_want = [w for j, w in zip(procs, want, strict=True) if j >= len(workers)]
                shard_law = count_law(shard_want)
                per, idle = laws([j for j in procs if j < len(workers)])
                for j, law in per.items():
                    if law is not None:
                        with_shards = count_law(shard_want, law)
                        new[j] = slowdown_of(with_shards, host_n[h], rt.corun)
                        new_pad[j] = slowdown_of(with_shards, host_n[h], rt.corun, speeds[j])
                    # a wake-up that holds the stage up comes while the stage waits: its
                    # thread finds every core taken when the others take them all then
                    others = idle[j] if idle[j] is not None else law
                    new_busy[j] = sum(
                        p * sum(shard_law[max(0, host_n[h] - c) :])
                        for c, p in enumerate(others or [1.0])
                    )
        # a task starts cold after its thread idled, as often as the stage is not busy
        new_cold = [
            1.0 + rt.cold * (1.0 - min(1.0, sim.busy[v][i])) if c.cools else 1.0
            for c, (v, i, _) in zip(flat, workers, strict=True)
        ]
        settled = (
            all(abs(x - y) <= TOLERANCE * y for x, y in zip(new, slow, strict=True))
            and all(abs(x - y) <= TOLERANCE * y for x, y in zip(new_pad, pad_slow, strict=True))
            and all(abs(x - y) <= TOLERANCE for x, y in zip(new_busy, busy, strict=True))
            and all(abs(x - y) <= TOLERANCE * y for x, y in zip(new_cold, cold, strict=True))
        )
        if settled or rounds == 1:  # the first round's answer replaces the unslowed start
            slow, pad_slow, busy, cold = new, new_pad, new_busy, new_cold
        else:
            slow = [(x + y) / 2 for x, y in zip(new, slow, strict=True)]
            pad_slow = [(x + y) / 2 for x, y in zip(new_pad, pad_slow, strict=True)]
            busy = [(x + y) / 2 for x, y in zip(new_busy, busy, strict=True)]
            cold = [(x + y) / 2 for x, y in zip(new_cold, cold, strict=True)]
    wake_of = [rt.wake_s * b for b in busy]
    n_vws = range(len(chosen))
    assert sim is not None
    return Prediction(
        sim,
        costs,
        tuple(tuple(per_stage(slow, u)) for u in n_vws),
        tuple(tuple(per_stage(wake_of, u)) for u in n_vws),
        tuple(tuple(per_stage(cold, u)) for u in n_vws),
        tuple(tuple(per_stage(pad_slow, u)) for u in n_vws),
        rounds,
    )


def _channels(
    devices: Sequence[Any], routes: Sequence[str]
) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """The shared links one VW's transfers take (see the module docs): per link between
    consecutive stages its forward and backward direction (``a>b``: host a's way to host
    b), per stage its pushes' and its pull answers' (``routes``: the host of its remote
    shards, :func:`.placement.shard_routes`); "" where a transfer stays inside one host."""

    def host(d: Any) -> str:
        return str(getattr(d, "host", getattr(d, "node", "")))

    def way(a: str, b: str) -> str:
        return f"{a}>{b}" if a and b and a != b else ""

    hosts = [host(d) for d in devices]
    links = [(way(a, b), way(b, a)) for a, b in itertools.pairwise(hosts)]
    stages = [(way(h, r), way(r, h)) for h, r in zip(hosts, routes, strict=True)]
    return links, stages


def _timeline_laws(
    sim: SimResult,
    sims: Sequence[SimVW],
    costs: Sequence[Sequence[StageCost]],
    workers: Sequence[tuple[int, int, str]],
    wakes: Sequence[float],
) -> Callable[[Sequence[int]], tuple[dict[int, list[float] | None], dict[int, list[float] | None]]]:
    """Who wants a core together, read off a synchronous run's simulated timeline.

    Independent processes (:func:`.runtime.slowdowns`) suit a full asynchronous pipeline,
    whose stages all compute all the time. A synchronous iteration fills and drains, and its
    order decides which stages compute at once: while the first stage runs the first forwards
    the others wait for them, in the 1F1B phase neighbours compute together. Busy shares
    taken as independent overcharge the first and undercharge the second. Here each action
    wants a core from its start for its CPU share (a padded device sleeps the rest), over the
    iterations after the first. The waits of wake-ups (a hand-off's, ``handoff_s``; a
    merge's, ``wakes[j]`` each) are not counted: the thread has no core then, and counting
    them as wanting one would feed back (more waits, cores seen busier, longer waits) until a
    contended flush is charged far more than it gets. Returns ``laws(procs)``: for those
    worker indices (one host), per worker the law of how many others want a core while it
    computes (its slowdown), and while it does not (None: it never does, or always does).
    The second prices its wake-ups: a hand-off that holds a synchronous stage up comes while
    the stage waits, and its thread waits for a core only when the others take them all. A
    stage's own compute does not count: a thread handing it work blocks next; two stages on
    two cores, computing together in the 1F1B phase, wake each other without a wait
    (counting the stage itself charged each wake-up a wait its timeline does not show).
    """
    firsts = [
        next((t for t, a in vw[0] if isinstance(a, OptimizerStep)), 0.0) for vw in sim.actions
    ]
    lo = max(firsts, default=0.0)
    hi = min(sim.vw_finish_s, default=0.0)
    if hi <= lo:
        lo, hi = 0.0, sim.makespan_s
    spans: list[list[tuple[float, float]]] = []
    for (v, i, _), w in zip(workers, wakes, strict=True):
        c, st = costs[v][i], sims[v].stages[i]
        share = c.compute_cpu_s / c.compute_s if c.compute_s > 0 else 0.0

        def part(compute: float, loop: float, share: float = share) -> float:
            return (compute * share + loop) / (compute + loop) if compute + loop > 0 else 0.0

        out = []
        for t, a in sim.actions[v][i]:
            if isinstance(a, Forward):
                length = st.fwd_s * part(c.compute_fwd_s, c.loop_fwd_s - c.hop_s)
            elif isinstance(a, Backward | BackwardInput | BackwardWeight):
                bwd_hop = c.hop_s if c.loop_bwd_s else 0.0
                length = st.bwd_s * part(c.compute_bwd_s, c.loop_bwd_s - bwd_hop)
                if isinstance(a, BackwardInput):  # a split backward's halves
                    length *= INPUT_GRAD_SHARE
                elif isinstance(a, BackwardWeight):
                    length *= 1.0 - INPUT_GRAD_SHARE
            elif isinstance(a, OptimizerStep):
                length = st.step_s
            elif isinstance(a, Push):
                length = st.push_s
            elif isinstance(a, Merge):
                merged = a.c >= 1 and not a.grads
                length = st.merge_s - (2 * w if c.merge_s else 0.0) if merged else 0.0
            else:
                continue
            a0, a1 = max(t, lo), min(t + length, hi)
            if a1 > a0:
                out.append((a0, a1))
        spans.append(out)

    def laws(
        procs: Sequence[int],
    ) -> tuple[dict[int, list[float] | None], dict[int, list[float] | None]]:
        edges = sorted({lo, hi, *(x for j in procs for sp in spans[j] for x in sp)})
        per = {j: [0.0] * len(procs) for j in procs}
        idle = {j: [0.0] * len(procs) for j in procs}
        idx = dict.fromkeys(procs, 0)
        for a0, a1 in itertools.pairwise(edges):
            mid = (a0 + a1) / 2
            on = []
            for j in procs:
                sp = spans[j]
                while idx[j] < len(sp) and sp[idx[j]][1] <= mid:
                    idx[j] += 1
                if idx[j] < len(sp) and sp[idx[j]][0] <= mid:
                    on.append(j)
            for j in procs:
                if j in on:
                    per[j][len(on) - 1] += a1 - a0
                else:
                    idle[j][len(on)] += a1 - a0

        def normed(law: list[float]) -> list[float] | None:
            mass = sum(law)
            return [x / mass for x in law] if mass > 0 else None

        return ({j: normed(per[j]) for j in procs}, {j: normed(idle[j]) for j in procs})

    return laws
