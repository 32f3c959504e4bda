"""The assignment of one stage of one job to one worker.

The head builds a :class:`StageTask` per device of a plan and sends it in an ``assign``
message; the worker rebuilds it from the plain dict. Everything a stage needs to run without
asking again is here: its layers, its neighbours' data addresses, its shards and the job.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["StageTask"]


@dataclass(frozen=True)
class StageTask:
    """One stage (layers ``first``..``last``-1) of virtual worker ``vw`` of ``job``."""

    job: str
    spec: dict[str, Any]  # JobSpec.to_dict()
    vw: int
    stage: int
    k: int  # stages in this virtual worker
    first: int
    last: int
    nm: int
    staleness: int
    minibatches: int  # per virtual worker
    num_vws: int
    prev: str | None  # data address of stage - 1
    next: str | None  # data address of stage + 1
    shards: dict[str, str] = field(default_factory=dict)  # shard index -> address
    placement: dict[str, int] = field(default_factory=dict)  # global state name -> shard
    prev_device: str | None = None  # device of stage - 1: the only sender of activations
    next_device: str | None = None  # device of stage + 1: the only sender of gradients
    recompute: list[int] = field(default_factory=list)  # global layers whose activations
    # are recomputed in the backward instead of kept (hetpipe.core.memory)
    swap: list[int] = field(default_factory=list)  # global layers whose activations wait
    # in host memory between the forward and the backward (hetpipe.swap)
    # the most minibatches this stage holds between a forward and its backward, and the
    # forwards it runs before its first backward (the plan's, hetpipe.planner.plan.make_plan
    # under train.in_flight = "plan"; hetpipe.core.schedule.fill_counts); 0: the schedule's own
    in_flight_limit: int = 0
    in_flight_fill: int = 0
    start: int = 0  # minibatches this VW ran before this attempt (a resumed job's position)
    restore: dict[str, Any] | None = None  # checkpointed stage state to start from: its
    # meta (the tensors travel with the assignment; hetpipe.checkpoint)
    # stage replicas (hetpipe.replicas). Each group lists a stage's devices, leader first,
    # with their data addresses; each ``*_rows`` its split of the minibatch's rows. A stage on
    # one device is a group of one holding every row. Empty lists: a task built without them
    # (unit tests), read as that group of one.
    replica: int = 0  # this device's place in ``group``
    group: list[str] = field(default_factory=list)  # devices of this stage
    peers: list[str] = field(default_factory=list)  # their data addresses
    rows: list[int] = field(default_factory=list)
    prev_group: list[str] = field(default_factory=list)  # devices of stage - 1 (the only
    prev_peers: list[str] = field(default_factory=list)  # senders of activations)
    prev_rows: list[int] = field(default_factory=list)
    next_group: list[str] = field(default_factory=list)  # devices of stage + 1 (the only
    next_peers: list[str] = field(default_factory=list)  # senders of gradients)
    next_rows: list[int] = field(default_factory=list)

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

    def my_rows(self, n: int) -> tuple[int, int]:
        """The rows of an ``n``-row minibatch this device holds."""
        return (self.rows[self.replica], self.rows[self.replica + 1]) if self.rows else (0, n)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StageTask:
        try:
            return cls(**d)
        except TypeError as exc:
            raise ValueError(f"malformed stage task: {exc}") from None
