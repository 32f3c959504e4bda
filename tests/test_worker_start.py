"""A worker whose stage cannot start: the head hears it at once, the device is free again."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from conftest import UNIFORM, job

from hetpipe import worker as worker_mod
from hetpipe.config import load_cluster
from hetpipe.core.layout import StageLayout
from hetpipe.localcluster import cluster_toml
from hetpipe.task import StageTask
from hetpipe.wire import Kind, Message


class _Head:
    """Records what the worker sends the head."""

    def __init__(self) -> None:
        self.sent: list[tuple[Any, dict[str, Any]]] = []
        self.errors: list[str] = []

    async def send(self, kind: Any, fields: dict[str, Any], *_a: object, **_k: object) -> None:
        self.sent.append((kind, fields))

    async def reply_error(self, _to: object, message: str, _rid: object = None) -> None:
        self.errors.append(message)


def test_a_stage_that_cannot_start_fails_its_job_in_one_line(tmp_path: Path, monkeypatch) -> None:
    """The stage's runner raises as the head starts it: the worker sends ``stage_failed``
    naming the error (the head fails the job with it instead of waiting for a stage that
    never runs) and drops the stage, so the device is idle for the next job."""
    from hetpipe.daemon import Owner

    path = tmp_path / "cluster.toml"
    path.write_text(cluster_toml(UNIFORM[:1], shards=1))
    cluster = load_cluster(path)
    task = StageTask.standalone("nostart-1", job("nostart"), StageLayout(("gpu0",), 0, 1))

    def broken(*_a: object, **_k: object) -> None:
        raise RuntimeError("no runner today")

    monkeypatch.setattr(worker_mod, "StageRunner", broken)

    async def go() -> tuple[_Head, str]:
        owner = Owner()
        w = worker_mod.Worker(cluster, cluster.devices[0], owner, None)
        head = _Head()
        w.head = head  # type: ignore[assignment]
        try:
            assign = {"rid": 2, "job": "nostart-1", "task": task.to_dict()}
            await asyncio.wait_for(w._assign(Message(Kind.ASSIGN, assign, {})), 60)
            assert head.sent[-1][0] == Kind.OK, (head.sent, head.errors)
            await asyncio.wait_for(
                w._on_head(None, Message(Kind.START, {"job": "nostart-1"}, {})), 30
            )
            return head, w.state
        finally:
            await w.close()
            await owner.close()

    head, state = asyncio.run(go())
    failed = [f for k, f in head.sent if k == Kind.STAGE_FAILED]
    assert len(failed) == 1, head.sent
    assert failed[0]["job"] == "nostart-1" and (failed[0]["vw"], failed[0]["stage"]) == (0, 0)
    assert failed[0]["error"] == "could not start: RuntimeError: no runner today"
    assert state == "idle"
