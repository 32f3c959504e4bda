"""The head's part of a live layer migration (:mod:`hetpipe.migrate`): where the stages of a
virtual worker meet at a migration's boundary, and the record of each migration.

A stage at a drained boundary sends a ``migrate`` request for each step of the migration
(its parcels, then its verdict, then the barrier before the shards forget the names it
gave away: :class:`hetpipe.migrate.HeadBus`). The head parks the requests of one step
until every stage of the virtual worker sent its own, then answers each: the parcels
addressed to it, or the first refusal. Nothing is computed or stored here beyond the
parcels in transit; a stage that never comes (a lost worker) leaves the others to their
timeout, whose error names the migration, and the job's attempt ends as for any failed
stage (re-planned or failed, ``train.on_worker_loss``).

Each migration carried out or refused is a line of the job's ``metrics.jsonl`` (``event``:
``migration`` or ``migration_refused``, with its boundary, split and reason) and an entry of
the job's status (``migrations``); each stage's own account (what it gave and took, its
stall) is in its stats in ``stages.json``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Sequence
from typing import Any

from hetpipe.core.layout import StageLayout, VWLayout
from hetpipe.head import drift
from hetpipe.head.states import JobStatus
from hetpipe.migrate import MigrationError, Order, check_order, cut_points
from hetpipe.planner.online import Decision
from hetpipe.transport import RemoteError
from hetpipe.wire import Kind, Message

__all__ = ["MigrationPart"]

ORDER_TIMEOUT_S = 10.0  # a worker answers an order at once (it only queues it)

# (wire id of the attempt, vw, boundary, step) -> stage -> (peer, its request)
Meets = dict[tuple[str, int, int, str], dict[int, tuple[bytes | None, Message]]]


def _parcels_for(
    stage: int, got: dict[int, tuple[bytes | None, Message]]
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The parcels the stages sent that go to ``stage``: their descriptions, renumbered,
    and their tensors under ``<index>/<name>``."""
    out: list[dict[str, Any]] = []
    tensors: dict[str, Any] = {}
    for src in sorted(got):
        msg = got[src][1]
        for i, parcel in enumerate(msg["parcels"] or []):
            if parcel["move"][3] != stage:
                continue
            j = len(out)
            out.append(parcel)
            for name in parcel["names"]:
                tensors[f"{j}/{name}"] = msg.tensors[f"{i}/{name}"]
    return out, tensors


def relaid_plan(vws: tuple[VWLayout, ...], vw: int, layers: list[int]) -> tuple[VWLayout, ...]:
    """The job's virtual-worker layouts with ``vw`` on split ``layers`` (layers per stage),
    each layer's activation policy going with it (as :func:`hetpipe.migrate.relaid` does on
    the workers)."""
    bounds = cut_points(layers)
    recompute = sorted(j for st in vws[vw].stages for j in st.recompute)
    swap = sorted(j for st in vws[vw].stages for j in st.swap)

    def stage(st: StageLayout, s: int) -> StageLayout:
        lo, hi = bounds[s], bounds[s + 1]
        return dataclasses.replace(
            st,
            first=lo,
            last=hi,
            recompute=tuple(j for j in recompute if lo <= j < hi),
            swap=tuple(j for j in swap if lo <= j < hi),
        )

    return tuple(
        dataclasses.replace(v, stages=tuple(stage(st, s) for s, st in enumerate(v.stages)))
        if i == vw
        else v
        for i, v in enumerate(vws)
    )


class MigrationPart:
    """The part of :class:`hetpipe.head.server.Head` that serves migrations."""

    channel: Any
    log: Any
    jobs: Any

    @property
    def _meets(self) -> Meets:
        meets = getattr(self, "_migration_meets", None)
        if meets is None:
            meets = self._migration_meets = {}
        return meets

    @property
    def _cancelled(self) -> set[tuple[str, int, int]]:
        """(wire id of the attempt, vw, boundary) of the migrations dropped after a stage
        refused its order (:meth:`_cancel`)."""
        got = getattr(self, "_migration_cancelled", None)
        if got is None:
            got = self._migration_cancelled = set()
        return got

    async def migrate(
        self, job_id: str, vw: int, layers: Sequence[int], reason: str
    ) -> dict[str, Any]:
        """Carry out split ``layers`` (layers per stage) on virtual worker ``vw`` of the
        running job ``job_id`` at its next free boundary, for ``reason`` (in the records):
        the entry point of the online re-plan.

        The boundary is the first wave (iteration) past what stage 0 has admitted that is
        no checkpoint's cut, and stage 0 itself picks it: the head's view of its progress
        lags. Each stage is told, stage 0 first: stage 0 is the furthest ahead of its
        virtual worker, so once it took the order no stage can have passed the boundary.
        Where a later stage refuses, the stages that took the order drop it again
        (:meth:`_cancel`). Returns ``{"at": N}`` once every stage took it; the migration
        happens when the stages reach ``N``, and its outcome (carried out, or refused with
        its reason) is in the job's ``migrations``. :class:`hetpipe.migrate.MigrationError`
        says why it was not ordered."""
        js = self.jobs.get(job_id)  # type: ignore[attr-defined]
        if js is None or js.plan is None or js.state != JobStatus.RUNNING:
            raise MigrationError(f"migrate: job {job_id} is not running")
        plan = js.plan
        if not 0 <= vw < len(plan.vws):
            raise MigrationError(f"migrate: job {job_id} has no vw{vw}")
        nm = plan.vws[vw].nm
        total = plan.minibatches_of(vw)
        admitted = int(js.progress.get((vw, 0), {}).get("forwards", 0))
        # the first boundary past stage 0's last report; stage 0 moves it on past what it
        # admitted since and past any checkpoint's cut (hetpipe.migrate.order)
        at = (admitted // nm + 1) * nm
        # never a boundary of a migration cancelled before: its answer there stays "cancelled"
        gone = [a for j, u, a in self._cancelled if (j, u) == (plan.job, vw)]
        at = max(at, max(gone, default=0) + nm)
        layers = [int(n) for n in layers]
        check_order(Order(at, tuple(layers), reason), len(plan.vws[vw].stages), nm, what=f"vw{vw}")
        if at >= total:
            raise MigrationError(
                f"migrate: vw{vw} has no boundary left (minibatch {at} of {total})"
            )
        workers = {
            w.stage: w
            for w in self.registry.workers.values()  # type: ignore[attr-defined]
            if w.job == js.id and w.vw == vw
        }
        fields = {"job": plan.job, "vw": vw, "layers": layers, "reason": reason}
        told: list[Any] = []
        for s in range(len(plan.vws[vw].stages)):
            w = workers.get(s)
            try:
                if w is None:
                    raise MigrationError(f"migrate: no worker runs vw{vw}/stage{s}")
                # stage 0 first: the furthest ahead of its virtual worker, it picks the
                # boundary, which no later stage can have passed
                mode = {"mode": "pick"} if s == 0 else {}
                reply = await self._order(w, {**fields, "at": at, **mode}, f"vw{vw}/stage{s}")
            except MigrationError as exc:
                if told:  # the stages that took it would wait for this one at the boundary
                    await self._cancel(plan.job, vw, at, told, str(exc))
                raise
            if s == 0:
                at = int((reply.get("info") or {}).get("at", at))
            told.append(w)
        self.log.info("migration ordered", job=job_id, vw=vw, at=at, layers=layers)
        return {"at": at}

    async def _order(self, w: Any, fields: dict[str, Any], where: str) -> Message:
        """One migration order to worker ``w``, its answer; :class:`MigrationError` where it
        refused or did not answer."""
        try:
            return await self.channel.request(
                Kind.MIGRATE_ORDER,
                fields,
                to=w.ident,
                timeout=ORDER_TIMEOUT_S,
                what=f"worker {w.device}",
            )
        except (RemoteError, TimeoutError) as exc:
            raise MigrationError(f"migrate: {where}: {exc}") from None

    async def _cancel(self, job: str, vw: int, at: int, told: list[Any], why: str) -> None:
        """Drop the migration at ``at`` that stages ``told`` took and a later one refused:
        a stage already at its exchange gets ``cancelled`` for an answer (now or when it
        comes), the others drop the order; every one goes on with its layers."""
        self._cancelled.add((job, vw, at))
        for key in [k for k in self._meets if k[:3] == (job, vw, at) and k[3] == "parcels"]:
            for _s, (p, m) in sorted(self._meets.pop(key).items()):
                await self._answer_cancelled(p, m, why)
        for w in told:
            with contextlib.suppress(MigrationError):  # a lost one fails its stage anyway
                await self._order(
                    w,
                    {"job": job, "vw": vw, "at": at, "layers": [], "reason": why, "mode": "cancel"},
                    f"vw{vw}",
                )

    async def _answer_cancelled(self, peer: bytes | None, msg: Message, why: str) -> None:
        await self.channel.send(
            Kind.OK, {"rid": msg["rid"], "info": {"cancelled": f"cancelled: {why}"}}, to=peer
        )

    async def _on_migrate(self, peer: bytes | None, msg: Message) -> None:
        """One stage's request at one step of a migration: parked until the virtual
        worker's every stage sent theirs, then each answered."""
        js = self._by_wire(msg["job"])  # type: ignore[attr-defined]
        if js is None or js.plan is None:
            await self.channel.reply_error(peer, f"no running job {msg['job']}", msg["rid"])
            return
        vw, stage, step = msg["vw"], msg["stage"], msg["step"]
        k = len(js.plan.vws[vw].stages)
        if step == "parcels" and (msg["job"], vw, msg["at"]) in self._cancelled:
            await self._answer_cancelled(peer, msg, "another stage refused the order")
            return
        key = (msg["job"], vw, msg["at"], step)
        got = self._meets.setdefault(key, {})
        got[stage] = (peer, msg)
        if len(got) < k:
            return
        del self._meets[key]
        if step == "parcels":
            for s, (p, m) in sorted(got.items()):
                parcels, tensors = _parcels_for(s, got)
                await self.channel.send(
                    Kind.OK, {"rid": m["rid"], "info": {"parcels": parcels}}, tensors, to=p
                )
            return
        refusal = next(
            (m.get("refusal") for _s, (_p, m) in sorted(got.items()) if m.get("refusal")), None
        )
        for _s, (p, m) in sorted(got.items()):
            await self.channel.send(Kind.OK, {"rid": m["rid"], "info": {"refusal": refusal}}, to=p)
        if step == "verdict:0":
            layers = list(msg.get("layers") or [])
            self._record_migration(js, vw, msg["at"], layers, msg.get("reason") or "", refusal)

    def order_migration(self, js: Any, decision: Decision) -> str | None:
        """The online re-plan's hook (:mod:`hetpipe.head.drift`): order ``decision``'s split
        as a live migration of its virtual worker at the next free boundary; None once
        ordered, else why not. A migration keeps the virtual worker's Nm. Whether the order
        reached every stage, and the migration's outcome, land in the job's ``migrations``
        (an order that fails is recorded there as refused)."""
        if decision.nm != decision.old_nm:
            return (
                f"not carried out: a live migration keeps Nm {decision.old_nm}, the re-plan "
                f"wants {decision.nm}"
            )
        layers = [last - first for first, last in decision.bounds]
        reason = f"replan: {decision.reason}"
        task = asyncio.ensure_future(self.migrate(js.id, decision.vw, layers, reason))

        def ordered(t: asyncio.Future[Any]) -> None:
            exc = None if t.cancelled() else t.exception()
            if exc is not None:  # no boundary was agreed: "at" stays None
                with contextlib.suppress(OSError):
                    self._record_migration(js, decision.vw, None, layers, reason, str(exc))

        task.add_done_callback(ordered)
        return None

    def _record_migration(
        self,
        js: Any,
        vw: int,
        at: int | None,
        layers: list[int],
        reason: str,
        refusal: str | None,
    ) -> None:
        """A migration decided (carried out, or refused with ``refusal``; ``at`` None: its
        order never reached every stage): into the job's status and a line of its
        ``metrics.jsonl``."""
        entry: dict[str, Any] = {
            "event": "migration" if refusal is None else "migration_refused",
            "time": time.time(),
            "vw": vw,
            "at": at,
            "layers": layers,
            "reason": reason,
        }
        if refusal is not None:
            entry["refused"] = refusal
        else:
            # the plan says where each layer is now: checkpoints after this one record the
            # new ranges, and a re-plan restores from them
            js.plan.vws = relaid_plan(js.plan.vws, vw, entry["layers"])
        js.migrations.append(entry)
        drift.migrated(js, vw, at, refusal)  # the re-plan's watch follows the outcome
        (self.log.info if refusal is None else self.log.warning)(
            "migration", job=js.id, **{k: v for k, v in entry.items() if k != "event"}
        )
        self.metrics_file(js).append(entry)  # type: ignore[attr-defined]
