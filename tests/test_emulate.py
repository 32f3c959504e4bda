"""The emulation's pad: which clock measures a slowed device's work (hetpipe.emulate)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch

from hetpipe import emulate


@pytest.fixture
def sleeps() -> list[float]:
    """The pad's sleeps, once :func:`_record` has patched them (after the test's own)."""
    return []


def _record(monkeypatch: pytest.MonkeyPatch, asked: list[float]) -> None:
    """Record the pad's sleeps in ``asked`` instead of sleeping them."""
    monkeypatch.setattr(emulate.time, "sleep", asked.append)


def _spin(cpu_s: float) -> None:
    """Compute (not wait) for ``cpu_s`` seconds of this thread's CPU time."""
    until = time.thread_time() + cpu_s
    x = 0
    while time.thread_time() < until:
        x += 1


@pytest.fixture
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_a_host_device_does_not_pad_a_stall(
    monkeypatch: pytest.MonkeyPatch, sleeps: list[float], one_thread: None
) -> None:
    """Time the compute thread did not run (descheduled, waiting for the GIL) is the host's,
    not the emulated device's: the pad does not stretch it by 1 / speed."""
    started = emulate.mark()
    time.sleep(0.05)  # a stall: no CPU time
    _record(monkeypatch, sleeps)
    took = emulate.pad(started, 0.5, "cpu")
    assert sleeps == []
    assert took >= 0.05


@pytest.mark.parametrize("speed", [0.1, 1.0])
def test_a_host_device_pads_its_cpu_time(
    monkeypatch: pytest.MonkeyPatch, sleeps: list[float], one_thread: None, speed: float
) -> None:
    """The work's CPU time over the speed is the pass's time, however long the wall says
    (10x at 0.1: a busy host does not stretch the wall that far); an unslowed device is
    never padded."""
    started = emulate.mark()
    _spin(0.03)
    _record(monkeypatch, sleeps)
    took = emulate.pad(started, speed, "cpu")
    work = time.thread_time() - started.cpu
    if speed == 1.0:
        assert sleeps == [] and took >= 0.03
        return
    assert len(sleeps) == 1
    assert 0.03 / speed <= took <= work / speed
    # it slept the rest of the way from where the wall clock stood
    assert sleeps[0] == pytest.approx(took - (time.perf_counter() - started.wall), abs=0.02)


def test_a_pass_is_padded_from_the_least_work_its_kind_took(
    monkeypatch: pytest.MonkeyPatch, sleeps: list[float], one_thread: None
) -> None:
    """A pass that took more CPU than the same kind of pass before (a cold start after the
    pad's sleep, another process's cache pollution) is stretched from the least: the host's
    extra milliseconds are not multiplied by 1 / speed. Another kind keeps its own least."""
    pace = emulate.Pace()
    _record(monkeypatch, sleeps)
    took = []
    for key, cpu_s in (("fwd", 0.02), ("fwd", 0.06), ("bwd", 0.06), ("fwd", 0.01)):
        started = emulate.mark()
        _spin(cpu_s)
        took.append(emulate.pad(started, 0.1, "cpu", pace, key))
    least_fwd, bwd = pace.least["fwd"], pace.least["bwd"]
    assert 0.01 <= least_fwd < 0.02 and bwd >= 0.06
    # the second forward spun 0.06 s but is padded as the first one's 0.02 s of work
    assert took[1] == pytest.approx(took[0], rel=0.05) and took[1] < 0.06 / 0.1 * 0.6
    assert took[2] >= 0.06 / 0.1  # its own kind: no less work seen
    assert took[3] <= 0.02 / 0.1 * 0.75  # a new least counts at once


def test_the_wall_clock_measures_work_the_thread_does_not_do(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A CUDA device's kernels and torch's other intra-op threads are not this thread's CPU
    time: there the wall clock measures the pass, stalls and all."""
    monkeypatch.setattr(emulate, "synchronize", lambda device: None)
    before = torch.get_num_threads()
    try:
        for device, threads in (("cuda:0", 1), ("cpu", 2)):
            torch.set_num_threads(threads)
            assert not emulate.on_thread_clock(device)
            started = emulate.mark()
            time.sleep(0.02)
            with monkeypatch.context() as m:
                asked: list[float] = []
                m.setattr(emulate.time, "sleep", asked.append)
                took = emulate.pad(started, 0.5, device)
            assert len(asked) == 1 and asked[0] >= 0.02
            assert took >= 0.04
    finally:
        torch.set_num_threads(before)
