"""The compute thread knows when it is busy; short compute runs go on the event loop only
where that is safe; and where they run changes nothing in what a job computes."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from conftest import UNIFORM, assert_same_weights, job, start_cluster
from helpers import stages_json

from hetpipe.computethread import ComputeThread, InlinePolicy

WAIT_S = 10.0


@pytest.fixture
def thread() -> Iterator[ComputeThread]:
    t = ComputeThread("compute-test")
    yield t
    t.shutdown(wait=True, cancel_futures=True)


def test_busy_while_work_is_queued_or_running(thread: ComputeThread) -> None:
    assert thread.idle
    release = threading.Event()
    started = threading.Event()

    def blocked() -> int:
        started.set()
        assert release.wait(WAIT_S)
        return 1

    first = thread.submit(blocked)
    second = thread.submit(lambda: 2)  # queued behind the first
    assert started.wait(WAIT_S)
    assert not thread.idle
    release.set()
    assert (first.result(WAIT_S), second.result(WAIT_S)) == (1, 2)
    # the count drops as the work ends, before its waiter hears of it
    assert thread.idle


def test_a_failing_computation_leaves_the_thread_idle(thread: ComputeThread) -> None:
    fut = thread.submit(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        fut.result(WAIT_S)
    assert thread.idle


def test_a_refused_submission_is_not_counted(thread: ComputeThread) -> None:
    thread.shutdown(wait=True)
    with pytest.raises(RuntimeError):
        thread.submit(lambda: 1)
    assert thread.idle


def test_the_first_run_of_a_kind_goes_to_the_thread(thread: ComputeThread) -> None:
    policy = InlinePolicy(thread, 0.02, device="cpu", speed=1.0)
    assert not policy.inline("Forward")
    policy.ran("Forward", 0.005)
    assert policy.inline("Forward")
    assert not policy.inline("Backward+OptimizerStep")  # measured per kind of run
    policy.ran("Forward", 0.03)  # it grew past the limit: back to the thread
    assert not policy.inline("Forward")
    assert (policy.inline_runs, policy.thread_runs) == (1, 3)


def test_never_inline_where_it_is_unsafe_or_off(thread: ComputeThread) -> None:
    # turned off
    off = InlinePolicy(thread, 0.0, device="cpu", speed=1.0)
    off.ran("Forward", 1e-6)
    assert not off.inline("Forward")
    # an emulated slow device sleeps out its pad: never on the event loop
    slow = InlinePolicy(thread, 0.02, device="cpu", speed=0.5)
    # a GPU's runs return before its kernels end: a measured run bounds nothing
    gpu = InlinePolicy(thread, 0.02, device="cuda:0", speed=1.0)
    # an injected stall rehearses a hang: the worker must keep answering meanwhile
    stalled = InlinePolicy(thread, 0.02, device="cpu", speed=1.0, stalls=True)
    # a stage that pulls weights decodes them on its loop, beside its computation
    pulling = InlinePolicy(thread, 0.02, device="cpu", speed=1.0, pulls=True)
    for policy in (slow, gpu, stalled, pulling):
        policy.ran("Forward", 1e-6)
        assert not policy.inline("Forward")
    # an executor that cannot say whether it is busy
    other = ThreadPoolExecutor(1)
    try:
        unknown = InlinePolicy(other, 0.02, device="cpu", speed=1.0)
        unknown.ran("Forward", 1e-6)
        assert not unknown.inline("Forward")
    finally:
        other.shutdown()
    # the compute thread has work: two computations would run on one device at once
    busy = InlinePolicy(thread, 0.02, device="cpu", speed=1.0)
    busy.ran("Forward", 1e-6)
    release = threading.Event()
    fut: Future[bool] = thread.submit(release.wait, WAIT_S)
    try:
        assert not busy.inline("Forward")
    finally:
        release.set()
        assert fut.result(WAIT_S)
    assert busy.inline("Forward")


@pytest.mark.timeout(240)
def test_compute_on_the_event_loop_trains_the_same_weights(tmp_path: Path) -> None:
    """The same synchronous job with every run on the compute thread (``inline_ms = 0``) and
    with runs up to 125 ms on the event loop: bit-identical weights; the stages' reports say
    where their runs went."""
    spec = job(
        "inline",
        split=[(["gpu0", "gpu1", "gpu2"], [2, 2, 2])],
        nm=4,
        minibatches=48,
        train={"schedule": "1f1b"},
    )
    weights, runs = {}, {}
    for inline_ms in (0, 125):  # 125: a quarter of the local cluster's heartbeat
        cluster = start_cluster(
            tmp_path / f"inline{inline_ms}", UNIFORM[:3], shards=1, inline_ms=inline_ms
        )
        try:
            info = cluster.submit(spec)
        finally:
            cluster.stop()
        assert info["state"] == "done", info.get("error")
        weights[inline_ms] = torch.load(info["model_path"])
        stages = stages_json(info)
        runs[inline_ms] = {
            where: (s["stats"]["inline_runs"], s["stats"]["thread_runs"])
            for where, s in stages.items()
        }
    assert_same_weights(weights[125], weights[0], tol=0.0)
    assert all(inline == 0 and thread > 0 for inline, thread in runs[0].values()), runs[0]
    # runs of a few milliseconds stay far below 125 ms even on a busy host; every kind's
    # first run measures it on the thread
    assert all(inline > thread for inline, thread in runs[125].values()), runs[125]
