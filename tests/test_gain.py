"""A live migration's measured gain: the pace of its first stage after the boundary over
the pace before (hetpipe.head.gain)."""

from __future__ import annotations

from hetpipe.head.gain import GainProbe, Pace


def paced(rates: list[tuple[float, float]], every: float = 0.5) -> list[tuple[float, int]]:
    """Reports every ``every`` s of a first stage admitting at ``rate`` per second for
    ``seconds`` each, in turn: (time, admitted)."""
    out, t, n = [(0.0, 0)], 0.0, 0.0
    for rate, seconds in rates:
        for _ in range(round(seconds / every)):
            t, n = t + every, n + rate * every
            out.append((t, int(n)))
    return out


def test_the_gain_is_the_pace_after_the_boundary_over_the_pace_before() -> None:
    # 10 per second until the boundary at 40, 16 per second after it
    points = paced([(10.0, 4.0), (16.0, 6.0)])
    got = GainProbe(0, at=40, nm=2, total=1000, predicted=1.5, span=2.0).measure(points)
    assert got is not None
    assert got["before_per_s"] == 10.0 and got["after_per_s"] == 16.0
    assert got["measured_gain"] == 1.6 and got["predicted_gain"] == 1.5


def test_no_gain_until_the_span_after_the_boundary_is_over() -> None:
    probe = GainProbe(0, at=40, nm=2, total=1000, predicted=1.5, span=2.0)
    assert probe.measure(paced([(10.0, 3.0)])) is None  # the boundary not reached
    assert probe.measure(paced([(10.0, 4.0), (16.0, 1.5)])) is None  # not 2 s after it


def test_a_vw_that_ends_right_after_the_boundary_is_measured_as_far_as_it_ran() -> None:
    points = paced([(10.0, 4.0), (16.0, 1.0)])  # ends at 56 of 56
    probe = GainProbe(0, at=40, nm=2, total=points[-1][1], predicted=1.5, span=2.0)
    got = probe.measure(points)
    assert got is not None and got["measured_gain"] == 1.6
    short = GainProbe(0, at=40, nm=2, total=42, predicted=1.5, span=2.0)
    got = short.measure(paced([(10.0, 4.0), (4.0, 0.5)]))
    assert got is not None and got["measured_gain"] is None and "after" in got["why"]


def test_a_pace_that_goes_back_is_a_new_attempt() -> None:
    pace = Pace()
    pace.note(0, 1.0, 10)
    pace.note(0, 2.0, 20)
    pace.note(0, 3.0, 2)  # re-formed: counts again
    assert pace.of(0) == [(3.0, 2)] and pace.of(1) == []


def test_a_vw_that_ends_within_its_first_wave_after_the_boundary_says_so() -> None:
    points = [*paced([(10.0, 4.0)]), (4.5, 41)]  # ends at 41 of 41: never reached 40 + nm
    got = GainProbe(0, at=40, nm=2, total=41, predicted=1.5, span=2.0).measure(points)
    assert got is not None and got["measured_gain"] is None and "first wave" in got["why"]
    assert GainProbe(0, at=40, nm=2, total=99, predicted=1.5, span=2.0).measure(points) is None
