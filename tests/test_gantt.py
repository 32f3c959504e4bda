"""The trace and its Gantt picture: the last stage's backward, windows, labels, shares."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from hetpipe.gantt import Window, gantt_png, pick_window, window_shares
from hetpipe.trace import chrome_trace

NM = 2


def stages(minibatches: int = 24) -> dict[str, dict[str, Any]]:
    """Two stages of one VW, 10 ms per compute; the last stage's forward (10 ms) and backward
    (20 ms) run back to back, one span each, as the runtime records them."""
    first: list[list[Any]] = []
    last: list[list[Any]] = []
    t = 100.0
    for p in range(minibatches):
        wave = p // NM
        first.append(["forward", t, t + 0.01, p, wave])
        last.append(["bubble", t, t + 0.01, None, None])
        last.append(["forward", t + 0.01, t + 0.02, p, wave])
        last.append(["backward", t + 0.02, t + 0.04, p, wave])
        first.append(["bubble", t + 0.01, t + 0.04, None, None])
        first.append(["backward", t + 0.04, t + 0.05, p, wave])
        last.append(["gate", t + 0.04, t + 0.05, None, wave])
        t += 0.05
    return {
        "vw0/stage0": {"spans": first, "forward_s": 0.01, "backward_s": 0.01},
        "vw0/stage1": {"spans": last, "forward_s": 1.0, "backward_s": 2.0},
    }


def trace(minibatches: int = 24) -> dict[str, Any]:
    return chrome_trace(stages(minibatches), {"vw0/stage0": "gpu0", "vw0/stage1": "gpu1"}, "t-1")


def test_the_last_stage_backward_is_drawn_as_backward() -> None:
    events = [e for e in trace()["traceEvents"] if e.get("ph") == "X" and e["tid"] == 2]
    fwd = [e for e in events if e["cat"] == "forward"]
    bwd = [e for e in events if e["cat"] == "backward"]
    assert len(fwd) == len(bwd) == 24
    assert fwd[0]["dur"] == pytest.approx(10_000, rel=1e-3)
    assert bwd[0]["dur"] == pytest.approx(20_000, rel=1e-3)
    assert bwd[0]["ts"] == pytest.approx(fwd[0]["ts"] + fwd[0]["dur"])
    assert [e["name"] for e in bwd[:2]] == ["backward 0", "backward 1"]


def test_default_window_is_a_few_steady_state_waves() -> None:
    win = pick_window(trace())
    assert win.label.startswith("waves 5-7 (steady state")
    # waves 5..7 are minibatches 10..15, 50 ms apart, starting 0.5 s into the job
    assert win.start == pytest.approx(0.5, abs=1e-6)
    assert win.end == pytest.approx(0.8, abs=1e-6)


def test_short_jobs_are_drawn_whole() -> None:
    assert pick_window(trace(4)).label == "the whole job"


def test_windows_by_minibatches_and_seconds() -> None:
    win = pick_window(trace(), minibatches=(2, 4))
    assert (win.start, win.end) == pytest.approx((0.1, 0.2))
    assert win.label == "minibatches 2-3"
    assert pick_window(trace(), seconds=(0.25, 0.5)) == Window(0.25, 0.5, "seconds 0.25-0.5")
    with pytest.raises(ValueError, match="--minibatches 500:600 holds nothing"):
        pick_window(trace(), minibatches=(500, 600))
    with pytest.raises(ValueError, match="--seconds 50:60 holds nothing"):
        pick_window(trace(), seconds=(50, 60))


def test_shares_in_the_window_add_up() -> None:
    t = trace()
    shares = window_shares(t, pick_window(t))
    for row in shares.values():
        assert sum(row.values()) == pytest.approx(1.0, abs=0.02)
    assert shares[1]["forward"] + shares[1]["backward"] == pytest.approx(0.4, abs=0.02)
    assert shares[2]["gate"] == pytest.approx(0.2, abs=0.02)


def test_png_is_written(tmp_path: Path) -> None:
    """The picture itself. The test set-up (the ``test`` extra) installs matplotlib, so CI
    (``CI`` set) fails here rather than skipping when it is missing."""
    if not os.environ.get("CI"):
        pytest.importorskip("matplotlib")
    out = tmp_path / "g.png"
    win = gantt_png(trace(), out, minibatches=(0, 6))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert win.label == "minibatches 0-5"
