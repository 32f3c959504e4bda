"""Checkpoint cuts after a virtual worker is re-formed (:mod:`hetpipe.head.reform`): the
shards count its waves from one base on every shard, past every push its old stages made; its
stages send their state at the shards' wave; the head takes the cuts past that base, each
VW's place in them its own (:mod:`hetpipe.head.cuts`)."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from conftest import job

from hetpipe import checkpoint
from hetpipe.core.layout import StageLayout, VWLayout
from hetpipe.head import JobState, JobStatus
from hetpipe.head.cuts import (
    CutRefused,
    CutsPart,
    cut_floor,
    cut_positions,
    cut_problem,
    expected_stages,
    last_wave,
    next_cut_past,
    propose_cut,
    ready_cuts,
)
from hetpipe.head.reform import _with_vw, common_base, pushed_before_reforms
from hetpipe.job import JobSpec
from hetpipe.jobplan import JobPlan
from hetpipe.pipeline import StageRunner
from hetpipe.ps import ShardServer
from hetpipe.shard import JobShard, ShardError, ShardStore
from hetpipe.wire import Kind, Message

# -- the shards' count of a re-formed VW's waves ------------------------------------------------


def _shard(cut_every: int = 0, waves: int = 10) -> JobShard[Any]:
    """Two VWs of one stage each, both holding ``w`` (0 initially)."""
    store: ShardStore[Any] = ShardStore()
    members = {str(v): {"waves": waves, "stages": {"0": ["w"]}} for v in (0, 1)}
    return store.init("j", members, 1, {"w": torch.zeros(1)}, cut_every=cut_every)


def _push(js: JobShard[Any], vw: int, wave: int, value: float) -> None:
    assert js.push(vw, 0, wave, {"w": torch.tensor([value])})


def test_a_vw_that_ran_ahead_joins_again_past_every_wave_its_old_stages_pushed() -> None:
    js = _shard()
    for c in range(2):
        _push(js, 0, c, 1.0)
    for c in range(4):  # VW 1 ran ahead of the global clock (2)
        _push(js, 1, c, 10.0)
    clock, _ = js.remove_vw(1, lambda item: False)
    assert clock == 4 and js.reach == {1: 4} and js.clock.global_clock() == 2
    assert js.rejoin_vw(1, {0: ["w"]}, waves=3) == 4  # not the global clock: past its pushes
    assert js.clock.applied_ranges(1, 0) == [[0, 4]] and js.finals[1] == 7
    _push(js, 1, 0, 100.0)  # its own wave 0 is the shards' 4
    assert js.clock.is_applied(1, 0, 4)


def test_the_head_moves_a_rejoined_vw_on_to_one_base_on_every_shard() -> None:
    js = _shard()
    _push(js, 0, 0, 1.0)
    js.remove_vw(1, lambda item: False)
    assert js.rejoin_vw(1, {0: ["w"]}, waves=3) == 1  # another shard joined it at 3
    assert js.rebase_vw(1, 3) == 3
    assert js.offsets == {1: 3} and js.finals[1] == 6
    assert js.clock.applied_ranges(1, 0) == [[0, 3]]
    assert js.clock.global_clock() == 1  # VW 0 holds it: nothing went back or jumped
    assert js.need_of(1, 0) == 3
    with pytest.raises(ShardError, match="not 2"):
        js.rebase_vw(1, 2)  # a base goes forward only
    _push(js, 1, 0, 1.0)
    with pytest.raises(ShardError, match="pushed already"):
        js.rebase_vw(1, 5)
    with pytest.raises(ShardError, match="not joined again"):
        js.rebase_vw(0, 5)


def test_a_cut_past_the_base_holds_every_old_push_and_the_new_waves_before_it() -> None:
    """VW 1 pushed waves 0..4 (ahead) and is lost; re-formed at base 5, its own waves 0 and 1
    are the shards' 5 and 6: the cut at 6 holds all its old pushes and its own wave 0."""
    js = _shard(cut_every=3, waves=12)
    for c in range(3):
        _push(js, 0, c, 1.0)
    for c in range(5):
        _push(js, 1, c, 10.0)
    js.remove_vw(1, lambda item: False)
    base = js.rejoin_vw(1, {0: ["w"]}, waves=4)
    assert base == 5 and js.finals == {0: 12, 1: 9}
    for c in range(3, 6):
        _push(js, 0, c, 1.0)
    _push(js, 1, 0, 100.0)  # the shards' wave 5
    _push(js, 1, 1, 1000.0)  # the shards' 6: past the cut
    _push(js, 0, 6, 1.0)
    weights, info = js.cut(6)  # type: ignore[misc]
    assert float(weights["w"]) == 6 * 1 + 5 * 10 + 100
    assert info["applied"] == {"0/0": [[0, 6]], "1/0": [[0, 6]]}


def test_a_vw_leaving_and_joining_again_moves_the_jobs_last_cut() -> None:
    """The job's last wave is a cut: where the re-formed VW ends later than the others, the
    shard keeps its cuts up to that end (the one it had at the others' end is no cut)."""
    js = _shard(cut_every=4, waves=6)
    for c in range(5):
        _push(js, 0, c, 1.0)
        _push(js, 1, c, 1.0)
    assert js.next_cut == 6  # the job's end, past the last multiple (4)
    js.remove_vw(1, lambda item: False)
    js.rejoin_vw(1, {0: ["w"]}, waves=5)  # at 5: ends at 10
    assert js.next_cut == 8
    _push(js, 0, 5, 1.0)
    for c in range(5):
        _push(js, 1, c, 1.0)
    assert js.cut(8) is not None and js.cut(10) is not None


# -- a stage's cuts on the shards' count -------------------------------------------------------


def test_a_re_formed_stage_takes_its_periodic_cuts_on_the_shards_waves() -> None:
    # own waves 1.. of a VW whose wave 0 is the shards' 5, every 4 waves, 6 waves in all
    assert [c for c in range(1, 8) if checkpoint.is_cut(c, 4, 6, (), 5)] == [3, 6]
    assert checkpoint.is_cut(2, 0, 6, {2}, 5)  # an asked cut is in its own count
    runner: Any = SimpleNamespace(
        cut_lock=threading.Lock(),
        copying=1,  # its push of own wave 1 is decided
        asked=set(),
        schedule=SimpleNamespace(waves=6),
        task=SimpleNamespace(nm=2, wave_base=5),
        migration=None,
    )
    assert StageRunner.ask_cut(runner, 4) == 8  # before its own wave 0: its base + 3
    assert StageRunner.ask_cut(runner, 7) == 8  # own cut 2: the push of own wave 1 is decided
    assert StageRunner.ask_cut(runner, 8) is None and runner.asked == {3}
    assert StageRunner.ask_cut(runner, 40) is None and runner.asked == {3, 6}  # its end


# -- the head's cuts ---------------------------------------------------------------------------

NAMES = ("0.weight", "0.bias", "2.weight", "2.bias")


def _plan(owed: tuple[int, ...], bases: tuple[int, ...], starts: tuple[int, ...]) -> JobPlan:
    """Two VWs of two stages (layers 0..2 and 2..4, on shards 1 and 2), Nm 2."""
    vws = tuple(
        VWLayout((StageLayout((f"gpu{2 * v}",), 0, 2), StageLayout((f"gpu{2 * v + 1}",), 2, 4)), 2)
        for v in range(2)
    )
    return JobPlan(
        job="t-1",
        spec=JobSpec.from_dict(job(nm=2, minibatches=40), source="test"),
        vws=vws,
        minibatches=40,
        placement={n: int(n.split(".")[0]) // 2 + 1 for n in NAMES},
        initial=None,
        dataset=None,  # type: ignore[arg-type]
        owed=owed,
        starts=starts,
        bases=bases,
    )


def _state(wave: int) -> tuple[dict[str, Any], dict[str, Any]]:
    return {"wave": wave, "kept_waves": []}, {}


def test_the_head_counts_a_re_formed_vw_from_its_base() -> None:
    # VW 1 re-formed at minibatch 14 (its restart position), at the shards' wave 9: it owes
    # 26 more minibatches (13 waves), so it ends at the shards' 22; VW 0 ends at 20
    plan = _plan(owed=(40, 26), bases=(0, 9), starts=(0, 14))
    assert last_wave(plan) == 22 and cut_floor(plan) == 10
    assert next_cut_past(plan, 8, 4) == 12  # the cut waited for lies before its base
    assert next_cut_past(plan, 16, 4) == 16
    assert next_cut_past(plan, 8, 0, {9, 11}) == 11
    assert next_cut_past(plan, None, 4) is None
    # a cut's states are the shards' waves; VW 1's own wave is 3 at the shards' 12
    states: dict[tuple[int, int], dict[int, Any]] = {(0, s): {12: _state(12)} for s in (0, 1)}
    states.update({(1, s): {12: _state(3)} for s in (0, 1)})
    cuts, nxt = ready_cuts(plan, states, 12, 4)
    assert [c for c, _ in cuts] == [12] and nxt == 16
    assert cut_positions(plan, 12) == [24, 14 + 3 * 2]
    assert cut_positions(plan, 22) == [40, 40] and cut_positions(plan, 30) == [40, 40]
    picks = cuts[0][1]
    whole = {"1": {"0/0": [[0, 12]], "1/0": [[0, 12]]}, "2": {"0/1": [[0, 12]], "1/1": [[0, 12]]}}
    assert cut_problem(plan, 12, whole, picks) is None
    early = {**picks, (1, 0): _state(12)}  # in the shards' count: not its own
    assert cut_problem(plan, 12, whole, early) == "vw1/stage0 sent its state of wave 12 for cut 12"
    # its end is a cut of its own count (13); a later one of the job's takes that state
    states = {(0, s): {20: _state(20)} for s in (0, 1)}
    states.update({(1, s): {22: _state(13)} for s in (0, 1)})
    cuts, nxt = ready_cuts(plan, states, 22, 4)
    assert [c for c, _ in cuts] == [22] and nxt is None
    # an on-demand cut: past what each first stage admitted, counted from its base
    assert propose_cut(plan, [24, 0]) == 13
    assert propose_cut(plan, [24, 6]) == 13


def test_a_vw_left_out_holds_no_state_and_the_cuts_go_on_past_its_pushes() -> None:
    # VW 1 left out at minibatch 14, having pushed up to the shards' wave 8
    plan = _plan(owed=(40, 0), bases=(0, 8), starts=(0, 14))
    assert expected_stages(plan) == [(0, 0), (0, 1)]
    assert last_wave(plan) == 20 and cut_floor(plan) == 8
    assert next_cut_past(plan, 4, 4) == 8
    states: dict[tuple[int, int], dict[int, Any]] = {(0, s): {8: _state(8)} for s in (0, 1)}
    cuts, nxt = ready_cuts(plan, states, 8, 4)
    assert [c for c, _ in cuts] == [8] and nxt == 12
    assert cut_positions(plan, 8) == [16, 14]
    whole = {"1": {"0/0": [[0, 8]]}, "2": {"0/1": [[0, 8]]}}
    assert cut_problem(plan, 8, whole, cuts[0][1]) is None


def test_a_re_formed_plan_keeps_the_other_vws_bases() -> None:
    plan = _plan(owed=(), bases=(), starts=())
    layout = VWLayout((StageLayout(("gpu2",), 0, 4),), 1)
    once = _with_vw(plan, 1, layout, 14, 26, 9)
    assert once.bases == (0, 9) and once.starts == (0, 14) and once.owed == (40, 26)
    twice = _with_vw(once, 0, None, 30, 0, 17)
    assert twice.bases == (17, 9) and twice.minibatches_of(0) == 0
    assert dataclasses.replace(twice, bases=()).base_of(1) == 0  # a new attempt: from 0


def test_one_base_for_every_shard_and_the_count_of_each_attempt() -> None:
    assert common_base([5, 7, 6]) == 7 and common_base([]) == 0
    reforms = [{"pushed": 10, "attempt": "j.r1"}, {"pushed": 4, "attempt": "j.r2"}, {"pushed": 1}]
    assert pushed_before_reforms(reforms) == 15
    assert pushed_before_reforms(reforms, "j.r2") == 5  # (a record without one: any attempt)


def test_no_cut_is_asked_for_nor_taken_from_a_vw_being_re_formed() -> None:
    """While VW 1 is being re-formed, ``hetpipe checkpoint`` is refused in one line, and a
    state its old stages still send is not kept for a cut."""
    plan = _plan(owed=(), bases=(), starts=())
    js = JobState(id="t-1", spec=plan.spec, submitted=0.0, plan=plan, started=time.time())
    js.move(JobStatus.PLANNING)
    js.move(JobStatus.RUNNING)
    js.cut_next = 4
    js.reforming[1] = {"lost": ["gpu3"]}
    head: Any = SimpleNamespace(_by_wire=lambda wire: js, _take_ready=lambda js, plan: None)
    with pytest.raises(CutRefused, match="vw1 is being re-formed after a lost worker"):
        asyncio.run(CutsPart.checkpoint_now(head, js))
    fields = {"job": "t-1", "stage": 0, "wave": 4, "meta": {}}
    CutsPart._stage_state(head, Message(Kind.STAGE_STATE, {**fields, "vw": 1}, {}))
    assert js.states == {}
    CutsPart._stage_state(head, Message(Kind.STAGE_STATE, {**fields, "vw": 0}, {}))
    assert list(js.states) == [(0, 0)]


def test_the_shard_daemon_moves_a_rejoined_vw_to_the_base_it_is_given() -> None:
    """``shard_init`` with ``reform``: a leave says the VW's clock and reach, a join its
    offset, a move to the job's one base (``{"vw": v, "base": b}``) keeps its workers."""
    sent: list[dict[str, Any]] = []

    class _Channel:
        async def send(self, kind: Kind, fields: dict[str, Any], to: Any = None) -> None:
            sent.append(fields)

        async def reply_error(self, peer: Any, error: str, rid: Any) -> None:
            sent.append({"error": error})

    server = ShardServer(1)
    server.channel = _Channel()  # type: ignore[assignment]
    members = {str(v): {"waves": 10, "stages": {"0": ["w"]}} for v in (0, 1)}
    js = server.store.init("j", members, 1, {"w": torch.zeros(1)})
    server.owners["j"] = {"0/0": "a", "1/0": "b"}
    for c in range(3):
        _push(js, 1, c, 1.0)
    _push(js, 0, 0, 1.0)

    def reform(reform: dict[str, Any], members: dict[str, Any] | None = None) -> dict[str, Any]:
        fields = {"rid": 1, "job": "j", "members": members or {}, "staleness": 1}
        msg = Message(Kind.SHARD_INIT, {**fields, "reform": reform, "owners": {"1/0": "c"}}, {})
        asyncio.run(server._reform(None, msg))
        return sent[-1]["info"]

    assert reform({"vw": 1, "leave": True}) == {"clock": 3, "reach": 3}
    assert reform({"vw": 1, "waves": 4}, {"1": {"stages": {"0": ["w"]}}}) == {"offset": 3}
    assert server.owners["j"] == {"0/0": "a", "1/0": "c"}
    assert reform({"vw": 1, "base": 5}) == {"offset": 5}
    assert server.owners["j"] == {"0/0": "a", "1/0": "c"} and js.offsets == {1: 5}
