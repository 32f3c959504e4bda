"""When a stage's compute may run on its event loop instead of its compute thread: the rule
the runtime runs by and the planner prices by."""

from __future__ import annotations

__all__ = ["may_run_inline"]


def may_run_inline(
    *, on_cpu: bool, speed: float, pulls: bool = False, stalls: bool = False
) -> bool:
    """Whether a stage's short runs may go on its event loop at all: on an unslowed CPU
    device, for a stage that pulls no weights and has no injected stalls (the reasons are
    :mod:`hetpipe.computethread`'s). The one home of that rule: the runtime's
    :class:`hetpipe.computethread.InlinePolicy` runs by it and the planner prices by it
    (:meth:`hetpipe.planner.runtime.RuntimeCosts.runs_inline`)."""
    return on_cpu and speed >= 1.0 and not pulls and not stalls
