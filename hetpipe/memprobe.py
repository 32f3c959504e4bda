"""A stage's MEASURED peak memory: the bytes of the tensors it really holds, not counted by
the memory model.

The runtime counts a stage's memory in the planner's own terms (:meth:`hetpipe.stage.
StageCompute.memory`), the same formula with its live counts, so comparing that count with
the planner's prediction checks the counts, never the formula. This module measures the
formula's subject instead: every allocation and free the stage makes on the host's
allocator, recorded by ``torch.profiler`` (``profile_memory=True``), whose running total of
allocated bytes is the stage's live bytes at each allocation. On CPU only: a GPU would
measure the same with ``torch.cuda.max_memory_allocated``.

:func:`stage_peak` builds one stage INSIDE the recording (so everything it allocates is in
it, and nothing allocated before counts), runs a warm-up iteration in its schedule's order
(the layers' first measuring forward, the optimizer's state made at the first step), then a
second iteration, and returns the peak of the live bytes over that second iteration. The
figure so includes the stage's weights and buffers, its optimizer state, its accumulators
and gradient sums (the previous iteration's update held beside the passes, as a run of a
virtual worker alone holds it until its wave is pushed), every in-flight microbatch's
received input, graph and saved tensors, the gradients it receives and keeps, and each
operation's temporaries at their peak; it
excludes what the process held before the stage was built (the data set, the inputs
recorded for it) and Python objects' own overhead.

The stage runs alone, in its schedule's order (:func:`hetpipe.core.schedule.
microbatch_order`), the action a runtime's stage runs; what its neighbours would send it is
replayed from one iteration of the whole pipeline run in process first (:func:`record`),
each a fresh copy as it would arrive off the wire. A synchronous order is fixed, whatever
the timing, so the replay holds what a run holds.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hetpipe.config import DeviceSpec
from hetpipe.core.devschedule import default_devices, device_order, placement
from hetpipe.core.layout import StageLayout
from hetpipe.core.schedule import microbatch_order
from hetpipe.job import JobSpec
from hetpipe.stage import StageCompute
from hetpipe.task import StageTask

__all__ = ["AllocationTrace", "Recorded", "StagePeak", "device_peak", "record", "stage_peak"]

# one allocation of this many bytes marks where the measured part of a trace starts
_MARK_BYTES = 7_777_777
DEVICE = DeviceSpec("probe", "cpu", "probe", 1 << 40, 1.0, 0, "n0", "127.0.0.1")


class AllocationTrace:
    """Every host allocation and free between ``__enter__`` and ``__exit__``; the live bytes
    allocated inside it, at their peak after :meth:`mark` (frees of tensors allocated before
    the trace are not seen, so those tensors never count)."""

    def __init__(self) -> None:
        self._prof: Any = None
        self._events: list[tuple[int, int]] = []  # (size, live bytes after)

    def __enter__(self) -> AllocationTrace:
        from torch.profiler import ProfilerActivity, profile

        gc.collect()
        self._prof = profile(
            activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=False
        )
        self._prof.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        from torch._C._profiler import _EventType

        self._prof.__exit__(*exc)

        def walk(events: Sequence[Any]) -> Iterator[Any]:
            for e in events:
                yield e
                yield from walk(e.children)

        tree = self._prof.profiler.kineto_results.experimental_event_tree()
        allocs = sorted(
            (e.start_time_ns, e.extra_fields.ptr, e.extra_fields.alloc_size)
            for e in walk(tree)
            if e.tag == _EventType.Allocation and str(e.extra_fields.device) == "cpu"
        )
        # live bytes after each event, of the blocks allocated inside the trace only (the
        # allocator's own running total also moves with frees of older blocks)
        live, sizes, total = [], {}, 0
        for _, ptr, size in allocs:
            if size > 0:
                sizes[ptr] = size
                total += size
            elif ptr in sizes:
                total -= sizes.pop(ptr)
            else:
                continue
            live.append((size, total))
        self._events = live

    @staticmethod
    def mark() -> None:
        """Mark the start of the measured part (one allocation of a size nothing else has)."""
        torch.empty(_MARK_BYTES, dtype=torch.uint8)

    def peak(self) -> int:
        """The most bytes live at once after the last :meth:`mark` (before the trace's end),
        counting every allocation made inside the trace and not yet freed."""
        sizes = [size for size, _ in self._events]
        if -_MARK_BYTES not in sizes:
            raise RuntimeError("allocation trace: no mark")
        after = len(sizes) - 1 - sizes[::-1].index(-_MARK_BYTES)
        return max((total for _, total in self._events[after:]), default=0)

    def final(self) -> int:
        """The bytes allocated inside the trace still live at its end."""
        return self._events[-1][1] if self._events else 0


@dataclass
class Recorded:
    """What each stage of one iteration receives: ``inputs[s][j]`` the forward input of
    microbatch ``j`` at stage ``s`` (the batch's at stage 0), ``grads[s][j]`` the gradient
    of its output (None at the last stage), ``targets[j]`` the labels."""

    inputs: list[list[torch.Tensor]]
    grads: list[list[torch.Tensor | None]]
    targets: list[torch.Tensor]


@dataclass(frozen=True)
class StagePeak:
    """A stage's measured peak (``peak``: bytes live at once in the measured iteration) and
    what it still held at the iteration's end (``final``)."""

    peak: int
    final: int


def _task(spec: JobSpec, cuts: Sequence[int], stage: int, m: int) -> StageTask:
    k = len(cuts) - 1
    return StageTask.standalone(
        "memprobe",
        spec.to_dict(),
        StageLayout(("probe",), cuts[stage], cuts[stage + 1]),
        stage=stage,
        k=k,
        nm=m,
        minibatches=2 * m,
    )


def _build(
    spec: JobSpec, cuts: Sequence[int], stage: int, m: int, state: Mapping[str, torch.Tensor]
) -> StageCompute:
    compute = StageCompute(_task(spec, cuts, stage, m), DEVICE)
    names = compute.state_names()
    compute.load({n: state[n] for n in names}, {n: [] for n in names})
    return compute


def _copy(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().clone()


def record(
    spec: JobSpec,
    cuts: Sequence[int],
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    state: Mapping[str, torch.Tensor],
) -> Recorded:
    """One iteration of the whole pipeline split at ``cuts`` (stage ``s`` holds layers
    ``cuts[s]`` .. ``cuts[s + 1]`` - 1) on the microbatches ``batches``, run in process: each
    microbatch forward through every stage, then backward; what each stage received."""
    k, m = len(cuts) - 1, len(batches)
    stages = [_build(spec, cuts, s, m, state) for s in range(k)]
    inputs: list[list[torch.Tensor]] = [[] for _ in range(k)]
    grads: list[list[torch.Tensor | None]] = [[] for _ in range(k)]
    for j, (x, y) in enumerate(batches):
        act: Any = x
        for s, c in enumerate(stages):
            inputs[s].append(_copy(act))  # type: ignore[arg-type]
            act = c.forward(j, act, y)
        g = None
        for s in reversed(range(k)):
            grads[s].append(_copy(g))
            g = stages[s].backward(j, g)
    return Recorded(inputs, grads, [y for _, y in batches])


def _iteration(
    compute: StageCompute, order: Sequence[tuple[str, int]], rec: Recorded, i: int
) -> None:
    """Iteration ``i`` of one stage in ``order``, each input and gradient a fresh copy of
    what it would receive; what it sends is dropped (gone to the wire)."""
    s = compute.task.stage
    m = compute.task.nm
    for op, j in order:
        p = i * m + j
        if op == "F":
            compute.forward(p, _copy(rec.inputs[s][j]), rec.targets[j])  # type: ignore[arg-type]
        elif op == "B":
            compute.backward(p, _copy(rec.grads[s][j]))
        elif op == "I":
            compute.backward_input(p, _copy(rec.grads[s][j]))
        elif op == "W":
            compute.backward_weight(p)
        else:
            raise ValueError(f"order: unknown action {op!r}")
    _end_iteration(compute, i)


def _end_iteration(compute: StageCompute, i: int) -> None:
    """Iteration ``i``'s end as the runtime does it for a virtual worker alone in its job
    (:meth:`hetpipe.pipeline.StageRunner._flushes`, ``train.push_every`` 0): the step, then
    the update carried into the next iteration's, unpushed, until the last iteration's push
    takes it (not kept: nothing sends it); the losses read. So the next iteration's passes
    run beside the update held, as they do in a run."""
    compute.step(i)
    if i + 1 < compute.task.minibatches // compute.task.nm:
        compute.carry(i)
    else:
        compute.push_deltas(i, keep=False)
    compute.read_losses(block=True)


def stage_peak(
    spec: JobSpec,
    cuts: Sequence[int],
    stage: int,
    rec: Recorded,
    state: Mapping[str, torch.Tensor],
    devices: int | None = None,
) -> StagePeak:
    """Measured peak of stage ``stage`` of the pipeline split at ``cuts`` under the job's
    schedule (``devices``: a device-level schedule's device count, as
    :func:`hetpipe.core.schedule.microbatch_order`), built and run inside an
    :class:`AllocationTrace`: one warm-up iteration, then the measured one."""
    k, m = len(cuts) - 1, len(rec.targets)
    order = microbatch_order(spec.schedule, k, stage, m, devices=devices)
    with AllocationTrace() as trace:
        compute = _build(spec, cuts, stage, m, state)
        _iteration(compute, order, rec, 0)
        gc.collect()
        trace.mark()
        _iteration(compute, order, rec, 1)
    del compute
    return StagePeak(trace.peak(), trace.final())


def _device_iteration(
    stages: Mapping[int, StageCompute],
    order: Sequence[tuple[int, str, int]],
    rec: Recorded,
    i: int,
) -> None:
    """Iteration ``i`` of one device's stages in its ``order``: what a stage on the same
    device sends its neighbour is handed over as it is (it does not leave the process), what
    comes from another device is a fresh copy of what it would receive."""
    m = next(iter(stages.values())).task.nm
    acts: dict[tuple[int, int], Any] = {}
    grads: dict[tuple[int, int], Any] = {}
    for s, op, j in order:
        c, p = stages[s], i * m + j
        if op == "F":
            x = acts.pop((s, j)) if (s, j) in acts else _copy(rec.inputs[s][j])
            out = c.forward(p, x, rec.targets[j])
            if s + 1 in stages:
                acts[(s + 1, j)] = out
            continue
        g = grads.pop((s, j)) if (s, j) in grads else _copy(rec.grads[s][j])
        if op == "B":
            back = c.backward(p, g)
        elif op == "I":
            back = c.backward_input(p, g)
        else:
            c.backward_weight(p)
            continue
        if s - 1 in stages:
            grads[(s - 1, j)] = back
    for c in stages.values():
        _end_iteration(c, i)


def device_peak(
    spec: JobSpec,
    cuts: Sequence[int],
    device: int,
    rec: Recorded,
    state: Mapping[str, torch.Tensor],
) -> tuple[tuple[int, ...], StagePeak]:
    """Measured peak of one device of a device-level schedule (its default device count,
    :func:`hetpipe.core.devschedule.default_devices`): every stage the device runs, built
    and run together in the device's order (:func:`hetpipe.core.devschedule.device_order`)
    inside one :class:`AllocationTrace`, as a worker runs its stages in one process. The
    stages it holds, and the peak."""
    k, m = len(cuts) - 1, len(rec.targets)
    devices = default_devices(spec.schedule, k)
    where = placement(spec.schedule, k, devices)
    mine = tuple(s for s in range(k) if where[s] == device)
    order = device_order(spec.schedule, k, devices, device, m)
    with AllocationTrace() as trace:
        stages = {s: _build(spec, cuts, s, m, state) for s in mine}
        _device_iteration(stages, order, rec, 0)
        gc.collect()
        trace.mark()
        _device_iteration(stages, order, rec, 1)
    del stages
    return mine, StagePeak(trace.peak(), trace.final())
