"""The schedule of one stage inside a virtual worker, as DESIGN.md states it.

Index letters used below:

====  ==========================================================
p     minibatch number inside the virtual worker (0, 1, 2, ...)
c     wave number: wave c = minibatches c*Nm .. (c+1)*Nm - 1
nf    the next minibatch this stage will run forward
nb    the next minibatch this stage will run backward
====  ==========================================================

Rules:

- Admission: stage 0 runs the forward of p only after the backward of p - Nm finished there,
  so at most Nm minibatches are in flight in the virtual worker.
- 1F1B: a ready backward goes before a ready forward; the last stage runs the loss and the
  backward of p right after its forward.
- Local update after every backward (in :mod:`hetpipe.stage`).
- WSP: after the backward of the last minibatch of wave c the stage pushes its update of
  wave c to its shards; before the forward of the first minibatch of wave c >= 1 it pulls
  with ``need = c - 1 - D`` and sets its weights to the pulled ones plus its own updates the
  shards had not applied. The pull is sent as soon as the forward of p - 1 is done, so it
  overlaps the backwards still running; the forward waits only for its answer. The clock
  a forward saw is recorded with it, so staleness is observable afterwards.

Compute runs on the worker's single compute thread; this coroutine only decides and moves
messages, so receives keep flowing while the stage computes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

import torch

from hetpipe.data import MinibatchStream
from hetpipe.stage import StageCompute
from hetpipe.timeline import Timeline, shares
from hetpipe.transport import Channel
from hetpipe.wire import Kind, Message
from hetpipe.wsp import is_last_of_wave, pull_need, wave_of

__all__ = ["PULL_TIMEOUT_S", "PUSH_TIMEOUT_S", "Record", "StageRunner"]

PUSH_TIMEOUT_S = 120.0
# A pull may be parked for as long as the slowest virtual worker needs to finish a wave.
PULL_TIMEOUT_S = 3600.0

Report = Callable[[dict[str, Any]], Awaitable[None]]
Send = Callable[[str, int, dict[str, torch.Tensor]], Awaitable[None]]


@dataclass
class Record:
    """What one minibatch saw at this stage: the observable staleness and weight versions."""

    p: int
    wave: int
    clock: int  # global clock of the weights its forward used
    vw_clock: int  # this VW's clock as the shard saw it then
    fwd_version: int = -1
    fwd_fingerprint: float = 0.0
    bwd_version: int = -1  # version current when its backward ran
    bwd_fingerprint: float = 0.0  # of the weights the backward differentiated
    t_fwd: float = 0.0  # wall-clock start of its forward here (comparable across daemons)
    t_bwd: float = 0.0  # wall-clock end of its backward here
    loss: float | None = None  # last stage only

    FIELDS = ("p", "wave", "clock", "vw_clock", "fwd_version", "fwd_fingerprint",
              "bwd_version", "bwd_fingerprint", "t_fwd", "t_bwd", "loss")

    def row(self) -> list[Any]:
        return [getattr(self, f) for f in self.FIELDS]


class StageRunner:
    """Runs one stage of one job to the end, or until cancelled."""

    def __init__(
        self,
        compute: StageCompute,
        executor: Executor,
        *,
        send: Send,
        shards: dict[int, Channel],
        report: Report,
        stream: MinibatchStream | None,
        report_every_s: float = 0.5,
    ) -> None:
        self.c = compute
        self.task = compute.task
        self.executor = executor
        self.send = send
        self.shards = shards
        self.report = report
        self.stream = stream
        self.report_every_s = report_every_s
        self.acts: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.grads: dict[int, torch.Tensor] = {}
        self.wakeup = asyncio.Event()
        self.nf = 0
        self.nb = 0
        self.merged_wave = -1  # the wave whose pulled weights are loaded
        self.pulls: dict[int, asyncio.Task[list[Message]]] = {}
        self.push_acks: list[asyncio.Future[Message]] = []
        self.records: dict[int, Record] = {}
        self.clock = 0
        self.vw_clock = 0
        self.started = 0.0
        self.timeline = Timeline()
        self.waiting: dict[str, Any] | None = None  # what the stage waits for, since when
        self.doing: dict[str, Any] | None = None  # the compute running now, since when
        # A virtual worker alone in its job skips the pulls after the first one: the global
        # weights then hold nothing but its own pushed updates, which its local weights
        # already include exactly (re-adding them would only change the rounding).
        self.pulls_needed = self.task.num_vws > 1 and compute.has_state

    # -- inbox ------------------------------------------------------------------------------

    def on_message(self, msg: Message) -> None:
        """Take an activation or a gradient addressed to this stage."""
        if msg.kind == Kind.ACT:
            self.acts[msg["p"]] = (msg.tensors["x"], msg.tensors["y"])
        elif msg.kind == Kind.GRAD:
            self.grads[msg["p"]] = msg.tensors["g"]
        self.wakeup.set()

    # -- main loop --------------------------------------------------------------------------

    async def run(self) -> dict[str, Any]:
        """Train this stage through all minibatches of the job; return its final stats."""
        self.started = time.monotonic()
        self.timeline = Timeline()
        reporter = asyncio.create_task(self._report_loop())
        try:
            with self.timeline.span("gate", wave=0):
                self._wait_for("pull", wave=0)
                await self._load_wave(0)
            total = self.task.minibatches
            while self.nb < total:
                if await self._try_backward() or await self._try_forward():
                    continue
                kind = "gate" if self.waiting and self.waiting["kind"] == "pull" else "bubble"
                with self.timeline.span(kind, self.waiting and self.waiting.get("p")):
                    await self.wakeup.wait()
                self.wakeup.clear()
            self._wait_for("push_ack")
            with self.timeline.span("push"):
                await self._wait_pushes()
            self.waiting = None
        finally:
            reporter.cancel()
            for t in self.pulls.values():
                t.cancel()
        return self.final_stats()

    def _wait_for(self, kind: str, **what: Any) -> None:
        """Say what the stage waits for (the head diagnoses hangs from it)."""
        if self.waiting is None or self.waiting["kind"] != kind or any(
                self.waiting.get(k) != v for k, v in what.items()):
            self.waiting = {"kind": kind, "since": time.time(), **what}

    async def _compute(self, kind: str, p: int, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn`` on the compute thread as one span; ``doing`` shows it meanwhile."""
        self.doing = {"kind": kind, "p": p, "since": time.time()}
        try:
            with self.timeline.span(kind, p, wave_of(p, self.task.nm)):
                return await asyncio.get_running_loop().run_in_executor(
                    self.executor, fn, *args)
        finally:
            self.doing = None

    async def _send(self, kind: str, p: int, tensors: dict[str, torch.Tensor]) -> None:
        with self.timeline.span("send", p, wave_of(p, self.task.nm)):
            await self.send(kind, p, tensors)

    async def _try_backward(self) -> bool:
        p = self.nb
        if self.task.is_last or p >= self.nf:
            return False
        if p not in self.grads:
            self._wait_for("gradient", p=p)
            return False
        grad_in = await self._compute("backward", p, self.c.backward, p, self.grads.pop(p))
        if not self.task.is_first and grad_in is not None:
            await self._send(Kind.GRAD, p, {"g": grad_in})
        await self._after_backward(p)
        return True

    async def _try_forward(self) -> bool:
        p = self.nf
        total = self.task.minibatches
        if p >= total:
            return False
        if self.task.is_first and p - self.task.nm >= self.nb:
            return False  # admission: p - Nm has not finished its backward here yet
        c = wave_of(p, self.task.nm)
        if c > self.merged_wave and not self.pulls_needed:
            # what a pull would have reported: the waves this VW has completed here
            self.merged_wave, self.clock = c, self.nb // self.task.nm
            self.vw_clock = self.clock
        if c > self.merged_wave:
            self._start_pull(c)
            task = self.pulls[c]
            if not task.done():
                self._wait_for("pull", wave=c, p=p, need=pull_need(c, self.task.staleness))
                return False
            with self.timeline.span("merge", p, c):
                await self._merge(c, task.result())
        if self.task.is_first:
            x, y = self.stream.batch(p)  # type: ignore[union-attr]
        elif p in self.acts:
            x, y = self.acts.pop(p)
        else:
            if self.nb >= self.nf:
                self._wait_for("activation", p=p)
            return False
        rec = Record(p=p, wave=c, clock=self.clock, vw_clock=self.vw_clock, t_fwd=time.time())
        self.records[p] = rec
        out, grad_in = await self._compute("forward", p, self.c.forward, p, x, y)
        self.nf = p + 1
        if self.task.is_last:
            if not self.task.is_first and grad_in is not None:
                await self._send(Kind.GRAD, p, {"g": grad_in})
            await self._after_backward(p)
        else:
            await self._send(Kind.ACT, p, {"x": out, "y": y})
            # prefetch the pull of the next wave as soon as its first forward is next
            nxt = wave_of(self.nf, self.task.nm)
            if self.pulls_needed and self.nf < total and nxt > self.merged_wave and (
                not self.task.is_first or self.nf - self.task.nm < self.nb
            ):
                self._start_pull(nxt)
        return True

    async def _after_backward(self, p: int) -> None:
        rec = self.records[p]
        fv, ffp, bv, bfp = self.c.versions.pop(p)
        rec.fwd_version, rec.fwd_fingerprint = fv, ffp
        rec.bwd_version, rec.bwd_fingerprint = bv, bfp
        rec.t_bwd = time.time()
        if self.task.is_last:
            rec.loss = self.c.stats.last_loss
        self.nb = p + 1
        if is_last_of_wave(p, self.task.nm, self.task.minibatches):
            c = wave_of(p, self.task.nm)
            with self.timeline.span("push", p, c):
                await self._push(c)

    # -- parameter server -------------------------------------------------------------------

    def _shard_names(self) -> dict[int, list[str]]:
        by_shard: dict[int, list[str]] = {}
        for name in self.c.state_names():
            by_shard.setdefault(self.task.placement[name], []).append(name)
        return by_shard

    async def _push(self, wave: int) -> None:
        """Send this stage's update of ``wave`` to each shard; acks are awaited later."""
        if not self.c.has_state:
            return
        deltas = await asyncio.get_running_loop().run_in_executor(
            self.executor, self.c.push_deltas, wave, self.pulls_needed)
        fields = {"job": self.task.job, "vw": self.task.vw, "stage": self.task.stage,
                  "wave": wave}
        for shard, names in self._shard_names().items():
            part = {n: deltas[n] for n in names if n in deltas}
            ch = self.shards[shard]
            self.push_acks.append(await ch.send_request(
                Kind.PUSH, fields, part, what=f"shard {shard} ({ch.name})"))

    async def _wait_pushes(self) -> None:
        for fut in self.push_acks:
            await asyncio.wait_for(fut, PUSH_TIMEOUT_S)
        self.push_acks.clear()

    def _start_pull(self, c: int) -> None:
        if c in self.pulls:
            return
        self.pulls[c] = asyncio.create_task(self._pull(c), name=f"pull:{c}")
        self.pulls[c].add_done_callback(lambda _t: self.wakeup.set())

    async def _pull(self, c: int) -> list[Message]:
        if not self.c.has_state:
            return []
        fields = {"job": self.task.job, "vw": self.task.vw, "stage": self.task.stage,
                  "need": pull_need(c, self.task.staleness), "wave": c}
        waits = [
            self.shards[shard].request(Kind.PULL, fields, timeout=PULL_TIMEOUT_S,
                                       what=f"shard {shard}")
            for shard in self._shard_names()
        ]
        return list(await asyncio.gather(*waits))

    async def _load_wave(self, c: int) -> None:
        self._start_pull(c)
        await self._merge(c, await self.pulls[c])

    async def _merge(self, c: int, replies: list[Message]) -> None:
        pulled: dict[str, torch.Tensor] = {}
        applied: dict[str, list[int]] = {}
        clock = vw_clock = None
        for r in replies:
            pulled.update(r.tensors)
            for name in r.tensors:
                applied[name] = list(r["applied"])
            clock = r["clock"] if clock is None else min(clock, r["clock"])
            vw_clock = r["vw_clock"] if vw_clock is None else min(vw_clock, r["vw_clock"])
        if pulled:
            await asyncio.get_running_loop().run_in_executor(
                self.executor, self.c.load, pulled, applied)
        self.clock = clock if clock is not None else c
        self.vw_clock = vw_clock if vw_clock is not None else c
        self.merged_wave = c
        self.pulls.pop(c, None)

    # -- reporting --------------------------------------------------------------------------

    def progress(self) -> dict[str, Any]:
        s = self.c.stats
        recent = s.losses[-20:]
        elapsed = self.timeline.elapsed()
        return {
            "timing": dict(self.timeline.totals),
            "shares": shares(self.timeline.totals, elapsed),
            "timeline_elapsed_s": elapsed,
            "waiting": self.doing or self.waiting,
            "done": self.nb,
            "forwards": self.nf,
            "total": self.task.minibatches,
            "loss": sum(recent) / len(recent) if recent else None,
            "elapsed_s": time.monotonic() - self.started,
            "forward_s": s.forward_s,
            "backward_s": s.backward_s,
            "peak_bytes": s.peak_bytes,
            "clock": self.clock,
            "vw_clock": self.vw_clock,
            "wave": wave_of(max(self.nf - 1, 0), self.task.nm),
        }

    async def _report_loop(self) -> None:
        while True:
            await asyncio.sleep(self.report_every_s)
            await self.report(self.progress())

    def final_stats(self) -> dict[str, Any]:
        out = self.progress()
        out["records"] = [self.records[p].row() for p in sorted(self.records)]
        out["spans"] = self.timeline.spans
        out["record_fields"] = list(Record.FIELDS)
        return out
