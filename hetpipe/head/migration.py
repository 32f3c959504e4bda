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

import json
import time
from typing import Any

from hetpipe.wire import Kind, Message

__all__ = ["MigrationPart"]

# (wire id of the attempt, vw, step) -> stage -> (peer, its request)
Meets = dict[tuple[str, int, str], dict[int, tuple[bytes | None, Message]]]


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


class MigrationPart:
    """The part of :class:`hetpipe.head.server.Head` that serves migrations."""

    channel: Any
    log: Any

    @property
    def _meets(self) -> Meets:
        meets = getattr(self, "_migration_meets", None)
        if meets is None:
            meets = self._migration_meets = {}
        return meets

    async def _on_migrate(self, peer: bytes | None, msg: Message) -> None:
        """One stage's request at one step of a migration: parked until the virtual
        worker's every stage sent theirs, then each answered."""
        js = self._by_wire(msg["job"])  # type: ignore[attr-defined]
        if js is None or js.plan is None:
            await self.channel.reply_error(peer, f"no running job {msg['job']}", msg["rid"])
            return
        vw, stage, step = msg["vw"], msg["stage"], msg["step"]
        k = len(js.plan.vws[vw].stages)
        key = (msg["job"], vw, step)
        got = self._meets.setdefault(key, {})
        got[stage] = (peer, msg)
        if len(got) < k:
            return
        del self._meets[key]
        if step.startswith("parcels"):
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
        if step.startswith("verdict") and step.endswith(":0"):
            self._record_migration(js, vw, msg, refusal)

    def _record_migration(self, js: Any, vw: int, msg: Message, refusal: str | None) -> None:
        """A migration decided (carried out, or refused with ``refusal``): into the job's
        status and a line of its ``metrics.jsonl``."""
        entry = {
            "event": "migration" if refusal is None else "migration_refused",
            "time": time.time(),
            "vw": vw,
            "at": msg["at"],
            "layers": list(msg.get("layers") or []),
            "reason": msg.get("reason") or "",
        }
        if refusal is not None:
            entry["refused"] = refusal
        js.migrations.append(entry)
        (self.log.info if refusal is None else self.log.warning)(
            "migration", job=js.id, **{k: v for k, v in entry.items() if k != "event"}
        )
        path = self.job_dir(js) / "metrics.jsonl"  # type: ignore[attr-defined]
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            f.write(json.dumps(entry) + "\n")
