"""The layout of a job's virtual workers: which devices run which layers, with which Nm.

One type for every place that speaks of a split: the planner's result, what the head lays
out and what a worker runs (a :class:`StageLayout` plus addresses). A stage is a half-open
layer range ``[first, last)`` on a group of devices (its leader first, then the devices
replicating it); a virtual worker is its stages in pipeline order and its Nm.

A job file's ``[[vw]]`` table is a :class:`VWSpec`: what a user may ask for, which can leave
the layers and Nm to the planner. It becomes a layout once (:meth:`VWSpec.layout`), where
the split is complete.

:func:`validate` is the one check of a split, so the job check, the planner's explicit
plans and the head agree on what is refused and say it with the same words. It names the
key a user wrote (``vw[0].layers``) so a message reads the same wherever it is raised.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

__all__ = [
    "OnStage",
    "SplitError",
    "StageLayout",
    "VWLayout",
    "VWSpec",
    "bounds_of",
    "validate",
]


class SplitError(ValueError):
    """A split that cannot run; ``key`` is the job-file key at fault (``vw[1].layers``)."""

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(f"{key}: {problem}")
        self.key = key
        self.problem = problem


@dataclass(frozen=True)
class StageLayout:
    """One stage: layers ``first``..``last``-1 on ``devices`` (leader first).

    ``recompute`` and ``swap`` list the global layers whose activations are recomputed in
    the backward or wait in host memory; ``rows`` (replicated stages only) are the
    minibatch's row bounds over the devices; ``in_flight_limit`` caps the minibatches the
    stage holds between a forward and its backward (0: the schedule's own maximum) and
    ``in_flight_fill`` is how many forwards it runs before its first backward.
    """

    devices: tuple[str, ...]
    first: int
    last: int
    recompute: tuple[int, ...] = ()
    swap: tuple[int, ...] = ()
    rows: tuple[int, ...] = ()
    in_flight_limit: int = 0
    in_flight_fill: int = 0

    @property
    def device(self) -> str:
        """The leader: the device that speaks for the stage (pushes, checkpoints, reports)."""
        return self.devices[0]

    @property
    def replicas(self) -> tuple[str, ...]:
        """The devices replicating the stage beside its leader; () for one device."""
        return self.devices[1:]

    @property
    def layers(self) -> tuple[int, int]:
        """The half-open layer range ``(first, last)``."""
        return (self.first, self.last)

    @property
    def n_layers(self) -> int:
        return self.last - self.first

    def holds(self, layer: int) -> bool:
        return self.first <= layer < self.last

    def to_dict(self) -> dict[str, Any]:
        """Plain data (msgpack/JSON), the form an assignment carries."""
        return {
            "devices": list(self.devices),
            "first": self.first,
            "last": self.last,
            "recompute": list(self.recompute),
            "swap": list(self.swap),
            "rows": list(self.rows),
            "in_flight_limit": self.in_flight_limit,
            "in_flight_fill": self.in_flight_fill,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StageLayout:
        try:
            return cls(
                devices=tuple(str(x) for x in d["devices"]),
                first=int(d["first"]),
                last=int(d["last"]),
                recompute=tuple(int(x) for x in d.get("recompute", ())),
                swap=tuple(int(x) for x in d.get("swap", ())),
                rows=tuple(int(x) for x in d.get("rows", ())),
                in_flight_limit=int(d.get("in_flight_limit", 0)),
                in_flight_fill=int(d.get("in_flight_fill", 0)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed stage layout: {exc!r}") from None


class OnStage:
    """A mixin for what belongs to one stage and holds its :class:`StageLayout` as
    ``layout`` (a planned stage, a stage's assignment): the layout's fields read through,
    so each is stored once and named alike everywhere."""

    layout: StageLayout

    @property
    def device(self) -> str:
        """The stage's leader."""
        return self.layout.device

    @property
    def first(self) -> int:
        return self.layout.first

    @property
    def last(self) -> int:
        return self.layout.last

    @property
    def layers(self) -> tuple[int, int]:
        """The half-open layer range ``(first, last)``."""
        return self.layout.layers

    @property
    def replicas(self) -> tuple[str, ...]:
        """The devices beside the leader that run the stage on their rows; () for one."""
        return self.layout.replicas

    @property
    def rows(self) -> tuple[int, ...]:
        """A replicated stage's row bounds over its devices; () on one device (every row)."""
        return self.layout.rows

    @property
    def recompute(self) -> tuple[int, ...]:
        """Global layers whose activations are recomputed in the backward."""
        return self.layout.recompute

    @property
    def swap(self) -> tuple[int, ...]:
        """Global layers whose activations wait in host memory."""
        return self.layout.swap

    @property
    def in_flight_limit(self) -> int:
        """The most minibatches the stage holds between a forward and its backward (0: the
        schedule's own maximum)."""
        return self.layout.in_flight_limit

    @property
    def in_flight_fill(self) -> int:
        """The forwards the stage runs before its first backward."""
        return self.layout.in_flight_fill


@dataclass(frozen=True)
class VWLayout:
    """One virtual worker: its stages in pipeline order and its Nm."""

    stages: tuple[StageLayout, ...]
    nm: int

    @classmethod
    def from_counts(
        cls,
        groups: Sequence[Sequence[str]],
        counts: Sequence[int],
        nm: int,
        *,
        recompute: Sequence[Iterable[int]] | None = None,
        swap: Sequence[Iterable[int]] | None = None,
        limits: Sequence[int] | None = None,
    ) -> VWLayout:
        """A layout from per-stage device groups and layer counts (the job file's form)."""
        bounds = bounds_of(counts)
        stages = []
        for i, group in enumerate(groups):
            stages.append(
                StageLayout(
                    devices=tuple(group),
                    first=bounds[i][0],
                    last=bounds[i][1],
                    recompute=tuple(recompute[i]) if recompute is not None else (),
                    swap=tuple(swap[i]) if swap is not None else (),
                    in_flight_limit=limits[i] if limits is not None else 0,
                )
            )
        return cls(tuple(stages), nm)

    @property
    def k(self) -> int:
        """Stages in this virtual worker."""
        return len(self.stages)

    @property
    def devices(self) -> tuple[str, ...]:
        """Each stage's leader, in pipeline order."""
        return tuple(s.device for s in self.stages)

    def all_devices(self) -> tuple[str, ...]:
        """Every device of this virtual worker, replicas included."""
        return tuple(d for s in self.stages for d in s.devices)

    @property
    def counts(self) -> tuple[int, ...]:
        """Layers per stage (the job file's ``layers = [...]``)."""
        return tuple(s.n_layers for s in self.stages)

    def with_stages(self, **changes: Sequence[Any]) -> VWLayout:
        """This layout with per-stage fields replaced, one value per stage."""
        stages = list(self.stages)
        for name, values in changes.items():
            if len(values) != len(stages):
                raise ValueError(f"{name}: {len(values)} values for {len(stages)} stages")
            stages = [replace(s, **{name: v}) for s, v in zip(stages, values, strict=True)]
        return replace(self, stages=tuple(stages))

    def pinned(self, activations: str) -> VWLayout:
        """This layout with the activations of every layer as ``train.activations`` pins
        them where nothing chose per layer: "recompute" or "swap" every layer of every
        stage, anything else ("keep", "auto" with no plan to choose) keeps them all."""
        every = [tuple(range(s.first, s.last)) for s in self.stages]
        none: list[tuple[int, ...]] = [() for _ in self.stages]
        return self.with_stages(
            recompute=every if activations == "recompute" else none,
            swap=every if activations == "swap" else none,
        )

    def to_dict(self) -> dict[str, Any]:
        return {"stages": [s.to_dict() for s in self.stages], "nm": self.nm}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> VWLayout:
        try:
            return cls(tuple(StageLayout.from_dict(s) for s in d["stages"]), int(d["nm"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed virtual-worker layout: {exc!r}") from None


@dataclass(frozen=True)
class VWSpec:
    """One ``[[vw]]`` table of a job file: devices in pipeline order, and optionally the
    layers per stage and the virtual worker's own Nm (None: the planner's or the job's)."""

    devices: tuple[str, ...]  # each stage's leader
    layers: tuple[int, ...] | None = None
    nm: int | None = None
    # per stage, the devices that replicate it beside ``devices[i]`` (its leader); () for a
    # stage on one device. None: no stage is replicated (hetpipe.replicas)
    replicas: tuple[tuple[str, ...], ...] | None = None

    @property
    def k(self) -> int:
        return len(self.devices)

    def group(self, stage: int) -> tuple[str, ...]:
        """The devices of ``stage``: its leader, then its replicas."""
        extra = self.replicas[stage] if self.replicas is not None else ()
        return (self.devices[stage], *extra)

    def all_devices(self) -> tuple[str, ...]:
        """Every device of this virtual worker, replicas included."""
        return tuple(d for s in range(self.k) for d in self.group(s))

    def layout(
        self,
        nm: int,
        *,
        recompute: Sequence[Iterable[int]] | None = None,
        swap: Sequence[Iterable[int]] | None = None,
    ) -> VWLayout:
        """This split as a layout, with ``nm`` where the table gives none; its layers must
        be given (a split the planner completes comes back as a layout of its own)."""
        if self.layers is None:
            raise ValueError("the split gives no layers")
        groups = [self.group(s) for s in range(self.k)]
        return VWLayout.from_counts(
            groups, self.layers, self.nm or nm, recompute=recompute, swap=swap
        )


def bounds_of(counts: Sequence[int]) -> list[tuple[int, int]]:
    """Half-open layer ranges of consecutive stages of ``counts`` layers each."""
    edges = [0, *itertools.accumulate(counts)]
    return list(itertools.pairwise(edges))


def validate(
    vws: Sequence[VWLayout | VWSpec],
    devices: Collection[str],
    n_layers: int,
    *,
    known_as: str = "the cluster",
    several: bool = False,
) -> None:
    """Raise :class:`SplitError` for the first problem of a job's split, naming its key.

    Takes the layouts the head runs or the job file's ``[[vw]]`` tables (whose layers and
    Nm may still be the planner's to choose; what is not given is not checked). Checked:
    every device is one of ``devices`` (``known_as`` names where they come from) and runs
    one stage of one virtual worker (with ``several``: stages of one virtual worker, several
    where its name repeats, none of them replicated);
    each virtual worker has at most as many stages as the model has layers; its stages are
    non-empty, contiguous and cover the model's ``n_layers`` exactly; Nm is at least 1; the
    layers a stage recomputes or swaps are its own and never both; a replicated stage's row
    bounds rise from 0, one more than its devices; an in-flight fill stays within its limit.
    """
    owner: dict[str, int] = {}
    for v, vw in enumerate(vws):
        key = f"vw[{v}]"
        groups = (
            [s.devices for s in vw.stages]
            if isinstance(vw, VWLayout)
            else [vw.group(s) for s in range(vw.k)]
        )
        if not groups:
            raise SplitError(f"{key}.devices", "must list at least one device")
        replicated = {d for g in groups if len(g) > 1 for d in g}
        for i, group in enumerate(groups):
            for d in group:
                if d not in devices:
                    known = ", ".join(sorted(devices))
                    raise SplitError(
                        f"{key}.devices[{i}]",
                        f"{d!r} is not a device of {known_as} (known: {known})",
                    )
                # a device may run several stages of its one vw, none of them replicated
                again = several and owner.get(d) == v and len(group) == 1 and d not in replicated
                if d in owner and not again:
                    where = "this vw" if owner[d] == v else f"vw[{owner[d]}]"
                    raise SplitError(f"{key}.devices[{i}]", f"device {d!r} is already in {where}")
                owner[d] = v
        if len(groups) > n_layers:
            raise SplitError(
                f"{key}.devices", f"{len(groups)} stages for a model of {n_layers} layers"
            )
        counts = vw.counts if isinstance(vw, VWLayout) else vw.layers
        if counts is not None:
            _check_counts(key, counts, n_layers)
        if isinstance(vw, VWLayout):
            _check_layout(key, vw, n_layers)
        elif vw.nm is not None and vw.nm < 1:
            raise SplitError(f"{key}.nm", f"must be >= 1, got {vw.nm}")


def _check_counts(key: str, counts: Sequence[int], n_layers: int) -> None:
    for i, n in enumerate(counts):
        if n < 1:
            raise SplitError(f"{key}.layers[{i}]", f"must be >= 1, got {n}")
    if sum(counts) != n_layers:
        raise SplitError(
            f"{key}.layers",
            f"{list(counts)} sums to {sum(counts)}, the model has {n_layers} layers",
        )


def _check_layout(key: str, vw: VWLayout, n_layers: int) -> None:
    if vw.stages[0].first != 0 or vw.stages[-1].last != n_layers:
        raise SplitError(
            f"{key}.layers",
            f"stages cover layers {vw.stages[0].first}..{vw.stages[-1].last - 1}, "
            f"the model has layers 0..{n_layers - 1}",
        )
    for i, (a, b) in enumerate(itertools.pairwise(vw.stages)):
        if a.last != b.first:
            raise SplitError(
                f"{key}.layers",
                f"stage {i} ends at layer {a.last} but stage {i + 1} starts at {b.first}",
            )
    if vw.nm < 1:
        raise SplitError(f"{key}.nm", f"must be >= 1, got {vw.nm}")
    for i, st in enumerate(vw.stages):
        _check_stage(f"{key}.stages[{i}]", st)


def _check_stage(key: str, st: StageLayout) -> None:
    for name, layers in (("recompute", st.recompute), ("swap", st.swap)):
        outside = [n for n in layers if not st.holds(n)]
        if outside:
            raise SplitError(
                f"{key}.{name}",
                f"layer {outside[0]} is not in the stage's layers {st.first}..{st.last - 1}",
            )
    both = sorted(set(st.recompute) & set(st.swap))
    if both:
        raise SplitError(f"{key}.swap", f"layer {both[0]} is also recomputed (one policy each)")
    if st.rows:
        rising = all(a < b for a, b in itertools.pairwise(st.rows))
        if len(st.rows) != len(st.devices) + 1 or st.rows[0] != 0 or not rising:
            raise SplitError(
                f"{key}.rows",
                f"{list(st.rows)} must rise from 0 with one bound more than its "
                f"{len(st.devices)} devices",
            )
    if st.in_flight_limit < 0:
        raise SplitError(f"{key}.in_flight", f"must be >= 0, got {st.in_flight_limit}")
    if st.in_flight_limit and st.in_flight_fill > st.in_flight_limit:
        raise SplitError(
            f"{key}.in_flight",
            f"fills {st.in_flight_fill} forwards past its limit {st.in_flight_limit}",
        )
