"""A lost worker costs only its own virtual worker: the shard's clock bookkeeping of a VW
that leaves and joins again, and the head's pure helpers (:mod:`hetpipe.head.reform`)."""

from __future__ import annotations

import pytest
import torch

from hetpipe.core.wsp import WaveClock, WspError
from hetpipe.head.reform import reform_outcome, restart_position, without_migration
from hetpipe.shard import ShardError, ShardStore


def _clock() -> WaveClock[tuple[int, str]]:
    return WaveClock({0: [0, 1], 1: [0], 2: [0, 1]}, staleness=0)


def _push_all(clock: WaveClock, vw: int, stages: list[int], wave: int) -> None:
    for s in stages:
        clock.record_push(vw, s, wave)


def test_a_removed_vw_holds_nobody_back_and_its_pulls_are_returned() -> None:
    clock = _clock()
    for c in range(3):
        _push_all(clock, 0, [0, 1], c)
        _push_all(clock, 2, [0, 1], c)
    _push_all(clock, 1, [0], 0)  # vw1 is slow: the global clock is 1
    assert clock.global_clock() == 1
    assert not clock.park(3, (0, "vw0 waits"))
    assert not clock.park(2, (1, "vw1's own"))
    was, mine = clock.remove_vw(1, lambda item: item[0] == 1)
    assert was == 1 and mine == [(1, "vw1's own")]
    assert clock.global_clock() == 3  # vw0 and vw2 pushed waves 0..2
    assert clock.release() == [(0, "vw0 waits")]
    with pytest.raises(WspError):
        clock.record_push(1, 0, 1)  # a push of the removed VW is refused


def test_a_rejoined_vw_starts_at_the_global_clock_which_never_goes_back() -> None:
    clock = _clock()
    for c in range(4):
        _push_all(clock, 0, [0, 1], c)
        _push_all(clock, 2, [0, 1], c)
    clock.remove_vw(1, lambda item: False)
    g = clock.global_clock()
    assert g == 4
    offset = clock.add_vw(1, [0, 1, 2], waves=5)  # re-formed with three stages
    assert offset == 4 and clock.global_clock() == 4 and clock.vw_clock(1) == 4
    # the others may run D + 1 = 1 wave ahead of it: a pull for wave 6 (need 5) waits
    _push_all(clock, 0, [0, 1], 4)
    _push_all(clock, 2, [0, 1], 4)
    assert clock.global_clock() == 4
    assert not clock.park(5, "vw0 wave 6")
    _push_all(clock, 1, [0, 1, 2], 4)  # its own wave 0
    assert clock.global_clock() == 5 and clock.release() == ["vw0 wave 6"]
    with pytest.raises(WspError):
        clock.record_push(1, 0, 9)  # past its final wave (4 + 5)


def test_a_one_vw_clock_keeps_its_value_while_the_vw_is_away() -> None:
    clock: WaveClock[str] = WaveClock({0: [0, 1]}, staleness=1)
    for c in range(3):
        _push_all(clock, 0, [0, 1], c)
    clock.remove_vw(0, lambda item: False)
    assert clock.global_clock() == 3 and clock.snapshot()["vws"] == {}
    assert clock.add_vw(0, [0], waves=2) == 3
    assert clock.global_clock() == 3


def _store() -> ShardStore:
    store: ShardStore = ShardStore()
    weights = {"0.weight": torch.zeros(2), "1.weight": torch.zeros(2)}
    members = {
        "0": {"waves": 10, "stages": {"0": ["0.weight"], "1": ["1.weight"]}},
        "1": {"waves": 10, "stages": {"0": ["0.weight", "1.weight"]}},
    }
    store.init("j", members, staleness=0, weights=weights)
    return store


def test_a_shard_maps_a_rejoined_vws_waves_and_pulls_to_its_own() -> None:
    js = _store().get("j")
    one = {"0.weight": torch.ones(2)}
    for c in range(3):
        js.push(0, 0, c, one)
        js.push(0, 1, c, {"1.weight": torch.ones(2)})
    js.push(1, 0, 0, {"0.weight": torch.ones(2), "1.weight": torch.ones(2)})
    clock, parked = js.remove_vw(1, lambda item: True)
    assert clock == 1 and parked == []
    with pytest.raises(ShardError):
        js.push(1, 0, 1, {"0.weight": torch.ones(2)})  # gone: refused, not applied
    assert js.clock.global_clock() == 3
    assert js.rejoin_vw(1, {0: ["0.weight"], 1: ["1.weight"]}, waves=4) == 3
    assert js.offsets == {1: 3}
    assert js.push(1, 0, 0, one)  # its own wave 0 is the shard's wave 3
    assert js.clock.is_applied(1, 0, 3) and js.clock.is_applied(1, 0, 0)  # 0..2: counted
    assert js.need_of(1, -1) == 2  # its wave-0 pull waits for nothing the others lack
    fields, tensors = js.answer(1, 0)
    assert fields["applied"] == [[0, 1]]  # in its own waves: its wave 0 only
    assert torch.equal(tensors["0.weight"], torch.full((2,), 5.0))
    # its stage 1 has not pushed: the vw clock, and the global one, stay at 3
    assert js.clock.vw_clock(1) == 3 and js.clock.global_clock() == 3
    # a second remove gives its clock in its own numbers again
    assert js.remove_vw(1, lambda item: True)[0] == 0


def test_a_shard_refuses_a_rejoin_of_a_member_or_of_unknown_names() -> None:
    js = _store().get("j")
    with pytest.raises(ShardError):
        js.rejoin_vw(0, {0: ["0.weight"]}, waves=1)
    js.remove_vw(0, lambda item: True)
    with pytest.raises(ShardError):
        js.rejoin_vw(0, {0: ["2.weight"]}, waves=1)
    with pytest.raises(ShardError):
        js.remove_vw(0, lambda item: True)


@pytest.mark.parametrize(
    ("start", "clocks", "nm", "total", "want"),
    [(0, [3, 2], 4, 100, 8), (10, [5], 2, 100, 20), (10, [], 2, 100, 10), (0, [9], 4, 30, 30)],
)
def test_restart_position(start: int, clocks: list[int], nm: int, total: int, want: int) -> None:
    assert restart_position(start, clocks, nm, total) == want


def test_reform_outcome_names_the_lost_worker() -> None:
    what, line = reform_outcome("gpu1", 1, ["gpu0"], 2, None)
    assert what == "reformed" and "gpu0" in line and "gpu1" in line
    what, line = reform_outcome("gpu1", 1, ["gpu0"], 2, "needs 300 MiB, gpu0 has 128 MiB")
    assert what == "dropped" and "gpu1" in line and "128 MiB" in line and "2 other" in line
    what, line = reform_outcome("gpu1", 0, [], 0, "none survived")
    assert what == "failed" and line.startswith("worker gpu1 lost")


def test_a_reformed_vw_does_not_carry_the_jobs_pinned_migration() -> None:
    from conftest import job

    from hetpipe.job import JobSpec

    d = job("x")
    d["replan"] = {"migrate_at": 40, "migrate_to": [2, 4], "migrate_vw": 1, "threshold": 2.0}
    spec = without_migration(JobSpec.from_dict(d, source="job").to_dict())
    replan = JobSpec.from_dict(spec, source="task").replan
    assert replan.migrate_at == 0 and replan.migrate_to is None and replan.threshold == 2.0
