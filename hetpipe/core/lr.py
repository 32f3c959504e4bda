"""Learning-rate schedules and dynamic loss scaling: pure rules every stage of a virtual
worker evaluates on the same clock, so that all stages of a minibatch (or an iteration) use
the same rate and the same loss scale.

A schedule is a factor of ``optimizer.lr`` per *step* (or a user's function
``"package.module:function"``, called as ``function(t, **args)`` with ``t`` the step after the
warm-up, which returns the factor): the step's index on the virtual
worker's one clock (:func:`step_index`), not a count kept by each stage. In the synchronous
schedules (gpipe, 1f1b) step ``i`` is iteration ``i``, the same on every stage and every
virtual worker; in the asynchronous one it is the minibatch number ``p`` of the virtual
worker, which every stage steps once for, in order. Factors follow ``torch.optim.lr_scheduler``:
a linear warm-up as ``LinearLR(start_factor, 1.0, total_iters=warmup_steps)``, then cosine as
``CosineAnnealingLR(T_max=total_steps - warmup_steps, eta_min=lr * min_factor)`` or step as
``StepLR(step_size=step_every, gamma)`` (the two chained as ``SequentialLR`` with the
milestone at ``warmup_steps``).

:class:`LossScale` is ``torch.amp.GradScaler``'s scale rule: a step whose gradients hold an
inf or NaN anywhere is skipped and the scale shrinks by ``backoff_factor``; after
``growth_interval`` applied steps in a row it grows by ``growth_factor``. Every stage runs it
on the verdicts the stages agreed on, so every stage holds the same scale at every step.

Pure: no torch, asyncio or zmq.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["KINDS", "LossScale", "LrSchedule", "is_function", "step_index"]

KINDS = ("constant", "cosine", "step")
_FUNCTION = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*")


def is_function(kind: str) -> bool:
    """Whether a schedule kind names a user's function (``"package.module:function"``)."""
    return bool(_FUNCTION.fullmatch(kind))


def step_index(sync: bool, i: int, nm: int, start: int) -> int:
    """The schedule's step of the optimizer step ``i`` of a stage (iteration ``i`` when
    ``sync``, else minibatch ``i``) of a virtual worker whose attempt began at its
    minibatch ``start`` (a resumed job goes on where it stopped)."""
    return (start // nm + i) if sync else start + i


@dataclass(frozen=True)
class LrSchedule:
    """The factor of ``optimizer.lr`` at each step (``[lr_schedule]`` of a job).

    ``total_steps``: the steps the schedule spans, warm-up included (cosine decays over
    ``total_steps - warmup_steps``); the caller fills in the job's length when the file
    leaves it unset.
    """

    kind: str = "constant"
    warmup_steps: int = 0
    warmup_start: float = 0.0
    total_steps: int | None = None
    min_factor: float = 0.0
    step_every: int | None = None
    gamma: float = 0.1
    args: dict[str, Any] = field(default_factory=dict)  # of a user's function
    # a user's function, resolved by the runtime (a job spec holds only its name)
    function: Callable[..., Any] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS and not is_function(self.kind):
            raise ValueError(
                f"lr_schedule: kind must be one of {', '.join(KINDS)} or 'package.module:function'"
            )
        if self.kind == "step" and not self.step_every:
            raise ValueError("lr_schedule: kind 'step' needs step_every")

    def factor(self, step: int) -> float:
        """The factor of the learning rate at ``step`` (0-based)."""
        w = self.warmup_steps
        if step < w:
            return self.warmup_start + (1.0 - self.warmup_start) * step / w
        t = step - w
        if self.kind == "cosine":
            span = max((self.total_steps or 0) - w, 1)
            t = min(t, span)
            return (
                self.min_factor + (1.0 - self.min_factor) * (1 + math.cos(math.pi * t / span)) / 2
            )
        if self.kind == "step":
            assert self.step_every
            return self.gamma ** (t // self.step_every)
        if self.kind in KINDS:
            return 1.0
        if self.function is None:
            raise ValueError(f"lr_schedule: function {self.kind} is not resolved")
        got = self.function(t, **self.args)
        if isinstance(got, bool) or not isinstance(got, int | float) or not math.isfinite(got):
            raise ValueError(
                f"lr_schedule: {self.kind} returned {got!r} for step {step}, not a finite number"
            )
        return float(got)

    @property
    def constant(self) -> bool:
        """Whether every step's factor is 1 (nothing to apply)."""
        return self.kind == "constant" and self.warmup_steps == 0


@dataclass
class LossScale:
    """``torch.amp.GradScaler``'s dynamic loss scale, stepped by agreed verdicts."""

    scale: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    tracker: int = 0  # applied steps in a row since the last change
    skipped: int = 0  # steps skipped so far

    def update(self, finite: bool) -> None:
        """After a step whose gradients were all ``finite`` on every stage (applied) or not
        (skipped): GradScaler.update's rule."""
        if not finite:
            self.scale *= self.backoff_factor
            self.tracker = 0
            self.skipped += 1
            return
        self.tracker += 1
        if self.tracker == self.growth_interval:
            grown = self.scale * self.growth_factor
            if math.isfinite(grown):
                self.scale = grown
            self.tracker = 0
