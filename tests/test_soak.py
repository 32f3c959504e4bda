"""``scripts/bench_soak.py`` at a small size: a one-stage job of minibatch 1 runs to ``done``
under a lowered frame limit (``[runtime] max_frame_bytes = "1MiB"``, the least allowed), so
no message may grow with the job's length (records stream in chunks); every daemon's memory
stays flat once the job is under way; the figures the benchmark reports are all there. And
the per-wave state a stage keeps while it runs: the acks of its pushes leave once answered."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import zmq

from hetpipe.pipeline import StageRunner
from hetpipe.ps import ShardServer

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_soak.py"


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_soak_small_job_stays_bounded() -> None:
    r = subprocess.run(
        [sys.executable, str(SCRIPT), "--minibatches", "3000", "--max-frame", "1MiB", "--json"],
        capture_output=True,
        text=True,
        timeout=220,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    figures = json.loads(r.stdout.strip().splitlines()[-1])
    assert figures["state"] == "done", figures
    assert figures["minibatches"] == 3000
    # the largest message stays well under the lowered limit (a stage's whole report in one
    # message would be about 250 bytes a minibatch)
    assert 0 < figures["largest_message_mib"] < 1.0, figures
    assert figures["largest_message_mib"] <= figures["targets"]["largest_message_mib"]
    assert set(figures["rss_growth_mb_by_daemon"]) == {"ps0", "worker-gpu0"}, figures
    assert figures["rss_growth_mb"] <= figures["targets"]["rss_growth_mb"], figures
    assert figures["job_dir_mib"] > 0


class _Shard:
    """A shard channel whose push acks the test answers (or fails) by hand."""

    name = "ps0"

    def __init__(self) -> None:
        self.acks: list[asyncio.Future[Any]] = []

    async def send_request(self, *_a: Any, **_kw: Any) -> asyncio.Future[Any]:
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.acks.append(fut)
        return fut


def _pusher(shard: _Shard) -> StageRunner:
    """A stage runner with just what :meth:`StageRunner._push` reads: one leader stage
    whose one tensor lives on shard 0, no snapshots."""
    runner = StageRunner.__new__(StageRunner)
    runner.task = SimpleNamespace(leader=True, placement={"w": 0}, job="j", vw=0, stage=0)
    runner.compute = SimpleNamespace(state_names=lambda: ["w"])
    runner.shards = {0: shard}
    runner.snapshot = None
    runner.push_acks = {}
    return runner


def test_answered_push_acks_do_not_pile_up() -> None:
    """A job of a million waves pushes a million times. A shard applies one stage's pushes
    in order, so an answer settles every earlier push: the acks it settles leave at the next
    push, even one whose answer never came (lost from a full queue), and the stage holds
    only those still in flight; an ack that failed stays, for the end of the job
    (``_wait_pushes``) to raise."""

    async def go() -> None:
        shard = _Shard()
        runner = _pusher(shard)
        for wave in range(1000):
            await runner._push(wave, None)
            shard.acks[-1].set_result({"ok": True})
        assert len(runner.push_acks[0]) <= 1
        await runner._push(1000, None)  # its answer is lost
        await runner._push(1001, None)  # in flight
        assert runner.push_acks[0] == shard.acks[-2:]
        shard.acks[-1].set_result({"ok": True})  # answered: the lost one is settled too
        await runner._push(1002, None)
        assert runner.push_acks[0] == shard.acks[-1:]
        assert shard.acks[-3].cancelled()
        shard.acks[-1].set_exception(RuntimeError("shard refused the push"))
        await runner._push(1003, None)
        shard.acks[-1].set_result({"ok": True})
        await runner._push(1004, None)
        assert shard.acks[-3] in runner.push_acks[0]  # the failed one waits for the end
        shard.acks[-1].set_result({"ok": True})
        with pytest.raises(RuntimeError, match="refused"):
            await runner._wait_pushes()

    asyncio.run(go())


def test_the_end_of_a_job_does_not_wait_for_an_answer_a_later_one_settled() -> None:
    """A push whose answer was lost, then one answered: the stage's end waits for nothing
    (before, it waited out ``PUSH_TIMEOUT_S`` and failed the job at its very end)."""

    async def go() -> None:
        shard = _Shard()
        runner = _pusher(shard)
        await runner._push(0, None)  # its answer is lost
        await runner._push(1, None)
        shard.acks[-1].set_result({"ok": True})
        await asyncio.wait_for(runner._wait_pushes(), 1.0)
        assert runner.push_acks == {} and shard.acks[0].cancelled()

    asyncio.run(go())


class _FullQueue:
    """A shard channel whose peer's queue is full for the first ``full`` sends."""

    def __init__(self, full: int) -> None:
        self.full = full
        self.sent: list[dict[str, Any]] = []

    async def send(self, _kind: Any, fields: dict[str, Any], *_a: Any, **_kw: Any) -> None:
        if self.full:
            self.full -= 1
            raise ConnectionError("its queue is full; message dropped") from zmq.Again()
        self.sent.append(fields)


def test_a_shard_sends_a_push_answer_again_once_the_stage_reads() -> None:
    """A stage that reads slower than it pushes fills its queue at the shard: the answer is
    sent again in the background as the queue drains, not dropped, and the shard's loop
    does not wait for it."""

    async def go() -> None:
        server = ShardServer(0)
        server.channel = _FullQueue(full=3)  # type: ignore[assignment]
        await server._ack(b"stage", {"rid": 7})
        assert server.channel.sent == []  # type: ignore[attr-defined]
        await asyncio.wait_for(asyncio.gather(*server._late), 5.0)
        assert server.channel.sent == [{"rid": 7}]  # type: ignore[attr-defined]
        assert not server._late

    asyncio.run(go())
