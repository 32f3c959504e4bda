"""Throttled logging of recurring problems: once per peer per interval, counted, excerpted."""

from __future__ import annotations

from typing import Any

from hetpipe.ratelog import Throttle, excerpt


class Recorder:
    def __init__(self) -> None:
        self.lines: list[tuple[str, dict[str, Any]]] = []

    def warning(self, event: str, **fields: Any) -> None:
        self.lines.append((event, fields))


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_once_per_peer_per_interval_with_the_count_of_the_rest() -> None:
    log, clock = Recorder(), Clock()
    t = Throttle(log, interval_s=10, clock=clock)
    for _ in range(1000):
        t.warning("bad message dropped", "peer-a", "garbage")
    t.warning("bad message dropped", "peer-b", "garbage")
    assert [f["peer"] for _, f in log.lines] == ["peer-a", "peer-b"]
    clock.t = 10.5
    t.warning("bad message dropped", "peer-a", "garbage")
    assert log.lines[-1][1]["repeated"] == 999


def test_overall_budget_bounds_a_flood_from_many_identities() -> None:
    log, clock = Recorder(), Clock()
    t = Throttle(log, interval_s=10, lines_per_interval=5, max_keys=100, clock=clock)
    for i in range(10_000):
        t.warning("bad message dropped", f"peer-{i}", "garbage")
    assert len(log.lines) == 5
    assert len(t._keys) <= 100
    clock.t = 11
    t.warning("bad message dropped", "peer-x", "garbage")
    assert log.lines[-1][1]["other_peers_held_back"] == 10_000 - 5


def test_excerpt_is_bounded() -> None:
    text = excerpt("x" * 100_000)
    assert len(text) < 300 and text.endswith("(99800 more characters)")
    assert excerpt("short") == "short"
