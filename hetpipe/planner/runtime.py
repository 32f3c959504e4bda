"""What the runtime costs besides the layers, and how the processes of one host share it.

A layer profile says what a layer's forward, backward and update cost when one process has
the machine to itself. A job's stages cost more, for reasons the planner can model:

* **Work around the layers** (:class:`RuntimeCosts`): every compute task is handed to the
  worker's compute thread and back to its event loop; every activation and gradient is
  encoded, sent through ZeroMQ and decoded; every wave a stage pushes its update to the
  parameter server and, when there are several virtual workers, pulls and merges the global
  weights. These are CPU seconds of the worker's event loop, not of its device, so a speed
  pad does not stretch them; ``task_s`` is the exception (memory check and version
  bookkeeping run inside the padded region).
* **Sharing a host** (:func:`slowdowns`): emulated devices (``device = "cpu"``) of one node
  compute on that node's cores, and every worker and shard of a host runs its event loop
  there. A device whose speed is s pads each task to (its measured time)/s by *sleeping*, so
  it wants a core only s of its busy time. When more processes want a core than there are
  cores, each gets its share (processor sharing), and a task stretches by the inverse of the
  share it gets; the pad is proportional to the stretched time, so the whole task stretches
  alike. The planner finds the slowdowns as a fixed point with the simulated rates (rates set
  how busy each process is, busyness sets the slowdowns, the slowdowns set the rates).

Index letters as in :mod:`.partition`; ``a_i`` is the fraction of time process i wants a core.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from hetpipe.core.inline import may_run_inline

__all__ = [
    "RuntimeCosts",
    "all_busy",
    "count_law",
    "host_cores",
    "reduce_answer_s",
    "slowdown_of",
    "slowdowns",
]


@dataclass(frozen=True)
class RuntimeCosts:
    """Per-event costs of the runtime in seconds of one uncontended core.

    The defaults are fitted to the runtime's own timeline (per stage: forward, backward,
    send, push, merge and gate spans, and the compute inside them) on a small CPU host: the
    hand-off, message and per-task terms from pipelines of one layer per stage, the sharing
    terms (``wake_s``, ``corun``, ``cold``) from several virtual workers on fewer cores than
    processes. Another host may differ: pass its own values to
    :func:`~hetpipe.planner.make_plan`.

    ======================  ==============================================================
    ``task_s``              per compute task, inside the padded region (memory check, weight
                            versions, autograd hooks); divided by the device's speed
    ``hop_s``               per compute task, outside it: to the compute thread and back
    ``message_s``           per activation or gradient a stage sends (encode, ZeroMQ)
    ``message_byte_s``      per byte of such a message, sent and again when received
    ``latency_s``           a message's time from one process's loop to the next's
    ``wave_s``              per wave and stage with state: pushing its update (a hop and a
                            message per shard); the same again to merge pulled weights
    ``wave_byte_s``         per parameter byte of a stage, for each of push, pull and merge
    ``shard_byte_s``        CPU of a shard per parameter byte it applies or sends
    ``reduce_byte_s``       per parameter byte a shard takes in or answers in a synchronous
                            gradient exchange, on the iteration's way: decrypting, decoding,
                            summing, encoding, encrypting (:func:`reduce_answer_s`)
    ``wake_s``              how long a woken thread waits for a core when every core of
                            its host is taken (the scheduler's slice); charged per wake-up
                            (two per hand-off, one per message, two per pull) times the
                            chance that all cores are busy (a synchronous stage: taken by
                            the other processes while it waits, read off its timeline)
    ``corun``               how much slower a core computes while every other core of its
                            host computes too (shared caches, memory bandwidth, clock);
                            in proportion to the other cores busy when fewer are
    ``cold``                how much more a compute task costs when its thread was idle
                            before it (caches and clocks cool down; a profile times layers
                            back to back): the idle share of an unpadded host device's
                            tasks (a padded one pads from its least work and shows none:
                            :attr:`.predict.StageCost.cools`)
    ``inline_s``            not a cost: the runtime's ``[runtime] inline_ms``. An unslowed
                            CPU device's tasks shorter than this run on its event loop, so
                            their hand-offs cost no hop and no wake-ups
                            (:mod:`hetpipe.computethread`; :func:`with_runtime` sets it
                            from a cluster file)
    ======================  ==============================================================
    """

    task_s: float = 0.2e-3
    hop_s: float = 0.4e-3
    message_s: float = 0.3e-3
    message_byte_s: float = 0.5e-9
    latency_s: float = 0.3e-3
    wave_s: float = 0.4e-3
    wave_byte_s: float = 0.5e-9
    shard_byte_s: float = 0.5e-9
    reduce_byte_s: float = 2.8e-9
    wake_s: float = 1.5e-3
    corun: float = 0.1
    cold: float = 0.15
    inline_s: float = 0.02

    @classmethod
    def zero(cls) -> RuntimeCosts:
        """An ideal runtime: the layers alone."""
        return cls(**{f.name: 0.0 for f in fields(cls)})

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RuntimeCosts:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"runtime costs: unknown key(s) {', '.join(unknown)}")
        values = {k: float(v) for k, v in d.items()}
        bad = [k for k, v in values.items() if not v >= 0]
        if bad:
            raise ValueError(f"runtime costs: {bad[0]} must be >= 0, got {values[bad[0]]}")
        return cls(**values)

    def with_runtime(self, cluster: Any) -> RuntimeCosts:
        """These costs for the runtime ``cluster``'s file sets up (its ``[runtime]
        inline_ms``); a cluster without a runtime table keeps them."""
        runtime = getattr(cluster, "runtime", None)
        if runtime is None:
            return self
        return replace(self, inline_s=runtime.inline_ms / 1e3)

    def runs_inline(self, task_s: Any, *, on_cpu: bool, speed: float, pulls: bool = False) -> Any:
        """Whether tasks of ``task_s`` (the longer of a stage's forward and backward; a
        number or an array of them) run on the stage's event loop, skipping the hand-off
        (:mod:`hetpipe.computethread`): on an unslowed CPU device, for a stage that pulls
        no weights (:func:`hetpipe.core.inline.may_run_inline`), when shorter than
        :attr:`inline_s`."""
        return may_run_inline(on_cpu=on_cpu, speed=speed, pulls=pulls) and task_s < self.inline_s

    @property
    def is_zero(self) -> bool:
        return not any(getattr(self, f.name) for f in fields(self))


def reduce_answer_s(rt: RuntimeCosts, state_bytes: float, vws: int, shards: int) -> float:
    """Seconds from a synchronous stage sending its iteration's gradient sum (the last of the
    ``vws`` virtual workers to do so) until the mean is back: the way there and back, the
    stage's own encoding and decoding, and on each shard holding its part of the state
    (``shards`` of them, in parallel) the last gradient taken in and the ``vws`` answers
    sent, each a message and its bytes. The parts of a stage's exchange that overlap its
    compute (the shards taking the earlier virtual workers' sums) are not in it."""
    if state_bytes <= 0:
        return 0.0
    per_shard = state_bytes / max(1, shards)
    return (
        2 * rt.latency_s
        + state_bytes * rt.wave_byte_s
        + (1 + vws) * (rt.message_s + per_shard * rt.reduce_byte_s)
    )


def host_cores(cores: int | Mapping[str, int] | None, node: str) -> int:
    """Cores of ``node``: a per-node map, one number for every node, or this machine's."""
    n = cores.get(node) if isinstance(cores, Mapping) else cores
    if n is None:
        n = os.cpu_count() or 1
    if n < 1:
        raise ValueError(f"cores of node {node!r} must be >= 1, got {n}")
    return int(n)


def slowdowns(
    activity: Sequence[float],
    cores: int,
    corun: float = 0.0,
    speeds: Sequence[float] | None = None,
) -> list[float]:
    """Each process's slowdown when processes share ``cores`` cores.

    Process i wants a core a fraction ``activity[i]`` of the time, independently of the
    others. While it does and n others do too, it gets ``min(1, cores / (n + 1))`` of a core,
    and that core runs ``1 + corun * min(n, cores - 1) / (cores - 1)`` times slower for the
    other busy cores; its work stretches by the inverse of the share it gets on average. The
    count of others follows a Poisson-binomial law, computed exactly (O(n^2) per process).
    ``speeds``: per process, the emulation speed its compute is padded to (see
    :func:`slowdown_of`; default 1, the slowdown of unpadded work).
    """
    a = [min(1.0, max(0.0, float(x))) for x in activity]
    if len(a) <= cores and corun == 0.0:
        return [1.0] * len(a)
    return [
        slowdown_of(
            count_law([aj for j, aj in enumerate(a) if j != i]),
            cores,
            corun,
            speeds[i] if speeds is not None else 1.0,
        )
        for i in range(len(a))
    ]


def count_law(activity: Sequence[float], base: Sequence[float] = (1.0,)) -> list[float]:
    """P(n of the processes want a core) for independent processes wanting one a fraction
    ``activity[i]`` of the time, added to a count already distributed as ``base``."""
    dist = list(base)
    for x in activity:
        ax = min(1.0, max(0.0, float(x)))
        if ax <= 0.0:
            continue
        nxt = [0.0] * (len(dist) + 1)
        for n, p in enumerate(dist):
            nxt[n] += p * (1.0 - ax)
            nxt[n + 1] += p * ax
        dist = nxt
    return dist


def slowdown_of(
    others: Sequence[float], cores: int, corun: float = 0.0, speed: float = 1.0
) -> float:
    """The slowdown of a process whose wanting a core meets ``others[n]`` = P(n others want
    one then) (see :func:`slowdowns`; the law may come from a timeline, not independence).

    ``speed`` < 1: the slowdown of compute an emulated device pads to the least CPU time its
    kind of pass took / speed (:func:`hetpipe.emulate.pad`, :class:`hetpipe.emulate.Pace`):
    a pass stretched by a share of a core or by co-running cores' contention (cycles it
    spends beyond that least) only fills time the pad would sleep, until it takes longer
    than the pad's target: ``speed`` x both stretches, where over 1."""
    spare = max(1, cores - 1)
    share = sum(
        p / max(1.0, speed * (1.0 + corun * min(n, spare) / spare) * max(1.0, (n + 1) / cores))
        for n, p in enumerate(others)
    )
    return 1.0 / share if share > 0 else math.inf


def all_busy(activity: Sequence[float], cores: int) -> float:
    """Probability that every core is taken (at least ``cores`` processes want one), when
    process i wants a core a fraction ``activity[i]`` of the time, independently."""
    return float(sum(count_law(activity)[cores:]))
