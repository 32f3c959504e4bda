"""Stage costs for the partitioners: the time and memory of every layer range on every
device type, as scalars and as matrices over all ``[a, b)`` at once.

Index letters used throughout:

=====  ==============================================================
``L``  number of layers; layer ranges are half-open ``[a, b)``
``k``  number of devices (= stages) of the virtual worker
``i``  stage position, 0 .. k-1 (device ``i`` of the order runs stage ``i``)
``a``  first layer of a stage; ``b`` one past its last layer
=====  ==============================================================

**Stage time** of device ``i`` running layers ``[a, b)``::

    time(i, a, b) = compute + comm_in + comm_out + tasks
    compute  = sum over the layers of (fwd_s + bwd_s + speed * update_s) on device i's
               type + call, the type's stage call term, once per stage whatever its layers
               (:class:`hetpipe.core.profile.CallProfile`; its update part also times
               ``speed``): an emulated device pads its forwards and backwards, never its
               optimizer step, while a profile holds every time padded, so the update is
               charged back at the speed the runtime runs it (:meth:`CostTables.step_scale`)
    comm_in  = in_bytes(a) * 2 / bw(device i-1, device i)      (0 for the first stage)
               + message_s + in_bytes(a) * message_byte_s      (sending the gradient back)
    comm_out = out_bytes(b-1) * 2 / bw(device i, device i+1)   (0 for the last stage)
               + message_s + out_bytes(b-1) * message_byte_s   (sending the activation on)
    tasks    = n * (task_s / speed + hop_s), n = 1 for the last stage (its forward and
               backward are one task), else 2

``in_bytes(a)`` is the model input for ``a = 0`` else ``out_bytes`` of layer ``a-1``; the
factor 2 is the activation forward plus the gradient of the same size backward. Both ends of
a link charge it, a deliberately conservative choice: a stage's worker sends and receives on
the same event loop as it computes. The ``message_s``, ``task_s`` and ``hop_s`` terms are the
runtime's own costs (:class:`hetpipe.planner.runtime.RuntimeCosts`; zero unless given);
``speed`` is the device type's emulation speed (capped at 1), since ``task_s`` is padded.

**Activations** (``activations``, the job's ``train.activations``): under ``keep`` every
layer keeps what it saves. Under ``recompute`` every stage recomputes all its layers as one
run (it keeps only its input; the run's saved tensors live again during its backward, the
``working`` term) and pays one more forward of its layers. Under ``auto`` a stage that fits
keeping everything keeps everything; one that does not recomputes the run of consecutive
layers ``[c, d)`` with the least forward time that makes it fit (the memory a run frees is
``in_flight`` x its saved bytes less its input, minus its saved bytes once while it reruns,
and under ``predict`` paper minus ``in_flight`` x its parameter bytes: the forward's
prediction every in-flight minibatch keeps for the rerun),
so the extra time lands on the stages short of memory, and on their cheapest layers. The
stage time adds that extra forward; the DP then balances the stages with it, so the cuts and
the policy are chosen together. One run per stage is a restriction (several runs could free
the same memory slightly cheaper), taken so the choice stays a small vectorised search.

``swap`` (pinned) swaps every layer of every stage to host memory and ``auto`` weighs it
against recomputing: a swapped set ``T`` frees ``in_flight`` x its saved bytes on the device
but holds the largest one's as in-transit room (``memory.working_bytes``), and adds the
copies' unhidden time at the device's ``host_gbps`` (``memory.unhidden_swap_s`` against the
stage's forward and backward compute). ``auto`` tries the smallest layers first (the fewest
bytes to move for the room they free: the prefix of the layers by saved bytes that makes the
stage fit) and takes, per stage, the cheaper of that swap and the recompute run; the DP
balances the cuts with either extra time, so the policy lands where it hurts the bottleneck
least. One policy per stage (no mix of a recomputed run and swapped layers) is again a
restriction that keeps the search small.

**Ties** (:attr:`ModelProfile.ties`, a tensor several layers share). A stage holding several
of a tie's layers holds the tensor once (its memory drops the bytes its layers' profiles count
twice: :meth:`ModelProfile.duplicate_bytes`); a tie whose layers fall in several stages is a
copy on each, counted in full on each. The asynchronous runtime keeps the copies together
through the shards: each copy steps on its own use's gradient and pushes its update to the one
entry, and pulls that entry every wave. A copy's stage (one holding a layer of the tie after
a stage that holds an earlier one: not the owner, which pushes its weights anyway) therefore
pays, per wave, its copy's push and pull::

    tie(i, a, b) = sum over the ties with a layer in [a, b) and one before a of
                   2 * (nbytes / bw(device i-1, device i) + message_s + nbytes * message_byte_s)
                   / Nm

the link into the stage standing for its way to the owner's shard (on the owner's host). A
split keeping a tie on one stage pays nothing, so at an equal bottleneck it wins; a tie spans
where that is faster, and its stage times hold the cost. A virtual worker alone in its job
also waits at each such pull for every stage's push of the wave before: a flush, which the
simulator times (:class:`hetpipe.planner.simulate.SimStage` ``tied``) and a per-stage term
cannot. (The synchronous schedules' exchange along the pipeline's links is priced by
:mod:`hetpipe.planner.syncmodel`.)

The memory of a stage is the one model (:mod:`hetpipe.core.memory`): its scalar form
(:meth:`CostTables.stage_memory`) and its matrices (:meth:`CostTables.memory_total`, the
recompute search) are :func:`~hetpipe.core.memory.stage_terms` on numbers or on arrays.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from hetpipe.config import DeviceSpec
from hetpipe.core.memory import (
    ACTIVATION_POLICIES,
    StageMemory,
    activation_bytes,
    backward_kind,
    copy_seconds,
    held_predictions,
    in_flight,
    kept_copies,
    param_copies,
    stage_terms,
    unhidden_swap_s,
    untied_params,
    working_bytes,
)
from hetpipe.core.profile import ModelProfile, StageTimes, padded_speed, update_scale
from hetpipe.core.schedule import SYNCHRONOUS
from hetpipe.planner.plans import PlanError
from hetpipe.planner.runtime import RuntimeCosts

__all__ = [
    "Bandwidth",
    "CostTables",
    "Policy",
    "band_index",
    "check_devices",
    "check_profile",
    "first_finite",
    "kept_matrix",
    "least_ratio",
    "saved_ends",
    "skew",
    "working_matrix",
]

Bandwidth = Callable[[Any, Any], float]
INF = math.inf
# per stage: the global layers it recomputes and those it swaps to host memory
Policy = tuple[tuple[int, ...], tuple[int, ...]]
DEFAULT_HOST_GBPS = DeviceSpec.host_gbps


_LAYER_FIGURES = (
    "fwd_s",
    "bwd_s",
    "update_s",
    "param_bytes",
    "buffer_bytes",
    "out_bytes",
    "saved_bytes",
    "work_bytes",
)


def _not_number(value: Any, least: float, strict: bool) -> bool:
    """True unless ``value`` is a number above ``least`` (at least it, unless ``strict``);
    NaN never is."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        return True
    return not (v > least if strict else v >= least)


def check_devices(devices: Sequence[Any], bandwidth: Bandwidth | None = None) -> None:
    """Raise :class:`PlanError` naming the first device (or link) the planner cannot price:
    an empty list; a speed that is not a finite number > 0; a memory cap that is negative,
    NaN or infinite; a ``host_gbps`` that is not > 0; with ``bandwidth``, a link between
    two of the devices whose bytes/s is not > 0 (NaN included). Every figure divides or
    caps a stage time, so one bad value would silently price every split wrong."""
    if not devices:
        raise PlanError("no devices to plan on: the device list is empty")
    for d in devices:
        speed = getattr(d, "speed", 1.0)
        if _not_number(speed, 0.0, True) or not math.isfinite(float(speed)):
            raise PlanError(f"device {d.name}: speed must be a finite number > 0, got {speed!r}")
        if _not_number(d.memory, 0.0, False) or not math.isfinite(float(d.memory)):
            raise PlanError(
                f"device {d.name}: memory must be a finite number >= 0, got {d.memory!r}"
            )
        gbps = getattr(d, "host_gbps", DEFAULT_HOST_GBPS)
        if _not_number(gbps, 0.0, True):
            raise PlanError(f"device {d.name}: host_gbps must be > 0, got {gbps!r}")
    if bandwidth is not None:
        for x, y in itertools.permutations(devices, 2):
            bw = bandwidth(x, y)
            if _not_number(bw, 0.0, True):
                raise PlanError(f"bandwidth between {x.name} and {y.name} must be > 0, got {bw!r}")


def check_profile(profile: ModelProfile, speeds: Mapping[str, float] | None = None) -> None:
    """Raise :class:`PlanError` naming the layer and device type of the first figure of
    ``profile`` that is negative, NaN or infinite (times, bytes, the stage call term, the
    input), or the type of a speed in ``speeds`` that is not a finite number > 0."""
    name = f"profile {profile.model!r}"
    if _not_number(profile.input_bytes, 0.0, False) or not math.isfinite(profile.input_bytes):
        raise PlanError(f"{name}: input_bytes must be >= 0, got {profile.input_bytes!r}")
    for dtype, lps in profile.layers.items():
        if not lps:
            continue
        table = np.array(
            [[float(getattr(lp, f)) for f in _LAYER_FIGURES] for lp in lps], dtype=np.float64
        )
        bad = ~(np.isfinite(table) & (table >= 0))
        if bad.any():
            j, f = (int(x[0]) for x in np.nonzero(bad))
            raise PlanError(
                f"{name}: layer {j} on {dtype}: {_LAYER_FIGURES[f]} must be a finite number "
                f">= 0, got {table[j, f]!r}"
            )
    for dtype, call in profile.calls.items():
        for f in ("fwd_s", "bwd_s", "update_s"):
            v = getattr(call, f)
            if _not_number(v, 0.0, False) or not math.isfinite(v):
                raise PlanError(f"{name}: call term on {dtype}: {f} must be >= 0, got {v!r}")
    for dtype, speed in (speeds or {}).items():
        if _not_number(speed, 0.0, True) or not math.isfinite(float(speed)):
            raise PlanError(
                f"device type {dtype}: speed must be a finite number > 0, got {speed!r}"
            )


def duplicate_matrix(profile: ModelProfile) -> Any:
    """:meth:`ModelProfile.duplicate_bytes` of every ``[a, b)`` (rows ``a``, columns ``b``;
    0 where the profile has no ties)."""
    if not profile.ties:
        return 0
    n = profile.n_layers() + 1
    out = np.zeros((n, n), dtype=np.int64)
    for tie in profile.ties:
        before = np.searchsorted(np.array(tie.layers), np.arange(n))  # its layers below x
        count = before[None, :] - before[:, None]
        out += np.maximum(count - 1, 0) * tie.nbytes
    return out


class SavedEnds(NamedTuple):
    """A type's per-layer saved bytes as prefix sums, with what the memory model subtracts
    from them (:func:`memory.activation_bytes`): ``saved[j]`` the sum over layers before j,
    ``s_in``/``s_out`` each layer's saved input and output, ``out`` its output bytes, and
    ``twice[j]`` the sum over layers before j of the tensor it and its predecessor both
    save (``min(s_in[j], s_out[j - 1])``, none for layer 0)."""

    saved: np.ndarray
    s_in: np.ndarray
    s_out: np.ndarray
    out: np.ndarray
    twice: np.ndarray


def saved_ends(lps: Sequence[Any]) -> SavedEnds:
    """:class:`SavedEnds` of the layers ``lps``."""
    n = len(lps)
    s_in = np.array([lp.saved_input_bytes for lp in lps], dtype=np.int64)
    s_out = np.array([lp.output_saved for lp in lps], dtype=np.int64)
    shared = np.zeros(n, dtype=np.int64)
    if n > 1:
        shared[1:] = np.minimum(s_in[1:], s_out[:-1])
    return SavedEnds(
        np.array([0, *itertools.accumulate(lp.saved_bytes for lp in lps)], dtype=np.int64),
        s_in,
        s_out,
        np.array([lp.out_bytes for lp in lps], dtype=np.int64),
        np.concatenate(([0], np.cumsum(shared))).astype(np.int64),
    )


def kept_matrix(lps: Sequence[Any], ends: SavedEnds | None = None) -> np.ndarray:
    """:func:`memory.activation_bytes` of every ``[a, b)`` keeping every activation (rows
    ``a``, columns ``b``; meaningful where ``a < b``), from prefix sums: the layers' saved
    bytes, less the first layer's saved input (the stage input, counted with the stage),
    less each tensor two adjacent layers both save (``a < j < b``), plus the stage's output
    where its last layer does not save it. A profile without the saved ends
    (``saved_input_bytes`` 0, ``saved_output_bytes`` its ``out_bytes``) corrects nothing:
    the plain prefix sums. ``ends``: :func:`saved_ends` of ``lps`` where made already."""
    e = saved_ends(lps) if ends is None else ends
    n = len(lps)
    s_in = np.concatenate((e.s_in, [0]))  # a = n: no first layer
    left_out = np.zeros(n + 1, dtype=np.int64)  # [b]: the output the last layer leaves out
    if n:
        left_out[1:] = np.maximum(0, e.out - e.s_out)
    # sum over a < j < b of the shared tensors = twice[b] - twice[min(a + 1, b)]
    after = np.minimum(np.arange(n + 1)[:, None] + 1, np.arange(n + 1)[None, :])
    return (
        e.saved[None, :]
        - e.saved[:, None]
        - s_in[:, None]
        - (e.twice[None, :] - e.twice[after])
        + left_out[None, :]
    )


def working_matrix(
    lps: Sequence[Any], backward: str, ends: SavedEnds | None = None, ties: Sequence[Any] = ()
) -> np.ndarray:
    """:func:`memory.working_bytes` of every ``[a, b)`` keeping every activation (rows ``a``,
    columns ``b``; meaningful where ``a < b``) for a ``backward`` of
    :func:`memory.backward_kind`, the same integers, from prefix sums and running maxima.

    ``layer``: the largest ``work_bytes`` over ``[a, b)``. ``split``: that or the stage's
    parameter bytes, the larger. ``whole`` (:func:`memory.backward_walk`): the last layer's
    ``work + params``, or, for a layer ``i < b - 1``, ``out[b-1] + work[i] + (P[b] - P[i])``
    less the tensors layers ``i + 1 .. b - 1`` saved (their share of the kept count, the
    stage output's saved part excepted), which splits into a part of ``i`` alone,
    ``u[i] = work[i] - P[i] + S[i+1] - Tw[i+1]`` (its running maximum from ``a``), and a part
    of ``b`` alone. ``ties`` (:class:`hetpipe.core.profile.TieProfile`): a tied tensor's
    gradient once, beside the whole backward of a stage holding one of its layers
    (:func:`memory.untied_params`)."""
    e = saved_ends(lps) if ends is None else ends
    n = len(lps)
    work = np.array([lp.work_bytes for lp in lps], dtype=np.int64)
    untied = untied_params([lp.param_bytes for lp in lps], [(t.layers, t.nbytes) for t in ties])
    params = np.array([0, *itertools.accumulate(untied)], dtype=np.int64)
    out = np.zeros((n + 1, n + 1), dtype=np.int64)
    if not n:
        return out
    tied = np.zeros((n + 1, n + 1), dtype=np.int64)  # [a, b]: the ties' bytes it holds
    for tie in ties:
        before = np.searchsorted(np.array(tie.layers), np.arange(n + 1))  # its layers below x
        tied += ((before[None, :] - before[:, None]) > 0) * tie.nbytes
    rows = np.arange(n)[:, None]
    cols = np.arange(n)[None, :]

    def running_max(v: np.ndarray) -> np.ndarray:
        """``[a, c]`` -> max of ``v`` over ``a .. c`` (columns ``c + 1``; -inf below a)."""
        m = np.where(cols >= rows, v[None, :], np.iinfo(np.int64).min // 4)
        return np.maximum.accumulate(m, axis=1)

    if backward in ("layer", "split"):
        out[:n, 1:] = running_max(work)
        if backward == "split":
            out = np.maximum(out, params[None, :] - params[:, None] + tied)
        return out
    if backward != "whole":
        raise ValueError(f"backward: unknown kind {backward!r}")
    j = np.arange(n)
    last = work + params[1:] - params[:-1]  # [b - 1]: the last layer's own peak
    u = work - params[:-1] + e.saved[1:] - e.twice[1:]  # [i]
    share = np.array([lp.saved_bytes for lp in lps], dtype=np.int64) - np.where(
        j > 0, e.twice[1:] - e.twice[:-1], 0
    )
    kept_out = np.minimum(e.s_out, share)  # [b - 1]: the stage output's saved part
    tail = e.out + params[1:] - e.saved[1:] + e.twice[1:] + kept_out  # [b - 1]
    before = np.full((n, n), np.iinfo(np.int64).min // 4, dtype=np.int64)  # [a, b-1]: i < b-1
    before[:, 1:] = running_max(u)[:, :-1]
    walk = np.maximum(last[None, :], before + tail[None, :])
    out[:n, 1:] = walk
    return out + tied


def tie_copy_matrices(profile: ModelProfile) -> tuple[np.ndarray, np.ndarray] | None:
    """For every ``[a, b)``: how many ties a stage of those layers holds a copy of past the
    first holder (a layer in ``[a, b)`` and one before ``a``), and their bytes; None where
    the profile has no ties."""
    if not profile.ties:
        return None
    n = profile.n_layers() + 1
    count = np.zeros((n, n), dtype=np.int64)
    nbytes = np.zeros((n, n), dtype=np.int64)
    for tie in profile.ties:
        before = np.searchsorted(np.array(tie.layers), np.arange(n))
        copy = ((before[None, :] - before[:, None]) > 0) & (before[:, None] > 0)
        count += copy
        nbytes += copy * tie.nbytes
    return count, nbytes


class _TypeCosts:
    """Prefix sums of one device type's layer profile (computed once per type), its
    updates at ``step_scale`` of their profiled time (:meth:`CostTables.step_scale`)."""

    def __init__(
        self, profile: ModelProfile, dtype: str, step_scale: float = 1.0, dup: Any = 0
    ) -> None:
        """``dup``: the tied bytes every ``[a, b)`` counts twice (:func:`duplicate_matrix`)."""
        lps = profile.layers[dtype]
        n = len(lps)
        self.cum = [
            0.0,
            *itertools.accumulate(lp.fwd_s + lp.bwd_s + lp.update_s * step_scale for lp in lps),
        ]
        self.cum_np = np.array(self.cum, dtype=np.float64)
        self.inb = [profile.input_bytes] + [lp.out_bytes for lp in lps[:-1]] + [0]
        self.outb = [0] + [lp.out_bytes for lp in lps]  # outb[b] = out_bytes of layer b-1

        def prefix(values: Iterable[int]) -> np.ndarray:
            return np.array([0, *itertools.accumulate(values)], dtype=np.int64)

        self.F = np.array([0.0, *itertools.accumulate(lp.fwd_s for lp in lps)])
        self.Bk = np.array([0.0, *itertools.accumulate(lp.bwd_s for lp in lps)])
        self.passes = np.diff(self.F) + np.diff(self.Bk)  # per layer: forward and backward
        self.U = [0.0, *itertools.accumulate(lp.update_s * step_scale for lp in lps)]
        self.fwd = [lp.fwd_s for lp in lps]
        # the stage call term: once per stage, so a constant of every [a, b), added where
        # the runtime's per-task costs are (the same float in the scalar and matrix paths)
        call = profile.call(dtype)
        self.call = call.fwd_s + call.bwd_s + call.update_s * step_scale
        self.saved = [lp.saved_bytes for lp in lps]
        self.saved_in = [lp.saved_input_bytes for lp in lps]
        self.saved_out = [lp.output_saved for lp in lps]
        self.work = [lp.work_bytes for lp in lps]
        self.P = prefix(lp.param_bytes for lp in lps)
        self.B = prefix(lp.buffer_bytes for lp in lps)
        work = np.array([lp.work_bytes for lp in lps], dtype=np.int64)
        m = np.where(np.arange(n)[None, :] >= np.arange(n)[:, None], work[None, :], 0)
        self.W = np.zeros((n + 1, n + 1), dtype=np.int64)  # W[a, b] = max work over [a, b)
        if n:
            self.W[:n, 1:] = np.maximum.accumulate(m, axis=1)
        upper = np.arange(n + 1)[None, :] > np.arange(n + 1)[:, None]
        self.valid = upper  # a < b
        self.inb_np = np.array(self.inb, dtype=np.int64)
        # every [a, b) at once: its parameters (a tie once), buffers and saved bytes
        self.pb = self.P[None, :] - self.P[:, None] - dup
        self.bb = self.B[None, :] - self.B[:, None]
        # the saved ends' prefix sums: keeping all (``sb``) and a recomputed run's count
        # (CostTables.run_kept)
        ends = saved_ends(lps)
        self.sb = kept_matrix(lps, ends)
        self.S, self.s_in_np, self.s_out_np, self.out_np, self.Tw = ends
        self.outs = [lp.out_bytes for lp in lps]
        self.params = [lp.param_bytes for lp in lps]
        self.ties = profile.ties
        # the working term of every [a, b) per backward kind (memory.backward_kind); the
        # layer kind's is W
        self._walks: dict[str, np.ndarray] = {"layer": self.W}
        self._ends = ends
        self._lps = lps

    def working(self, schedule: str = "async") -> np.ndarray:
        """:func:`working_matrix` of this type's layers for ``schedule``'s backward, made
        once per kind."""
        kind = backward_kind(schedule)
        m = self._walks.get(kind)
        if m is None:
            m = self._walks[kind] = working_matrix(self._lps, kind, self._ends, self.ties)
        return m


class CostTables:
    """Stage times and memory of one profile under one network, with caches: per-type
    prefix sums, time matrices (per type and link pair) and memory masks (per type,
    in-flight count and cap) are computed once. :class:`hetpipe.planner.partition.CostModel`
    adds the exact partitioning over them.
    """

    def __init__(
        self,
        profile: ModelProfile,
        bandwidth: Bandwidth,
        optimizer_state_factor: int,
        costs: RuntimeCosts | None = None,
        speeds: Mapping[str, float] | None = None,
        weights: str = "stash",
        activations: str = "keep",
        row_profiles: Mapping[int, ModelProfile] | None = None,
    ) -> None:
        """``weights``: the job's mode as :func:`memory.weights_mode` names it;
        ``activations``: the policy (:data:`memory.ACTIVATION_POLICIES`);
        ``row_profiles``: the same model profiled at fewer rows than ``profile`` (by rows),
        for the compute of stage replicas (:meth:`compute_at`)."""
        check_profile(profile, speeds)
        if activations not in ACTIVATION_POLICIES:
            raise PlanError(
                f"activations must be one of {ACTIVATION_POLICIES}, got {activations!r}"
            )
        self.activations = activations
        if optimizer_state_factor < 0:
            raise PlanError(f"optimizer_state_factor must be >= 0, got {optimizer_state_factor}")
        self.profile = profile
        self.bandwidth = bandwidth
        self.factor = optimizer_state_factor
        self.weights = weights
        self.runtime = costs or RuntimeCosts.zero()
        self.speeds = dict(speeds or {})
        self.L = profile.n_layers()
        self.row_profiles = {
            m: p
            for m, p in (row_profiles or {}).items()
            if 0 < m < profile.minibatch and p.n_layers() == self.L
        }
        self._at_rows: dict[str, list[tuple[int, np.ndarray, np.ndarray]]] = {}
        self._types: dict[str, _TypeCosts] = {}
        self._dup = duplicate_matrix(profile)
        self._tie_copies = tie_copy_matrices(profile)
        self._tie_times: dict[tuple, np.ndarray] = {}
        self._min_total: tuple[tuple, int] | None = None  # min_total_memory's, by its inputs
        self._times: dict[tuple, np.ndarray] = {}
        self._totals: dict[tuple, np.ndarray] = {}
        self._steps: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
        self._firsts: dict[tuple, np.ndarray] = {}
        self._widths: dict[tuple[str, int], int] = {}
        self._skews: dict[tuple[str, int], tuple[np.ndarray, np.ndarray, np.ndarray, int]] = {}
        self._kept_fits: dict[tuple, tuple[np.ndarray, np.ndarray, np.ndarray, int]] = {}
        self._masked: dict[tuple, np.ndarray] = {}
        self._extra: dict[tuple, tuple[np.ndarray, dict[tuple[int, int], tuple[int, int]]]] = {}
        self._bands: dict[tuple, tuple[np.ndarray, int]] = {}
        self._band_cells = 0  # cells held in ``_bands``, bounded like the matrices
        # a band's distinct finite times by the band's id, with the band (the joint search's,
        # :meth:`hetpipe.planner.partition.CostModel._band_values`); cleared with the bands
        self._band_vals: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        # a band's furthest ends by the band's id, with the band (the reach test's,
        # :meth:`hetpipe.planner.partition.CostModel._unreachable`); cleared with the bands
        self._band_ends: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        # bound the caches to ~64 MiB of matrices
        cells = (self.L + 1) ** 2
        self._matrix_limit = max(16, (64 << 20) // (8 * cells))

    # ---------------------------------------------------------------- primitives

    def costs(self, dtype: str) -> _TypeCosts:
        tc = self._types.get(dtype)
        if tc is None:
            tc = self._types[dtype] = _TypeCosts(
                self.profile, dtype, self.step_scale(dtype), self._dup
            )
        return tc

    def link(self, a: Any, b: Any) -> float:
        bw = float(self.bandwidth(a, b))
        if not bw > 0:
            raise PlanError(f"bandwidth between {a.name} and {b.name} must be > 0, got {bw}")
        return bw

    def links(self, devices: Sequence[Any]) -> tuple[float, ...]:
        return tuple(self.link(x, y) for x, y in itertools.pairwise(devices))

    def speed(self, dtype: str) -> float:
        """The emulation speed of ``dtype``'s devices as the runtime pads it (at most 1)."""
        return padded_speed(self.speeds.get(dtype, 1.0))

    def step_scale(self, dtype: str) -> float:
        """What share of a profiled update ``dtype``'s devices spend on it (unpadded:
        :func:`.profile.update_scale`)."""
        return update_scale(self.speed(dtype))

    def tasks_time(self, dtype: str, first: bool, last: bool) -> float:
        """The runtime's per-task costs of one stage per minibatch (``tasks`` above)."""
        c = self.runtime
        n = 1 if last else 2
        return n * (c.task_s / self.speed(dtype) + c.hop_s)

    def stage_time(
        self,
        dtype: str,
        a: int,
        b: int,
        bw_in: float | None,
        bw_out: float | None,
        share: float = 1.0,
    ) -> float:
        """Time of a stage on ``dtype`` running ``[a, b)``; ``None`` = no link on that side.
        ``share``: the part of each minibatch's rows it runs (a stage replica,
        :mod:`hetpipe.planner.replicas`): forward, backward and bytes scale with it; the
        update, the call term and the per-message and per-task costs do not."""
        tc = self.costs(dtype)
        ms, mb = self.runtime.message_s, self.runtime.message_byte_s
        inb, outb = tc.inb[a] * share, tc.outb[b] * share
        cin = inb * 2.0 / bw_in + (ms + inb * mb) if bw_in is not None else 0.0
        cout = outb * 2.0 / bw_out + (ms + outb * mb) if bw_out is not None else 0.0
        const = self.tasks_time(dtype, bw_in is None, bw_out is None) + tc.call
        compute = tc.cum[b] - tc.cum[a]
        if share != 1.0:  # a replica's update still steps every weight of the stage
            fwd, bwd = self.compute_at(dtype, a, b, share)
            compute = fwd + bwd + (tc.U[b] - tc.U[a])
        return compute + cin + cout + const

    def tie_time(self, a: int, b: int, bw_in: float | None, nm: int) -> float:
        """Per minibatch, what the copies of ties a stage of ``[a, b)`` holds past their first
        holder cost it (``tie`` in the module docs; 0 without such a copy)."""
        if self._tie_copies is None or bw_in is None:
            return 0.0
        count, nbytes = self._tie_copies
        n, nb = float(count[a, b]), float(nbytes[a, b])
        if n == 0.0:
            return 0.0
        ms, mb = self.runtime.message_s, self.runtime.message_byte_s
        return (nb * 2.0 / bw_in + 2.0 * (n * ms + nb * mb)) / nm

    def tie_matrix(self, bw_in: float | None, nm: int) -> Any:
        """:meth:`tie_time` of every ``[a, b)`` (0 where the profile has no ties)."""
        if self._tie_copies is None or bw_in is None:
            return 0.0
        key = (bw_in, nm)
        t = self._tie_times.get(key)
        if t is None:
            count, nbytes = self._tie_copies
            n, nb = count.astype(np.float64), nbytes.astype(np.float64)
            ms, mb = self.runtime.message_s, self.runtime.message_byte_s
            t = (nb * 2.0 / bw_in + 2.0 * (n * ms + nb * mb)) / nm
            t = self._tie_times[key] = np.where(n == 0.0, 0.0, t)
        return t

    def stage_times_at(self, dtype: str, a: int, b: int, share: float = 1.0) -> StageTimes:
        """Forward, backward and update of a stage of ``[a, b)`` on ``dtype`` running
        ``share`` of the minibatch's rows, as the runtime runs them: its layers
        (:meth:`compute_at` for a replica's share) plus the stage call term once, since a
        replica's rows scale its layers, not its one forward and one backward call; the
        update unpadded (:meth:`step_scale`)."""
        times = self.profile.stage_times(dtype, a, b)
        update = times.update_s * self.step_scale(dtype)
        if share == 1.0:
            return StageTimes(times.fwd_s, times.bwd_s, update)
        call = self.profile.call(dtype)
        fwd, bwd = self.compute_at(dtype, a, b, share)
        return StageTimes(fwd + call.fwd_s, bwd + call.bwd_s, update)

    def compute_at(self, dtype: str, a: int, b: int, share: float) -> tuple[float, float]:
        """Forward and backward time of ``[a, b)`` on ``dtype`` for ``share`` of the
        minibatch's rows (a stage replica's). Where the model was profiled at fewer rows
        too (``row_profiles``), interpolated between the two profiles around those rows
        (proportional below the fewest): small batches under-use a device, so half the rows
        rarely take half the time. Without them, proportional to the share. The layers
        only: the stage call term is the caller's to add, once."""
        m = self.profile.minibatch
        points = self._row_points(dtype)
        x = share * m
        lo = hi = points[-1]
        for pt in points:
            if pt[0] >= x:
                hi = pt
                break
            lo = pt
        if x >= points[-1][0] or x <= points[0][0]:  # proportional from the nearest
            r, F, Bk = points[-1] if x >= points[-1][0] else points[0]
            f = x / r
            return float(F[b] - F[a]) * f, float(Bk[b] - Bk[a]) * f
        w = (x - lo[0]) / (hi[0] - lo[0])

        def at(pt: tuple[int, np.ndarray, np.ndarray], arr: int) -> float:
            return float(pt[arr][b] - pt[arr][a])

        return ((1 - w) * at(lo, 1) + w * at(hi, 1), (1 - w) * at(lo, 2) + w * at(hi, 2))

    def _row_points(self, dtype: str) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """(rows, forward prefix sums, backward prefix sums) of ``dtype`` at each profiled
        row count, fewest first, the full minibatch last."""
        pts = self._at_rows.get(dtype)
        if pts is None:
            pts = []
            for m, prof in sorted(self.row_profiles.items()):
                lps = prof.layers.get(dtype)
                if lps:
                    pts.append(
                        (
                            m,
                            np.array([0.0, *itertools.accumulate(lp.fwd_s for lp in lps)]),
                            np.array([0.0, *itertools.accumulate(lp.bwd_s for lp in lps)]),
                        )
                    )
            tc = self.costs(dtype)
            pts.append((self.profile.minibatch, tc.F, tc.Bk))
            self._at_rows[dtype] = pts
        return pts

    def time_matrix(self, dtype: str, bw_in: float | None, bw_out: float | None) -> np.ndarray:
        """``stage_time`` for every ``(a, b)`` at once (inf where ``a >= b``)."""
        key = (dtype, bw_in, bw_out)
        t = self._times.get(key)
        if t is None:
            t = self._times[key] = self.time_matrix_at(dtype, bw_in, bw_out, None)
        return t

    def time_matrix_at(
        self, dtype: str, bw_in: float | None, bw_out: float | None, at: np.ndarray | None
    ) -> np.ndarray:
        """:meth:`time_matrix` at the layer boundaries ``at`` only (rows and columns; every
        boundary where None), uncached: the same floats as the full matrix's entries there,
        one expression elementwise."""
        cum, cin, cout, const = self._time_terms(dtype, bw_in, bw_out, at)
        t = (cum[None, :] - cum[:, None]) + cin[:, None] + cout[None, :] + const
        valid = self.costs(dtype).valid if at is None else at[None, :] > at[:, None]
        return np.where(valid, t, INF)

    def time_cells(
        self, dtype: str, bw_in: float | None, bw_out: float | None, a: np.ndarray, b: np.ndarray
    ) -> np.ndarray:
        """:meth:`time_matrix`'s entries at the cells ``(a, b)`` only (index arrays,
        broadcast together), uncached: the same floats, one expression elementwise, without
        the whole matrix (a band needs its cells alone)."""
        cum, cin, cout, const = self._time_terms(dtype, bw_in, bw_out, None)
        return np.where(a < b, (cum[b] - cum[a]) + cin[a] + cout[b] + const, INF)

    def _time_terms(
        self, dtype: str, bw_in: float | None, bw_out: float | None, at: np.ndarray | None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
        """What a stage time ``[a, b)`` adds up, at the boundaries ``at`` (every boundary
        where None): the prefix sums of compute (``b``'s less ``a``'s), the input's way in
        (by ``a``), the output's way out (by ``b``) and the per-stage constant."""
        tc = self.costs(dtype)
        ms, mb = self.runtime.message_s, self.runtime.message_byte_s
        idx = slice(None) if at is None else at
        inb = tc.inb_np.astype(np.float64)[idx]
        outb = np.array(tc.outb, dtype=np.float64)[idx]
        cum = tc.cum_np[idx]
        n = len(cum)
        cin = inb * 2.0 / bw_in + (ms + inb * mb) if bw_in is not None else np.zeros(n)
        cout = outb * 2.0 / bw_out + (ms + outb * mb) if bw_out is not None else np.zeros(n)
        const = self.tasks_time(dtype, bw_in is None, bw_out is None) + tc.call
        return cum, cin, cout, const

    def memory_total(self, dtype: str, flight: int, schedule: str = "async") -> np.ndarray:
        """``stage_memory(...).total`` for every ``(a, b)`` with ``flight`` in flight.

        Outside the synchronous kinds every term of :func:`memory.stage_terms` is affine in
        ``flight`` (weight copies, kept minibatches and inputs grow by whole multiples of
        it; the accumulators do not depend on it), so each flight's matrix is the one at a
        single minibatch plus ``flight - 1`` times the step between one and two: the very
        integers, two elementwise operations instead of the whole model per flight."""
        key = (dtype, flight, schedule)
        m = self._totals.get(key)
        if m is None:
            if schedule in SYNCHRONOUS:
                m = self._terms(self.costs(dtype), flight, schedule).total
            else:
                one, step = self._flight_step(dtype, schedule)
                m = one + (flight - 1) * step
            self._totals[key] = m
        return m

    def _flight_step(self, dtype: str, schedule: str) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`memory_total` at one minibatch in flight, and what each further one adds
        (asynchronous kinds, where the total is affine in the flight)."""
        key = (dtype, schedule)
        hit = self._steps.get(key)
        if hit is None:
            tc = self.costs(dtype)
            one = self._terms(tc, 1, schedule).total
            hit = self._steps[key] = (one, self._terms(tc, 2, schedule).total - one)
        return hit

    def _terms(
        self,
        tc: _TypeCosts,
        flight: int,
        schedule: str = "async",
        kept: Any = None,
        working: Any = None,
        held: Any = 0,
        rows: slice = slice(None),
        cols: slice = slice(None),
    ) -> StageMemory:
        """:func:`memory.stage_terms` of every ``[a, b)`` (rows ``a``, columns ``b``) as
        arrays, keeping every activation unless ``kept`` and ``working`` say otherwise."""
        return stage_terms(
            tc.pb[rows, cols],
            tc.bb[rows, cols],
            tc.sb[rows, cols] if kept is None else kept,
            tc.inb_np[rows, None],
            tc.working(schedule)[rows, cols] if working is None else working,
            factor=self.factor,
            flight=flight,
            schedule=schedule,
            weights=self.weights,
            held=held,
        )

    def fit_mask(self, dtype: str, flight: int, cap: int) -> np.ndarray:
        """Where ``[a, b)`` fits a device of ``cap`` bytes (and ``a < b``), keeping all."""
        return (self.memory_total(dtype, flight) <= cap) & self.costs(dtype).valid

    def recompute_plan(
        self, dtype: str, flight: int, cap: int, host_gbps: float = DEFAULT_HOST_GBPS
    ) -> tuple[np.ndarray, dict[tuple[int, int], Policy]]:
        """Under the model's activation policy, for every ``[a, b)``: the extra time of its
        recompute or swap (inf where nothing fits) and the layers it recomputes and swaps.

        A stage that fits keeping everything keeps everything; see the module docs."""
        key = (dtype, flight, cap, host_gbps)
        hit = self._extra.get(key)
        if hit is not None:
            return hit
        tc = self.costs(dtype)
        keep = self.memory_total(dtype, flight)
        fits = (keep <= cap) & tc.valid
        extra = np.where(fits, 0.0, INF)
        chosen: dict[tuple[int, int], Policy] = {}
        pinned = self.activations in ("recompute", "swap")
        if self.activations != "keep":
            n = self.L + 1
            todo = [(a, b) for a in range(n) for b in range(a + 1, n) if pinned or not fits[a, b]]
            # minibatches whose kept tensors stay: one where the backward reruns the forward
            m = kept_copies(flight, "async", self.weights)
            for a, b in todo:
                options = []
                if self.activations in ("recompute", "auto"):
                    options.append(self._recompute_option(tc, a, b, cap, flight))
                if self.activations in ("swap", "auto"):
                    options.append(self._swap_option(tc, a, b, int(keep[a, b]), m, cap, host_gbps))
                cost, policy = min(options, key=lambda o: o[0])  # recompute first on ties
                if cost < INF:
                    extra[a, b] = cost
                    chosen[(a, b)] = policy
        self._extra[key] = (extra, chosen)
        return extra, chosen

    def _recompute_option(
        self, tc: _TypeCosts, a: int, b: int, cap: int, flight: int
    ) -> tuple[float, Policy]:
        """The cheapest run ``[c, d)`` of ``[a, b)`` whose recompute makes it fit (all of it
        when pinned): its extra forward time and the policy, or inf. (``predict`` paper: the
        run's predicted weights stay with every in-flight minibatch, see
        :func:`memory.held_predictions`.)"""
        if self.activations == "recompute":
            if self._recompute_need(tc, a, b, flight, a, b) <= cap:
                return float(tc.F[b] - tc.F[a]), (tuple(range(a, b)), ())
            return INF, ((), ())
        w = slice(a, b + 1)  # runs [c, d) for c, d in [a, b]: rows c, columns d
        idx = np.arange(a, b + 1)
        need = self._recompute_need(tc, a, b, flight, idx[:, None], idx[None, :])
        fd = tc.F[None, a : b + 1] - tc.F[a : b + 1, None]
        ok = (need <= cap) & tc.valid[w, w]
        if not ok.any():
            return INF, ((), ())
        cost = np.where(ok, fd, INF)
        c, d = np.unravel_index(int(cost.argmin()), cost.shape)
        return float(cost[c, d]), (tuple(range(a + int(c), a + int(d))), ())

    @staticmethod
    def run_kept(tc: _TypeCosts, a: int, b: int, c: Any, d: Any) -> tuple[Any, Any]:
        """:func:`memory.activation_bytes` and :func:`memory.working_bytes` of stage
        ``[a, b)`` recomputing the run ``[c, d)`` (``a <= c < d <= b``; numbers, or arrays
        over many runs at once, elementwise): the very count of the memory model, from
        prefix sums. The run's saved bytes leave the kept ones (and live again in the
        working term while it reruns), its first layer's input stays where that is not the
        stage input; the stage input's saved copy is subtracted only where the first layer
        is kept, a tensor two layers save only where both are kept (``j`` outside
        ``[c, d]``), and the stage output counted whole where the last layer is
        recomputed."""
        c = np.asarray(c)
        d = np.asarray(d)
        run = tc.S[d] - tc.S[c]
        kept = int(tc.S[b] - tc.S[a]) - run
        kept = kept + np.where(c > a, tc.inb_np[c] - tc.s_in_np[a], 0)
        # the shared tensors of a < j < b, less those of j in [max(c, a + 1), min(d, b - 1)]
        both = int(tc.Tw[max(b, a + 1)] - tc.Tw[a + 1]) if b > a + 1 else 0
        lo = np.maximum(c, a + 1)
        hi = np.minimum(d, b - 1)
        dropped = np.where(hi >= lo, tc.Tw[np.maximum(hi + 1, lo)] - tc.Tw[lo], 0)
        kept = kept - (both - dropped)
        last = np.where(d >= b, 0, tc.s_out_np[b - 1])
        kept = kept + np.maximum(0, tc.out_np[b - 1] - last)
        return kept, int(tc.W[a, b]) + run

    def _recompute_need(self, tc: _TypeCosts, a: int, b: int, flight: int, c: Any, d: Any) -> Any:
        """Total memory of stage ``[a, b)`` recomputing the run ``[c, d)`` of its layers
        (:meth:`run_kept`); ``predict`` paper keeps the run's predicted weights per
        in-flight minibatch. Numbers, or arrays over every run at once (elementwise)."""
        kept, working = self.run_kept(tc, a, b, c, d)
        return stage_terms(
            int(tc.pb[a, b]),
            int(tc.bb[a, b]),
            kept,
            tc.inb[a],
            working,
            factor=self.factor,
            flight=flight,
            weights=self.weights,
            held=held_predictions(flight, tc.P[d] - tc.P[c], "async", self.weights),
        ).total

    def _swap_option(
        self, tc: _TypeCosts, a: int, b: int, keep: int, m: int, cap: int, host_gbps: float
    ) -> tuple[float, Policy]:
        """The layers of ``[a, b)`` to swap (all when pinned, else the smallest first until
        the stage fits): their unhidden copy time and the policy, or inf."""
        order = (
            list(range(a, b))
            if self.activations == "swap"
            else sorted(range(a, b), key=lambda j: (tc.saved[j], j))
        )
        moved = largest = freed = 0
        gone: set[int] = set()
        for n, j in enumerate(order, start=1):
            moved += tc.saved[j]
            largest = max(largest, tc.saved[j])
            freed += self._swap_frees(tc, a, b, j, gone)
            gone.add(j)
            if self.activations == "swap" and n < len(order):
                continue
            # the keep total with ``freed`` bytes gone from the kept ones and the largest
            # swapped layer's in the working term (memory.stage_terms is linear in both: a
            # kept byte counts m times, memory.kept_copies)
            if keep - m * freed + largest <= cap:
                swap = tuple(sorted(order[:n]))
                return self.swap_time(tc, a, b, moved, host_gbps), ((), swap)
        return INF, ((), ())

    @staticmethod
    def _swap_frees(tc: _TypeCosts, a: int, b: int, j: int, gone: set[int]) -> int:
        """What swapping layer ``j`` of stage ``[a, b)`` takes off
        :func:`memory.activation_bytes` where the layers ``gone`` are swapped already: its
        saved bytes, less what the count subtracted for it while it was kept (the stage
        input it saves, as the first layer; a tensor it and a kept neighbour both save),
        less the stage output, which stays whole once the last layer keeps none of it."""
        frees = tc.saved[j]
        if j == a:
            frees -= tc.saved_in[a]
        if j > a and j - 1 not in gone:
            frees -= int(tc.Tw[j + 1] - tc.Tw[j])
        if j + 1 < b and j + 1 not in gone:
            frees -= int(tc.Tw[j + 2] - tc.Tw[j + 1])
        if j == b - 1:
            out = int(tc.out_np[j])
            frees -= out - max(0, out - tc.saved_out[j])
        return frees

    def swap_time(self, tc: _TypeCosts, a: int, b: int, moved: int, host_gbps: float) -> float:
        """The unhidden time of swapping ``moved`` saved bytes of stage ``[a, b)``: the copies
        out beside its forward, in beside its backward (:func:`memory.unhidden_swap_s`)."""
        return unhidden_swap_s(
            copy_seconds(moved, host_gbps), float(tc.F[b] - tc.F[a]), float(tc.Bk[b] - tc.Bk[a])
        )

    def chosen(
        self,
        dtype: str,
        a: int,
        b: int,
        flight: int,
        cap: int,
        host_gbps: float = DEFAULT_HOST_GBPS,
    ) -> Policy:
        """The global layers of ``[a, b)`` the policy recomputes and swaps on a device of
        ``cap`` and ``host_gbps``."""
        return self.recompute_plan(dtype, flight, cap, host_gbps)[1].get((a, b), ((), ()))

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
        """``time_matrix`` with inf wherever the stage does not fit (one DP step's input),
        plus its ties' copies at ``nm`` minibatches a wave (:meth:`tie_matrix`)."""
        key = self.masked_key(dtype, bw_in, bw_out, flight, cap, host_gbps, nm)
        tm = self._masked.get(key)
        if tm is None:
            if len(self._masked) >= self._matrix_limit:
                self._masked.clear()
            tm = self.masked_at(dtype, bw_in, bw_out, flight, cap, host_gbps, nm, None)
            self._masked[key] = tm
        return tm

    def masked_key(
        self,
        dtype: str,
        bw_in: float | None,
        bw_out: float | None,
        flight: int,
        cap: int,
        host_gbps: float,
        nm: int,
    ) -> tuple:
        """What a masked time matrix depends on (``nm`` only where ties spanning stages
        are priced)."""
        ties = self._tie_copies is not None and bw_in is not None
        return (dtype, bw_in, bw_out, flight, cap, host_gbps, nm if ties else 0)

    def masked_at(
        self,
        dtype: str,
        bw_in: float | None,
        bw_out: float | None,
        flight: int,
        cap: int,
        host_gbps: float,
        nm: int,
        at: np.ndarray | None,
    ) -> np.ndarray:
        """:meth:`masked_times` uncached, at the layer boundaries ``at`` only (rows and
        columns; every boundary where None): the same floats as the full matrix there."""
        ties = self._tie_copies is not None and bw_in is not None
        if at is None:
            times = self.time_matrix(dtype, bw_in, bw_out)
            extra, _ = self.recompute_plan(dtype, flight, cap, host_gbps)
        else:
            times = self.time_matrix_at(dtype, bw_in, bw_out, at)
            extra = self.extra_at(dtype, flight, cap, host_gbps, *np.ix_(at, at))
        # inf where nothing fits, + 0.0 (the same float) where keeping everything fits
        tm = times + extra
        if ties:
            tie = self.tie_matrix(bw_in, nm)
            tm = tm + (tie if at is None else tie[np.ix_(at, at)])
        return tm

    def band(
        self,
        dtype: str,
        bw_in: float | None,
        bw_out: float | None,
        flight: int,
        cap: int,
        host_gbps: float = DEFAULT_HOST_GBPS,
        nm: int = 1,
    ) -> tuple[np.ndarray, int]:
        """:meth:`masked_times` skewed to the band the DP steps over, and its width ``w``.

        Row ``b`` holds ``time[b - w + j, b]`` for ``j`` in ``0 .. w-1`` (inf where
        ``b - w + j < 0``), first ``a`` first, and ``w`` is the longest stage that fits
        (``b - a`` of any finite entry): every finite entry of the matrix is in the band
        exactly once, so a minimum over a band row is the minimum over the matrix column,
        the same floats. A memory cap bounds a stage's layers, so the band is usually much
        narrower than the matrix, and the DP's steps cost ``L x w`` instead of ``L^2``."""
        ties = self._tie_copies is not None and bw_in is not None
        key = (dtype, bw_in, bw_out, flight, cap, host_gbps, nm if ties else 0)
        hit = self._bands.get(key)
        if hit is None:
            n = self.L + 1
            hit = self._new_band(dtype, bw_in, bw_out, flight, cap, host_gbps, nm)
            w = hit[1]
            if self._band_cells + n * w > 4 * self._matrix_limit * n * n:
                self._bands.clear()
                self._band_vals.clear()
                self._band_ends.clear()
                self._band_cells = 0
            self._bands[key] = hit
            self._band_cells += n * w
        return hit

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
        """:meth:`band` uncached: what :meth:`masked_at` adds (the stage times, the
        activation policy's extra time, the ties' copies) at the band's cells only, in the
        same order: the same floats, without building the masked matrix nor the time matrix
        (:meth:`time_cells`). Its width comes from where the policy finds a fit, kept per
        policy key."""

        def times(a: np.ndarray, b: np.ndarray) -> np.ndarray:
            return self.time_cells(dtype, bw_in, bw_out, a, b)

        tie = self.tie_matrix(bw_in, nm) if self._tie_copies is not None else 0.0
        if self.activations == "keep":
            return self._kept_band(dtype, flight, cap, times, tie)

        def values(a: np.ndarray, b: np.ndarray) -> np.ndarray:
            tm = times(a, b) + self.extra_at(dtype, flight, cap, host_gbps, a, b)
            return tm + tie[a, b] if isinstance(tie, np.ndarray) else tm

        return skew(values, self._fitting(dtype, flight, cap, host_gbps))

    def extra_at(
        self, dtype: str, flight: int, cap: int, host_gbps: float, a: np.ndarray, b: np.ndarray
    ) -> np.ndarray:
        """:meth:`recompute_plan`'s extra time at the cells ``(a, b)`` only (index arrays,
        broadcast together). Under ``keep`` that is 0.0 where the stage fits and inf
        elsewhere, read off the memory model at those cells: no whole matrix per flight."""
        if self.activations != "keep":
            return self.recompute_plan(dtype, flight, cap, host_gbps)[0][a, b]
        one, step = self._flight_step(dtype, "async")
        fits = (one[a, b] + (flight - 1) * step[a, b] <= cap) & self.costs(dtype).valid[a, b]
        return np.where(fits, 0.0, INF)

    def _fitting(self, dtype: str, flight: int, cap: int, host_gbps: float) -> np.ndarray:
        """For each ``b``, the first ``a`` whose ``[a, b)`` fits under the activation policy
        (``b`` where none does): a band's rows start there (:func:`skew`)."""
        key = (dtype, flight, cap, host_gbps)
        hit = self._firsts.get(key)
        if hit is None:
            extra, _ = self.recompute_plan(dtype, flight, cap, host_gbps)
            hit = self._firsts[key] = first_finite(np.isfinite(extra) & self.costs(dtype).valid)
        return hit

    def _kept_band(
        self,
        dtype: str,
        flight: int,
        cap: int,
        times: Callable[[np.ndarray, np.ndarray], np.ndarray],
        tie: Any,
    ) -> tuple[np.ndarray, int]:
        """:meth:`band` under ``keep``: which stages fit, from the memory model laid out as
        a band already (:meth:`_skewed`, contiguous), and the times (with the ties' copies)
        gathered where they do; inf elsewhere, as ``times + extra`` is (``extra`` 0.0 where
        the stage fits, inf where not)."""
        key = (dtype, flight, cap)
        hit = self._kept_fits.get(key)
        if hit is None:  # which stages fit depends on neither the links nor Nm: kept apart
            one, step, ok, wide = self._skewed(dtype, cap)
            fits = ok & (one + (flight - 1) * step <= cap)
            rows = fits.any(axis=1)
            w = max(1, wide - int(fits[rows].argmax(axis=1).min())) if rows.any() else 1
            a, cols, _ = band_index(self.L + 1, w)
            hit = self._kept_fits[key] = (fits[:, wide - w :], a, cols, w)
        fits, a, cols, w = hit
        vals = times(a, cols) + tie[a, cols] if isinstance(tie, np.ndarray) else times(a, cols)
        return np.where(fits, vals, INF), w

    def _skewed(self, dtype: str, cap: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        """:meth:`_flight_step`'s two matrices and where ``a < b``, laid out as a band of
        :meth:`_widest`'s width ``W`` (row ``b``, entry ``j``: ``[b - W + j, b)``), and
        ``W``: every flight's fit is then a few contiguous operations."""
        wide = self._widest(dtype, cap)
        key = (dtype, wide)
        hit = self._skews.get(key)
        if hit is None:
            one, step = self._flight_step(dtype, "async")
            a, cols, inside = band_index(self.L + 1, wide)
            ok = inside & self.costs(dtype).valid[a, cols]
            hit = self._skews[key] = (one[a, cols], step[a, cols], ok, wide)
        return hit

    def _widest(self, dtype: str, cap: int) -> int:
        """The longest stage that fits ``cap`` keeping everything with one minibatch in
        flight, and so with any: a further minibatch in flight only adds bytes (the step
        of :meth:`_flight_step` is never negative; where it were, the whole model)."""
        key = (dtype, cap)
        hit = self._widths.get(key)
        if hit is None:
            one, step = self._flight_step(dtype, "async")
            n = self.L + 1
            if (step < 0).any():
                hit = max(1, n - 1)
            else:
                first = first_finite((one <= cap) & self.costs(dtype).valid)
                hit = max(1, int((np.arange(n) - first).max()))
            self._widths[key] = hit
        return hit

    def stage_memory(
        self,
        dtype: str,
        a: int,
        b: int,
        position: int,
        k: int,
        nm: int,
        schedule: str = "async",
        recompute: Sequence[int] = (),
        swap: Sequence[int] = (),
        flight: int | None = None,
    ) -> StageMemory:
        """:func:`memory.stage_memory` of ``[a, b)`` from the prefix sums (same integers);
        ``recompute``: global layers recomputed, one run ``[c, d)`` (or none); ``swap``:
        global layers swapped to host memory; ``flight``: the count in flight to charge
        (default the bound, :func:`memory.in_flight`)."""
        tc = self.costs(dtype)
        n = in_flight(position, k, nm, schedule, self.weights) if flight is None else flight
        kept = int(tc.sb[a, b])
        working = int(tc.working(schedule)[a, b])
        held = 0
        if recompute:
            c, d = recompute[0], recompute[-1] + 1
            assert list(recompute) == list(range(c, d)) and a <= c < d <= b, recompute
            held = held_predictions(n, int(tc.P[d] - tc.P[c]), schedule, self.weights)
        if recompute or swap:
            ties_in = [
                ([j - a for j in t.layers if a <= j < b], t.nbytes)
                for t in tc.ties
                if any(a <= j < b for j in t.layers)
            ]
            kept = activation_bytes(
                tc.saved[a:b],
                tc.inb[a:b],
                [j - a for j in recompute],
                [j - a for j in swap],
                tc.saved_in[a:b],
                tc.saved_out[a:b],
                tc.outb[b],
            )
            working = working_bytes(
                tc.work[a:b],
                tc.saved[a:b],
                [j - a for j in recompute],
                [j - a for j in swap],
                backward=backward_kind(schedule),
                out=tc.outs[a:b],
                params=untied_params(tc.params[a:b], ties_in),
                saved_in=tc.saved_in[a:b],
                saved_out=tc.saved_out[a:b],
                tied=sum(nbytes for _, nbytes in ties_in),
            )
        return stage_terms(
            int(tc.pb[a, b]),
            int(tc.B[b] - tc.B[a]),
            kept,
            tc.inb[a],
            working,
            factor=self.factor,
            flight=n,
            schedule=schedule,
            weights=self.weights,
            held=held,
        )

    def extra_time(
        self, device: Any, a: int, b: int, recompute: Sequence[int], swap: Sequence[int]
    ) -> float:
        """What the policy adds to stage ``[a, b)`` on ``device`` per minibatch: the
        recomputed run's forward, the swapped layers' unhidden copies (the very floats the
        DP added)."""
        tc = self.costs(device.type)
        if recompute:
            return float(tc.F[recompute[-1] + 1] - tc.F[recompute[0]])
        if swap:
            moved = sum(tc.saved[j] for j in swap)
            return self.swap_time(tc, a, b, moved, device.host_gbps)
        return 0.0

    def min_total_memory(self) -> int:
        """The least memory any split needs over all its devices together: parameters,
        optimizer state, the two accumulators and one in-flight copy of every layer's saved
        activations (the least over device types; none when they may be recomputed).
        Computed once per (profile, factor, policy): the formation search asks for every
        group."""
        key = (id(self.profile), self.factor, self.activations)
        hit = self._min_total
        if hit is not None and hit[0] == key:
            return hit[1]
        total = self._min_total_memory()
        self._min_total = (key, total)
        return total

    def _min_total_memory(self) -> int:
        """:meth:`min_total_memory`, computed."""
        keeps = self.activations == "keep"
        # a tie is one tensor: every layer using it counted it
        tied = sum((len(t.layers) - 1) * t.nbytes for t in self.profile.ties)
        return -param_copies(self.factor, 1, weights="latest") * tied + min(
            sum(
                param_copies(self.factor, 1, weights="latest") * lp.param_bytes
                + lp.buffer_bytes
                + (lp.saved_bytes if keeps else 0)
                for lp in lps
            )
            for lps in self.profile.layers.values()
        )


def least_ratio(mine: np.ndarray, ref: np.ndarray) -> float:
    """The least ``mine / ref`` over the layers where ``ref`` takes time (0 where none
    does): how much faster than the reference a type can be on any layer, which the
    planner's relaxations scale the reference's times by."""
    ok = ref > 0
    return float((mine[ok] / ref[ok]).min()) if ok.any() else 0.0


def first_finite(finite: np.ndarray) -> np.ndarray:
    """For each column ``b`` of a square mask over ``[a, b)``, its first true row ``a``;
    ``b`` where the column has none (a stage of no layers: never in a band)."""
    n = finite.shape[1]
    return np.where(finite.any(axis=0), finite.argmax(axis=0), np.arange(n))


def skew(
    values: Callable[[np.ndarray, np.ndarray], np.ndarray], first: np.ndarray
) -> tuple[np.ndarray, int]:
    """A band (:meth:`CostTables.band`) from a matrix's entries at given cells, ``values(a,
    b)`` (index arrays), and each column's first finite row ``first``: width ``w`` the
    longest ``b - a`` from there, row ``b`` the entries ``[b - w + j, b]``, inf above the
    matrix (``b - w + j < 0``)."""
    n = len(first)
    w = max(1, int((np.arange(n) - first).max()))
    a, cols, inside = band_index(n, w)
    return np.where(inside, values(a, cols), INF), w


def band_index(n: int, w: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The cells of a band of width ``w`` over ``n`` boundaries (:meth:`CostTables.band`):
    row ``b``, entry ``j`` is ``[b - w + j, b)``. Their first layers (0 above the matrix),
    the rows' ``b`` as a column (the index arrays broadcast together), and where the cell
    lies inside the matrix."""
    cols = np.arange(n)[:, None]
    a = cols - w + np.arange(w)[None, :]
    return np.maximum(a, 0), cols, a >= 0
