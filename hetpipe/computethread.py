"""A worker's one compute thread, and when a stage's compute runs on its event loop instead.

Every computation of a device runs on one thread, so that the event loop keeps receiving,
sending and answering (heartbeats, status, cancels) while the device computes. The hand-off
has a price: the loop wakes the thread, the thread wakes the loop when done, and both contend
for the interpreter lock on the way. For computations of a few milliseconds (small stages
on a CPU, where the pipeline hands work over several times per microbatch) that price is a
sizeable share of the computation itself. :class:`InlinePolicy` decides which runs skip it:
a run of a kind the stage measured shorter than ``[runtime] inline_ms`` runs on the loop,
which then waits at most that long before it serves anything else. It never does so while
the compute thread has work (two computations on one device at once), and only for a stage
that pulls no weights, on an unslowed CPU device, without injected stalls:

- a stage that pulls (several virtual workers) receives and decodes a copy of its weights
  every wave on its event loop; beside a computation on the thread that work overlaps it,
  on the loop it would wait for it (the rule rests on that reasoning, not on a measured
  gain);
- on a GPU a run's time says nothing about the next one's: launches return at once until the
  device's queue is full, then wait for it, and a synchronising call waits for everything
  queued, so an inline run could hold the worker's event loop past its heartbeat deadline
  (and the head would declare the worker lost);
- an emulated slow device sleeps out its pad, which stands for a device computing while its
  host serves messages;
- an injected stall (``[[fault]]``) rehearses a hang that the head must diagnose, from the
  heartbeats and status of a worker that stays responsive.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Any

from hetpipe.core.inline import may_run_inline

__all__ = ["ComputeThread", "InlinePolicy", "may_run_inline"]


class ComputeThread(ThreadPoolExecutor):
    """One thread that runs a device's computations in order, and knows whether it has any
    (submitted and not finished)."""

    def __init__(self, name: str) -> None:
        super().__init__(1, thread_name_prefix=name)
        self._lock = threading.Lock()
        self._queued = 0

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        with self._lock:
            self._queued += 1
        try:
            fut = super().submit(fn, *args, **kwargs)
        except BaseException:
            self._finished(None)
            raise
        # runs on the compute thread as the work ends, before the waiting loop is told
        fut.add_done_callback(self._finished)
        return fut

    def _finished(self, _fut: Future[Any] | None) -> None:
        with self._lock:
            self._queued -= 1

    @property
    def idle(self) -> bool:
        """Whether nothing is queued on or running in the thread."""
        return self._queued == 0


class InlinePolicy:
    """Whether a stage's next compute run goes on its event loop (see the module's doc).

    ``limit_s``: the longest run, as last measured for its kind, that may; 0 turns it off.
    A kind not measured yet goes to the thread: its first run says how long it takes.
    """

    def __init__(
        self,
        executor: Executor,
        limit_s: float,
        *,
        device: str,
        speed: float,
        pulls: bool = False,
        stalls: bool = False,
    ) -> None:
        """``device``: the torch device the stage computes on; ``speed``: its emulated speed;
        ``pulls``: whether the stage pulls weights every wave; ``stalls``: whether the job
        injects stalls into this stage."""
        self.executor = executor
        allowed = may_run_inline(on_cpu=device == "cpu", speed=speed, pulls=pulls, stalls=stalls)
        self.limit_s = limit_s if allowed else 0.0
        self._last_s: dict[str, float] = {}
        self.inline_runs = 0  # the stage's report says how its compute ran
        self.thread_runs = 0

    def inline(self, kind: str) -> bool:
        """Whether the next run of ``kind`` runs on the loop."""
        ok = (
            self.limit_s > 0
            and self._last_s.get(kind, math.inf) < self.limit_s
            and isinstance(self.executor, ComputeThread)
            and self.executor.idle
        )
        if ok:
            self.inline_runs += 1
        else:
            self.thread_runs += 1
        return ok

    def ran(self, kind: str, seconds: float) -> None:
        """Record how long a run of ``kind`` took, wherever it ran."""
        self._last_s[kind] = seconds
