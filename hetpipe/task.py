"""The assignment of one stage of one job to one worker: a layout plus addresses.

The head builds a :class:`StageTask` per device of a job's layout and sends it in an
``assign`` message; the worker rebuilds it from the plain dict. Everything a stage needs to
run without asking again is here: its own stage layout and its neighbours' (the only senders
of its activations and gradients), their data addresses, its shards and the job.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from hetpipe.core.layout import OnStage, StageLayout

__all__ = ["StageTask"]


@dataclass(frozen=True)
class StageTask(OnStage):
    """Stage ``stage`` (its ``layout``) of virtual worker ``vw`` of ``job``, on device
    ``layout.devices[replica]``."""

    job: str
    spec: dict[str, Any]  # JobSpec.to_dict()
    vw: int
    stage: int
    k: int  # stages in this virtual worker
    nm: int
    staleness: int
    minibatches: int  # per virtual worker
    num_vws: int
    layout: StageLayout
    shards: dict[str, str] = field(default_factory=dict)  # shard index -> address
    placement: dict[str, int] = field(default_factory=dict)  # global state name -> shard
    start: int = 0  # minibatches this VW ran before this attempt (a resumed job's position)
    # the shards' wave of this VW's own wave 0: past 0 for a VW re-formed after a lost
    # worker (hetpipe.head.reform); its checkpoint cuts are counted on the shards' waves
    wave_base: int = 0
    shares: list[int] = field(default_factory=list)  # every VW's share of an epoch (empty:
    # equal; hetpipe.jobplan.data_shares)
    restore: dict[str, Any] | None = None  # checkpointed stage state to start from: its
    # meta (the tensors travel with the assignment; hetpipe.checkpoint)
    replica: int = 0  # this device's place in ``layout.devices`` (hetpipe.replicas)
    # data addresses of this stage's devices and of its neighbours' (stage - 1 sends the
    # activations, stage + 1 the gradients); a neighbour is None at either end
    peers: list[str] = field(default_factory=list)
    prev: StageLayout | None = None
    prev_peers: list[str] = field(default_factory=list)
    next: StageLayout | None = None
    next_peers: list[str] = field(default_factory=list)
    # the ties of this virtual worker that span stages: canonical name -> the stages that
    # hold a copy, ascending (the first owns it: hetpipe.modelstate)
    ties: dict[str, list[int]] = field(default_factory=dict)

    @classmethod
    def standalone(
        cls,
        job: str,
        spec: dict[str, Any],
        layout: StageLayout,
        *,
        stage: int = 0,
        k: int = 1,
        nm: int = 1,
        minibatches: int = 1,
        num_vws: int = 1,
        **more: Any,
    ) -> StageTask:
        """A stage of virtual worker 0 run in process on its own (the probes and the unit
        tests): no neighbours, no shards, WSP's D of 0; ``more`` sets other fields."""
        return cls(
            job=job,
            spec=spec,
            vw=0,
            stage=stage,
            k=k,
            nm=nm,
            staleness=0,
            minibatches=minibatches,
            num_vws=num_vws,
            layout=layout,
            **more,
        )

    @property
    def group(self) -> tuple[str, ...]:
        """This stage's devices, leader first."""
        return self.layout.devices

    @property
    def prev_group(self) -> tuple[str, ...]:
        return self.prev.devices if self.prev is not None else ()

    @property
    def prev_rows(self) -> tuple[int, ...]:
        return self.prev.rows if self.prev is not None else ()

    @property
    def next_group(self) -> tuple[str, ...]:
        return self.next.devices if self.next is not None else ()

    @property
    def next_rows(self) -> tuple[int, ...]:
        return self.next.rows if self.next is not None else ()

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.k - 1

    @property
    def where(self) -> str:
        suffix = f"/replica{self.replica}" if self.replicated else ""
        return f"vw{self.vw}/stage{self.stage}{suffix}"

    @property
    def replicated(self) -> bool:
        return len(self.group) > 1

    @property
    def leader(self) -> bool:
        """Whether this device speaks for its stage: pushes, checkpoints, reports."""
        return self.replica == 0

    @property
    def tied(self) -> tuple[str, ...]:
        """The canonical names of the spanning ties this stage holds a copy of."""
        return tuple(n for n, stages in self.ties.items() if self.stage in stages)

    @property
    def copies(self) -> frozenset[str]:
        """The spanning ties this stage holds but does not own: their one entry on the
        shards is the owner's to push and reduce in the synchronous schedules."""
        return frozenset(n for n, stages in self.ties.items() if self.stage in stages[1:])

    def my_rows(self, n: int) -> tuple[int, int]:
        """The rows of an ``n``-row minibatch this device holds."""
        return (self.rows[self.replica], self.rows[self.replica + 1]) if self.rows else (0, n)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StageTask:
        try:
            d = dict(d)
            for key in ("layout", "prev", "next"):
                if d.get(key) is not None:
                    d[key] = StageLayout.from_dict(d[key])
            if not isinstance(d.get("layout"), StageLayout):
                raise TypeError("missing its stage layout")
            return cls(**d)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"malformed stage task: {exc}") from None
