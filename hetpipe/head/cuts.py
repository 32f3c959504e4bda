"""Checkpoint cuts: which wave to write, whether the shards' cut and the stages' states agree,
and writing both as one checkpoint.

Every ``train.checkpoint_every`` waves (and at the end) each stage sends the head its state
right after its push of that wave, and the shards keep the cut of the global weights at the
same wave (:mod:`hetpipe.shard`). Once every stage's state of a cut is in
(:func:`ready_cuts`), the head fetches the shards' cut, checks that the shards' applied sets
prove it whole (:func:`cut_problem`) and writes both (:mod:`hetpipe.checkpoint`). A virtual
worker that ends before a cut keeps its last state for the later cuts.

``hetpipe checkpoint JOB`` asks for a cut now (:meth:`CutsPart.checkpoint_now`): the head
proposes the first wave boundary past what every first stage has admitted
(:func:`propose_cut`), tells the shards first (each keeps the cut only if no push of that wave
or later has landed) and then every stage (each sends its state there only if it has not yet
decided its push of the wave before); where one is already past, it proposes a later wave
and asks again. A wave every shard and stage took becomes one of the job's cuts.

Cuts are waves of the shards' count. A virtual worker re-formed after a lost worker
(:mod:`hetpipe.head.reform`) counts its own waves from 0 again, from the wave it joined the
shards at (its *base*, ``JobPlan.bases``): its stages send their state at the shards' wave
``base + c`` after their own wave ``c - 1``, and its place at a cut is its restart position
plus the minibatches of its own waves before it. A cut is taken only past every such base
(:func:`cut_floor`): there every update the VW's old stages pushed is in the shards' cut, and
its new stages have a state of their own. A VW left out after a loss holds no state; its place
is where it stopped.

:class:`CutsPart` is the part of :class:`hetpipe.head.server.Head` that does it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Collection
from typing import TYPE_CHECKING, Any

import torch

from hetpipe import checkpoint
from hetpipe.head.registry import SHARD_TIMEOUT_S
from hetpipe.head.states import JobFailed, JobStatus
from hetpipe.jobplan import JobPlan
from hetpipe.ratelog import excerpt
from hetpipe.transport import RemoteError
from hetpipe.wire import Kind, Message

if TYPE_CHECKING:
    from hetpipe.head.jobs import JobState

__all__ = [
    "CutRefused",
    "CutsPart",
    "cut_end",
    "cut_floor",
    "cut_positions",
    "cut_problem",
    "expected_stages",
    "last_wave",
    "next_cut_past",
    "propose_cut",
    "ready_cuts",
]

ASK_TIMEOUT_S = 10.0  # a shard or a worker answers a cut's request at once
ASK_TRIES = 8  # proposals before an on-demand cut is given up (each further past the last)


class CutRefused(Exception):
    """An on-demand cut that cannot be taken; ``str(e)`` is one line saying why."""


# a stage's state at a cut, as it sent it: (meta, tensors)
Picks = dict[tuple[int, int], tuple[dict[str, Any], Any]]


def _base(plan: JobPlan, v: int) -> int:
    """The shards' wave of VW ``v``'s own wave 0 (``JobPlan.bases``; 0 where none)."""
    bases = getattr(plan, "bases", ())
    return int(bases[v]) if bases else 0


def cut_end(plan: JobPlan, v: int) -> int:
    """The shards' wave at which VW ``v`` ends (its state there serves every later cut)."""
    return _base(plan, v) + plan.waves(v)


def last_wave(plan: JobPlan) -> int:
    """The job's last wave on the shards' count: the furthest end of a VW that trains (one
    left out after a loss ends nothing; the shards forget it too)."""
    return max((cut_end(plan, v) for v in range(len(plan.vws)) if plan.waves(v) > 0), default=0)


def cut_floor(plan: JobPlan) -> int:
    """The first wave a cut may be at: past every re-formed VW's base (before its own first
    wave it has no state of its own, and its old stages' pushes reach up to its base), and
    at a left-out VW's base at the earliest (every update it pushed lies below it)."""
    return max(
        (_base(plan, v) + (plan.waves(v) > 0) for v in range(len(plan.vws))),
        default=0,
    )


def next_cut_past(
    plan: JobPlan, c: int | None, every: int, asked: Collection[int] = ()
) -> int | None:
    """The cut to wait for after a VW was re-formed or left out: ``c`` (the one waited for),
    or the first cut point after it that is at :func:`cut_floor` or later (None: no more)."""
    if c is None:
        return None
    return checkpoint.cut_after(max(c, cut_floor(plan)) - 1, every, last_wave(plan), asked)


def expected_stages(plan: JobPlan) -> list[tuple[int, int]]:
    """The (vw, stage) of every stage that holds state (a stage without parameters sends
    none, nor one of a VW left out after a loss)."""
    return [
        (v, s)
        for v, vw in enumerate(plan.vws)
        for s in range(len(vw.stages))
        if plan.stage_names(v, s) and plan.waves(v) > 0
    ]


def ready_cuts(
    plan: JobPlan,
    states: dict[tuple[int, int], dict[int, Any]],
    first: int | None,
    every: int,
    asked: Collection[int] = (),
) -> tuple[list[tuple[int, Picks]], int | None]:
    """The cuts from ``first`` on whose every stage state has come, in order, each with the
    state of each stage; and the next cut still to wait for (None: no more).

    ``states`` is (vw, stage) -> wave -> state, as the stages sent them (the shards'
    waves); a VW that ends before a cut gives the state of its last wave. The states older
    than a cut taken are dropped from ``states`` (a VW at its end keeps its last for the
    later cuts). ``asked`` holds the cuts asked for on demand, between the periodic ones.
    """
    last = last_wave(plan)
    expected = expected_stages(plan)
    out: list[tuple[int, Picks]] = []
    c = first
    while c is not None:
        picks: Picks = {}
        for v, s in expected:
            got = states.get((v, s), {}).get(min(c, cut_end(plan, v)))
            if got is None:
                return out, c
            picks[(v, s)] = got
        out.append((c, picks))
        for v, s in picks:
            held = states[(v, s)]
            for w in [w for w in held if w < min(c, cut_end(plan, v))]:
                del held[w]
        c = checkpoint.cut_after(c, every, last, asked)
    return out, None


def propose_cut(plan: JobPlan, admitted: list[int], at_least: int = 0) -> int:
    """The wave an on-demand cut is first proposed at: one whole wave past what each virtual
    worker's first stage has admitted (``admitted``: minibatches, by VW; it is the furthest
    ahead of its VW, so no stage has decided that wave's push yet; counted from its base
    on the shards, past which alone a cut can be), and no earlier than ``at_least`` (a wave
    some shard or stage said it could still take)."""
    waves = [_base(plan, v) + -(-n // plan.vws[v].nm) for v, n in enumerate(admitted)]
    return max([*waves, at_least - 1, 0]) + 1


def cut_positions(plan: JobPlan, c: int) -> list[int]:
    """Each VW's place in the whole job at cut ``c`` (where its data resumes): its start in
    this attempt (a re-formed VW's restart position) and the minibatches of its own waves
    before the cut."""
    return [
        plan.start_of(v)
        + min(
            max(0, min(c, cut_end(plan, v)) - _base(plan, v)) * plan.vws[v].nm,
            plan.minibatches_of(v),
        )
        for v in range(len(plan.vws))
    ]


def cut_problem(
    plan: JobPlan,
    c: int,
    applied: dict[str, dict[str, list[int]]],
    picks: Picks,
) -> str | None:
    """Why the shards' cut ``c`` and the stages' states are not one consistent checkpoint:
    every stage's applied set on every shard holding its state must be exactly waves
    0 .. min(c, its VW's end) - 1, and cover the accumulators the stage still keeps (a
    re-formed VW's stage counts its state's waves from its base)."""
    for (v, s), (meta, _) in picks.items():
        end = min(c, cut_end(plan, v))
        base = _base(plan, v)
        want = [[0, end]] if end else []
        for index in sorted({plan.placement[n] for n in plan.stage_names(v, s)}):
            got = applied.get(str(index), {}).get(f"{v}/{s}")
            if got != want:
                return (
                    f"shard {index} applied waves {excerpt(got, 80)} of vw{v}/stage{s} "
                    f"at cut {c}, not [0, {end})"
                )
        if int(meta.get("wave", -1)) != end - base:
            return f"vw{v}/stage{s} sent its state of wave {meta.get('wave')} for cut {c}"
        outside = [w for w in meta.get("kept_waves", []) if not 0 <= w < end - base]
        if outside:
            return f"vw{v}/stage{s} keeps updates of waves {outside[:3]} outside cut {c}"
    return None


def checkpoint_meta(
    js: JobState,
    plan: JobPlan,
    c: int,
    applied: dict[str, Any],
    picks: Picks,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The manifest of cut ``c`` of ``js`` and the stages' tensors by file name."""
    positions = cut_positions(plan, c)
    stages = {}
    files = {}
    for (v, s), (m, tensors) in sorted(picks.items()):
        name = checkpoint.stage_file(v, s)
        st = plan.vws[v].stages[s]
        stages[name] = tensors
        files[name] = {
            "vw": v,
            "stage": s,
            "device": st.device,
            "first": st.first,
            "last": st.last,
            "meta": m,
        }
    meta = {
        "job": js.id,
        "attempt": plan.job,
        "spec": js.spec.to_dict(),
        "wave": c,
        "positions": positions,
        "totals": list(js.totals),
        # each VW's own wave 0 on the shards' count (past 0: re-formed after a loss)
        "bases": [_base(plan, v) for v in range(len(plan.vws))],
        "minibatches_done": min(positions),
        "minibatches_total": max(js.totals),
        "applied": applied,
        "plan": [
            {"nm": vw.nm, "stages": [[st.device, st.first, st.last] for st in vw.stages]}
            for vw in plan.vws
        ],
        "stages": files,
        "t": time.time(),
    }
    return meta, stages


class CutsPart:
    """Checkpoint cuts of the running job (a part of :class:`hetpipe.head.server.Head`)."""

    def _stage_state(self, msg: Message) -> None:
        """Keep a stage's state at a cut; once every stage's is in, write the checkpoint."""
        js = self._by_wire(msg["job"])
        if js is None or js.state != JobStatus.RUNNING or js.plan is None or js.cut_next is None:
            return  # (no cut waited for: none is written from it, so none is kept)
        if msg["vw"] in js.reforming:
            return  # its old stages', sent before they dropped the job (hetpipe.head.reform)
        meta = dict(msg["meta"])
        js.states.setdefault((msg["vw"], msg["stage"]), {})[msg["wave"]] = (meta, msg.tensors)
        plan = js.plan
        self._take_ready(js, plan)

    def _take_ready(self, js: JobState, plan: JobPlan) -> None:
        """Hand every cut whose stage states are all in to a writer."""
        cuts, js.cut_next = ready_cuts(
            plan, js.states, js.cut_next, js.spec.checkpoint_every, js.cut_asked
        )
        for c, picks in cuts:
            js.cut_queued = c
            js.cut_writes.append(asyncio.ensure_future(self._write_cut(js, plan, c, picks)))

    async def _write_cut(self, js: JobState, plan: JobPlan, c: int, picks: Picks) -> None:
        """Fetch the shards' cut ``c``, check it against the stages' states, write both."""
        async with js.cut_lock:
            if js.plan is not plan:  # the attempt was given up meanwhile
                return
            if c < js.cut_queued:
                # a newer cut is ready: writing this one would only delay that one, and a
                # head that fell behind would ask the shards for cuts they no longer keep
                # (they keep the newest JobShard.KEEP_CUTS), failing every write after
                js.checkpoints_superseded += 1
                self.log.info("checkpoint superseded", job=js.id, wave=c, newest=js.cut_queued)
                return
            t0 = time.perf_counter()
            try:
                weights, applied = await self._fetch_cut(plan, c)
                problem = cut_problem(plan, c, applied, picks)
                if problem is not None:
                    self.log.warning(
                        "checkpoint not written: inconsistent cut",
                        job=js.id,
                        wave=c,
                        problem=problem,
                    )
                    return
                meta, stages = checkpoint_meta(js, plan, c, applied, picks)
                out = self.job_dir(js)
                loop = asyncio.get_running_loop()
                seq = checkpoint.next_seq(out)
                fetched = time.perf_counter()
                path = await loop.run_in_executor(
                    None, lambda: checkpoint.write(out, seq, weights, meta, stages=stages)
                )
                self.log.info(
                    "checkpoint written",
                    job=js.id,
                    wave=c,
                    path=str(path),
                    fetch_s=round(fetched - t0, 4),
                    write_s=round(time.perf_counter() - fetched, 4),
                )
                js.checkpoints += 1
                js.checkpoint_stage_s += max(
                    (m.get("state_s", 0.0) for m, _ in picks.values()), default=0.0
                )
                js.last_checkpoint = {"path": str(path), "wave": c, "positions": meta["positions"]}
            except (RemoteError, TimeoutError, ConnectionError, OSError, JobFailed) as exc:
                self.log.warning("checkpoint failed", job=js.id, wave=c, error=excerpt(exc))
            finally:
                js.checkpoint_s += time.perf_counter() - t0

    async def _fetch_cut(
        self, plan: JobPlan, c: int
    ) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, list[list[int]]]]]:
        """The shards' cut ``c`` of the attempt's global weights, and each shard's applied
        sets (by shard index, as text)."""
        weights: dict[str, torch.Tensor] = {}
        applied: dict[str, dict[str, list[list[int]]]] = {}
        shards = plan.shards_used()
        channels = [await self.registry.shard(index) for index in shards]
        replies = await asyncio.gather(
            *(
                ch.request(
                    Kind.SHARD_CUT,
                    {"job": plan.job, "wave": c},
                    timeout=SHARD_TIMEOUT_S,
                    what=f"shard {index}",
                )
                for index, ch in zip(shards, channels, strict=True)
            )
        )
        for index, reply in zip(shards, replies, strict=True):
            weights.update(reply.tensors)
            applied[str(index)] = reply["info"]["applied"]
        return weights, applied

    async def _cuts_written(self, js: JobState) -> None:
        """Wait for the checkpoints under way (the last one is the job's end)."""
        writes, js.cut_writes = js.cut_writes, []
        if writes:
            await asyncio.gather(*writes)

    def _drop_cuts(self, js: JobState) -> None:
        """An attempt ends: checkpoints under way are given up, states held dropped."""
        for t in js.cut_writes:
            t.cancel()
        js.cut_writes = []
        js.states.clear()
        js.cut_next = None
        js.cut_asked.clear()
        js.cut_queued = -1  # the next attempt counts its waves afresh

    def _checkpoint_request(self, peer: bytes | None, msg: Message) -> None:
        """Answer ``hetpipe checkpoint`` in a task of its own: its asks wait on the shards
        and the workers, whose answers come through the loop that called this."""
        tasks = getattr(self, "_checkpoint_tasks", None)
        if tasks is None:
            tasks = self._checkpoint_tasks = set()
        task = asyncio.ensure_future(self._on_checkpoint(peer, msg))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    async def _on_checkpoint(self, peer: bytes | None, msg: Message) -> None:
        """``hetpipe checkpoint``: a cut of the running job at the next wave it can reach."""
        js = self.jobs.get(msg["job"])
        try:
            if js is None:
                raise CutRefused(f"checkpoint: no job {msg['job']!r}")
            refusal = self._refusal("checkpoint", msg.user, js.id, js.owner)
            if refusal is not None:
                raise CutRefused(refusal)
            info = {"wave": await self.checkpoint_now(js), "checkpoints": js.checkpoints}
        except CutRefused as exc:
            await self.channel.reply_error(peer, str(exc), msg["rid"])
            return
        await self.channel.send(Kind.OK, {"rid": msg["rid"], "info": info}, to=peer)

    async def checkpoint_now(self, js: JobState) -> int:
        """Take a cut of running job ``js`` at the first wave boundary every stage and shard
        can still reach; its wave (the checkpoint is written once the stages get there).
        :class:`CutRefused` says why none can be taken."""
        plan = js.plan
        if js.state != JobStatus.RUNNING or plan is None:
            raise CutRefused(f"checkpoint: job {js.id} is not running ({js.state})")
        if js.reforming:
            v = min(js.reforming)
            raise CutRefused(
                f"checkpoint: job {js.id}'s vw{v} is being re-formed after a lost worker; "
                "ask again once it runs"
            )
        last = last_wave(plan)
        admitted = [
            int(js.progress.get((v, 0), {}).get("forwards", 0)) for v in range(len(plan.vws))
        ]
        c = propose_cut(plan, admitted)
        workers = [
            w
            for w in self.registry.workers.values()
            if w.job == js.id and not getattr(w, "lost", False)
        ]
        held = {w.device for w in workers}  # a worker runs every stage of its device
        missing = {(v, s) for v, s in expected_stages(plan) if plan.device_of(v, s) not in held}
        if missing:
            v, s = min(missing)
            raise CutRefused(f"checkpoint: job {js.id} has no worker running vw{v}/stage{s}")
        for attempt in range(ASK_TRIES):
            if c > last:
                if js.spec.checkpoint_every > 0:  # the job's end is a cut already
                    return last
                raise CutRefused(
                    f"checkpoint: job {js.id} ends (wave {last}) before a cut can be taken"
                )
            later = await self._ask_cut(js, plan, c, workers)
            if js.plan is not plan or js.state != JobStatus.RUNNING:
                raise CutRefused(f"checkpoint: job {js.id} ended before wave {c} ({js.state})")
            if later is None:
                js.cut_asked.add(c)
                if js.cut_next is None or c < js.cut_next:
                    js.cut_next = c
                self.log.info("checkpoint asked", job=js.id, wave=c)
                self._take_ready(js, plan)  # every state of it may be in already
                return c
            # the stages went on while the asks travelled: leave them more room each time
            c = propose_cut(plan, admitted, later + 2 ** (attempt + 1))
        raise CutRefused(f"checkpoint: job {js.id} ran past every wave proposed (last {c})")

    async def _ask_cut(self, js: JobState, plan: JobPlan, c: int, workers: list[Any]) -> int | None:
        """Ask the shards, then every stage, to keep cut ``c``: None where all took it, else
        the earliest wave the furthest one could."""
        asks: list[tuple[Any, dict[str, Any], str]] = []
        for index in plan.shards_used():
            asks.append((await self.registry.shard(index), {}, f"shard {index}"))
        earliest = await self._asks(Kind.SHARD_CUT, plan.job, c, asks, keep=1)
        if earliest is not None:
            return earliest
        stage_asks = [(self.channel, {"to": w.ident}, f"worker {w.device}") for w in workers]
        return await self._asks(Kind.CUT_AT, plan.job, c, stage_asks)

    async def _asks(
        self,
        kind: Kind,
        job: str,
        c: int,
        asks: list[tuple[Any, dict[str, Any], str]],
        **more: Any,
    ) -> int | None:
        """Send ``kind`` for cut ``c`` to each peer of ``asks`` at once; the largest earliest
        wave among the refusals, or None."""
        try:
            replies = await asyncio.gather(
                *(
                    ch.request(
                        kind,
                        {"job": job, "wave": c, **more},
                        timeout=ASK_TIMEOUT_S,
                        what=what,
                        **to,
                    )
                    for ch, to, what in asks
                )
            )
        except (RemoteError, TimeoutError, ConnectionError) as exc:
            raise CutRefused(f"checkpoint: {excerpt(exc, 200)}") from None
        refused = [int(r["info"]["earliest"]) for r in replies if r["info"].get("earliest")]
        return max(refused, default=None)
