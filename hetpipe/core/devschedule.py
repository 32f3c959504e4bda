"""Device-level schedules as data: what one device runs next when it holds several stages.

Pure (no torch, asyncio or sockets), like :mod:`hetpipe.core.schedule`. A device-level
schedule gives, for each device of a virtual worker, the sequence of ``(stage, op, j)`` it
runs in one iteration (``op``: ``F`` forward, ``B`` whole backward, ``I`` input gradient, ``W``
weight gradient; ``j`` the microbatch in the iteration). Each stage's own order is the
projection of its device's sequence onto that stage (:func:`stage_order`), so the per-stage
machinery (:class:`hetpipe.core.schedule.StageSchedule`) runs it unchanged; the runtime makes
a device run its stages' actions in exactly its sequence (:mod:`hetpipe.devturn`).

Index letters used below:

====  =====================================================================================
k     stages in the virtual worker, ``k = v * D``
D     devices of the virtual worker (each holds ``v`` stages, its chunks)
v     chunks (stages) per device
d     a device, 0 .. D - 1
m     microbatches per iteration
j     a microbatch of the iteration, 0 .. m - 1
====  =====================================================================================

Kinds:

- ``interleaved-1f1b`` (Megatron-LM's interleaved 1F1B, Narayanan et al. SC'21): stage s on
  device ``s mod D`` (round robin, v chunks each). A device counts its ``v * m`` forwards
  (and backwards) as virtual microbatches taken in groups of D microbatches: the i-th forward
  is of chunk ``(i // D) mod v``, microbatch ``(i // (D v)) D + i mod D``; the i-th backward
  runs the chunks in reverse. Device d warms up with ``2 (D - d - 1) + (v - 1) D`` forwards
  (at most ``v m``), then alternates one forward and one backward, then drains the
  backwards. Needs m a multiple of D.
- ``zbv`` (the V-shaped zero-bubble schedule ZB-V, Qi et al., "Pipeline Parallelism with
  Controllable Memory", NeurIPS'24): ``k = 2 D``, device d holds stage d (chunk 0, going
  down) and stage ``k - 1 - d`` (chunk 1, coming back), so the first and the last stage
  share device 0. Backwards are split into input and weight gradients. Device d runs
  ``2 (D - d) - 1`` forwards of chunk 0; then d pairs of (chunk 1, chunk 0) forwards; then
  ``D - d`` rounds of chunk 1's forward, input and weight gradient; in the steady state a
  chunk-0 forward (while some are left), its input and weight gradient, then chunk 1's
  forward, input and weight gradient; it cools down with d pairs of input gradients (chunk
  0, chunk 1), then ``D - d`` chunk-0 input and weight gradients, then the weight gradients
  left, chunk 1's first. Counted as if there were ``max(m, 2 D - 1)`` microbatches, the
  entries of microbatches beyond m dropped: any m >= 1.
"""

from __future__ import annotations

import functools
from collections.abc import Hashable, Sequence

from hetpipe.core.schedule import DEVICE_KINDS, ScheduleError, check_order

__all__ = [
    "DEVICE_KINDS",
    "Entry",
    "check_microbatches",
    "check_placement",
    "default_devices",
    "device_cycles",
    "device_of",
    "device_order",
    "device_orders",
    "last_iteration_problem",
    "placement",
    "stage_order",
]

Entry = tuple[int, str, int]  # (stage, op, microbatch j of the iteration)


def placement(kind: str, k: int, devices: int) -> tuple[int, ...]:
    """The device (0 .. D - 1) of each stage under ``kind``, for k stages on D devices."""
    _check_shape(kind, k, devices)
    return tuple(device_of(kind, k, devices, s) for s in range(k))


def device_of(kind: str, k: int, devices: int, stage: int) -> int:
    """The device of ``stage``: round robin (interleaved) or a V (zbv)."""
    if kind == "interleaved-1f1b":
        return stage % devices
    if kind == "zbv":
        return stage if stage < devices else k - 1 - stage
    raise ScheduleError(f"schedule: {kind!r} is not a device-level schedule")


def default_devices(kind: str, k: int) -> int:
    """The device count a device-level schedule of k stages is priced with when nobody says
    (the planner prices one stage per device): two chunks per device, zbv's only shape and
    interleaved's usual one."""
    if kind not in DEVICE_KINDS:
        raise ScheduleError(f"schedule: {kind!r} is not a device-level schedule")
    if k < 2 or k % 2:
        raise ScheduleError(f"{kind}: needs an even number of stages (two per device), got {k}")
    return k // 2


def check_placement(kind: str, devices: Sequence[Hashable]) -> int:
    """The device count D of a virtual worker whose stage s runs on ``devices[s]``, where
    ``kind`` can use that placement; else :class:`ScheduleError`, one line."""
    k = len(devices)
    names = list(dict.fromkeys(devices))  # first appearance: device 0, 1, ...
    D = len(names)
    _check_shape(kind, k, D)
    want = [names[device_of(kind, k, D, s)] for s in range(k)]
    if list(devices) != want:
        shape = (
            "stage s on device s mod D (round robin)"
            if kind == "interleaved-1f1b"
            else "a V: stage s and stage k - 1 - s on one device"
        )
        raise ScheduleError(f"{kind}: needs {shape}, e.g. {want}, got {list(devices)}")
    return D


def _check_shape(kind: str, k: int, devices: int) -> None:
    if kind not in DEVICE_KINDS:
        raise ScheduleError(f"schedule: {kind!r} is not a device-level schedule")
    if devices < 1 or k < 1:
        raise ScheduleError(f"{kind}: needs k >= 1 stages on D >= 1 devices, got {k} on {devices}")
    if kind == "interleaved-1f1b" and (k % devices or k < 2 * devices):
        raise ScheduleError(
            f"{kind}: needs k a multiple of D with at least 2 chunks a device, "
            f"got {k} stages on {devices} devices"
        )
    if kind == "zbv" and k != 2 * devices:
        raise ScheduleError(f"zbv: needs k = 2 D (two chunks a device), got {k} on {devices}")


def check_microbatches(kind: str, devices: int, m: int) -> None:
    """Refuse ``m`` microbatches per iteration where ``kind`` on ``devices`` devices cannot
    run them (interleaved: a multiple of the devices), one line."""
    if m < 1:
        raise ScheduleError(f"microbatches per iteration: must be >= 1, got {m}")
    if kind == "interleaved-1f1b" and m % devices:
        raise ScheduleError(
            f"{kind}: microbatches per iteration must be a multiple of the devices "
            f"({devices}), got {m}"
        )


def last_iteration_problem(kind: str, devices: int, total: int, m: int) -> str | None:
    """Why a run of ``total`` microbatches in iterations of ``m`` cannot end under ``kind``
    (its last, short iteration of ``total mod m``), in one line; None where it can."""
    rest = total % m
    if not rest:
        return None
    try:
        check_microbatches(kind, devices, rest)
    except ScheduleError as exc:
        return f"{total} leaves a last iteration of {rest} microbatches ({kind}: {exc})"
    return None


@functools.lru_cache(maxsize=1024)
def device_order(kind: str, k: int, devices: int, d: int, m: int) -> tuple[Entry, ...]:
    """What device ``d`` runs in one iteration, in order (see the module docstring)."""
    _check_shape(kind, k, devices)
    if not 0 <= d < devices:
        raise ScheduleError(f"device: must be in 0..{devices - 1}, got {d}")
    check_microbatches(kind, devices, m)
    if kind == "interleaved-1f1b":
        return _interleaved(k, devices, d, m)
    return _zbv(k, devices, d, m)


def device_orders(kind: str, k: int, devices: int, m: int) -> tuple[tuple[Entry, ...], ...]:
    """Every device's :func:`device_order`, device 0 first."""
    return tuple(device_order(kind, k, devices, d, m) for d in range(devices))


@functools.lru_cache(maxsize=4096)
def stage_order(kind: str, k: int, devices: int, stage: int, m: int) -> tuple[tuple[str, int], ...]:
    """``stage``'s own order: its device's order, that stage's entries only. Checked as any
    stage's order is (:func:`hetpipe.core.schedule.check_order`)."""
    if not 0 <= stage < k:
        raise ScheduleError(f"stage: must be in 0..{k - 1}, got {stage}")
    d = device_of(kind, k, devices, stage)
    order = tuple((op, j) for s, op, j in device_order(kind, k, devices, d, m) if s == stage)
    check_order(order, m)
    return order


def _interleaved(k: int, D: int, d: int, m: int) -> tuple[Entry, ...]:
    v = k // D
    total = v * m  # this device's forwards (and backwards), over its v chunks

    def forward(i: int) -> Entry:
        chunk = (i // D) % v
        return chunk * D + d, "F", (i // (D * v)) * D + i % D

    def backward(i: int) -> Entry:
        chunk = v - 1 - (i // D) % v
        return chunk * D + d, "B", (i // (D * v)) * D + i % D

    warm = min(2 * (D - d - 1) + (v - 1) * D, total)
    out = [forward(i) for i in range(warm)]
    for i in range(total - warm):
        out += [forward(warm + i), backward(i)]
    out += [backward(i) for i in range(total - warm, total)]
    return tuple(out)


def _zbv(k: int, D: int, d: int, m: int) -> tuple[Entry, ...]:
    down, up = d, k - 1 - d  # chunk 0's stage, chunk 1's
    n = max(m, 2 * D - 1)  # counted as if the pipeline were full, extra entries dropped
    nf = {down: 0, up: 0}  # next forward, input gradient, weight gradient of each chunk
    ni = {down: 0, up: 0}
    nw = {down: 0, up: 0}
    out: list[Entry] = []

    def run(stage: int, op: str) -> None:
        count = {"F": nf, "I": ni, "W": nw}[op]
        out.append((stage, op, count[stage]))
        count[stage] += 1

    for _ in range(2 * (D - d) - 1):
        run(down, "F")
    for _ in range(d):
        run(up, "F")
        run(down, "F")
    for _ in range(D - d):
        run(up, "F")
        run(up, "I")
        run(up, "W")
    while nf[up] < nf[down] or nf[down] < n:
        if nf[down] < n:
            run(down, "F")
        run(down, "I")
        run(down, "W")
        run(up, "F")
        run(up, "I")
        run(up, "W")
    for _ in range(d):
        run(down, "I")
        run(up, "I")
    for _ in range(D - d):
        run(down, "I")
        run(down, "W")
    while nw[up] < ni[up]:
        run(up, "W")
    while nw[down] < ni[down]:
        run(down, "W")
    return tuple(e for e in out if e[2] < m)


def device_cycles(
    kind: str, k: int, devices: int, m: int, *, limit: int = 100_000
) -> list[list[tuple[int, Entry]]]:
    """Run one iteration with each device in lock step, strictly in its order: each tick a
    device runs its next entry if its input is there (a forward: the previous stage's
    activation; a backward or input gradient: the next stage's gradient; a weight gradient:
    nothing), one entry a tick. What is made in tick t arrives for tick t + 1, on the same
    device too. Returns, per device, its ``(tick, entry)`` in order; :class:`ScheduleError`
    names each device's blocked entry where no device can go on (a deadlock)."""
    orders = device_orders(kind, k, devices, m)
    pos = [0] * devices
    acts: set[tuple[int, int]] = set()  # (stage, j): the activation stage has received
    grads: set[tuple[int, int]] = set()  # (stage, j): the gradient stage has received
    out: list[list[tuple[int, Entry]]] = [[] for _ in range(devices)]
    for tick in range(limit):
        if all(pos[d] == len(orders[d]) for d in range(devices)):
            return out
        made: list[tuple[set[tuple[int, int]], tuple[int, int]]] = []
        ran = False
        for d in range(devices):
            if pos[d] == len(orders[d]):
                continue
            s, op, j = orders[d][pos[d]]
            ready = (
                op == "W"
                or (op == "F" and (s == 0 or (s, j) in acts))
                or (op in ("B", "I") and (s == k - 1 or (s, j) in grads))
            )
            if not ready:
                continue
            pos[d] += 1
            ran = True
            out[d].append((tick, (s, op, j)))
            if op == "F" and s + 1 < k:
                made.append((acts, (s + 1, j)))
            elif op in ("B", "I") and s > 0:
                made.append((grads, (s - 1, j)))
        if not ran:  # nothing arrives for the next tick either
            blocked = {d: orders[d][pos[d]] for d in range(devices) if pos[d] < len(orders[d])}
            raise ScheduleError(f"{kind} deadlocks at tick {tick}: devices wait at {blocked}")
        for box, key in made:
            box.add(key)
    raise ScheduleError(f"{kind}: did not finish in {limit} ticks")
