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
    # are recomputed in the backward instead of kept (hetpipe.planner.memory)
    start: int = 0  # minibatches this VW ran before this attempt (a resumed job's position)
    restore: dict[str, Any] | None = None  # checkpointed stage state to start from: its
    # meta (the tensors travel with the assignment; hetpipe.checkpoint)

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.k - 1

    @property
    def where(self) -> str:
        return f"vw{self.vw}/stage{self.stage}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StageTask:
        try:
            return cls(**d)
        except TypeError as exc:
            raise ValueError(f"malformed stage task: {exc}") from None
